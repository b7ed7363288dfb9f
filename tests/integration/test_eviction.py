"""Eviction (evictable buffers go least recently used first to make room), against a real daemon.

Evictable buffers are released by the daemon — least recently attached
first, scrubbed — when a reserve would otherwise fail for the tenant's quota
(only that tenant's buffers are candidates) or for pool capacity (any
tenant's buffers in that pool are). Non-evictable buffers never are.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from maasd.client import Worker

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


def new_pool(d: Daemon, capacity: int) -> str:
    name = f"ev-{secrets.token_hex(3)}"
    r = d.admin.post("/v1/pools", json={"name": name, "numa_node": 0, "capacity_bytes": capacity})
    assert r.status_code == 201, r.text
    return name


def reserve(c: httpx.Client, pool: str, size: int, **extra: Any) -> str:
    r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": size, **extra})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def alive(c: httpx.Client, buffer_id: str) -> bool:
    return c.get(f"/v1/buffers/{buffer_id}").status_code == 200


def test_quota_shortfall_evicts_least_recently_attached_first(daemon) -> None:
    _, key = daemon.tenant("lru", 8 * MiB)
    user = daemon.client(key)
    evictions = daemon.metric("maasd_evictions_total")
    e = [reserve(user, "node0", 2 * MiB, evictable=True) for _ in range(4)]
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        # Attach order decides: e3, e1, e0, e2 (e3 least recently attached).
        maps = {}
        for i in (3, 1, 0, 2):
            maps[i] = w.attach(e[i])
            maps[i].array[:] = i + 1
            time.sleep(0.01)
        new = reserve(user, "node0", 3 * MiB)  # needs 3 MiB: e3 (2) then e1 (2)
        assert not alive(user, e[3])
        assert not alive(user, e[1])
        assert alive(user, e[0])
        assert alive(user, e[2])
        assert alive(user, new)
        for i in (3, 1):
            assert not np.any(maps[i].array), f"evicted buffer {i} was not scrubbed"
        for i in (0, 2):
            assert np.all(maps[i].array == i + 1), f"buffer {i} was touched"
    assert daemon.metric("maasd_evictions_total") == evictions + 2
    usage = user.get("/v1/usage").json()
    assert usage["used_bytes"] == 7 * MiB
    assert usage["buffers"] == 3
    for b in (e[0], e[2], new):
        assert user.delete(f"/v1/buffers/{b}").status_code == 204
    user.close()


def test_non_evictable_buffers_are_never_evicted(daemon) -> None:
    _, key = daemon.tenant("keep", 4 * MiB)
    user = daemon.client(key)
    evictions = daemon.metric("maasd_evictions_total")
    kept = [reserve(user, "node0", 2 * MiB) for _ in range(2)]
    r = user.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "evictable": True})
    assert r.status_code == 409, r.text
    assert r.json()["type"].endswith("quota-exceeded"), r.text
    # Half evictable: not enough to free 4 MiB, so nothing is evicted at all.
    assert user.delete(f"/v1/buffers/{kept[1]}").status_code == 204
    ev = reserve(user, "node0", 2 * MiB, evictable=True)
    r = user.post("/v1/pools/node0/reserve", json={"size_bytes": 4 * MiB})
    assert r.status_code == 409, r.text
    assert alive(user, ev)
    assert alive(user, kept[0])
    assert daemon.metric("maasd_evictions_total") == evictions
    for b in (kept[0], ev):
        assert user.delete(f"/v1/buffers/{b}").status_code == 204
    user.close()


def test_quota_eviction_takes_only_the_tenants_own_buffers(daemon) -> None:
    pool = new_pool(daemon, 8 * MiB)
    _, key_a = daemon.tenant("owner", 64 * MiB)
    _, key_b = daemon.tenant("capped", 2 * MiB)
    a, b = daemon.client(key_a), daemon.client(key_b)
    a_bufs = [reserve(a, pool, 2 * MiB, evictable=True) for _ in range(2)]
    b_buf = reserve(b, pool, 2 * MiB)
    r = b.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB})
    assert r.status_code == 409, r.text
    assert r.json()["type"].endswith("quota-exceeded"), r.text
    assert all(alive(a, x) for x in a_bufs)
    assert alive(b, b_buf)
    for c, x in ((a, a_bufs[0]), (a, a_bufs[1]), (b, b_buf)):
        assert c.delete(f"/v1/buffers/{x}").status_code == 204
    assert daemon.admin.delete(f"/v1/pools/{pool}").status_code == 204
    a.close()
    b.close()


def test_pool_capacity_shortfall_evicts_any_tenants_evictable_buffers(daemon) -> None:
    pool = new_pool(daemon, 8 * MiB)
    _, key_a = daemon.tenant("cache", 64 * MiB)
    _, key_b = daemon.tenant("needy", 64 * MiB)
    a, b = daemon.client(key_a), daemon.client(key_b)
    evictions = daemon.metric("maasd_evictions_total")
    a_bufs = [reserve(a, pool, 2 * MiB, evictable=True) for _ in range(3)]  # LRU: 0, 1, 2
    b_first = reserve(b, pool, 2 * MiB)  # the pool is full now
    b_new = reserve(b, pool, 3 * MiB)  # 3 MiB short: a_bufs[0] and a_bufs[1] go
    assert [alive(a, x) for x in a_bufs] == [False, False, True]
    assert daemon.metric("maasd_evictions_total") == evictions + 2
    assert daemon.metric("maasd_release_total", reason="evict") >= 2
    info = next(p for p in daemon.admin.get("/v1/pools").json() if p["name"] == pool)
    assert info["used_bytes"] == 7 * MiB
    assert info["used_bytes"] + info["free_bytes"] == 8 * MiB
    assert a.get("/v1/usage").json()["used_bytes"] == 2 * MiB
    # Only non-evictable bytes would have to go now: 507, and nothing changes.
    r = b.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 4 * MiB})
    assert r.status_code == 507, r.text
    assert r.json()["type"].endswith("pool-exhausted"), r.text
    assert alive(a, a_bufs[2])
    assert alive(b, b_first)
    assert alive(b, b_new)
    assert daemon.metric("maasd_evictions_total") == evictions + 2
    assert daemon.admin.delete(f"/v1/pools/{pool}?drain=true").status_code == 204
    assert b.get("/v1/usage").json()["used_bytes"] == 0
    a.close()
    b.close()


def test_eviction_frees_a_key_for_reuse(daemon) -> None:
    _, key = daemon.tenant("prefix", 4 * MiB)
    user = daemon.client(key)
    old = reserve(user, "node0", 4 * MiB, evictable=True, key="model:abc")
    hit = user.post("/v1/buffers/lookup", json={"keys": ["model:abc"]})
    assert hit.status_code == 200
    assert hit.json()["buffer"]["id"] == old
    new = reserve(user, "node0", 2 * MiB, evictable=True, key="model:abcd")
    assert not alive(user, old)
    assert user.post("/v1/buffers/lookup", json={"keys": ["model:abc"]}).status_code == 404
    hit = user.post("/v1/buffers/lookup", json={"keys": ["model:abc", "model:abcd"]})
    assert hit.json()["key"] == "model:abcd"
    assert hit.json()["buffer"]["id"] == new
    assert user.delete(f"/v1/buffers/{new}").status_code == 204
    user.close()
