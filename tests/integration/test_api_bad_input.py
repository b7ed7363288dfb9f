"""SPEC §2.7 "bad input never harms", through real HTTP.

Every malformed, oversized, negative, unknown-field or wrongly-typed body gets a
4xx ``application/problem+json`` answer with ``type``, ``title``, ``status`` and
``detail`` — never a 5xx — and changes nothing: the tenant's usage, the pools'
used bytes, the tenants, the pools and the target buffer read the same after.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from maasd.bounds import MAX_LOOKUP_KEYS

if TYPE_CHECKING:
    from conftest import Daemon

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096


class Raw:
    """A body sent as-is (bytes), with an explicit content type (``None``: no header)."""

    def __init__(self, content: bytes, content_type: str | None = "application/json") -> None:
        self.content, self.content_type = content, content_type

    def __repr__(self) -> str:
        return f"Raw({self.content[:24]!r}…, {self.content_type})"


def send(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, Raw):
        headers = {"content-type": body.content_type} if body.content_type else {}
        return c.request(method, path, content=body.content, headers=headers)
    return c.request(
        method,
        path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


def assert_problem_4xx(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, f"{r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert {"type", "title", "status", "detail"} <= body.keys(), body
    assert body["status"] == r.status_code
    assert isinstance(body["detail"], str)
    assert body["detail"]
    return body


DEEP = b"[" * 20_000 + b"]" * 20_000  # 40 KB: under the body limit, deeper than any decoder stack
DEEP_OBJECT = b'{"size_bytes":' + b'{"a":' * 6000 + b"1" + b"}" * 6001


def _common_bad_bodies() -> list[tuple[str, Any]]:
    """Bodies bad for any JSON-object route."""
    return [
        ("malformed-json", Raw(b'{"size_bytes": ')),
        ("unquoted-key", Raw(b"{size_bytes: 4096}")),
        ("trailing-garbage", Raw(b'{"size_bytes": 4096} x')),
        ("nan", Raw(b'{"size_bytes": NaN}')),
        ("invalid-utf8", Raw(b'{"label": "\xff\xfe"}')),
        ("json-array", [{"size_bytes": 4096}]),
        ("empty-array", []),
        ("json-scalar", 4096),
        ("json-string", "size_bytes"),
        ("json-null", None),
        ("empty-body", Raw(b"")),
        ("whitespace-body", Raw(b"   ")),
        ("text-plain", Raw(b'{"size_bytes": 4096}', "text/plain")),
        ("form-encoded", Raw(b"size_bytes=4096", "application/x-www-form-urlencoded")),
        ("no-content-type", Raw(b'{"size_bytes": 4096}', None)),
        ("over-64KiB", {"size_bytes": 4096, "label": "x" * (65 * KiB)}),
        ("deeply-nested-array", Raw(DEEP)),
        ("deeply-nested-object", Raw(DEEP_OBJECT)),
    ]


RESERVE_BAD: list[tuple[str, Any]] = [
    ("missing-size", {}),
    ("neither-size", {"ttl_s": 60, "label": "x"}),
    ("both-sizes", {"size_bytes": 4096, "size_gb": 0.001}),
    ("size-zero", {"size_bytes": 0}),
    ("size-negative", {"size_bytes": -4096}),
    ("size-2^63", {"size_bytes": 2**63}),
    ("size-2^64", {"size_bytes": 2**64}),
    ("size-huge-int", {"size_bytes": 10**40}),
    ("size-float", {"size_bytes": 4096.5}),
    ("size-float-integral", {"size_bytes": 4096.0}),
    ("size-string", {"size_bytes": "4096"}),
    ("size-bool", {"size_bytes": True}),
    ("size-null", {"size_bytes": None}),
    ("size-list", {"size_bytes": [4096]}),
    ("size-object", {"size_bytes": {"n": 4096}}),
    ("gb-zero", {"size_gb": 0}),
    ("gb-negative", {"size_gb": -1.0}),
    ("gb-huge", {"size_gb": 1e30}),
    ("gb-2^33", {"size_gb": 2.0**33}),
    ("gb-string", {"size_gb": "1"}),
    ("gb-bool", {"size_gb": True}),
    ("gb-null", {"size_gb": None}),
    ("gb-infinity", Raw(b'{"size_gb": Infinity}')),
    ("gb-1e400", Raw(b'{"size_gb": 1e400}')),
    ("unknown-field", {"size_bytes": 4096, "colour": "red"}),
    ("unknown-field-null", {"size_bytes": 4096, "pool": None}),
    ("tenant-id-field", {"size_bytes": 4096, "tenant_id": "0" * 32}),
    ("persistence-bad-enum", {"size_bytes": 4096, "persistence": "forever"}),
    ("persistence-case", {"size_bytes": 4096, "persistence": "Volatile"}),
    ("persistence-int", {"size_bytes": 4096, "persistence": 1}),
    ("evictable-string", {"size_bytes": 4096, "evictable": "yes"}),
    ("evictable-int", {"size_bytes": 4096, "evictable": 1}),
    ("evictable-null", {"size_bytes": 4096, "evictable": None}),
    ("label-129", {"size_bytes": 4096, "label": "l" * 129}),
    ("label-int", {"size_bytes": 4096, "label": 7}),
    ("key-513", {"size_bytes": 4096, "key": "k" * 513}),
    ("key-empty", {"size_bytes": 4096, "key": ""}),
    ("key-list", {"size_bytes": 4096, "key": ["a"]}),
    ("ttl-zero", {"size_bytes": 4096, "ttl_s": 0}),
    ("ttl-negative", {"size_bytes": 4096, "ttl_s": -60}),
    ("ttl-over-max", {"size_bytes": 4096, "ttl_s": 10**8}),
    ("ttl-2^63", {"size_bytes": 4096, "ttl_s": 2**63}),
    ("ttl-float", {"size_bytes": 4096, "ttl_s": 1.5}),
    ("ttl-string", {"size_bytes": 4096, "ttl_s": "60"}),
    ("ttl-bool", {"size_bytes": 4096, "ttl_s": True}),
    ("ttl-null", {"size_bytes": 4096, "ttl_s": None}),
    ("latency-negative", {"size_bytes": 4096, "latency_us": -1}),
    ("latency-string", {"size_bytes": 4096, "latency_us": "1"}),
    ("latency-2^64", {"size_bytes": 4096, "latency_us": 2**64}),
    ("numa-negative", {"size_bytes": 4096, "numa_node": -1}),
    ("numa-string", {"size_bytes": 4096, "numa_node": "0"}),
    ("numa-huge", {"size_bytes": 4096, "numa_node": 2**40}),
    *_common_bad_bodies(),
]


@pytest.fixture(scope="module")
def victim(daemon: Daemon):
    """A tenant holding one keyed buffer: ``(tenant_id, client, buffer)``."""
    tid, key = daemon.tenant("bad-input", 64 * MiB)
    with daemon.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": 1 * MiB, "key": "held", "label": "held"})
        assert r.status_code == 201, r.text
        yield tid, c, r.json()
    daemon.admin.delete(f"/v1/tenants/{tid}")


def snapshot(daemon: Daemon, c: httpx.Client, buffer_id: str) -> dict[str, Any]:
    """Everything a bad request must leave unchanged."""
    pools = daemon.admin.get("/v1/pools").json()
    return {
        "usage": c.get("/v1/usage").json(),
        "pools": sorted(
            (p["name"], p["capacity_bytes"], p["used_bytes"], p["buffers"]) for p in pools
        ),
        "tenants": sorted(
            (t["id"], t["name"], t["quota_bytes"], t["used_bytes"])
            for t in daemon.admin.get("/v1/tenants").json()
        ),
        "buffers": c.get("/v1/buffers").json(),
        "buffer": c.get(f"/v1/buffers/{buffer_id}").json(),
    }


@pytest.mark.parametrize("path", ["/v1/reserve", "/v1/pools/node0/reserve"])
@pytest.mark.parametrize(("case", "body"), RESERVE_BAD, ids=[c for c, _ in RESERVE_BAD])
def test_reserve_bad_body(daemon: Daemon, victim, path: str, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "POST", path, body)
    problem = assert_problem_4xx(r)
    if case == "over-64KiB":
        assert r.status_code == 413
    elif case not in ("gb-huge",):  # 1e30 GiB is a well-formed size that no pool holds: 400 or 422
        assert r.status_code == 400, problem
    assert snapshot(daemon, c, held["id"]) == before


def test_unknown_field_detail_names_the_field(victim) -> None:
    _, c, _ = victim
    r = c.post("/v1/reserve", json={"size_bytes": 4096, "colour": "red"})
    assert "colour" in assert_problem_4xx(r)["detail"]
    r = c.post("/v1/reserve", json={"size_bytes": "4096"})
    assert "size_bytes" in assert_problem_4xx(r)["detail"]


def test_bad_input_without_a_valid_key_is_401_before_the_body_is_read(daemon: Daemon) -> None:
    for headers in ({}, {"Authorization": "Bearer maasd_not-a-key"}):
        for body in (Raw(b"{"), {"size_bytes": -1}, Raw(DEEP), Raw(b"")):
            r = send(
                httpx.Client(base_url=daemon.url, headers=headers), "POST", "/v1/reserve", body
            )
            assert r.status_code == 401, r.text
            assert_problem_4xx(r)


# -- pools, tenants -------------------------------------------------------------------------


def _pool(**over: Any) -> dict[str, Any]:
    return {
        "name": f"bad-{secrets.token_hex(3)}",
        "numa_node": 0,
        "capacity_bytes": 1 * MiB,
        **over,
    }


POOL_BAD: list[tuple[str, Any]] = [
    ("missing-name", {"numa_node": 0, "capacity_bytes": MiB}),
    ("missing-node", {"name": "bad-x", "capacity_bytes": MiB}),
    ("missing-capacity", {"name": "bad-x", "numa_node": 0}),
    ("name-empty", _pool(name="")),
    ("name-space", _pool(name="has space")),
    ("name-slash", _pool(name="a/b")),
    ("name-65", _pool(name="n" * 65)),
    ("name-leading-dot", _pool(name=".hidden")),
    ("name-int", _pool(name=5)),
    ("node-negative", _pool(numa_node=-1)),
    ("node-string", _pool(numa_node="0")),
    ("node-huge", _pool(numa_node=2**63)),
    ("node-7", _pool(numa_node=7)),
    ("capacity-zero", _pool(capacity_bytes=0)),
    ("capacity-negative", _pool(capacity_bytes=-1)),
    ("capacity-2^63", _pool(capacity_bytes=2**63)),
    ("capacity-2^64", _pool(capacity_bytes=2**64)),
    ("capacity-2^63-1", _pool(capacity_bytes=2**63 - 1)),
    ("capacity-float", _pool(capacity_bytes=1.5)),
    ("capacity-string", _pool(capacity_bytes="1048576")),
    ("capacity-bool", _pool(capacity_bytes=True)),
    ("backing-bad", _pool(backing="disk")),
    ("persistence-bad", _pool(persistence="sometimes")),
    ("scrub-bad", _pool(scrub="shred")),
    ("prefault-string", _pool(prefault="yes")),
    ("latency-negative", _pool(latency_us=-1)),
    ("latency-float", _pool(latency_us=0.5)),
    ("spill-dir-volatile", _pool(spill_dir="/tmp/x")),
    ("spill-dir-empty", _pool(persistence="persistent", spill_dir="")),
    ("unknown-field", _pool(colour="red")),
    ("id-field", _pool(id="0" * 32)),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize(("case", "body"), POOL_BAD, ids=[c for c, _ in POOL_BAD])
def test_pool_create_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(daemon.admin, "POST", "/v1/pools", body)
    assert_problem_4xx(r)
    if case == "node-7":
        assert r.status_code == 422
    assert snapshot(daemon, c, held["id"]) == before


TENANT_BAD: list[tuple[str, Any]] = [
    ("missing-name", {"quota_bytes": MiB}),
    ("missing-quota", {"name": "bad-t"}),
    ("name-empty", {"name": "", "quota_bytes": MiB}),
    ("name-space", {"name": "a b", "quota_bytes": MiB}),
    ("name-65", {"name": "n" * 65, "quota_bytes": MiB}),
    ("name-null", {"name": None, "quota_bytes": MiB}),
    ("quota-negative", {"name": "bad-t", "quota_bytes": -1}),
    ("quota-2^63", {"name": "bad-t", "quota_bytes": 2**63}),
    ("quota-2^64", {"name": "bad-t", "quota_bytes": 2**64}),
    ("quota-float", {"name": "bad-t", "quota_bytes": 1.5}),
    ("quota-string", {"name": "bad-t", "quota_bytes": "1"}),
    ("quota-bool", {"name": "bad-t", "quota_bytes": False}),
    ("unknown-field", {"name": "bad-t", "quota_bytes": MiB, "admin": True}),
    ("api-key-field", {"name": "bad-t", "quota_bytes": MiB, "api_key": "mine"}),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize("body", [b for _, b in TENANT_BAD], ids=[c for c, _ in TENANT_BAD])
def test_tenant_create_bad_body(daemon: Daemon, victim, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    assert_problem_4xx(send(daemon.admin, "POST", "/v1/tenants", body))
    assert snapshot(daemon, c, held["id"]) == before


def test_tenant_create_duplicate_name_changes_nothing(daemon: Daemon, victim) -> None:
    tid, c, held = victim
    name = daemon.admin.get(f"/v1/tenants/{tid}").json()["name"]
    before = snapshot(daemon, c, held["id"])
    r = daemon.admin.post("/v1/tenants", json={"name": name, "quota_bytes": 1})
    assert assert_problem_4xx(r)["status"] == 409
    assert snapshot(daemon, c, held["id"]) == before


QUOTA_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("negative", {"quota_bytes": -1}),
    ("2^64", {"quota_bytes": 2**64}),
    ("string", {"quota_bytes": "1"}),
    ("null", {"quota_bytes": None}),
    ("rename", {"name": "other"}),
    ("unknown-field", {"quota_bytes": MiB, "name": "other"}),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize("body", [b for _, b in QUOTA_BAD], ids=[c for c, _ in QUOTA_BAD])
def test_tenant_patch_bad_body(daemon: Daemon, victim, body: Any) -> None:
    tid, c, held = victim
    before = snapshot(daemon, c, held["id"])
    assert_problem_4xx(send(daemon.admin, "PATCH", f"/v1/tenants/{tid}", body))
    assert snapshot(daemon, c, held["id"]) == before


# -- pin, renew, lookup ---------------------------------------------------------------------


PIN_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("node-negative", {"numa_node": -1}),
    ("node-string", {"numa_node": "0"}),
    ("node-float", {"numa_node": 0.0}),
    ("node-bool", {"numa_node": False}),
    ("node-null", {"numa_node": None}),
    ("node-2^64", {"numa_node": 2**64}),
    ("node-1024", {"numa_node": 1024}),
    ("node-7", {"numa_node": 7}),
    ("unknown-field", {"numa_node": 0, "migrate": False}),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize(("case", "body"), PIN_BAD, ids=[c for c, _ in PIN_BAD])
def test_pin_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "PATCH", f"/v1/buffers/{held['id']}/pin", body)
    assert_problem_4xx(r)
    assert r.status_code == (422 if case == "node-7" else 413 if case == "over-64KiB" else 400)
    assert snapshot(daemon, c, held["id"]) == before


RENEW_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("ttl-zero", {"ttl_s": 0}),
    ("ttl-negative", {"ttl_s": -1}),
    ("ttl-over-max", {"ttl_s": 10**8}),
    ("ttl-2^64", {"ttl_s": 2**64}),
    ("ttl-float", {"ttl_s": 60.5}),
    ("ttl-string", {"ttl_s": "60"}),
    ("ttl-bool", {"ttl_s": True}),
    ("ttl-null", {"ttl_s": None}),
    ("unknown-field", {"ttl_s": 60, "forever": True}),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize(("case", "body"), RENEW_BAD, ids=[c for c, _ in RENEW_BAD])
def test_renew_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "POST", f"/v1/buffers/{held['id']}/renew", body)
    assert_problem_4xx(r)
    assert r.status_code == (413 if case == "over-64KiB" else 400)
    assert snapshot(daemon, c, held["id"]) == before  # expires_at included


LOOKUP_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("keys-empty", {"keys": []}),
    ("keys-string", {"keys": "held"}),
    ("keys-null", {"keys": None}),
    ("keys-int-item", {"keys": [1]}),
    ("keys-null-item", {"keys": ["held", None]}),
    ("keys-empty-item", {"keys": [""]}),
    ("keys-513", {"keys": ["k" * 513]}),
    ("keys-1025", {"keys": [f"k{i}" for i in range(MAX_LOOKUP_KEYS + 1)]}),
    ("keys-object", {"keys": {"held": 1}}),
    ("unknown-field", {"keys": ["held"], "tenant_id": "0" * 32}),
    *_common_bad_bodies(),
]


@pytest.mark.parametrize(("case", "body"), LOOKUP_BAD, ids=[c for c, _ in LOOKUP_BAD])
def test_lookup_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "POST", "/v1/buffers/lookup", body)
    assert_problem_4xx(r)
    assert r.status_code == (413 if case == "over-64KiB" else 400)
    assert snapshot(daemon, c, held["id"]) == before


# -- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("drain", ["maybe", "2", ""])
def test_delete_pool_bad_drain(daemon: Daemon, victim, drain: str) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = daemon.admin.delete("/v1/pools/node0", params={"drain": drain})
    assert_problem_4xx(r)
    assert snapshot(daemon, c, held["id"]) == before


@pytest.mark.parametrize("buffer_id", ["x" * 5000, "%00", "..%2f..%2fetc", "' OR 1=1 --", "∞"])
def test_odd_ids_are_404(daemon: Daemon, victim, buffer_id: str) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    for method, suffix, body in [
        ("GET", "", None),
        ("DELETE", "", None),
        ("POST", "/renew", {"ttl_s": 60}),
        ("PATCH", "/pin", {"numa_node": 0}),
        ("POST", "/checkpoint", None),
    ]:
        r = c.request(method, f"/v1/buffers/{buffer_id}{suffix}", json=body)
        assert r.status_code in (404, 400), r.text
        assert_problem_4xx(r)
    assert snapshot(daemon, c, held["id"]) == before


@pytest.mark.parametrize("spill_dir", ["/proc/maasd-no-such-dir", "/etc/hostname", "relative/dir"])
def test_pool_unusable_spill_dir_is_4xx(daemon: Daemon, victim, spill_dir: str) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = daemon.admin.post("/v1/pools", json=_pool(persistence="persistent", spill_dir=spill_dir))
    assert snapshot(daemon, c, held["id"]) == before
    assert_problem_4xx(r)
    assert r.status_code == 400
    assert "spill_dir" in r.json()["detail"]


def test_pool_larger_than_the_node_is_422(daemon: Daemon) -> None:
    r = daemon.admin.post("/v1/pools", json=_pool(capacity_bytes=1 << 50))
    assert r.status_code == 422, r.text
    assert r.json()["type"].endswith("too-large")
