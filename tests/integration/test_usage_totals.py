"""The ledger's running usage totals stay exact through a real daemon under load.

One daemon (SQLite, and PostgreSQL when ``MAASD_TEST_PG_URL`` is set) and, at once:
a tenant whose puts evict its own entries (its quota full), a tenant whose REST
reserves evict by its buffer count and release, a tenant whose released entries stay
held (a peer keeps their fds) and then let go, and tenants deleted while they hold
entries. A second store on the same ledger checks the totals against the rows
(:meth:`~maasd.store.Store.check_totals`, one snapshot) while it runs and after; the
tenants' and pools' figures over REST are the totals.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon
from maasd.client import MaasdClientError, Worker
from maasd.protocol import Found, Lookup
from maasd.store import Store
from pgdb import BACKENDS, fresh_pg_database
from sockpeer import Raw
from waiting import wait_until

KiB = 1 << 10
SIZE = 64 * KiB


@pytest.fixture(params=BACKENDS)
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'd' / 'maasd.db'}"
        return
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def daemon(tmp_path: Path, ledger_url: str) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d", env={"MAASD_DB_URL": ledger_url})
    d.start()
    yield d
    d.close()


@pytest.fixture
def ledger(daemon: Daemon, ledger_url: str) -> Iterator[Store]:
    """A store of the test's own on the daemon's ledger (once the daemon migrated it)."""
    assert daemon.proc is not None
    s = Store(ledger_url, pool_size=1, max_overflow=1)
    yield s
    s.dispose()


def loop(stop: threading.Event, errors: list[BaseException], step: Callable[[int], None]):
    def run() -> None:
        i = 0
        while not stop.is_set():
            try:
                step(i)
            except MaasdClientError:
                pass  # a refusal (quota, count, a key being replaced) is an answer
            except BaseException as exc:  # anything else fails the test below
                errors.append(exc)
                return
            i += 1

    return threading.Thread(target=run, daemon=True)


def used(d: Daemon, tenant_id: str) -> tuple[int, int]:
    body = d.admin.get(f"/v1/tenants/{tenant_id}").json()
    return body["used_bytes"], body["buffers"]


def pool_used(d: Daemon, name: str) -> tuple[int, int]:
    body = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == name)
    return body["used_bytes"], body["buffers"]


@contextlib.contextmanager
def holding(d: Daemon, key: str, n: int) -> Iterator[tuple[list[str], list[int]]]:
    """``n`` committed entries whose fds a peer keeps (looked up, never closed)."""
    ids, fds = [], []
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for i in range(n):
            with w.entry(f"held-{i}", SIZE) as m:
                m.array[:4] = 7
        raw = Raw(d.socket_path)
        raw.hello(key)
        for i in range(n):
            reply, got = raw.call(Lookup(keys=[f"held-{i}"]))
            assert isinstance(reply, Found), reply
            ids.append(reply.buffer_id)
            fds.extend(got)
        try:
            yield ids, fds
        finally:
            for fd in fds:
                os.close(fd)
            raw.close()


def test_the_totals_equal_the_rows_under_every_kind_of_change(
    daemon: Daemon, ledger: Store
) -> None:
    d = daemon
    evictor_id, evictor = d.tenant("evictor", 8 * SIZE)  # its puts evict its own
    counted_id, counted = d.tenant("counted", 1 << 30)
    assert d.admin.patch(f"/v1/tenants/{counted_id}", json={"max_buffers": 4}).status_code == 200
    holder_id, holder = d.tenant("holder", 1 << 30)
    doomed = [d.tenant(f"doomed{i}", 1 << 30) for i in range(3)]
    stop, errors = threading.Event(), list[BaseException]()

    worker = Worker(d.socket_path, evictor, renew_interval_s=0)

    def put(i: int) -> None:
        with worker.entry(f"k{i % 40}", SIZE) as m:  # repeats: a key in use is refused
            m.array[:4] = 1

    rest = d.client(counted)

    def reserve(i: int) -> None:
        r = rest.post("/v1/reserve", json={"size_bytes": SIZE, "evictable": True})
        assert r.status_code in (201, 409, 507), r.text
        if r.status_code == 201 and i % 2:
            assert rest.delete(f"/v1/buffers/{r.json()['id']}").status_code in (204, 404)

    threads = [loop(stop, errors, put), loop(stop, errors, reserve)]
    for t in threads:
        t.start()
    try:
        with holding(d, holder, 3) as (held_ids, _fds):
            for buffer_id in held_ids:  # released, but its memory still held: counted
                assert d.client(holder).delete(f"/v1/buffers/{buffer_id}").status_code == 204
            assert used(d, holder_id) == (3 * SIZE, 3)
            assert ledger.totals.check_totals() == []
            for tenant_id, key in doomed:  # deleted with entries in the ledger
                with Worker(d.socket_path, key, renew_interval_s=0) as w:
                    for j in range(3):
                        with w.entry(f"d{j}", SIZE) as m:
                            m.array[:4] = 2
                r = d.admin.delete(f"/v1/tenants/{tenant_id}")
                assert r.status_code == 204, r.text
                assert ledger.totals.check_totals() == []
        # the peer let go: the held rows end by themselves
        wait_until(lambda: used(d, holder_id) == (0, 0), message="held entries freed")
        assert ledger.totals.check_totals() == []
        # both loaders evicted often (quota, count) while all this went on, and go on
        wait_until(
            lambda: d.metric("maasd_evictions_total") >= 100, timeout=120, message="evictions"
        )
        assert ledger.totals.check_totals() == []
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        worker.close()
        rest.close()
    assert not errors, errors
    assert ledger.totals.check_totals() == []
    assert used(d, evictor_id)[0] <= 8 * SIZE
    assert used(d, counted_id)[1] <= 4
    wait_until(
        lambda: all(d.admin.get(f"/v1/tenants/{t}").status_code == 404 for t, _ in doomed),
        message="the deleted tenants gone",
    )
    rows: dict[str, Any] = {}
    for b in ledger.buffers.buffers(states=None):
        n, c = rows.get(b.pool_id, (0, 0))
        rows[b.pool_id] = (n + b.size_bytes, c + 1)
    pools = ledger.pools.all_pools()
    assert pools
    for p in pools:
        assert pool_used(d, p.name) == rows.get(p.id, (0, 0))
