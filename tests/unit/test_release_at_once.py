"""A small volatile buffer's release in one ledger transaction (Releaser.release_live): its
row's end, its event and its scrub before one commit — ordered against every other
release as the two-step release was, and leaving nothing half done when it fails."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from maasd import errors
from maasd.core import Service
from maasd.core.buffers import RELEASE_AT_ONCE_MAX
from maasd.models import PoolSpec, Principal, ReserveSpec
from maasd.settings import Settings
from pgdb import BACKENDS, fresh_pg_database

MiB = 1 << 20


def started(data_dir: Path, db_url: str | None) -> Service:
    spill = data_dir / "spill"
    spill.mkdir()
    s = Service(
        Settings(
            data_dir=str(data_dir),
            db_url=db_url,
            admin_key="admin-key-for-tests",
            pools=[
                PoolSpec(name="p", numa_node=0, capacity_bytes=64 * MiB, prefault=False),
                PoolSpec(
                    name="firm",
                    numa_node=0,
                    capacity_bytes=16 * MiB,
                    prefault=False,
                    persistence="persistent",
                    spill_dir=str(spill),
                ),
            ],
            node_name="at-once",
        )
    )
    s.start(reaper=False)
    return s


@pytest.fixture(params=BACKENDS)
def svc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    with contextlib.ExitStack() as stack:
        url = None if request.param == "sqlite" else stack.enter_context(fresh_pg_database())
        s = started(tmp_path, url)
        stack.callback(s.close)
        yield s


class Commits:
    """The ledger's commits (every engine of the store: views of one)."""

    def __init__(self, svc: Service) -> None:
        self.n = 0
        event.listen(svc.store.engine, "commit", self._count)

    def _count(self, _conn: Any) -> None:
        self.n += 1


def tenant(svc: Service, name: str = "t") -> Principal:
    return svc.auth.authenticate(svc.tenants.create(name, 64 * MiB).api_key)


def reserve(svc: Service, who: Principal, size: int = MiB, pool: str = "p") -> str:
    return svc.reserves.reserve(who, ReserveSpec(size_bytes=size, pool=pool)).id


def used(svc: Service, who: Principal) -> int:
    row = svc.store.tenants.tenant(who.tenant_id or "")
    assert row is not None
    return row.used_bytes


def events(svc: Service, buffer_id: str) -> list[str]:
    return [e.kind for e in svc.store.events.events(1000) if e.buffer_id == buffer_id]


def patch_scrub(svc: Service, monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> None:
    """``before()`` runs where the release scrubs the buffer, before the scrub."""
    releaser: Any = svc.buffers._releaser
    scrub = releaser.release_memory

    def release_memory(row: Any, **kwargs: Any) -> None:
        before()
        scrub(row, **kwargs)

    monkeypatch.setattr(releaser, "release_memory", release_memory)


def test_a_small_volatile_buffer_is_released_in_one_commit(svc: Service) -> None:
    who = tenant(svc)
    bid = reserve(svc, who)
    commits = Commits(svc)
    svc.buffers.release(who, bid)
    assert commits.n == 1
    assert svc.store.buffers.buffer(bid) is None
    assert events(svc, bid) == ["release", "reserve"]
    assert svc.regions.held(bid) is None
    assert used(svc, who) == 0
    assert svc.live.find("p").pool.used == 0
    with pytest.raises(errors.NotFound):
        svc.buffers.release(who, bid)


def test_the_others_keep_their_two_steps(svc: Service) -> None:
    """A buffer over the bound, a persistent pool's, and a staged entry: marked releasing,
    scrubbed, then ended — two commits each, as before."""
    who = tenant(svc)
    big = reserve(svc, who, RELEASE_AT_ONCE_MAX + MiB)
    firm = reserve(svc, who, MiB, pool="firm")
    handle = svc.entries.put(who, "k", MiB)
    os.close(handle.fd)
    for bid in (big, firm, handle.buffer_id):
        commits = Commits(svc)
        svc.buffers.release(who, bid)
        assert commits.n == 2, bid
        assert svc.store.buffers.buffer(bid) is None
    assert used(svc, who) == 0


def test_the_scrub_is_done_before_the_commit(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the memory is scrubbed the row's end is not committed: another connection
    still reads the buffer live, and its bytes still count."""
    who = tenant(svc)
    bid = reserve(svc, who)
    seen: list[Any] = []
    patch_scrub(
        svc, monkeypatch, lambda: seen.append((svc.store.buffers.buffer(bid), used(svc, who)))
    )
    svc.buffers.release(who, bid)
    ((row, bytes_then),) = seen
    assert row is not None
    assert row.state == "live"
    assert bytes_then == MiB
    assert svc.store.buffers.buffer(bid) is None


def test_a_failed_scrub_rolls_the_row_back_and_recovery_releases_it(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    who = tenant(svc)
    bid = reserve(svc, who)

    def fail() -> None:
        raise RuntimeError("scrub failed")

    patch_scrub(svc, monkeypatch, fail)
    with pytest.raises(RuntimeError, match="scrub failed"):
        svc.buffers.release(who, bid)
    row = svc.store.buffers.buffer(bid)
    assert row is not None
    assert row.state == "live"
    assert events(svc, bid) == ["reserve"]
    assert used(svc, who) == MiB
    monkeypatch.undo()
    assert svc.regions.held(bid) is not None  # the scrub never began: the region is intact
    svc.regions.take_region(bid)  # as if the process had died with it:
    assert svc.recovery.recover() == {"released": 1}  # a volatile live row is released
    assert svc.store.buffers.buffer(bid) is None
    assert used(svc, who) == 0


def test_a_concurrent_release_waits_for_the_commit_and_finds_it_gone(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two DELETEs of one buffer: the second waits on the first's row lock (SQLite: its
    writer lock) until the first's scrub and commit are done, then answers 404 — never
    done before the bytes are zero."""
    who = tenant(svc)
    bid = reserve(svc, who)
    in_scrub, go = threading.Event(), threading.Event()

    def hold() -> None:
        in_scrub.set()
        assert go.wait(10)

    patch_scrub(svc, monkeypatch, hold)
    first = threading.Thread(target=svc.buffers.release, args=(who, bid))
    first.start()
    assert in_scrub.wait(10)
    monkeypatch.undo()
    second: list[BaseException | None] = []

    def release_again() -> None:
        try:
            svc.buffers.release(who, bid)
        except BaseException as e:
            second.append(e)
        else:
            second.append(None)

    other = threading.Thread(target=release_again)
    other.start()
    time.sleep(0.3)
    assert not second  # waiting for the first's commit
    go.set()
    first.join(10)
    other.join(10)
    assert isinstance(second[0], errors.NotFound)
    assert events(svc, bid) == ["release", "reserve"]
    assert used(svc, who) == 0


def test_isolation_and_the_admin(svc: Service) -> None:
    """Another tenant's id is not found (nothing changes); the admin's release is one
    commit too."""
    who, other = tenant(svc), tenant(svc, "u")
    bid = reserve(svc, who)
    with pytest.raises(errors.NotFound):
        svc.buffers.release(other, bid)
    assert svc.regions.held(bid) is not None
    assert events(svc, bid) == ["reserve"]
    admin = svc.auth.authenticate("admin-key-for-tests")
    commits = Commits(svc)
    svc.buffers.release(admin, bid)
    assert commits.n == 1
    assert used(svc, who) == 0


def test_an_open_circuit_changes_nothing(svc: Service) -> None:
    """The ledger known down: 507 before any memory is touched; the buffer is intact and
    released once the ledger is back."""
    who = tenant(svc)
    bid = reserve(svc, who)
    svc.store.circuit.trip("the database cannot serve now")
    with pytest.raises(errors.LedgerUnavailable):
        svc.buffers.release(who, bid)
    held = svc.regions.held(bid)
    assert held is not None
    assert held.live
    deadline = time.monotonic() + 10
    while svc.store.circuit.down_since is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    svc.buffers.release(who, bid)
    assert svc.store.buffers.buffer(bid) is None
