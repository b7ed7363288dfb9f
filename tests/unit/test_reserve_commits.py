"""A reserve's ledger round trips: two commits, also when attaches are waiting to be written.

Attach times (the LRU order eviction follows) are batched in memory; on SQLite a
reserve writes them in its admitting transaction instead of a commit of their
own (on PostgreSQL in one just before it). A reserve that fails keeps them for
the next writer, and an eviction decided in that transaction already sees them
— on both backends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from maasd import errors
from maasd.core import Service
from maasd.models import PoolSpec, Principal, ReserveSpec
from maasd.settings import Settings
from pgdb import BACKENDS, fresh_pg_database

MiB = 1 << 20


def started(data_dir: Path, db_url: str | None = None) -> Service:
    s = Service(
        Settings(
            data_dir=str(data_dir),
            db_url=db_url,
            admin_key="admin-key-for-tests",
            pools=[PoolSpec(name="p", numa_node=0, capacity_bytes=8 * MiB, prefault=False)],
            node_name="commits",
        )
    )
    s.start(reaper=False)
    return s


@pytest.fixture(params=BACKENDS)
def svc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    if request.param == "sqlite":
        s = started(tmp_path)
        yield s
        s.close()
        return
    with fresh_pg_database() as url:
        s = started(tmp_path, url)
        yield s
        s.close()


@pytest.fixture
def sqlite_svc(tmp_path: Path) -> Iterator[Service]:
    s = started(tmp_path)
    yield s
    s.close()


class Commits:
    """Counts the ledger's commits (every engine of the store)."""

    def __init__(self, svc: Service) -> None:
        self.n = 0
        store: Any = svc.store
        for engine in {id(e): e for e in (store.db.write, store.db.single, store.db.read)}.values():
            event.listen(engine, "commit", self._count)

    def _count(self, _conn: Any) -> None:
        self.n += 1


def tenant(svc: Service, quota: int) -> Principal:
    return svc.auth.authenticate(svc.tenants.create("t", quota).api_key)


def attach(svc: Service, who: Principal, buffer_id: str) -> None:
    handle = svc.handles.open(who, buffer_id)  # remembers the use, writes nothing
    os.close(handle.fd)
    svc.handles.drop(who, buffer_id)


def test_a_plain_reserve_commits_once_and_a_keyed_one_twice(sqlite_svc: Service) -> None:
    """A plain buffer (no key, not evictable) is admitted live: one commit. A keyed or
    evictable one is admitted reserving, then goes live once its region is held: two."""
    svc = sqlite_svc
    who = tenant(svc, 64 * MiB)
    commits = Commits(svc)
    svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    assert commits.n == 1  # admission, live at once
    commits.n = 0
    svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p", key="k"))
    assert commits.n == 2  # admission (reserving), then live
    commits.n = 0
    svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p", evictable=True))
    assert commits.n == 2


def test_a_reserve_writes_the_attaches_pending_in_its_admission(sqlite_svc: Service) -> None:
    svc = sqlite_svc
    who = tenant(svc, 64 * MiB)
    held = svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    commits = Commits(svc)
    attach(svc, who, held.id)
    assert held.id in svc.uses.pending_uses()
    before = svc.store.buffers.buffer(held.id)
    assert before is not None
    svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    assert commits.n == 1  # the attach was written by the admission, no commit of its own
    after = svc.store.buffers.buffer(held.id)
    assert after is not None
    assert after.last_used_at > before.last_used_at
    assert svc.uses.pending_uses() == {}


def test_a_refused_reserve_keeps_the_attaches_for_the_next_writer(svc: Service) -> None:
    who = tenant(svc, 2 * MiB)
    held = svc.reserves.reserve(who, ReserveSpec(size_bytes=2 * MiB, pool="p"))
    attach(svc, who, held.id)
    pending = svc.uses.pending_uses()
    with pytest.raises(errors.QuotaExceeded):
        svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    assert svc.uses.pending_uses() == pending  # rolled back with the admission: kept
    svc.uses.flush()
    row = svc.store.buffers.buffer(held.id)
    assert row is not None
    assert row.last_used_at == pending[held.id]


def test_eviction_in_the_admission_follows_the_attaches_it_writes(svc: Service) -> None:
    """Two evictable buffers fill the quota; the older one is attached, so the reserve
    that needs room evicts the other (least recently used as of that attach)."""
    who = tenant(svc, 2 * MiB)
    older = svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p", evictable=True))
    newer = svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p", evictable=True))
    attach(svc, who, older.id)
    svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    live = {b.id for b in svc.buffers.buffers(who)}
    assert older.id in live
    assert newer.id not in live


class Statements:
    """The SQL statements the ledger runs (every engine of the store), by first word."""

    def __init__(self, svc: Service) -> None:
        self.seen: list[str] = []
        store: Any = svc.store
        for engine in {id(e): e for e in (store.db.write, store.db.single, store.db.read)}.values():
            event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        word = statement.split(None, 1)[0].upper()
        if word not in ("BEGIN", "PRAGMA"):
            self.seen.append(word)


def test_a_release_of_a_buffer_held_here_reads_nothing_first(svc: Service) -> None:
    """The region held here says which host and pool the row is of: the release is its
    compare-and-set and its end, without a read before them (the read was ~0.2 ms)."""
    who = tenant(svc, 64 * MiB)
    other = svc.auth.authenticate(svc.tenants.create("u", 64 * MiB).api_key)
    mine = svc.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="p"))
    sql = Statements(svc)
    with pytest.raises(errors.NotFound):  # another tenant's id: the ledger is asked, and says no
        svc.buffers.release(other, mine.id)
    assert "SELECT" in sql.seen
    assert [b.id for b in svc.buffers.buffers(who)] == [mine.id]  # nothing changed
    sql.seen.clear()
    svc.buffers.release(who, mine.id)
    # a small volatile buffer: its row ended and its event, in one transaction, no read
    assert sql.seen == ["DELETE", "INSERT"]
    assert svc.buffers.buffers(who) == []
    with pytest.raises(errors.NotFound):  # twice: the second finds it gone
        svc.buffers.release(who, mine.id)
