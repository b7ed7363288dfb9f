"""Isolation (another tenant's buffer is a 404 like an unknown one) through real HTTP.

Tenant B can never see, pin, renew, checkpoint, release or learn the existence
of tenant A's buffer: every operation answers 404 exactly as for an id that
never existed, and A's buffer is untouched afterwards. A tenant key on an
admin route is 403, and does nothing.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20
PAGE = 4096


@pytest.fixture(scope="module")
def world(daemon: Daemon):
    """Tenants A and B; A holds a volatile keyed buffer and a persistent one."""
    ta, ka = daemon.tenant("iso-a", 64 * MiB)
    tb, kb = daemon.tenant("iso-b", 64 * MiB)
    pool = daemon.pool(f"iso-{secrets.token_hex(3)}", 4 * MiB, persistence="persistent")
    with daemon.client(ka) as a, daemon.client(kb) as b:
        r = a.post(
            "/v1/reserve", json={"size_bytes": MiB, "key": "model:prefix", "label": "secret"}
        )
        assert r.status_code == 201, r.text
        durable = a.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": PAGE})
        assert durable.status_code == 201, durable.text
        yield {
            "a": a,
            "b": b,
            "ta": ta,
            "tb": tb,
            "buf": r.json(),
            "durable": durable.json(),
            "pool": pool,
        }
    daemon.admin.delete(f"/v1/pools/{pool['id']}?drain=true")
    for t in (ta, tb):
        daemon.admin.delete(f"/v1/tenants/{t}")


def operations(buffer_id: str) -> list[tuple[str, str, dict | None]]:
    return [
        ("GET", f"/v1/buffers/{buffer_id}", None),
        ("PATCH", f"/v1/buffers/{buffer_id}/pin", {"numa_node": 0}),
        ("POST", f"/v1/buffers/{buffer_id}/renew", {"ttl_s": 5}),
        ("POST", f"/v1/buffers/{buffer_id}/checkpoint", None),
        ("DELETE", f"/v1/buffers/{buffer_id}", None),
    ]


def shape(r: httpx.Response, buffer_id: str) -> tuple:
    """What a 404 tells the caller, with the id it was given masked out."""
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    return (
        r.status_code,
        body["type"],
        body["title"],
        body["status"],
        body["detail"].replace(buffer_id, "<id>"),
    )


@pytest.mark.parametrize("which", ["buf", "durable"])
def test_foreign_buffer_is_404_like_an_unknown_one(world, which: str) -> None:
    a, b, buf = world["a"], world["b"], world[which]
    before = a.get(f"/v1/buffers/{buf['id']}").json()
    unknown = secrets.token_hex(16)
    for (method, path, body), (_, upath, _) in zip(
        operations(buf["id"]), operations(unknown), strict=True
    ):
        r = b.request(method, path, json=body)
        assert r.status_code == 404, f"{method} {path}: {r.status_code} {r.text}"
        u = b.request(method, upath, json=body)
        # same status, type, title and detail: a foreign id is indistinguishable from none
        assert shape(r, buf["id"]) == shape(u, unknown)
    # A's buffer is untouched: not renewed, not pinned, not released
    after = a.get(f"/v1/buffers/{buf['id']}")
    assert after.status_code == 200
    assert after.json() == before


def test_foreign_buffer_never_listed(world) -> None:
    b, buf = world["b"], world["buf"]
    assert buf["id"] not in {x["id"] for x in b.get("/v1/buffers").json()}
    # the admin-only filter is ignored for a tenant key: it still sees only its own
    r = b.get("/v1/buffers", params={"tenant_id": world["ta"]})
    assert r.status_code in (200, 403)
    if r.status_code == 200:
        assert {x["tenant_id"] for x in r.json()} <= {world["tb"]}
    usage = b.get("/v1/usage").json()
    assert usage["tenant_id"] == world["tb"]


def test_lookup_never_crosses_tenants(world) -> None:
    a, b, buf = world["a"], world["b"], world["buf"]
    r = b.post("/v1/buffers/lookup", json={"keys": ["model", "model:prefix"]})
    assert r.status_code == 404, r.text
    # B may use the same key for its own buffer; each tenant then finds its own
    mine = b.post("/v1/reserve", json={"size_bytes": PAGE, "key": "model:prefix"})
    assert mine.status_code == 201, mine.text
    try:
        hit_b = b.post("/v1/buffers/lookup", json={"keys": ["model:prefix"]}).json()
        hit_a = a.post("/v1/buffers/lookup", json={"keys": ["model:prefix"]}).json()
        assert hit_b["buffer"]["id"] == mine.json()["id"]
        assert hit_a["buffer"]["id"] == buf["id"]
    finally:
        assert b.delete(f"/v1/buffers/{mine.json()['id']}").status_code == 204
    assert b.post("/v1/buffers/lookup", json={"keys": ["model:prefix"]}).status_code == 404


def test_usage_and_quota_are_per_tenant(world) -> None:
    a, b = world["a"], world["b"]
    assert a.get("/v1/usage").json()["used_bytes"] == MiB + PAGE
    assert b.get("/v1/usage").json()["used_bytes"] == 0


ADMIN_ROUTES = [
    ("GET", "/v1/tenants", None),
    ("POST", "/v1/tenants", {"name": "intruder", "quota_bytes": 1 << 40}),
    ("GET", "/v1/tenants/{ta}", None),
    ("GET", "/v1/tenants/{tb}", None),
    ("PATCH", "/v1/tenants/{tb}", {"quota_bytes": 1 << 40}),
    ("PATCH", "/v1/tenants/{ta}", {"quota_bytes": 0}),
    ("DELETE", "/v1/tenants/{ta}", None),
    ("POST", "/v1/tenants/{ta}/keys", None),
    ("POST", "/v1/tenants/{tb}/keys", None),
    ("DELETE", "/v1/tenants/{ta}/keys/{kid}", None),
    ("POST", "/v1/pools", {"name": "intruder", "numa_node": 0, "capacity_bytes": 4096}),
    ("DELETE", "/v1/pools/{pool}", None),
    ("DELETE", "/v1/pools/{pool}?drain=true", None),
]


@pytest.mark.parametrize(
    ("method", "path", "body"), ADMIN_ROUTES, ids=[f"{m} {p}" for m, p, _ in ADMIN_ROUTES]
)
def test_tenant_key_on_admin_route_is_403(
    daemon: Daemon, world, method: str, path: str, body: dict | None
) -> None:
    a, b = world["a"], world["b"]
    kid = "0" * 32
    before = (
        daemon.admin.get("/v1/tenants").json(),
        daemon.admin.get("/v1/pools").json(),
        a.get("/v1/buffers").json(),
    )
    r = b.request(
        method,
        path.format(ta=world["ta"], tb=world["tb"], kid=kid, pool=world["pool"]["id"]),
        json=body,
    )
    assert r.status_code == 403, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"].endswith("forbidden")
    assert (
        daemon.admin.get("/v1/tenants").json(),
        daemon.admin.get("/v1/pools").json(),
        a.get("/v1/buffers").json(),
    ) == before
