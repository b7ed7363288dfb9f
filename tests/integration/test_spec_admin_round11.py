"""SPEC §4 admin and tenant routes, §6's Client and §7's maasctl (round 11): hostile
inputs no other test sent through a real daemon, and the clauses they lean on.

- §4 / invariant 7: "Any malformed … request gets a 4xx ``application/problem+json``
  answer … and changes nothing. No input yields a 5xx" — a query parameter or an
  ``Authorization`` header given twice (a proxy reading the first and the daemon the
  last saw two different requests), a NUL character in an id, a query, a key or a
  label (PostgreSQL refuses one with an error: a 500 on the shared ledger).
- §4 ``GET /v1/buffers`` "tenant (own) / admin (all, ``?tenant_id=``)" and invariant 2
  ("… or learn the existence of another tenant's buffer"): a tenant's ``?tenant_id=``
  is no oracle.
- §4 ``DELETE /v1/tenants/{id}/keys/{key_id}``: another tenant's key through this one's
  path is a 404 and stays good.
- §4 ``PATCH /v1/tenants/{id}``: a quota near 2^63 answers integers a 64-bit client
  reads (the derived disk quota was 4 × it).
- §4 timestamps "RFC 3339 strings in UTC with a fixed format" on every record.
- §6 "Errors raise typed exceptions … carrying the problem details": the buffer cap's.
- §7 "SIZE accepts bytes or units"; "on any error it exits non-zero": a size of
  thousands of digits, digits of other scripts; NAME|ID for a name that looks like an id.

Daemons are real ``maasd serve`` subprocesses (``tests/conftest.py``); the PostgreSQL
tests need ``MAASD_TEST_PG_URL`` (``scripts/pg-test-server``), like every ledger test.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_api_routes import problem
from test_maasctl import maasctl, ok, ok_json

from bad_bodies import Raw, assert_problem_4xx, send
from conftest import Daemon
from maasd.bounds import MAX_BYTES
from maasd.client import BufferCountExceeded, Client, QuotaExceeded
from pgdb import PG_URL, fresh_pg_database

KiB, MiB = 1 << 10, 1 << 20
#: §4: "RFC 3339 strings in UTC with a fixed format, so they also sort as text".
FIXED_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def world(daemon: Daemon) -> dict[str, Any]:
    """What a refused request must leave as it was: tenants, pools, every buffer."""
    a = daemon.admin
    return {
        "tenants": sorted(
            (t["id"], t["quota_bytes"], t["used_bytes"], t["buffers"], t["max_buffers"])
            for t in a.get("/v1/tenants").json()
        ),
        "pools": sorted(
            (p["id"], p["used_bytes"], p["buffers"]) for p in a.get("/v1/pools").json()
        ),
        "buffers": sorted(
            (b["id"], b["state"], b["expires_at"]) for b in a.get("/v1/buffers").json()
        ),
    }


@pytest.fixture
def pool_with_a_buffer(daemon: Daemon) -> Iterator[tuple[dict, str, httpx.Client]]:
    """A pool of this test holding one buffer: ``(pool, buffer_id, tenant client)``."""
    p = daemon.pool(uniq("dup"), 4 * MiB)
    tid, key = daemon.tenant("dup", 4 * MiB)
    with daemon.client(key) as t:
        r = t.post(f"/v1/pools/{p['id']}/reserve", json={"size_bytes": 64 * KiB})
        assert r.status_code == 201, r.text
        yield p, r.json()["id"], t
    daemon.admin.delete(f"/v1/pools/{p['id']}", params={"drain": "true"})
    daemon.admin.delete(f"/v1/tenants/{tid}")


# -- a parameter or a header given twice --------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    ["drain=false&drain=true", "drain=false&dr%61in=true", "drain=true&drain=true"],
)
def test_a_drain_given_twice_is_refused_and_drains_nothing(
    daemon: Daemon, pool_with_a_buffer: tuple[dict, str, httpx.Client], query: str
) -> None:
    """``DELETE /v1/pools/{id}?drain=false&drain=true`` drained the pool (the last value
    won): a filter or a log reading the first saw a delete that would have been a 409."""
    p, bid, t = pool_with_a_buffer
    before = world(daemon)
    r = daemon.admin.delete(f"/v1/pools/{p['id']}?{query}")
    body = problem(r, 400, "/invalid-request")
    assert "'drain'" in body["detail"], body
    assert world(daemon) == before
    assert t.get(f"/v1/buffers/{bid}").json()["state"] == "live"
    # one drain=true is what drains
    assert daemon.admin.delete(f"/v1/pools/{p['id']}?drain=true").status_code == 204
    problem(t.get(f"/v1/buffers/{bid}"), 404)


def test_a_tenant_id_given_twice_is_refused(daemon: Daemon) -> None:
    a_id, _ = daemon.tenant("one")
    b_id, _ = daemon.tenant("two")
    r = daemon.admin.get(f"/v1/buffers?tenant_id={a_id}&tenant_id={b_id}")
    assert "'tenant_id'" in problem(r, 400, "/invalid-request")["detail"]
    r = daemon.admin.get(f"/v1/events?tenant_id={a_id}&limit=5&tenant_id={b_id}")
    problem(r, 400, "/invalid-request")
    # one of each is fine
    assert daemon.admin.get(f"/v1/events?tenant_id={a_id}&limit=5").status_code == 200


@pytest.mark.parametrize("order", ["admin-first", "tenant-first"])
def test_two_authorization_headers_are_refused_whichever_comes_first(
    daemon: Daemon, order: str
) -> None:
    """Which key a request with two ``Authorization`` headers is made with depended on
    which one the reader takes (the daemon took the first): neither is taken, 400."""
    tid, key = daemon.tenant("twokeys", 4 * MiB)
    keys = [daemon.admin_key, key] if order == "admin-first" else [key, daemon.admin_key]
    headers = [("Authorization", f"Bearer {k}") for k in keys]
    before = world(daemon)
    name = uniq("twokeys")
    with httpx.Client(base_url=daemon.url, timeout=30) as c:
        r = c.post(
            "/v1/pools",
            json={"name": name, "numa_node": 0, "capacity_bytes": MiB},
            headers=headers,
        )
        assert "Authorization" in problem(r, 400, "/invalid-request")["detail"]
        problem(c.post("/v1/reserve", json={"size_bytes": 4096}, headers=headers), 400)
        problem(c.get("/v1/pools", headers=headers), 400)
        problem(c.get("/metrics", headers=headers), 400)
    assert world(daemon) == before
    assert name not in {p["name"] for p in daemon.admin.get("/v1/pools").json()}
    with daemon.client(key) as t:  # each key alone still works
        assert t.get("/v1/usage").json()["tenant_id"] == tid


# -- NUL characters: PostgreSQL refuses them -------------------------------------------------


def _nul_requests(bid: str, tid: str) -> list[tuple[str, str, str, Any]]:
    """``(who, method, path, body)`` with a NUL in an id, a query, a key or a label."""
    return [
        ("tenant", "GET", "/v1/buffers/a%00b", None),
        ("tenant", "DELETE", "/v1/buffers/a%00b", None),
        ("tenant", "POST", "/v1/buffers/a%00b/renew", {"ttl_s": 60}),
        ("tenant", "PATCH", "/v1/buffers/a%00b/pin", {"numa_node": 0}),
        ("tenant", "POST", "/v1/pools/a%00b/reserve", {"size_bytes": 4096}),
        ("tenant", "POST", "/v1/reserve", Raw(b'{"size_bytes": 4096, "key": "a\\u0000b"}')),
        ("tenant", "POST", "/v1/reserve", Raw(b'{"size_bytes": 4096, "label": "a\\u0000"}')),
        ("tenant", "POST", "/v1/buffers/lookup", Raw(b'{"keys": ["a", "a\\u0000b"]}')),
        ("tenant", "GET", f"/v1/buffers?tenant_id={tid}%00", None),
        ("admin", "GET", "/v1/tenants/a%00b", None),
        ("admin", "PATCH", "/v1/tenants/a%00b", {"quota_bytes": 1}),
        ("admin", "DELETE", "/v1/tenants/a%00b", None),
        ("admin", "POST", "/v1/tenants/a%00b/keys", None),
        ("admin", "DELETE", f"/v1/tenants/{tid}/keys/k%00", None),
        ("admin", "DELETE", "/v1/pools/a%00b", None),
        ("admin", "GET", "/v1/buffers?tenant_id=a%00b", None),
        ("admin", "GET", "/v1/events?tenant_id=a%00b", None),
        ("admin", "GET", f"/v1/buffers/{bid}%00", None),
    ]


def _nul_attack(daemon: Daemon) -> None:
    tid, key = daemon.tenant("nul", 4 * MiB)
    with daemon.client(key) as t:
        held = t.post("/v1/reserve", json={"size_bytes": 4096, "key": "a", "label": "held"})
        assert held.status_code == 201, held.text
        bid = held.json()["id"]
        before = world(daemon)
        for who, method, path, body in _nul_requests(bid, tid):
            c = t if who == "tenant" else daemon.admin
            r = send(c, method, path, body) if body is not None else c.request(method, path)
            p = assert_problem_4xx(r)
            assert r.status_code == 400, (method, path, r.status_code, r.text)
            assert "NUL" in p["detail"], (method, path, p)
        assert world(daemon) == before
        assert t.post("/v1/buffers/lookup", json={"keys": ["a"]}).json()["buffer"]["id"] == bid


def test_a_nul_in_an_id_query_key_or_label_is_a_400(daemon: Daemon) -> None:
    """The SQLite ledger (the default)."""
    _nul_attack(daemon)


def test_a_nul_in_an_id_query_key_or_label_is_a_400_on_postgresql(tmp_path: Path) -> None:
    """On PostgreSQL each of these was a 500 ("A string literal cannot contain NUL")."""
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        d = Daemon(tmp_path / "maasd", env={"MAASD_DB_URL": url})
        try:
            d.start()
            _nul_attack(d)
            assert "Traceback" not in d.log()
        finally:
            d.close()


# -- ?tenant_id= of a tenant key, keys of another tenant ---------------------------------------


def test_a_tenant_keys_tenant_id_filter_learns_nothing(daemon: Daemon) -> None:
    """A tenant's ``?tenant_id=`` is no filter of its (§4: "tenant (own)"): another
    tenant's id, an unknown one, junk and its own all answer its own buffers alike —
    never another's, and no 404 that would tell an existing tenant from none."""
    a_id, a_key = daemon.tenant("own", 4 * MiB)
    b_id, b_key = daemon.tenant("other", 4 * MiB)
    with daemon.client(a_key) as a, daemon.client(b_key) as b:
        mine = a.post("/v1/reserve", json={"size_bytes": 4096}).json()["id"]
        assert b.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201
        b_name = daemon.admin.get(f"/v1/tenants/{b_id}").json()["name"]
        for ref in [b_id, b_name, "0" * 32, "nope", a_id]:
            r = a.get("/v1/buffers", params={"tenant_id": ref})
            assert r.status_code == 200, (ref, r.text)
            assert [(x["id"], x["tenant_id"]) for x in r.json()] == [(mine, a_id)], ref
    # the admin's filter: an unknown tenant is a 404, a known one its buffers alone
    problem(daemon.admin.get("/v1/buffers", params={"tenant_id": "0" * 32}), 404)
    listed = daemon.admin.get("/v1/buffers", params={"tenant_id": a_id}).json()
    assert [x["id"] for x in listed] == [mine]


def test_another_tenants_key_through_this_ones_path_is_404_and_stays_good(
    daemon: Daemon,
) -> None:
    a_id, _ = daemon.tenant("keys-a")
    b_id, b_key = daemon.tenant("keys-b")
    issued = daemon.admin.post(f"/v1/tenants/{b_id}/keys")
    assert issued.status_code == 201, issued.text
    k = issued.json()
    problem(daemon.admin.delete(f"/v1/tenants/{a_id}/keys/{k['id']}"), 404, "/not-found")
    with daemon.client(k["api_key"]) as c:
        assert c.get("/v1/usage").json()["tenant_id"] == b_id
    # through its own tenant's name, it is revoked at once; twice is a 404
    b_name = daemon.admin.get(f"/v1/tenants/{b_id}").json()["name"]
    assert daemon.admin.delete(f"/v1/tenants/{b_name}/keys/{k['id']}").status_code == 204
    with daemon.client(k["api_key"]) as c:
        problem(c.get("/v1/usage"), 401, "/unauthorized")
    problem(daemon.admin.delete(f"/v1/tenants/{b_id}/keys/{k['id']}"), 404)
    with daemon.client(b_key) as c:  # the tenant's first key is untouched
        assert c.get("/v1/usage").status_code == 200


# -- quotas near 2^63, timestamps -------------------------------------------------------------


def test_a_quota_near_2_63_answers_64_bit_integers(daemon: Daemon) -> None:
    """PATCH quota_bytes = 2^63 - 1 (the largest the API takes) answered a disk quota of
    4 × it, which no 64-bit integer holds."""
    tid, key = daemon.tenant("huge", MiB)
    r = daemon.admin.patch(f"/v1/tenants/{tid}", json={"quota_bytes": MAX_BYTES})
    assert r.status_code == 200, r.text
    with daemon.client(key) as t:
        b = t.post("/v1/reserve", json={"size_bytes": 4096})
        assert b.status_code == 201, b.text
        records = [
            r.json(),
            daemon.admin.get(f"/v1/tenants/{tid}").json(),
            t.get("/v1/usage").json(),
            *[x for x in daemon.admin.get("/v1/tenants").json() if x["id"] == tid],
        ]
    for rec in records:
        for field, value in rec.items():
            if isinstance(value, int):
                assert -(2**63) <= value <= MAX_BYTES, (field, value, rec)
        assert rec["quota_bytes"] == MAX_BYTES
    assert records[1]["used_bytes"] == 4096


def test_every_timestamp_has_the_one_fixed_format(daemon: Daemon) -> None:
    tid, key = daemon.tenant("stamps", MiB)
    stamps: list[tuple[str, str]] = []
    stamps.append(("tenant", daemon.admin.get(f"/v1/tenants/{tid}").json()["created_at"]))
    k = daemon.admin.post(f"/v1/tenants/{tid}/keys").json()
    stamps.append(("key", k["created_at"]))
    with daemon.client(key) as t:
        b = t.post("/v1/reserve", json={"size_bytes": 4096, "ttl_s": 1}).json()
        stamps += [("created", b["created_at"]), ("expires", b["expires_at"])]
        renewed = t.post(f"/v1/buffers/{b['id']}/renew", json={"ttl_s": 60}).json()
        stamps.append(("renewed", renewed["expires_at"]))
        stamps.append(("get", t.get(f"/v1/buffers/{b['id']}").json()["expires_at"]))
    for x in daemon.admin.get("/v1/events", params={"tenant_id": tid}).json():
        stamps += [(f"event {k}", v) for k, v in x.items() if k in ("at", "created_at", "time")]
    for what, value in stamps:
        assert FIXED_RFC3339.fullmatch(value), (what, value)
    assert renewed["expires_at"] > b["expires_at"]  # sorts as text


# -- §6 the Client ------------------------------------------------------------------------------


def test_client_buffer_cap_is_a_typed_exception_with_the_problem(daemon: Daemon) -> None:
    """§4 "at the cap a reserve … answers 409 (``type`` ends in ``buffer-count-exceeded``)";
    §6 "typed exceptions … carrying the problem details"; ``c.lookup`` → ``None``."""
    tid, key = daemon.tenant("cap", 4 * MiB)
    assert daemon.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 1}).status_code == 200
    with Client(daemon.url, key) as c:
        first = c.reserve(size_bytes=4096, key="k1")
        with pytest.raises(BufferCountExceeded) as info:
            c.reserve(size_bytes=4096)
        e = info.value
        assert not isinstance(e, QuotaExceeded)
        assert e.status == 409
        assert e.type.endswith("buffer-count-exceeded")
        assert e.title
        assert "max_buffers" in e.detail
        assert e.problem["status"] == 409
        assert c.lookup(["k0"]) is None
        hit = c.lookup(["k0", "k1"])
        assert hit is not None
        assert hit.id == first.id
        assert len(c.buffers()) == 1


# -- §7 maasctl ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    ["1" * 5000, "1." + "0" * 5000 + "GiB", "\uff11\uff12\uff18MiB", "\u0661GiB", "8\u00a0GiB"],
    ids=["5000-digits", "5000-decimals", "fullwidth-digits", "arabic-indic-digit", "nbsp"],
)
def test_maasctl_refuses_sizes_a_reader_would_misread(daemon: Any, size: str) -> None:
    """A 5000-digit SIZE was "internal error: ValueError"; '１２８MiB' was 128 MiB."""
    name = uniq("sizes")
    r = maasctl(daemon, "tenants", "create", name, "--quota", size)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "internal error" not in r.stderr
    assert "--quota" in r.stderr
    assert "not a size" in r.stderr
    problem(daemon.admin.get(f"/v1/tenants/{name}"), 404)


def test_maasctl_a_name_that_looks_like_an_id_is_resolved_as_that_name(daemon: Any) -> None:
    """§7 NAME|ID: a tenant named with 32 hex digits (no tenant's id) is found by name by
    every command that takes one, and acts on that tenant alone."""
    name = secrets.token_hex(16)
    created = ok_json(maasctl(daemon, "--json", "tenants", "create", name, "--quota", "1MiB"))
    tid = created["id"]
    assert tid != name
    shown = ok_json(maasctl(daemon, "--json", "tenants", "show", name))
    assert (shown["id"], shown["quota_bytes"]) == (tid, MiB)
    ok(maasctl(daemon, "tenants", "set-quota", name, "2MiB"))
    assert daemon.admin.get(f"/v1/tenants/{tid}").json()["quota_bytes"] == 2 * MiB
    key = ok_json(maasctl(daemon, "--json", "keys", "issue", name))
    with daemon.client(key["api_key"]) as t:
        assert t.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201
    listed = ok_json(maasctl(daemon, "--json", "buffers", "list", "--tenant", name))
    assert [b["tenant_id"] for b in listed] == [tid]
    ok(maasctl(daemon, "keys", "revoke", name, key["id"]))
    ok(maasctl(daemon, "tenants", "delete", name))
    problem(daemon.admin.get(f"/v1/tenants/{tid}"), 404)


@pytest.mark.parametrize(
    ("args", "path"),
    [
        (["tenants", "show"], "/v1/tenants/{ref}"),
        (["tenants", "set-quota", "{ref}", "1MiB"], "/v1/tenants/{ref}"),
        (["keys", "issue"], "/v1/tenants/{ref}"),
        (["buffers", "list", "--tenant"], "/v1/tenants/{ref}"),
        (["pools", "delete"], "/v1/pools/{ref}"),
    ],
)
def test_maasctl_an_unknown_name_is_the_problems_title_and_detail(
    daemon: Any, args: list[str], path: str
) -> None:
    """§7 "on any error it exits non-zero with the problem's title and detail on stderr" —
    also when the error is a NAME|ID that names nothing (it said "no such tenant")."""
    ref = uniq("nobody")
    want = daemon.admin.get(path.format(ref=ref)).json()
    argv = [a.format(ref=ref) for a in args]
    if "{ref}" not in " ".join(args):
        argv.append(ref)
    r = maasctl(daemon, *argv)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert want["title"] in r.stderr, (want, r.stderr)
    # (a pool's miss names the pools there are, in place of the host: the client's help)
    assert want["detail"].split(" on host ")[0] in r.stderr, (want, r.stderr)
    assert r.stdout == ""


@pytest.mark.parametrize("number", ["nan", "inf", "-inf"])
def test_no_float_option_or_argument_takes_nan_or_infinity(daemon: Any, number: str) -> None:
    """JSON has no NaN: ``--latency-us nan`` (and ``Client.reserve(latency_us=nan)``) went
    out as ``null`` — a reserve with no latency ceiling at all; ``--timeout nan`` was an
    internal error."""
    tid, key = daemon.tenant("nan", 4 * MiB)
    for argv in (
        ["buffers", "reserve", "4096", f"--latency-us={number}"],
        [f"--timeout={number}", "pools", "list"],
        ["top", f"--interval={number}"],
    ):
        r = maasctl(daemon, *argv, MAASD_KEY=key)
        assert r.returncode == 2, (argv, r.returncode, r.stdout, r.stderr)
        # (-inf is below every option's minimum first)
        assert "not a finite number" in r.stderr or "not in the range" in r.stderr, r.stderr
        assert "internal error" not in r.stderr
    with Client(daemon.url, key) as c:
        for kw in ({"size_bytes": 4096, "latency_us": float(number)}, {"size_gb": float(number)}):
            with pytest.raises(ValueError, match="finite"):
                c.reserve(**kw)  # type: ignore[arg-type]
        assert c.usage().buffers == 0


def test_an_unknown_query_parameter_is_refused_and_changes_nothing(
    daemon: Daemon, pool_with_a_buffer: tuple[dict, str, httpx.Client]
) -> None:
    """Unknown body fields are a 400 (§4); so are query parameters a route does not take:
    ``?tenantid=`` (a typo) answered the admin every tenant's buffers, ``?Drain=true``
    a 409 that read as if the drain had been refused."""
    p, bid, t = pool_with_a_buffer
    tid = t.get("/v1/usage").json()["tenant_id"]
    before = world(daemon)
    for who, method, path, name in [
        (daemon.admin, "GET", f"/v1/buffers?tenantid={tid}", "tenantid"),
        (daemon.admin, "DELETE", f"/v1/pools/{p['id']}?Drain=true", "Drain"),
        (daemon.admin, "GET", "/v1/events?limit=5&tenant=x", "tenant"),
        (daemon.admin, "GET", "/v1/pools?verbose=1", "verbose"),
        (t, "DELETE", f"/v1/buffers/{bid}?force=true", "force"),
        (t, "GET", "/v1/usage?tenant_id=x", "tenant_id"),
    ]:
        r = who.request(method, path)
        assert repr(name) in problem(r, 400, "/invalid-request")["detail"], (method, path)
    assert world(daemon) == before
    # the parameters a route takes still work, and a key is checked first
    listed = daemon.admin.get(f"/v1/buffers?tenant_id={tid}").json()
    assert [b["id"] for b in listed] == [bid]
    with httpx.Client(base_url=daemon.url, timeout=30) as anon:
        problem(anon.get("/v1/pools?verbose=1"), 401)


def test_metrics_content_type_names_its_charset_once(daemon: Daemon) -> None:
    """It said ``text/plain; version=0.0.4; charset=utf-8; charset=utf-8``."""
    ctype = daemon.admin.get("/metrics").headers["content-type"]
    params = [p.strip().partition("=")[0] for p in ctype.split(";")[1:]]
    assert ctype.startswith("text/plain"), ctype
    assert sorted(params) == ["charset", "version"], ctype
