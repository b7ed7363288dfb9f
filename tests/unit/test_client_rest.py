"""maasd.client.Client without a daemon: what reaches the wire, and what comes back.

An ``httpx.MockTransport`` records the final URL of every request (after httpx's
own normalisation), so these tests see exactly the route a call would reach.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from maasd.client import (
    BufferCountExceeded,
    Client,
    Conflict,
    ConnectionFailed,
    InsufficientStorage,
    InternalError,
    InvalidReference,
    LimitExceeded,
    MaasdClientError,
    NotFound,
    PoolExhausted,
    ProtocolError,
    ResourceLimit,
    ServerError,
    raw_json,
)

BASE = "http://maasd.test"

POOLS = [
    {
        "id": "p0",
        "name": "node0",
        "numa_node": 0,
        "backing": "memfd",
        "persistence": "volatile",
        "latency_us": 1,
        "capacity_bytes": 1 << 28,
        "used_bytes": 0,
        "free_bytes": 1 << 28,
        "page_bytes": 4096,
        "prefault": True,
        "scrub": "zero",
        "buffers": 0,
    },
    {
        "id": "p1",
        "name": "fast",
        "numa_node": 0,
        "backing": "memfd",
        "persistence": "volatile",
        "latency_us": 1,
        "capacity_bytes": 1 << 20,
        "used_bytes": 0,
        "free_bytes": 1 << 20,
        "page_bytes": 4096,
        "prefault": True,
        "scrub": "zero",
    },
]


class Recorder:
    """A fake daemon: records each request's method and raw path, answers with ``answer``."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response] | None = None) -> None:
        self.seen: list[tuple[str, str]] = []
        self.answer = answer or (lambda _r: httpx.Response(404, json={"title": "Not found"}))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.raw_path.decode()))
        return self.answer(request)

    def client(self) -> Client:
        return Client(BASE, "key", transport=httpx.MockTransport(self))


def _problem(status: int, code: str, detail: str = "d") -> httpx.Response:
    return httpx.Response(
        status,
        json={
            "type": f"https://maasd.dev/problems/{code}",
            "title": code,
            "status": status,
            "detail": detail,
        },
    )


# -- path segments -------------------------------------------------------------------------

#: Every method that puts a caller's id or name into the path, with its other arguments.
CALLS: dict[str, Callable[[Client, str], Any]] = {
    "buffer": lambda c, x: c.buffer(x),
    "release": lambda c, x: c.release(x),
    "pin": lambda c, x: c.pin(x, 0),
    "renew": lambda c, x: c.renew(x, 60),
    "checkpoint": lambda c, x: c.checkpoint(x),
    "pool": lambda c, x: c.pool(x),
    "pool_id": lambda c, x: c.pool_id(x),
    "reserve": lambda c, x: c.reserve(4096, pool=x),
    "delete_pool": lambda c, x: c.delete_pool(x),
    "tenant": lambda c, x: c.tenant(x),
    "set_quota": lambda c, x: c.set_quota(x, 1),
    "delete_tenant": lambda c, x: c.delete_tenant(x),
    "issue_key": lambda c, x: c.issue_key(x),
    "revoke_key(tenant)": lambda c, x: c.revoke_key(x, "k1"),
    "revoke_key(key)": lambda c, x: c.revoke_key("t1", x),
}

UNSAFE = ["..", ".", "", "../tenants", "a/b", "t1/keys/k1", "/", "x/..", "../../metrics"]


@pytest.mark.parametrize("ref", UNSAFE)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_unsafe_segments_are_refused_before_anything_is_sent(call: str, ref: str) -> None:
    rec = Recorder()
    with rec.client() as c, pytest.raises(InvalidReference) as info:
        CALLS[call](c, ref)
    assert isinstance(info.value, ValueError)
    assert repr(ref) in str(info.value)
    assert rec.seen == []


def test_the_named_cases_never_reach_another_route() -> None:
    rec = Recorder()
    with rec.client() as c:
        for call in (
            lambda: c.release(".."),
            lambda: c.buffer("../tenants"),
            lambda: c.tenant("a/b"),
        ):
            with pytest.raises(ValueError, match="not a valid id or name"):
                call()
    assert rec.seen == []


@pytest.mark.parametrize(
    ("ref", "segment"),
    [
        ("a b", "a%20b"),
        ("x?y#z", "x%3Fy%23z"),
        ("%2E%2E", "%252E%252E"),  # a literal percent stays literal: never decoded into ".."
        ("a%2Fb", "a%252Fb"),
        ("..a", "..a"),
        ("a..", "a.."),
        ("\x1b[2J", "%1B%5B2J"),
        ("é", "%C3%A9"),
        ("back\\slash", "back%5Cslash"),
    ],
)
def test_other_odd_refs_stay_one_segment(ref: str, segment: str) -> None:
    rec = Recorder()
    with rec.client() as c:
        with pytest.raises(NotFound):
            c.buffer(ref)
        with pytest.raises(NotFound):
            c.revoke_key(ref, ref)
    assert rec.seen == [
        ("GET", f"/v1/buffers/{segment}"),
        ("DELETE", f"/v1/tenants/{segment}/keys/{segment}"),
    ]


def test_a_non_string_id_is_a_type_error() -> None:
    rec = Recorder()
    with rec.client() as c, pytest.raises(TypeError):
        c.buffer(7)  # type: ignore[arg-type]
    assert rec.seen == []


# -- pools: by id or name, and a 404 that names the pools ---------------------------------------


def _pools_daemon(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/pools":
        return httpx.Response(200, json=POOLS)
    return _problem(404, "not-found", "no pool 'nope'")


def test_a_missing_pool_lists_the_pools() -> None:
    rec = Recorder(_pools_daemon)
    with rec.client() as c:
        for call in (
            lambda: c.pool("nope"),
            lambda: c.reserve(4096, pool="nope"),
            lambda: c.delete_pool("nope"),
        ):
            with pytest.raises(NotFound) as info:
                call()
            assert info.value.detail == "no pool 'nope'; pools: fast, node0"
            assert info.value.problem["detail"] == info.value.detail
            assert info.value.status == 404
            assert info.value.type.endswith("not-found")
    # one request for the pool itself (resolved by the daemon), one listing for the message
    assert rec.seen == [
        ("GET", "/v1/pools/nope"),
        ("GET", "/v1/pools"),
        ("POST", "/v1/pools/nope/reserve"),
        ("GET", "/v1/pools"),
        ("DELETE", "/v1/pools/nope"),
        ("GET", "/v1/pools"),
    ]


def test_the_list_of_pools_is_cut_short() -> None:
    many = [{**POOLS[0], "id": f"i{n:03d}", "name": f"p{n:03d}"} for n in range(30)]

    def daemon(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/pools":
            return httpx.Response(200, json=many)
        return _problem(404, "not-found")

    with Recorder(daemon).client() as c, pytest.raises(NotFound) as info:
        c.pool("nope")
    assert "p000, p001" in info.value.detail
    assert info.value.detail.endswith("… and 10 more")


def test_a_404_for_a_pool_that_exists_is_not_rewritten() -> None:
    """A reserve 404 about an existing pool (a race with its deletion and re-creation) is
    passed on as the daemon said it."""
    rec = Recorder(_pools_daemon)
    with rec.client() as c, pytest.raises(NotFound) as info:
        c.reserve(4096, pool="fast")
    assert info.value.detail == "no pool 'nope'"


def test_pool_by_name_is_one_request() -> None:
    rec = Recorder(lambda _r: httpx.Response(200, json=POOLS[1]))
    with rec.client() as c:
        assert c.pool_id("fast") == "p1"
    assert rec.seen == [("GET", "/v1/pools/fast")]


# -- the raw answer, for --json ----------------------------------------------------------------


def test_responses_captures_the_raw_answers_of_this_thread() -> None:
    body = (
        b'{"id":"p1","name":"fast","numa_node":0,"backing":"memfd","persistence":"volatile",'
        b'"latency_us":1,"capacity_bytes":1,"used_bytes":0,"free_bytes":1,"page_bytes":4096,'
        b'"prefault":true,"scrub":"zero","buffers":0,"from_the_future":[1,2]}'
    )
    rec = Recorder(lambda _r: httpx.Response(200, content=body))
    other: list[int] = []
    with rec.client() as c:
        with c.responses() as outer:
            pool = c.pool("fast")
            with c.responses() as inner:
                c.pool("fast")
            # another thread's calls are not captured here
            t = threading.Thread(target=lambda: other.append(len([c.pool("fast")])))
            t.start()
            t.join()
        c.pool("fast")  # after the block: not captured
    assert pool.name == "fast"
    assert len(outer) == 2
    assert len(inner) == 1
    assert other == [1]
    # the raw JSON keeps what the typed struct drops
    assert raw_json(outer[-1])["from_the_future"] == [1, 2]


def test_raw_json_of_a_204_is_none() -> None:
    rec = Recorder(lambda _r: httpx.Response(204))
    with rec.client() as c, c.responses() as seen:
        c.release("b1")
    assert raw_json(seen[-1]) is None


def test_raw_json_of_garbage_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        raw_json(httpx.Response(200, content=b"<html>"))


# -- typed problems ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "cls", "also"),
    [
        (409, "buffer-count-exceeded", BufferCountExceeded, Conflict),
        (409, "something-new", Conflict, Conflict),
        (429, "limit-exceeded", LimitExceeded, MaasdClientError),
        (507, "pool-exhausted", PoolExhausted, InsufficientStorage),
        (507, "resource-limit", ResourceLimit, InsufficientStorage),
        (507, "something-new", InsufficientStorage, InsufficientStorage),
        (500, "internal", InternalError, ServerError),
        (503, "unavailable", ServerError, ServerError),
        (404, "quota-exceeded", NotFound, NotFound),  # a code with the wrong status: by status
    ],
)
def test_problems_become_their_class(
    status: int, code: str, cls: type[MaasdClientError], also: type[MaasdClientError]
) -> None:
    rec = Recorder(lambda _r: _problem(status, code, "why"))
    with rec.client() as c, pytest.raises(MaasdClientError) as info:
        c.usage()
    assert type(info.value) is cls
    assert isinstance(info.value, also)
    assert info.value.status == status
    assert info.value.detail == "why"


def test_resource_limit_is_not_pool_exhausted() -> None:
    rec = Recorder(lambda _r: _problem(507, "resource-limit"))
    with rec.client() as c, pytest.raises(InsufficientStorage) as info:
        c.usage()
    assert not isinstance(info.value, PoolExhausted)


def test_an_error_without_problem_details_keeps_the_reason_phrase() -> None:
    html = httpx.Response(502, content=b"<html>bad gateway</html>")
    with Recorder(lambda _r: html).client() as c, pytest.raises(ServerError) as info:
        c.usage()
    assert info.value.title == "Bad Gateway"
    assert info.value.detail.startswith("<html>")
    with Recorder(lambda _r: httpx.Response(404)).client() as c, pytest.raises(NotFound) as nf:
        c.usage()
    assert nf.value.title == "Not Found"
    assert nf.value.detail == ""


def test_timeouts_and_refusals_are_told_apart() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with Recorder(timeout).client() as c, pytest.raises(ConnectionFailed) as t:
        c.usage()
    assert t.value.timed_out
    assert "timed out after 30s" in t.value.detail
    with Recorder(refused).client() as c, pytest.raises(ConnectionFailed) as r:
        c.usage()
    assert not r.value.timed_out
    assert "Connection refused" in r.value.detail
    assert r.value.status == 0


def test_no_key_sends_no_authorization() -> None:
    headers: list[httpx.Headers] = []

    def daemon(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers)
        return httpx.Response(200, text="# metrics\n")

    with Client(BASE, None, transport=httpx.MockTransport(daemon)) as c:
        c.metrics()
    with Client(BASE, "k", transport=httpx.MockTransport(daemon)) as c:
        c.metrics()
    assert "authorization" not in headers[0]
    assert headers[1]["authorization"] == "Bearer k"


def test_a_bad_base_url_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="invalid base_url"):
        Client("http://[::1", "k")


def test_events_passes_its_paging() -> None:
    rec = Recorder(lambda _r: httpx.Response(200, json=[{"id": 3, "at": "t", "kind": "reserve"}]))
    with rec.client() as c:
        (e,) = c.events(5, tenant_id="acme", before=9)
    assert e.kind == "reserve"
    assert e.tenant_id is None
    assert rec.seen == [("GET", "/v1/events?limit=5&tenant_id=acme&before=9")]


def test_why_dot_segments_must_be_refused() -> None:
    """What the guard prevents: httpx itself turns ``/v1/buffers/..`` into ``/v1`` (and
    ``quote`` leaves dots alone), so a release of ``..`` would be a ``DELETE /v1``."""
    seen: list[str] = []

    def daemon(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(204)

    with httpx.Client(base_url=BASE, transport=httpx.MockTransport(daemon)) as raw:
        raw.delete("/v1/buffers/..")
        raw.delete("/v1/buffers/.")
    assert seen == ["/v1", "/v1/buffers"]


def test_health_parses_healthy_and_unhealthy_alike() -> None:
    answers = iter(
        [
            httpx.Response(200, json={"status": "ok"}),
            httpx.Response(
                503,
                json={
                    "status": "unhealthy",
                    "components": {
                        "broker": {"ok": False, "detail": "the accept thread died"},
                        "ledger": {"ok": True, "detail": "ok"},
                    },
                },
            ),
            httpx.Response(500, json={"title": "Internal error", "status": 500, "detail": "x"}),
        ]
    )
    with Recorder(lambda _r: next(answers)).client() as c:
        ok = c.health()
        assert ok.ok
        assert ok.components == {}
        sick = c.health()
        assert not sick.ok
        assert sick.status == "unhealthy"
        assert not sick.components["broker"].ok
        assert sick.components["broker"].detail == "the accept thread died"
        assert sick.components["ledger"].ok
        with pytest.raises(ServerError):  # any other failure is still an error
            c.health()


def test_update_tenant_sends_only_what_is_given() -> None:
    bodies: list[bytes] = []

    def daemon(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(
            200, json={"id": "t", "name": "acme", "quota_bytes": 5, "max_buffers": 9}
        )

    with Client(BASE, "k", transport=httpx.MockTransport(daemon)) as c:
        assert c.set_max_buffers("acme", 9).max_buffers == 9
        c.set_quota("acme", 5)
        c.update_tenant("acme", quota_bytes=5, max_buffers=9)
        c.set_disk_quota("acme", 0)
        with pytest.raises(ValueError, match="give quota_bytes, max_buffers or disk_quota_bytes"):
            c.update_tenant("acme")
    assert bodies == [
        b'{"max_buffers":9}',
        b'{"quota_bytes":5}',
        b'{"quota_bytes":5,"max_buffers":9}',
        b'{"disk_quota_bytes":0}',
    ]
