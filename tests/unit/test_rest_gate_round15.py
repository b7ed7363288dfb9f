"""The REST gate's requests in progress per caller (``Gate.begin``/``end``), requests
outside ``/v1`` counted as anonymous ones (``anonymous_share``), and what a revocation
takes back (``Gate.revoked``): the books of ``maasd.api.server.Gate`` alone.

The daemon-level attacks are in ``tests/integration/test_attacks_rest_gate_round15.py``.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sized
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from gate_fakes import Conn, held
from maasd.api.server import (
    ANONYMOUS,
    CONNECTION_STATE,
    METRICS,
    Gate,
    GuardedH11,
    HttpLimits,
    Verdict,
    anonymous_share,
    begin,
    http_config,
    protocol_for,
)
from maasd.core.auth import Auth
from maasd.errors import ResourceLimit
from maasd.problems import problem_of
from maasd.settings import Settings
from maasd.store import Store


def c(conn: Conn) -> Any:
    return cast(Any, conn)


def test_a_caller_has_at_most_its_share_of_requests_in_progress() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    share = gate.limits.caller_share
    busy = [held(gate, idle=False) for _ in range(share)]
    assert all(gate.begin(c(b), "tenant:a") for b in busy)
    assert gate.begin(c(busy[0]), "tenant:a")  # the same request again: counted once
    over = held(gate, idle=False)
    assert not gate.begin(c(over), "tenant:a")  # refused: nothing counted for it
    assert gate.begin(c(over), "tenant:b")  # another caller's share is its own
    assert gate.begin(c(held(gate, idle=False)), "admin")
    assert gate._busy == {"tenant:a": share, "tenant:b": 1, "admin": 1}
    gate.end(c(busy[0]))  # answered
    gate.end(c(busy[0]))  # once only
    assert gate._busy["tenant:a"] == share - 1
    late = held(gate, idle=False)
    assert gate.begin(c(late), "tenant:a")  # the place given back is taken
    busy[1].close_for("body_timeout")  # closed mid-request: counted out
    busy[2].close_for("lost")
    gate.leave(Verdict.DROPPED, c(busy[2]))  # connection_lost after close_for: nothing more
    assert gate._busy["tenant:a"] == share - 2
    for conn in [*busy[3:], late]:
        gate.end(c(conn))
    gate.end(c(over))
    assert gate._busy == {"admin": 1}


def test_the_share_of_requests_in_progress_is_at_least_two() -> None:
    gate = Gate(HttpLimits(max_connections=4))
    conns = [held(gate, idle=False) for _ in range(3)]
    assert [gate.begin(c(x), "tenant:a") for x in conns] == [True, True, False]


def test_a_revocation_makes_every_kept_connection_anonymous() -> None:
    gate = Gate(HttpLimits(max_connections=8))
    share = gate.limits.caller_share
    kept = [held(gate, idle=True, caller="tenant:a") for _ in range(share)]
    other = held(gate, idle=True, caller="admin")
    busy_kept = held(gate, idle=False, caller="tenant:b")
    assert gate.begin(c(busy_kept), "tenant:b")
    for _ in range(8 - gate.held):
        held(gate, idle=False)
    assert gate.admit() is Verdict.REFUSED  # 4 of 8 kept, not over half: nothing shed
    gate.leave(Verdict.REFUSED, cast(Any, None))
    gate.forget_callers()
    assert not gate._kept
    assert not gate._caller_of
    assert not gate._idle_kept
    assert gate._busy == {"tenant:b": 1}  # its request goes on, counted until it ends
    for victim in [*kept, other]:  # anonymous: shed for newcomers, oldest first
        assert gate.admit() is Verdict.HELD
        assert victim.closed_for == "shed"
    assert busy_kept.closed_for is None
    gate.idle(c(busy_kept))  # its answer is complete: idle, and anonymous too
    assert busy_kept in gate._idle
    gate.trust(c(busy_kept), "tenant:b")  # its next request with a valid key: kept again
    assert gate._kept == {"tenant:b": 1}
    assert busy_kept in gate._idle_kept


def test_revoked_hops_to_the_event_loop_from_any_thread() -> None:
    gate = Gate(HttpLimits(max_connections=8))
    gate.revoked()  # before any connection, no loop: nothing kept, nothing to do
    loop = asyncio.new_event_loop()
    try:
        gate.loop = loop
        held(gate, idle=True, caller="tenant:a")
        revoking = threading.Thread(target=gate.revoked)
        revoking.start()
        revoking.join()
        assert gate._kept  # not on the revoking thread
        loop.run_until_complete(asyncio.sleep(0))
        assert not gate._kept
    finally:
        loop.close()
    gate.revoked()  # the server gone: nothing raised at the revoking thread


def test_the_daemon_gate_hears_every_revocation_of_its_auth(tmp_path: Path) -> None:
    """``http_config`` wires the gate to ``Auth.watch_revocations``, which a revocation
    of this daemon and one heard from another daemon (``forget_keys``) both call."""
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    loop = asyncio.new_event_loop()
    try:
        settings = Settings(data_dir=str(tmp_path))
        auth = Auth(settings, store.tenants)
        config = http_config(object(), settings, auth=auth)
        gate = cast(type[GuardedH11], config.http).gate
        gate.loop = loop
        for _ in range(2):
            conn = held(gate, idle=True, caller="tenant:a")
            auth.forget_keys()
            loop.run_until_complete(asyncio.sleep(0))
            assert not gate._kept
            assert c(conn) in gate._idle
    finally:
        loop.close()
        store.dispose()


class Cycle:
    """What ``GuardedH11.began_by`` touches of uvicorn's request-response cycle."""

    def __init__(self) -> None:
        self.keep_alive = True
        self.scope: dict[str, Any] = {"headers": [(b"host", b"maasd")]}


class Transport:
    def __init__(self) -> None:
        self.aborted = False
        self.unsent = 0

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.unsent


def proto_of(gate: Gate, verdict: Verdict) -> GuardedH11:
    cls = protocol_for(gate)
    proto = cls.__new__(cls)  # no transport: only the state
    proto._verdict = verdict
    proto.cycle = cast(Any, Cycle())
    proto.flow = cast(Any, SimpleNamespace(write_paused=False))
    proto.transport = cast(Any, Transport())
    proto.client = None
    return proto


def test_a_request_over_the_share_is_refused_and_its_connection_closed_after_it() -> None:
    gate = Gate(HttpLimits(max_connections=4))
    ok = [proto_of(gate, Verdict.HELD) for _ in range(2)]
    for proto in ok:
        begin({CONNECTION_STATE: proto}, "tenant:a")
    over = proto_of(gate, Verdict.HELD)
    with pytest.raises(ResourceLimit) as refused:
        begin({CONNECTION_STATE: over}, "tenant:a")
    problem = problem_of(refused.value)
    assert problem.status == 507
    assert problem.type.endswith("/resource-limit")
    assert "2 REST requests in progress" in problem.detail
    cycle = cast(Cycle, over.cycle)
    assert cycle.keep_alive is False  # uvicorn closes it once the 507 is sent
    assert cycle.scope["headers"][-1] == (b"connection", b"close")  # and says so
    assert all(cast(Cycle, p.cycle).keep_alive for p in ok)
    begin({}, "tenant:a")  # a request served otherwise (a test client): nothing
    begin(None, "tenant:a")
    shed = proto_of(gate, Verdict.DROPPED)  # shed while its key was checked
    begin({CONNECTION_STATE: shed}, "tenant:a")  # not counted: it left the books already
    assert gate._busy == {"tenant:a": 2}
    assert set(gate._busy_for) == set(ok)


def check(gate: Gate, live: list[Conn]) -> None:
    """The gate's books agree with the connections that are still open."""
    holding = {id(x) for x in live if x.verdict is Verdict.HELD}
    assert gate.held == len(holding)
    assert gate.refusing == sum(x.verdict is Verdict.REFUSED for x in live)
    assert {id(x) for x in gate._caller_of} <= holding
    assert {id(x) for x in gate._busy_for} <= holding
    assert {id(x) for x in gate._idle} <= holding
    assert {id(x) for x in gate._idle_kept} <= {id(x) for x in gate._caller_of}
    assert not set(gate._idle) & set(gate._idle_kept)
    assert sum(gate._kept.values()) == len(gate._caller_of)
    assert sum(gate._busy.values()) == len(gate._busy_for)
    share = gate.limits.caller_share
    assert all(0 < n <= share for n in [*gate._kept.values(), *gate._busy.values()])
    assert set(gate._caller_of.values()) == set(gate._kept)
    assert set(gate._busy_for.values()) == set(gate._busy)


@pytest.mark.parametrize("seed", range(8))
def test_no_order_of_events_leaves_a_request_counted(seed: int) -> None:
    """Connections come, carry requests of callers (begun or refused at the share), are
    answered, go idle, are shed, time out, close, and keys are revoked, in a random order:
    the books always agree with what is open, and are empty once everything is closed."""
    rng = random.Random(seed)
    gate = Gate(HttpLimits(max_connections=8))
    live: list[Conn] = []
    callers = [f"tenant:{n}" for n in range(3)] + ["admin"]
    for _ in range(3000):
        live = [x for x in live if x.closed_for is None]
        step = rng.random()
        if step < 0.2 or not live:
            conn = Conn(gate, gate.admit())
            if conn.verdict is Verdict.DROPPED:
                conn.closed_for = "dropped"
            else:
                if conn.verdict is Verdict.HELD:
                    gate.idle(c(conn))
                live.append(conn)
            continue
        conn = rng.choice(live)
        held_now = conn.verdict is Verdict.HELD
        if step < 0.45 and held_now:  # a request's head, then the /v1 hook
            gate.busy(c(conn))
            caller = rng.choice(callers)
            if gate.begin(c(conn), caller):
                gate.trust(c(conn), caller)
            else:  # 507, then closed after the answer
                conn.close_for("lost")
        elif step < 0.6 and held_now:  # answered
            gate.end(c(conn))
            gate.idle(c(conn))
        elif step < 0.65:
            gate.forget_callers()
        elif step < 0.7:
            gate.distrust(c(conn))
        elif step < 0.85:
            conn.close_for(rng.choice(["head_timeout", "body_timeout", "send_timeout"]))
        else:  # connection_lost: the gate is told once more, as GuardedH11 does
            conn.close_for("lost")
            gate.leave(Verdict.DROPPED, c(conn))
        check(gate, [x for x in live if x.closed_for is None])
    for conn in live:
        if conn.closed_for is None:
            conn.close_for("lost")
    assert (gate.held, gate.refusing) == (0, 0)
    books: list[Sized] = [gate._idle, gate._idle_kept, gate._caller_of, gate._kept]
    books += [gate._busy_for, gate._busy]
    assert [len(b) for b in books] == [0] * len(books)


# -- requests outside /v1: the anonymous share (anonymous_share) ------------------------


class App:
    """The app behind the wrapper: which paths reached it."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, _receive: Any, _send: Any) -> None:
        self.paths.append(scope["path"])


def call(app: Any, path: str, proto: GuardedH11 | None, method: str = "GET") -> list[Any]:
    """``app`` run for one request on ``proto``'s connection: the messages it sent."""
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    state = {} if proto is None else {CONNECTION_STATE: proto}
    scope = {"type": "http", "method": method, "path": path, "state": state}
    asyncio.run(app(scope, receive, send))
    return sent


def refused_507(sent: list[Any]) -> None:
    start, body = sent
    assert start["status"] == 507
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/problem+json"
    assert headers[b"connection"] == b"close"
    problem = msgspec.json.decode(body["body"])
    assert problem["status"] == 507
    assert problem["type"].endswith("/resource-limit")
    assert "outside /v1" in problem["detail"]
    assert not body.get("more_body", False)


def test_requests_outside_v1_count_as_anonymous_until_their_answer_is_complete() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    inner = App()
    app = anonymous_share(cast(Any, inner))
    share = gate.limits.caller_share
    protos = [proto_of(gate, Verdict.HELD) for _ in range(share)]
    paths = ["/schema/openapi.json", "/docs", "/no-such-path", "/v1"]
    for proto, path in zip(protos, paths, strict=False):
        assert call(app, path, proto) == []  # through to the app, counted
    assert gate._busy == {ANONYMOUS: share}
    assert inner.paths == paths[:share]
    gate.end(protos[0])  # its answer complete (GuardedH11.on_response_complete)
    gate.end(protos[0])  # once only
    assert gate._busy == {ANONYMOUS: share - 1}
    assert call(app, "/schema/openapi.json", protos[0]) == []
    assert gate._busy == {ANONYMOUS: share}


def test_healthz_and_v1_are_not_counted_as_anonymous() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    inner = App()
    app = anonymous_share(cast(Any, inner))
    full = [proto_of(gate, Verdict.HELD) for _ in range(gate.limits.caller_share)]
    for proto in full:
        call(app, "/schema/openapi.json", proto)
    proto = proto_of(gate, Verdict.HELD)
    for method, path in [("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/v1/usage")]:
        assert call(app, path, proto, method) == []  # answered by the app, even now
    assert call(app, "/v1/buffers", proto, "POST") == []  # (the hook counts it, by caller)
    assert inner.paths[-4:] == ["/healthz", "/healthz", "/v1/usage", "/v1/buffers"]
    assert proto not in gate._busy_for
    assert cast(Cycle, proto.cycle).keep_alive


def test_a_request_outside_v1_beyond_the_share_is_refused_and_its_connection_closed() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    inner = App()
    app = anonymous_share(cast(Any, inner))
    for _ in range(gate.limits.caller_share):
        call(app, "/schema/openapi.json", proto_of(gate, Verdict.HELD))
    over = proto_of(gate, Verdict.HELD)
    refused_507(call(app, "/schema/openapi.json", over))
    assert inner.paths == ["/schema/openapi.json"] * gate.limits.caller_share  # not routed
    assert cast(Cycle, over.cycle).keep_alive is False  # uvicorn closes it after the 507
    assert not cast(Transport, over.transport).aborted  # (nothing unsent before it)
    assert over not in gate._busy_for
    assert gate._busy == {ANONYMOUS: gate.limits.caller_share}
    # a tenant's share is its own: the anonymous share full takes nothing from it
    begin({CONNECTION_STATE: proto_of(gate, Verdict.HELD)}, "tenant:a")


def test_metrics_has_a_share_of_its_own() -> None:
    """Clients without a key filling the anonymous share leave the scrapes room: ``/metrics``
    counts as its own caller (its guard answers a request without the key in a few bytes,
    so only a scraper can hold a connection busy with it)."""
    gate = Gate(HttpLimits(max_connections=16))
    inner = App()
    app = anonymous_share(cast(Any, inner))
    share = gate.limits.caller_share
    for _ in range(share):
        call(app, "/schema/openapi.json", proto_of(gate, Verdict.HELD))
    scrapes = [proto_of(gate, Verdict.HELD) for _ in range(share)]
    for proto in scrapes:
        assert call(app, "/metrics", proto) == []  # through, though the anonymous share is full
    assert gate._busy == {ANONYMOUS: share, METRICS: share}
    refused_507(call(app, "/metrics", proto_of(gate, Verdict.HELD)))  # its own share, bounded
    gate.end(scrapes[0])
    assert gate._busy == {ANONYMOUS: share, METRICS: share - 1}


def test_a_request_refused_behind_unread_answers_closes_its_connection_at_once() -> None:
    """A client pipelining large answers it never reads: its refused request's 507 would
    wait behind them (the connection busy, counted nowhere, until the send deadline)."""
    gate = Gate(HttpLimits(max_connections=16))
    app = anonymous_share(cast(Any, App()))
    for _ in range(gate.limits.caller_share):
        call(app, "/schema/openapi.json", proto_of(gate, Verdict.HELD))
    over = proto_of(gate, Verdict.HELD)
    assert (gate.admit(), gate.held) == (Verdict.HELD, 1)  # its place in the count
    over.flow = cast(Any, SimpleNamespace(write_paused=True))
    call(app, "/schema/openapi.json", over)
    assert cast(Transport, over.transport).aborted
    assert over._verdict is Verdict.DROPPED  # out of the count at once
    assert gate.held == 0
    # below the writer's high-water mark, but answers still unsent: the same
    behind = proto_of(gate, Verdict.HELD)
    cast(Transport, behind.transport).unsent = 4096
    call(app, "/docs", behind)
    assert cast(Transport, behind.transport).aborted
    assert gate._busy == {ANONYMOUS: gate.limits.caller_share}


def test_no_connection_no_count() -> None:
    """Served without the guarded server (an ASGI test client): the app answers, as ever."""
    inner = App()
    app = anonymous_share(cast(Any, inner))
    assert call(app, "/schema/openapi.json", None) == []
    gate = Gate(HttpLimits(max_connections=4))
    shed = proto_of(gate, Verdict.DROPPED)  # shed before its request reached the app
    assert call(app, "/schema/openapi.json", shed) == []
    assert inner.paths == ["/schema/openapi.json"] * 2
    assert not gate._busy


def test_the_app_counts_requests_outside_v1_before_routing(tmp_path: Path) -> None:
    """``create_app`` puts the wrapper in front of everything: at the anonymous share, a
    request for the API page is refused unrouted, and ``/healthz`` is still answered."""
    from inprocess_api import service
    from maasd.api.app import create_app

    svc = service(tmp_path)
    try:
        app = create_app(svc)
        gate = Gate(HttpLimits(max_connections=16))
        for _ in range(gate.limits.caller_share):
            assert gate.begin(proto_of(gate, Verdict.HELD), ANONYMOUS)
        proto = proto_of(gate, Verdict.HELD)

        def full_call(path: str) -> list[Any]:
            sent: list[Any] = []

            async def send(message: Any) -> None:
                sent.append(message)

            async def receive() -> Any:
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "GET",
                "scheme": "http",
                "path": path,
                "raw_path": path.encode(),
                "root_path": "",
                "query_string": b"",
                "headers": [(b"host", b"maasd")],
                "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 8080),
                "state": {CONNECTION_STATE: proto},
            }
            asyncio.run(app(cast(Any, scope), receive, send))
            return sent

        refused_507(full_call("/schema/openapi.json"))
        assert full_call("/healthz")[0]["status"] == 200
    finally:
        svc.close()
