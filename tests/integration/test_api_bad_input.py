"""Bad input never harms (a 4xx problem that says what is wrong, nothing changed), through real HTTP.

Every malformed, oversized, negative, unknown-field or wrongly-typed body gets a
4xx ``application/problem+json`` answer with ``type``, ``title``, ``status`` and
``detail`` — never a 5xx — and changes nothing: the tenant's usage, the pools'
used bytes, the tenants, the pools and the target buffer read the same after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import pytest

from bad_bodies import (
    DEEP,
    LOOKUP_BAD,
    PIN_BAD,
    POOL_BAD,
    RENEW_BAD,
    RESERVE_BAD,
    TENANT_BAD,
    TENANT_PATCH_BAD,
    Raw,
    assert_problem_4xx,
    pool_body,
    send,
)

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


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
        assert problem["type"].endswith("/body-too-large")
    elif case not in ("gb-huge",):  # 1e30 GiB is a well-formed size that no pool holds: 400 or 422
        assert r.status_code == 400, problem
        assert problem["type"].endswith("/invalid-request"), problem
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


@pytest.mark.parametrize(("case", "body"), POOL_BAD, ids=[c for c, _ in POOL_BAD])
def test_pool_create_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(daemon.admin, "POST", "/v1/pools", body)
    assert_problem_4xx(r)
    if case == "node-7":
        assert r.status_code == 422
    assert snapshot(daemon, c, held["id"]) == before


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


@pytest.mark.parametrize(
    "body", [b for _, b in TENANT_PATCH_BAD], ids=[c for c, _ in TENANT_PATCH_BAD]
)
def test_tenant_patch_bad_body(daemon: Daemon, victim, body: Any) -> None:
    tid, c, held = victim
    before = snapshot(daemon, c, held["id"])
    assert_problem_4xx(send(daemon.admin, "PATCH", f"/v1/tenants/{tid}", body))
    assert snapshot(daemon, c, held["id"]) == before


# -- pin, renew, lookup ---------------------------------------------------------------------


@pytest.mark.parametrize(("case", "body"), PIN_BAD, ids=[c for c, _ in PIN_BAD])
def test_pin_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "PATCH", f"/v1/buffers/{held['id']}/pin", body)
    assert_problem_4xx(r)
    assert r.status_code == (422 if case == "node-7" else 413 if case == "over-64KiB" else 400)
    assert snapshot(daemon, c, held["id"]) == before


@pytest.mark.parametrize(("case", "body"), RENEW_BAD, ids=[c for c, _ in RENEW_BAD])
def test_renew_bad_body(daemon: Daemon, victim, case: str, body: Any) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "POST", f"/v1/buffers/{held['id']}/renew", body)
    assert_problem_4xx(r)
    assert r.status_code == (413 if case == "over-64KiB" else 400)
    assert snapshot(daemon, c, held["id"]) == before  # expires_at included


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
    problem = assert_problem_4xx(r)
    assert r.status_code == 400
    assert problem["type"].endswith("/invalid-request")
    assert "drain" in problem["detail"]
    assert snapshot(daemon, c, held["id"]) == before


#: Bodies a route that takes none refuses: a field, not JSON, JSON of another kind, or
#: any of them sent as something other than JSON.
NOT_NO_BODY = [
    ("field", Raw(b'{"x": 1}')),
    ("not-json", Raw(b"not json at all")),
    ("array", Raw(b"[]")),
    ("number", Raw(b"0")),
    ("text-plain", Raw(b'{"x":1}', "text/plain")),
    ("empty-object-as-text", Raw(b"{}", "text/plain")),
    ("no-content-type", Raw(b"{}", None)),
]


@pytest.mark.parametrize("body", [b for _, b in NOT_NO_BODY], ids=[c for c, _ in NOT_NO_BODY])
def test_a_route_that_takes_no_body_refuses_one_and_changes_nothing(
    daemon: Daemon, victim, body: Raw
) -> None:
    """A DELETE (or GET) with a body that is not what a bodiless route accepts is a 400,
    and is not carried out: before, each of these DELETEs answered 204 and deleted."""
    tid, c, held = victim
    issued = daemon.admin.post(f"/v1/tenants/{tid}/keys").json()
    kid = issued["id"]
    before = snapshot(daemon, c, held["id"])
    for client, method, path in [
        (c, "DELETE", f"/v1/buffers/{held['id']}"),
        (c, "GET", f"/v1/buffers/{held['id']}"),
        (c, "GET", "/v1/buffers"),
        (daemon.admin, "DELETE", f"/v1/tenants/{tid}/keys/{kid}"),
        (daemon.admin, "DELETE", "/v1/pools/node0"),
        (daemon.admin, "DELETE", f"/v1/tenants/{tid}"),
    ]:
        r = send(client, method, path, body)
        problem = assert_problem_4xx(r)
        assert r.status_code == 400, (method, path, problem)
        assert problem["type"].endswith("/invalid-request")
    assert snapshot(daemon, c, held["id"]) == before
    with daemon.client(issued["api_key"]) as other:
        assert other.get("/v1/usage").status_code == 200  # the key is not revoked
    assert daemon.admin.delete(f"/v1/tenants/{tid}/keys/{kid}").status_code == 204


@pytest.mark.parametrize("body", [Raw(b""), Raw(b"{}"), Raw(b"null"), Raw(b" { } ")])
def test_a_route_that_takes_no_body_accepts_none_an_empty_object_or_null(victim, body: Raw) -> None:
    _, c, _ = victim
    made = c.post("/v1/reserve", json={"size_bytes": 4096}).json()
    r = send(c, "DELETE", f"/v1/buffers/{made['id']}", body)
    assert r.status_code == 204, r.text
    assert c.get(f"/v1/buffers/{made['id']}").status_code == 404


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
    r = daemon.admin.post(
        "/v1/pools", json=pool_body(persistence="persistent", spill_dir=spill_dir)
    )
    assert snapshot(daemon, c, held["id"]) == before
    assert_problem_4xx(r)
    assert r.status_code == 400
    assert "spill_dir" in r.json()["detail"]


def test_pool_larger_than_the_node_is_422(daemon: Daemon) -> None:
    r = daemon.admin.post("/v1/pools", json=pool_body(capacity_bytes=1 << 50))
    assert r.status_code == 422, r.text
    assert r.json()["type"].endswith("too-large")


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ([("content-type", "application/json")] * 2, "given more than once"),
        ([("content-type", "application/json"), ("content-type", "text/plain")], "more than once"),
        ([("content-type", "application/json; charset=utf-16")], "charset=utf-16"),
    ],
    ids=["twice", "json-and-text", "utf-16"],
)
def test_a_body_is_sent_as_one_utf8_json_document(
    daemon: Daemon, victim, headers: list[tuple[str, str]], said: str
) -> None:
    """Two Content-Type headers (a proxy may keep the first, the daemon read the last) or a
    charset other than UTF-8 (decoded as UTF-8 all the same) are a 400, and nothing is
    carried out: before, each of these reserves and deletes was."""
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    for method, path, body in [
        ("POST", "/v1/reserve", b'{"size_bytes": 4096}'),
        ("DELETE", f"/v1/buffers/{held['id']}", b"{}"),
    ]:
        r = c.request(method, path, content=body, headers=headers)
        problem = assert_problem_4xx(r)
        assert r.status_code == 400, problem
        assert said in problem["detail"], problem
    assert snapshot(daemon, c, held["id"]) == before


def test_a_lone_surrogate_escape_is_a_400_that_names_it(daemon: Daemon, victim) -> None:
    _, c, held = victim
    before = snapshot(daemon, c, held["id"])
    r = send(c, "POST", "/v1/reserve", Raw(rb'{"size_bytes": 4096, "key": "\ud800"}'))
    problem = assert_problem_4xx(r)
    assert r.status_code == 400, problem
    assert "surrogate" in problem["detail"], problem
    assert snapshot(daemon, c, held["id"]) == before
