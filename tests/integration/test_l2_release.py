"""An entry's release and its value in L2: two daemons, one PostgreSQL, one real Redis.

Hosts ``rel-a`` and ``rel-b`` (tests/l2hosts.py, as test_l2.py). Only an eviction leaves
an entry's value in L2; after a tenant's DELETE, an admin's DELETE or the end of its lease
the next lookup misses on the host that wrote it and on the other one — the value is
gone from Redis — and a DELETE right after the commit, racing the write-behind, leaves
nothing either. With Redis frozen the DELETE still answers 204 (the delete waits for
Redis, the release does not), and the value goes once Redis answers again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from conftest import Daemon
from l2hosts import SMALL_DB_POOL, commit, in_l2, two_hosts
from maasd.client import Worker
from redisdb import RedisServer
from waiting import wait_until

MiB = 1 << 20


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, l2_ledger_url: str, redis_server: RedisServer
) -> Iterator[tuple[Daemon, Daemon]]:
    env = {
        "MAASD_L2_TIMEOUT_S": "0.1",
        "MAASD_L2_BREAKER_BACKOFF_S": "0.5",
        "MAASD_REAPER_INTERVAL_S": "0.2",
        **SMALL_DB_POOL,
    }
    with two_hosts(tmp_path_factory, ("rel-a", "rel-b"), l2_ledger_url, redis_server, env) as pair:
        yield pair


def found(d: Daemon, api_key: str, name: str) -> bytes | None:
    """The bytes a socket lookup of ``name`` on ``d`` answers (restored from L2 if need
    be), or None on a miss."""
    with Worker(d.socket_path, api_key) as w:
        hit = w.lookup([name])
        if hit is None:
            return None
        try:
            return bytes(hit.array)
        finally:
            hit.close()


def written(d: Daemon, redis_server: RedisServer, tid: str, api_key: str, name: str) -> str:
    """Commit 1 MiB under ``name`` on ``d`` and wait for it in L2: the entry's id."""
    with Worker(d.socket_path, api_key) as w:
        buffer_id = commit(w, name, os.urandom(MiB))
    wait_until(lambda: in_l2(redis_server, tid, name), timeout=20, message=f"{name} in L2")
    return buffer_id


def gone_everywhere(
    a: Daemon, b: Daemon, redis_server: RedisServer, tid: str, api_key: str, name: str
) -> None:
    """``name`` is not restored on A, leaves Redis, and is not restored on B."""
    assert found(a, api_key, name) is None  # at once: A does not restore what it deletes
    wait_until(lambda: not in_l2(redis_server, tid, name), timeout=15, message="out of L2")
    assert found(b, api_key, name) is None
    assert found(a, api_key, name) is None


def test_a_tenants_delete_is_not_undone_by_l2(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("rel-tenant", quota_bytes=64 * MiB)
    buffer_id = written(a, redis_server, tid, key, "pii")
    assert a.client(key).delete(f"/v1/buffers/{buffer_id}").status_code == 204
    gone_everywhere(a, b, redis_server, tid, key, "pii")
    assert a.metric("maasd_l2_deletes_total", outcome="deleted") >= 1


def test_an_admins_delete_is_not_undone_by_l2(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("rel-admin", quota_bytes=64 * MiB)
    buffer_id = written(a, redis_server, tid, key, "pii")
    assert a.admin.delete(f"/v1/buffers/{buffer_id}").status_code == 204
    gone_everywhere(a, b, redis_server, tid, key, "pii")


def test_a_lease_end_is_not_undone_by_l2(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("rel-lease", quota_bytes=64 * MiB)
    with Worker(a.socket_path, key) as w:
        m = w.put("leased", MiB, ttl_s=3)
        m.array[:] = 7
        w.commit(m)
    wait_until(lambda: in_l2(redis_server, tid, "leased"), timeout=20, message="in L2")
    # no lookup meanwhile (a hit extends the lease): the reaper ends it
    wait_until(lambda: not in_l2(redis_server, tid, "leased"), timeout=30, message="expired")
    assert a.client(key).get("/v1/buffers").json() == []
    assert found(b, key, "leased") is None
    assert found(a, key, "leased") is None


def test_a_delete_of_a_copy_restored_from_l2_drops_the_value_it_came_from(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """B restored the entry from L2, then it was deleted on B: B does not restore it
    again. A's own entry is another host's and lives on."""
    a, b = hosts
    tid, key = a.tenant("rel-restored", quota_bytes=64 * MiB)
    written(a, redis_server, tid, key, "shared")
    with Worker(b.socket_path, key) as w:
        hit = w.lookup(["shared"])  # restored on B
        assert hit is not None
        copy = hit.buffer_id
        hit.close()
    assert b.client(key).delete(f"/v1/buffers/{copy}").status_code == 204
    assert found(b, key, "shared") is None
    wait_until(lambda: not in_l2(redis_server, tid, "shared"), timeout=15, message="out of L2")
    assert found(a, key, "shared") is not None


def test_an_evicted_entry_is_still_restored_from_l2(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("rel-evict", quota_bytes=64 * MiB)
    a.pool("rel-small", 4 * MiB, prefault=False)
    data = os.urandom(MiB)
    with Worker(a.socket_path, key) as w:
        commit(w, "evicted", data, pool="rel-small")
    wait_until(lambda: in_l2(redis_server, tid, "evicted"), timeout=20, message="in L2")
    evicted = a.metric("maasd_entry_evictions_total", tenant=tid)
    with Worker(a.socket_path, key) as w:
        for i in range(6):
            commit(w, f"filler{i}", os.urandom(MiB), pool="rel-small")
    wait_until(lambda: a.metric("maasd_entry_evictions_total", tenant=tid) > evicted)
    assert "evicted" not in [x["key"] for x in a.client(key).get("/v1/buffers").json()]
    assert in_l2(redis_server, tid, "evicted")
    restored = found(b, key, "evicted")
    assert restored is not None
    assert restored[:MiB] == data


def test_a_delete_racing_the_write_behind_leaves_nothing(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """Each entry deleted as soon as its commit answers: its write-behind is still
    queued, being stored, or done — whichever, nothing of it stays in L2."""
    a, b = hosts
    tid, key = a.tenant("rel-race", quota_bytes=64 * MiB)
    names = [f"raced{i}" for i in range(12)]
    with Worker(a.socket_path, key) as w:
        for name in names:
            buffer_id = commit(w, name, os.urandom(MiB))
            assert a.client(key).delete(f"/v1/buffers/{buffer_id}").status_code == 204
        # The writer takes one tenant's jobs in order, deletes first: once an entry
        # committed after them is in L2, every one of theirs was handled.
        commit(w, "marker", os.urandom(4096))
    wait_until(lambda: in_l2(redis_server, tid, "marker"), timeout=20, message="marker in L2")
    wait_until(lambda: a.metric("maasd_l2_delete_queue_entries") == 0, timeout=15)
    assert [n for n in names if in_l2(redis_server, tid, n)] == []
    assert [n for n in names if found(b, key, n) is not None] == []


def test_a_delete_while_redis_is_frozen_answers_and_the_value_goes_once_it_is_back(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """Last in this module: it freezes the module's Redis (SIGSTOP)."""
    a, b = hosts
    tid, key = a.tenant("rel-frozen", quota_bytes=64 * MiB)
    buffer_id = written(a, redis_server, tid, key, "frozen")
    errors = a.metric("maasd_l2_deletes_total", outcome="error")
    proc = redis_server.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        r = a.client(key).delete(f"/v1/buffers/{buffer_id}")
        assert r.status_code == 204
        assert found(a, key, "frozen") is None
        wait_until(
            lambda: a.metric("maasd_l2_deletes_total", outcome="error") > errors,
            timeout=15,
            message="the delete tried and failed while Redis is frozen",
        )
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_until(lambda: not in_l2(redis_server, tid, "frozen"), timeout=30, message="deleted")
    assert a.metric("maasd_l2_deletes_total", outcome="given_up") == 0
    assert found(b, key, "frozen") is None
