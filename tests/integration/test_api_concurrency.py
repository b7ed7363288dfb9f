"""No over-commit (quota and capacity hold) under concurrent REST requests.

64 reserves from 32 threads (one ``httpx.Client`` per thread) race for a quota,
or for a pool's capacity, that fits exactly N of them: exactly N are granted,
the others get 409 ``quota-exceeded`` (resp. 507 ``pool-exhausted``), nothing
answers 5xx otherwise, and the ledger equals the sum of what was granted.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import Daemon

KiB, MiB = 1 << 10, 1 << 20
THREADS, REQUESTS = 32, 64
SIZE = 256 * KiB


def race(daemon: Daemon, key: str, path: str, body: dict) -> list[httpx.Response]:
    """POST ``body`` to ``path`` REQUESTS times from THREADS threads, all released at once."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def client() -> httpx.Client:
        if not hasattr(local, "c"):
            local.c = daemon.client(key)
            with lock:
                clients.append(local.c)
            start.wait(timeout=30)  # every thread holds a connection before the first request
        return local.c

    def one(_: int) -> httpx.Response:
        return client().post(path, json=body)

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            return list(pool.map(one, range(REQUESTS)))
    finally:
        for c in clients:
            c.close()


def outcome(rs: list[httpx.Response]) -> Counter:
    return Counter(
        (r.status_code, r.json()["type"].rsplit("/", 1)[-1] if r.status_code >= 400 else "granted")
        for r in rs
    )


@pytest.mark.parametrize("granted", [1, 20])
def test_quota_race_grants_exactly_n(daemon: Daemon, granted: int) -> None:
    tid, key = daemon.tenant("race-quota", granted * SIZE)
    rs = race(daemon, key, "/v1/reserve", {"size_bytes": SIZE})
    assert not [r for r in rs if r.status_code >= 500], outcome(rs)
    assert outcome(rs) == Counter(
        {(201, "granted"): granted, (409, "quota-exceeded"): REQUESTS - granted}
    )
    ids = {r.json()["id"] for r in rs if r.status_code == 201}
    assert len(ids) == granted
    with daemon.client(key) as c:
        usage = c.get("/v1/usage").json()
        assert (usage["used_bytes"], usage["buffers"]) == (granted * SIZE, granted)
        assert {b["id"] for b in c.get("/v1/buffers").json()} == ids
    assert daemon.admin.get(f"/v1/tenants/{tid}").json()["used_bytes"] == granted * SIZE
    assert daemon.admin.delete(f"/v1/tenants/{tid}").status_code == 204


@pytest.mark.parametrize("granted", [1, 20])
def test_pool_capacity_race_grants_exactly_n(daemon: Daemon, granted: int) -> None:
    r = daemon.admin.post(
        "/v1/pools",
        json={
            "name": f"race-{secrets.token_hex(3)}",
            "numa_node": 0,
            "capacity_bytes": granted * SIZE,
        },
    )
    assert r.status_code == 201, r.text
    pool = r.json()
    tid, key = daemon.tenant("race-pool", 1 << 40)
    rs = race(daemon, key, f"/v1/pools/{pool['id']}/reserve", {"size_bytes": SIZE})
    assert not [r for r in rs if r.status_code >= 500 and r.status_code != 507], outcome(rs)
    assert outcome(rs) == Counter(
        {(201, "granted"): granted, (507, "pool-exhausted"): REQUESTS - granted}
    )
    after = daemon.admin.get(f"/v1/pools/{pool['id']}").json()
    assert (after["used_bytes"], after["free_bytes"]) == (granted * SIZE, 0)
    with daemon.client(key) as c:
        assert c.get("/v1/usage").json()["used_bytes"] == granted * SIZE
    assert daemon.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    assert daemon.admin.get(f"/v1/pools/{pool['id']}").json()["used_bytes"] == 0
    assert daemon.admin.delete(f"/v1/pools/{pool['id']}").status_code == 204


def test_two_tenants_racing_for_one_pool(daemon: Daemon) -> None:
    """Quota and capacity at once: each tenant may take 12, the pool holds 16."""
    r = daemon.admin.post(
        "/v1/pools",
        json={"name": f"race2-{secrets.token_hex(3)}", "numa_node": 0, "capacity_bytes": 16 * SIZE},
    )
    pool = r.json()
    tenants = [daemon.tenant("race-two", 12 * SIZE) for _ in range(2)]
    path = f"/v1/pools/{pool['id']}/reserve"
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda t: race(daemon, t[1], path, {"size_bytes": SIZE}), tenants))
    granted = [sum(r.status_code == 201 for r in rs) for rs in results]
    for rs in results:
        assert {r.status_code for r in rs} <= {201, 409, 507}, outcome(rs)
    assert sum(granted) == 16
    assert all(g <= 12 for g in granted)
    assert daemon.admin.get(f"/v1/pools/{pool['id']}").json()["used_bytes"] == 16 * SIZE
    for (tid, key), g in zip(tenants, granted, strict=True):
        with daemon.client(key) as c:
            assert c.get("/v1/usage").json()["used_bytes"] == g * SIZE
        daemon.admin.delete(f"/v1/tenants/{tid}")
    daemon.admin.delete(f"/v1/pools/{pool['id']}?drain=true")


def test_concurrent_release_and_reserve_keep_the_ledger(daemon: Daemon) -> None:
    """Releases racing reserves (and double releases) never leak or double-free bytes."""
    tid, key = daemon.tenant("race-churn", 8 * SIZE)
    with daemon.client(key) as c:
        held = [c.post("/v1/reserve", json={"size_bytes": SIZE}).json()["id"] for _ in range(8)]
    local = threading.local()

    def work(i: int) -> int:
        if not hasattr(local, "c"):
            local.c = daemon.client(key)
        if i < 16:  # every held buffer released twice: one 204, one 404
            return local.c.delete(f"/v1/buffers/{held[i % 8]}").status_code
        return local.c.post("/v1/reserve", json={"size_bytes": SIZE}).status_code

    with ThreadPoolExecutor(THREADS) as ex:
        codes = list(ex.map(work, range(48)))
    deletes, reserves = Counter(codes[:16]), Counter(codes[16:])
    assert deletes == Counter({204: 8, 404: 8}), deletes
    assert set(reserves) <= {201, 409}, reserves
    with daemon.client(key) as c:
        usage = c.get("/v1/usage").json()
        live = c.get("/v1/buffers").json()
    assert usage["used_bytes"] == len(live) * SIZE == reserves[201] * SIZE
    assert usage["used_bytes"] <= 8 * SIZE
    daemon.admin.delete(f"/v1/tenants/{tid}")
