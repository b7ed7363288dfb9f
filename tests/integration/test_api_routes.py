"""Every REST route of docs/api.md through real HTTP against a real ``maasd serve``.

Happy paths first, then every status code the API answers (401, 403, 404, 409,
422, 507), each checked as an RFC 9457 problem. The module shares one daemon
(256 MiB ``node0`` pool); every test makes its own tenants and pools (names
made unique) and releases what it reserved, so the order of tests is free.
"""

from __future__ import annotations

import re
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from conftest import Daemon

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
BUFFER_FIELDS = {
    "id",
    "tenant_id",
    "pool_id",
    "size_bytes",
    "numa_node",
    "persistence",
    "label",
    "key",
    "evictable",
    "state",
    "created_at",
    "expires_at",
}
POOL_FIELDS = {
    "id",
    "name",
    "numa_node",
    "backing",
    "persistence",
    "latency_us",
    "capacity_bytes",
    "used_bytes",
    "free_bytes",
    "page_bytes",
    "scrub",
}


def problem(r: httpx.Response, status: int, type_suffix: str | None = None) -> dict:
    """Assert ``r`` is an RFC 9457 problem with this status; return its body."""
    assert r.status_code == status, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert {"type", "title", "status", "detail"} <= body.keys(), body
    assert body["status"] == status
    assert body["detail"]
    assert body["title"]
    if type_suffix is not None:
        assert body["type"].endswith(type_suffix), body
    return body


def ts(text: str) -> float:
    assert TIMESTAMP.match(text), text
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def make_pool(daemon: Daemon, capacity: int, **fields: object) -> dict:
    r = daemon.admin.post(
        "/v1/pools", json={"name": uniq("p"), "numa_node": 0, "capacity_bytes": capacity, **fields}
    )
    assert r.status_code == 201, r.text
    return r.json()


def pool(daemon: Daemon, pool_id: str) -> dict:
    r = daemon.admin.get(f"/v1/pools/{pool_id}")
    assert r.status_code == 200, r.text
    return r.json()


def reserve(
    c: httpx.Client, size: int = 64 * KiB, pool_id: str | None = None, **fields: object
) -> dict:
    path = f"/v1/pools/{pool_id}/reserve" if pool_id else "/v1/reserve"
    r = c.post(path, json={"size_bytes": size, **fields})
    assert r.status_code == 201, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()


@pytest.fixture
def tenant(daemon: Daemon):
    """A fresh tenant (64 MiB quota): ``(id, key, client)``; deleted afterwards."""
    tid, key = daemon.tenant("routes", 64 * MiB)
    with daemon.client(key) as c:
        yield tid, key, c
    daemon.admin.delete(f"/v1/tenants/{tid}")


# -- anyone ---------------------------------------------------------------------------------


def test_healthz_needs_no_key(daemon: Daemon) -> None:
    r = httpx.get(f"{daemon.url}/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_metrics_is_prometheus_text(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    buf = reserve(c, 64 * KiB)
    assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    r = daemon.admin.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {s.name for f in families.values() for s in f.samples}
    assert daemon.metric("maasd_pool_capacity_bytes", pool="node0") == 256 * MiB
    for name in ("maasd_pool_capacity_bytes", "maasd_pool_used_bytes", "maasd_tenant_used_bytes"):
        assert name in samples, name
    # reserve/release counts and latency histograms, scrub bytes
    assert any(s.startswith("maasd_reserve") and s.endswith("_bucket") for s in samples), samples
    assert any(s.startswith("maasd_release") and s.endswith("_total") for s in samples), samples
    assert any(s.startswith("maasd_scrub") and "bytes" in s for s in samples), samples


def test_metrics_needs_the_admin_key_by_default(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    problem(httpx.get(f"{daemon.url}/metrics"), 401, "unauthorized")
    problem(c.get("/metrics"), 403, "forbidden")


def test_metrics_key_is_good_for_metrics_only(fresh_daemon: Daemon) -> None:
    metrics_key = "maasd-metrics-" + secrets.token_hex(16)
    fresh_daemon.env["MAASD_METRICS_KEY"] = metrics_key
    d = fresh_daemon.start()
    scraper = {"Authorization": f"Bearer {metrics_key}"}
    r = httpx.get(f"{d.url}/metrics", headers=scraper)
    assert r.status_code == 200
    assert "maasd_pool_capacity_bytes" in r.text
    assert d.admin.get("/metrics").status_code == 200
    problem(httpx.get(f"{d.url}/metrics"), 401, "unauthorized")
    for path in ("/v1/pools", "/v1/tenants", "/v1/usage"):
        problem(httpx.get(d.url + path, headers=scraper), 403, "forbidden")


def test_metrics_public(fresh_daemon: Daemon) -> None:
    fresh_daemon.env["MAASD_METRICS_PUBLIC"] = "1"
    d = fresh_daemon.start()
    r = httpx.get(f"{d.url}/metrics")
    assert r.status_code == 200
    assert "maasd_pool_capacity_bytes" in r.text
    problem(httpx.get(f"{d.url}/v1/pools"), 401, "unauthorized")  # nothing else is public


def test_unknown_route_and_wrong_method_are_problems(daemon: Daemon) -> None:
    problem(httpx.get(f"{daemon.url}/v1/no-such-route"), 404, "not-found")
    r = daemon.admin.put("/v1/pools")
    problem(r, 405, "method-not-allowed")
    assert "POST" in r.headers["allow"]


def test_openapi_document_is_served(daemon: Daemon) -> None:
    r = httpx.get(f"{daemon.url}/schema/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    for path in (
        "/v1/reserve",
        "/v1/pools/{pool_id}/reserve",
        "/v1/buffers/lookup",
        "/v1/tenants/{tenant_id}/keys/{key_id}",
    ):
        assert path in doc["paths"], path
    reserve_responses = doc["paths"]["/v1/reserve"]["post"]["responses"]
    assert {"201", "400", "401", "409", "422", "507"} <= reserve_responses.keys()
    assert "application/problem+json" in reserve_responses["507"]["content"]


# -- any key --------------------------------------------------------------------------------


def test_topology(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    for client in (c, daemon.admin):
        r = client.get("/v1/topology")
        assert r.status_code == 200, r.text
        topo = r.json()
        assert {"nodes", "hugepage_bytes", "hugepages_free"} <= topo.keys()
        node0 = next(n for n in topo["nodes"] if n["id"] == 0)
        assert {"id", "cpus", "mem_total_bytes", "mem_free_bytes", "distances"} <= node0.keys()
        assert node0["mem_total_bytes"] >= node0["mem_free_bytes"] > 0
        assert node0["cpus"]
        assert node0["distances"]
    problem(httpx.get(f"{daemon.url}/v1/topology"), 401, "unauthorized")


def test_pools_list_any_key(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    for client in (c, daemon.admin):
        r = client.get("/v1/pools")
        assert r.status_code == 200
        pools = {p["name"]: p for p in r.json()}
        node0 = pools["node0"]
        assert node0.keys() >= POOL_FIELDS
        assert node0["capacity_bytes"] == 256 * MiB
        assert node0["page_bytes"] == PAGE
        assert node0["used_bytes"] + node0["free_bytes"] == node0["capacity_bytes"]
        assert (node0["backing"], node0["persistence"], node0["latency_us"], node0["scrub"]) == (
            "memfd",
            "volatile",
            1,
            "zero",
        )


# -- pools (admin) --------------------------------------------------------------------------


def test_pool_create_rounds_up_and_delete(daemon: Daemon) -> None:
    name = uniq("pc")
    r = daemon.admin.post(
        "/v1/pools",
        json={
            "name": name,
            "numa_node": 0,
            "capacity_bytes": 5000,
            "latency_us": 7,
            "scrub": "punch",
            "prefault": False,
        },
    )
    assert r.status_code == 201, r.text
    p = r.json()
    assert p.keys() >= POOL_FIELDS
    assert p["name"] == name
    assert p["capacity_bytes"] == 2 * PAGE  # rounded up to the page
    assert (p["latency_us"], p["scrub"], p["persistence"], p["backing"]) == (
        7,
        "punch",
        "volatile",
        "memfd",
    )
    assert (p["used_bytes"], p["free_bytes"]) == (0, 2 * PAGE)
    assert name in {q["name"] for q in daemon.admin.get("/v1/pools").json()}
    # by name too
    assert pool(daemon, name)["id"] == p["id"]
    # name is unique
    problem(
        daemon.admin.post("/v1/pools", json={"name": name, "numa_node": 0, "capacity_bytes": PAGE}),
        409,
    )
    # a node that does not exist
    problem(
        daemon.admin.post(
            "/v1/pools", json={"name": uniq("p7"), "numa_node": 7, "capacity_bytes": PAGE}
        ),
        422,
    )
    r = daemon.admin.delete(f"/v1/pools/{p['id']}")
    assert r.status_code == 204
    assert r.content == b""
    assert name not in {q["name"] for q in daemon.admin.get("/v1/pools").json()}
    problem(daemon.admin.delete(f"/v1/pools/{p['id']}"), 404, "not-found")
    problem(daemon.admin.get(f"/v1/pools/{p['id']}"), 404)


def test_pool_delete_nonempty_409_then_drain(daemon: Daemon, tenant) -> None:
    tid, _, c = tenant
    p = make_pool(daemon, 1 * MiB)
    a = reserve(c, 256 * KiB, p["id"])
    b = reserve(c, 256 * KiB, p["name"])
    assert pool(daemon, p["id"])["used_bytes"] == 512 * KiB
    problem(daemon.admin.delete(f"/v1/pools/{p['id']}"), 409)
    problem(daemon.admin.delete(f"/v1/pools/{p['id']}?drain=false"), 409)
    # nothing was released by the refused delete
    assert c.get(f"/v1/buffers/{a['id']}").status_code == 200
    r = daemon.admin.delete(f"/v1/pools/{p['id']}", params={"drain": "true"})
    assert r.status_code == 204, r.text
    for buf in (a, b):
        problem(c.get(f"/v1/buffers/{buf['id']}"), 404)
    assert c.get("/v1/usage").json()["used_bytes"] == 0
    assert daemon.admin.get(f"/v1/tenants/{tid}").json()["used_bytes"] == 0


# -- tenants and keys (admin) ---------------------------------------------------------------


def test_tenant_lifecycle(daemon: Daemon) -> None:
    name = uniq("life")
    r = daemon.admin.post("/v1/tenants", json={"name": name, "quota_bytes": 8 * MiB})
    assert r.status_code == 201, r.text
    t = r.json()
    assert {"id", "name", "quota_bytes", "used_bytes", "api_key"} <= t.keys()
    assert (t["name"], t["quota_bytes"], t["used_bytes"]) == (name, 8 * MiB, 0)
    assert len(t["id"]) >= 32  # ≥ 122 random bits as hex
    # duplicate name
    problem(daemon.admin.post("/v1/tenants", json={"name": name, "quota_bytes": 1}), 409)

    listed = {x["id"]: x for x in daemon.admin.get("/v1/tenants").json()}
    assert t["id"] in listed
    assert "api_key" not in listed[t["id"]]  # shown only at creation
    assert {"used_bytes", "buffers"} <= listed[t["id"]].keys()

    with daemon.client(t["api_key"]) as c:
        buf = reserve(c, 1 * MiB)
        got = daemon.admin.get(f"/v1/tenants/{t['id']}").json()
        assert (got["used_bytes"], got["buffers"], got["quota_bytes"]) == (1 * MiB, 1, 8 * MiB)
        assert "api_key" not in got

        # quota up, then below use: allowed, blocks new reserves
        r = daemon.admin.patch(f"/v1/tenants/{t['id']}", json={"quota_bytes": 16 * MiB})
        assert r.status_code == 200
        assert r.json()["quota_bytes"] == 16 * MiB
        r = daemon.admin.patch(f"/v1/tenants/{t['id']}", json={"quota_bytes": 512 * KiB})
        assert r.status_code == 200, r.text
        assert (r.json()["quota_bytes"], r.json()["used_bytes"]) == (512 * KiB, 1 * MiB)
        problem(c.post("/v1/reserve", json={"size_bytes": PAGE}), 409, "quota-exceeded")
        assert c.get(f"/v1/buffers/{buf['id']}").status_code == 200  # existing buffer kept

        # the buffer cap, alone and with the quota (one transaction), below use too
        r = daemon.admin.patch(f"/v1/tenants/{t['id']}", json={"max_buffers": 1})
        assert (r.json()["max_buffers"], r.json()["quota_bytes"]) == (1, 512 * KiB)
        r = daemon.admin.patch(
            f"/v1/tenants/{t['id']}", json={"quota_bytes": 16 * MiB, "max_buffers": 1}
        )
        assert (r.json()["max_buffers"], r.json()["quota_bytes"]) == (1, 16 * MiB)
        problem(c.post("/v1/reserve", json={"size_bytes": PAGE}), 409, "buffer-count-exceeded")
        r = daemon.admin.patch(f"/v1/tenants/{t['id']}", json={"max_buffers": 2})
        assert reserve(c, PAGE)["size_bytes"] == PAGE
        kinds = [
            e["kind"] for e in daemon.admin.get("/v1/events", params={"tenant_id": t["id"]}).json()
        ]
        assert kinds.count("max_buffers_set") == 3

        node0_used = pool(daemon, "node0")["used_bytes"]
        r = daemon.admin.delete(f"/v1/tenants/{t['id']}")
        assert r.status_code == 204, r.text
        # its buffers are released, its key is revoked at once
        assert pool(daemon, "node0")["used_bytes"] == node0_used - 1 * MiB - PAGE
        problem(c.get("/v1/usage"), 401, "unauthorized")
        problem(c.get(f"/v1/buffers/{buf['id']}"), 401)
    problem(daemon.admin.get(f"/v1/tenants/{t['id']}"), 404)
    problem(daemon.admin.patch(f"/v1/tenants/{t['id']}", json={"quota_bytes": 1}), 404)
    problem(daemon.admin.delete(f"/v1/tenants/{t['id']}"), 404)
    problem(daemon.admin.get(f"/v1/buffers/{buf['id']}"), 404)
    assert t["id"] not in {x["id"] for x in daemon.admin.get("/v1/tenants").json()}


def test_keys_issue_and_revoke(daemon: Daemon, tenant) -> None:
    tid, first_key, first = tenant
    r = daemon.admin.post(f"/v1/tenants/{tid}/keys")
    assert r.status_code == 201, r.text
    k = r.json()
    assert {"id", "api_key", "created_at"} <= k.keys()
    ts(k["created_at"])
    assert k["api_key"] != first_key
    with daemon.client(k["api_key"]) as second:
        assert second.get("/v1/usage").json()["tenant_id"] == tid
        buf = reserve(second, 64 * KiB)
        # both keys act for the same tenant
        assert first.get(f"/v1/buffers/{buf['id']}").status_code == 200
        r = daemon.admin.delete(f"/v1/tenants/{tid}/keys/{k['id']}")
        assert r.status_code == 204, r.text
        problem(second.get("/v1/usage"), 401, "unauthorized")  # at once
        problem(second.delete(f"/v1/buffers/{buf['id']}"), 401)
    assert first.get("/v1/usage").status_code == 200  # the other key still works
    assert first.get(f"/v1/buffers/{buf['id']}").status_code == 200  # buffers stay
    problem(daemon.admin.delete(f"/v1/tenants/{tid}/keys/{k['id']}"), 404)  # already revoked
    problem(daemon.admin.delete(f"/v1/tenants/{tid}/keys/{'0' * 32}"), 404)
    problem(daemon.admin.post(f"/v1/tenants/{'0' * 32}/keys"), 404)


# -- tenant ---------------------------------------------------------------------------------


def test_usage(daemon: Daemon, tenant) -> None:
    tid, _, c = tenant
    assert c.get("/v1/usage").json() == {
        "tenant_id": tid,
        "quota_bytes": 64 * MiB,
        "used_bytes": 0,
        "buffers": 0,
        "max_buffers": 4096,  # the daemon's default cap
        "held_bytes": 0,
        "disk_quota_bytes": 4 * 64 * MiB,  # disk_quota_factor × the quota, by default
        "disk_used_bytes": 0,
    }
    a = reserve(c, 5000)  # rounded to two pages
    reserve(c, 1 * MiB)
    u = c.get("/v1/usage").json()
    assert (u["used_bytes"], u["buffers"]) == (2 * PAGE + 1 * MiB, 2)
    c.delete(f"/v1/buffers/{a['id']}")
    assert c.get("/v1/usage").json()["used_bytes"] == 1 * MiB
    problem(daemon.admin.get("/v1/usage"), 403)  # the admin owns no buffers


def test_reserve_in_pool_by_id_and_name(daemon: Daemon, tenant) -> None:
    tid, _, c = tenant
    p = make_pool(daemon, 4 * MiB, latency_us=3)
    try:
        before = time.time()
        a = reserve(c, 100, p["id"], ttl_s=120, label="kv layer 0", key="k-a", evictable=True)
        assert a.keys() >= BUFFER_FIELDS
        assert (a["tenant_id"], a["pool_id"], a["size_bytes"], a["numa_node"]) == (
            tid,
            p["id"],
            PAGE,
            0,
        )
        assert (a["persistence"], a["label"], a["key"], a["evictable"], a["state"]) == (
            "volatile",
            "kv layer 0",
            "k-a",
            True,
            "live",
        )
        assert len(a["id"]) >= 32
        created, expires = ts(a["created_at"]), ts(a["expires_at"])
        assert before - 1 <= created <= time.time() + 1
        assert expires - created == pytest.approx(120, abs=1)
        assert a["created_at"] < a["expires_at"]  # sorts as text

        b = reserve(c, 1 * MiB, p["name"])
        assert (b["pool_id"], b["size_bytes"], b["label"], b["key"], b["evictable"]) == (
            p["id"],
            1 * MiB,
            None,
            None,
            False,
        )
        assert ts(b["expires_at"]) - ts(b["created_at"]) == pytest.approx(600, abs=1)  # default
        # size_gb is GiB (2^30 bytes): 1/1024 GiB is exactly 1 MiB
        g = c.post(f"/v1/pools/{p['id']}/reserve", json={"size_gb": 1 / 1024})
        assert g.status_code == 201, g.text
        assert g.json()["size_bytes"] == 1 * MiB
        assert pool(daemon, p["id"])["used_bytes"] == PAGE + 2 * MiB
        problem(c.post(f"/v1/pools/{'0' * 32}/reserve", json={"size_bytes": PAGE}), 404)
        problem(c.post("/v1/pools/no-such-pool/reserve", json={"size_bytes": PAGE}), 404)
        # a pool's persistence must match
        problem(
            c.post(
                f"/v1/pools/{p['id']}/reserve",
                json={"size_bytes": PAGE, "persistence": "persistent"},
            ),
            422,
            "qos-unmet",
        )
        problem(
            c.post(f"/v1/pools/{p['id']}/reserve", json={"size_bytes": PAGE, "latency_us": 2}),
            422,
            "qos-unmet",
        )
    finally:
        daemon.admin.delete(f"/v1/pools/{p['id']}?drain=true")


def test_auto_reserve_qos(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    slow = make_pool(daemon, 8 * MiB, latency_us=50)
    durable = make_pool(daemon, 8 * MiB, latency_us=20, persistence="persistent")
    try:
        # persistence picks the only persistent pool
        d = reserve(c, PAGE, persistence="persistent")
        assert (d["pool_id"], d["persistence"]) == (durable["id"], "persistent")
        # latency_us is a ceiling: only node0 (latency 1) meets 10
        f = reserve(c, PAGE, latency_us=10)
        assert f["pool_id"] == pool(daemon, "node0")["id"]
        # volatile with a loose latency: the pool with the most free space (node0, 256 MiB)
        v = reserve(c, PAGE, persistence="volatile", latency_us=1000)
        assert v["pool_id"] == pool(daemon, "node0")["id"]
        # the persistent pool's latency (20) is above a 10 µs ceiling
        problem(
            c.post(
                "/v1/reserve",
                json={"size_bytes": PAGE, "persistence": "persistent", "latency_us": 10},
            ),
            422,
            "qos-unmet",
        )
        # larger than every pool that meets the QoS (the 8 MiB persistent one): 422
        problem(
            c.post("/v1/reserve", json={"size_bytes": 9 * MiB, "persistence": "persistent"}), 422
        )
        n = reserve(c, PAGE, numa_node=0)
        assert n["numa_node"] == 0
        problem(c.post("/v1/reserve", json={"size_bytes": PAGE, "numa_node": 7}), 422)
        problem(c.post("/v1/reserve", json={"size_bytes": PAGE, "latency_us": 0}), 422, "qos-unmet")
    finally:
        for p in (slow, durable):
            assert daemon.admin.delete(f"/v1/pools/{p['id']}?drain=true").status_code == 204


def test_buffers_list_and_get(daemon: Daemon, tenant) -> None:
    tid, _, c = tenant
    oid, okey = daemon.tenant("other", 8 * MiB)
    with daemon.client(okey) as other:
        mine = [reserve(c, PAGE, label=f"m{i}") for i in range(3)]
        theirs = reserve(other, PAGE)
        listed = c.get("/v1/buffers").json()
        assert {b["id"] for b in listed} == {b["id"] for b in mine}
        assert all(b.keys() >= BUFFER_FIELDS for b in listed)
        got = c.get(f"/v1/buffers/{mine[0]['id']}")
        assert got.status_code == 200
        assert got.json()["label"] == "m0"
        # admin: all, or one tenant's
        every = {b["id"] for b in daemon.admin.get("/v1/buffers").json()}
        assert {b["id"] for b in mine} | {theirs["id"]} <= every
        r = daemon.admin.get("/v1/buffers", params={"tenant_id": tid})
        assert {b["id"] for b in r.json()} == {b["id"] for b in mine}
        r = daemon.admin.get("/v1/buffers", params={"tenant_id": oid})
        assert {b["id"] for b in r.json()} == {theirs["id"]}
        assert daemon.admin.get(f"/v1/buffers/{theirs['id']}").json()["tenant_id"] == oid
        problem(daemon.admin.get("/v1/buffers", params={"tenant_id": "0" * 32}), 404)
        problem(c.get(f"/v1/buffers/{'0' * 32}"), 404, "not-found")
        # the admin may release any buffer
        assert daemon.admin.delete(f"/v1/buffers/{theirs['id']}").status_code == 204
        problem(other.get(f"/v1/buffers/{theirs['id']}"), 404)
    daemon.admin.delete(f"/v1/tenants/{oid}")


def test_pin(tenant) -> None:
    _, _, c = tenant
    buf = reserve(c, 1 * MiB)
    r = c.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.keys() >= BUFFER_FIELDS
    assert body["numa_node"] == 0
    assert body["placement"] == {"0": 1 * MiB // PAGE}
    problem(c.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": 7}), 422)
    assert c.get(f"/v1/buffers/{buf['id']}").json()["numa_node"] == 0
    problem(c.patch(f"/v1/buffers/{'0' * 32}/pin", json={"numa_node": 0}), 404)


def test_renew_moves_expires_at(tenant) -> None:
    _, _, c = tenant
    buf = reserve(c, PAGE, ttl_s=60)
    r = c.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 3600})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.keys() >= BUFFER_FIELDS
    assert ts(body["expires_at"]) - ts(buf["expires_at"]) == pytest.approx(3540, abs=2)
    assert body["created_at"] == buf["created_at"]
    assert c.get(f"/v1/buffers/{buf['id']}").json()["expires_at"] == body["expires_at"]
    # shorter is allowed too: the lease is now + ttl
    r = c.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 30})
    assert ts(r.json()["expires_at"]) == pytest.approx(time.time() + 30, abs=2)
    problem(c.post(f"/v1/buffers/{'0' * 32}/renew", json={"ttl_s": 60}), 404)


def test_checkpoint(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    volatile = reserve(c, PAGE)
    problem(c.post(f"/v1/buffers/{volatile['id']}/checkpoint"), 409)
    p = make_pool(daemon, 4 * MiB, persistence="persistent")
    try:
        buf = reserve(c, 256 * KiB, p["id"])
        assert buf["persistence"] == "persistent"
        r = c.post(f"/v1/buffers/{buf['id']}/checkpoint")
        assert r.status_code == 200, r.text
        ck = r.json()
        assert ck["bytes"] == 256 * KiB
        assert isinstance(ck["checksum"], str)
        assert ck["checksum"]
        # a fresh buffer reads zeros: the checksum is stable across checkpoints
        assert c.post(f"/v1/buffers/{buf['id']}/checkpoint").json()["checksum"] == ck["checksum"]
        problem(c.post(f"/v1/buffers/{'0' * 32}/checkpoint"), 404)
    finally:
        daemon.admin.delete(f"/v1/pools/{p['id']}?drain=true")


def test_release_then_404(daemon: Daemon, tenant) -> None:
    _, _, c = tenant
    used = pool(daemon, "node0")["used_bytes"]
    buf = reserve(c, 2 * MiB)
    assert pool(daemon, "node0")["used_bytes"] == used + 2 * MiB
    r = c.delete(f"/v1/buffers/{buf['id']}")
    assert r.status_code == 204
    assert r.content == b""
    assert pool(daemon, "node0")["used_bytes"] == used
    assert c.get("/v1/usage").json()["used_bytes"] == 0
    for r in (
        c.delete(f"/v1/buffers/{buf['id']}"),
        c.get(f"/v1/buffers/{buf['id']}"),
        c.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 60}),
        c.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": 0}),
        c.post(f"/v1/buffers/{buf['id']}/checkpoint"),
    ):
        problem(r, 404, "not-found")
    assert buf["id"] not in {b["id"] for b in c.get("/v1/buffers").json()}


def test_lookup_longest_key_wins(tenant) -> None:
    _, _, c = tenant
    short = reserve(c, PAGE, key="m:a")
    long = reserve(c, PAGE, key="m:a:b:c")
    r = c.post("/v1/buffers/lookup", json={"keys": ["m:a", "m:a:b", "m:a:b:c", "m:a:b:c:d"]})
    assert r.status_code == 200, r.text
    hit = r.json()
    assert hit["key"] == "m:a:b:c"
    assert hit["buffer"]["id"] == long["id"]
    assert hit["buffer"].keys() >= BUFFER_FIELDS
    r = c.post("/v1/buffers/lookup", json={"keys": ["m:a", "m:a:x"]})
    assert r.json()["buffer"]["id"] == short["id"]
    problem(c.post("/v1/buffers/lookup", json={"keys": ["nope", "nope:1"]}), 404, "not-found")
    # a released buffer no longer answers
    c.delete(f"/v1/buffers/{long['id']}")
    assert c.post("/v1/buffers/lookup", json={"keys": ["m:a", "m:a:b:c"]}).json()["key"] == "m:a"


# -- the status codes of the API -------------------------------------------------------------


ADMIN_ROUTES = [
    ("GET", "/v1/tenants", None),
    ("POST", "/v1/tenants", {"name": "x", "quota_bytes": 1}),
    ("GET", "/v1/tenants/{tid}", None),
    ("PATCH", "/v1/tenants/{tid}", {"quota_bytes": 1 << 40}),
    ("DELETE", "/v1/tenants/{tid}", None),
    ("POST", "/v1/tenants/{tid}/keys", None),
    ("DELETE", "/v1/tenants/{tid}/keys/{kid}", None),
    ("POST", "/v1/pools", {"name": "x", "numa_node": 0, "capacity_bytes": 4096}),
    ("DELETE", "/v1/pools/node0", None),
]


@pytest.mark.parametrize("key", ["missing", "unknown", "basic", "empty-bearer"])
def test_401_missing_or_unknown_key(daemon: Daemon, key: str) -> None:
    headers = {
        "missing": {},
        "unknown": {"Authorization": "Bearer maasd_nope"},
        "basic": {"Authorization": "Basic dXNlcjpwdw=="},
        "empty-bearer": {"Authorization": "Bearer"},
    }[key]
    for method, path, body in [
        ("GET", "/v1/usage", None),
        ("GET", "/v1/pools", None),
        ("GET", "/v1/tenants", None),
        ("GET", "/v1/buffers", None),
        ("POST", "/v1/reserve", {"size_bytes": 4096}),
        ("DELETE", f"/v1/buffers/{'0' * 32}", None),
    ]:
        r = httpx.request(method, daemon.url + path, json=body, headers=headers)
        problem(r, 401, "unauthorized")
        assert r.headers.get("www-authenticate", "").lower().startswith("bearer")


def test_403_tenant_key_on_admin_routes(daemon: Daemon, tenant) -> None:
    tid, _, c = tenant
    kid = daemon.admin.post(f"/v1/tenants/{tid}/keys").json()["id"]
    for method, path, body in ADMIN_ROUTES:
        r = c.request(method, path.format(tid=tid, kid=kid), json=body)
        problem(r, 403, "forbidden")
    # nothing happened: quota, keys, tenants and pools unchanged
    assert c.get("/v1/usage").json()["quota_bytes"] == 64 * MiB
    assert daemon.admin.delete(f"/v1/tenants/{tid}/keys/{kid}").status_code == 204
    assert pool(daemon, "node0")["name"] == "node0"


def test_409_quota_and_duplicate_key(daemon: Daemon) -> None:
    tid, key = daemon.tenant("quota", 1 * MiB)
    with daemon.client(key) as c:
        reserve(c, 768 * KiB, key="dup")
        problem(c.post("/v1/reserve", json={"size_bytes": 512 * KiB}), 409, "quota-exceeded")
        # the quota counts rounded sizes: 256 KiB + 1 byte rounds to 65 pages > what is left
        problem(c.post("/v1/reserve", json={"size_bytes": 256 * KiB + 1}), 409, "quota-exceeded")
        reserve(c, 256 * KiB)  # exactly fills the quota
        assert c.get("/v1/usage").json()["used_bytes"] == 1 * MiB
        problem(c.post("/v1/reserve", json={"size_bytes": 1}), 409, "quota-exceeded")
    tid2, key2 = daemon.tenant("dup", 4 * MiB)
    with daemon.client(key2) as c:
        reserve(c, PAGE, key="dup")  # keys are per tenant
        problem(
            c.post("/v1/reserve", json={"size_bytes": PAGE, "key": "dup"}), 409, "duplicate-key"
        )
        assert c.get("/v1/usage").json()["buffers"] == 1
    for t in (tid, tid2):
        daemon.admin.delete(f"/v1/tenants/{t}")


def test_422_size_larger_than_pool(daemon: Daemon) -> None:
    tid, key = daemon.tenant("big", 1 << 40)
    p = make_pool(daemon, 1 * MiB)
    with daemon.client(key) as c:
        problem(
            c.post(f"/v1/pools/{p['id']}/reserve", json={"size_bytes": 1 * MiB + 1}),
            422,
            "too-large",
        )
        problem(c.post("/v1/reserve", json={"size_bytes": 512 * MiB}), 422, "too-large")
        problem(c.post("/v1/reserve", json={"size_gb": 4.0}), 422, "too-large")
        assert c.get("/v1/usage").json()["used_bytes"] == 0
    daemon.admin.delete(f"/v1/pools/{p['id']}")
    daemon.admin.delete(f"/v1/tenants/{tid}")


def test_507_pool_full_now(daemon: Daemon) -> None:
    p = make_pool(daemon, 1 * MiB)
    ta, ka = daemon.tenant("filler", 64 * MiB)
    tb, kb = daemon.tenant("late", 64 * MiB)
    with daemon.client(ka) as a, daemon.client(kb) as b:
        held = [reserve(a, 256 * KiB, p["id"]) for _ in range(4)]
        assert pool(daemon, p["id"])["free_bytes"] == 0
        body = problem(
            b.post(f"/v1/pools/{p['id']}/reserve", json={"size_bytes": PAGE}), 507, "pool-exhausted"
        )
        assert body["type"].endswith("/pool-exhausted")
        assert b.get("/v1/usage").json()["used_bytes"] == 0
        # once space is back, the same request succeeds
        a.delete(f"/v1/buffers/{held[0]['id']}")
        reserve(b, PAGE, p["id"])
    daemon.admin.delete(f"/v1/pools/{p['id']}?drain=true")
    for t in (ta, tb):
        daemon.admin.delete(f"/v1/tenants/{t}")
