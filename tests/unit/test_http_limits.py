"""The REST server's bounds: settings, the cap under the open-files limit, and the gate's rules.

The deadlines themselves are exercised against a real daemon in
``tests/integration/test_api_slow_clients.py``; here are the pure parts.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any, cast

import httpx
import pytest

from maasd.api.server import Gate, HttpLimits, Verdict, http_config
from maasd.errors import ConfigError
from maasd.metrics import Metrics
from maasd.settings import Settings, load


def test_http_settings_from_the_environment() -> None:
    s = load(
        env={
            "MAASD_HTTP_MAX_CONNECTIONS": "64",
            "MAASD_HTTP_HEAD_TIMEOUT_S": "2.5",
            "MAASD_HTTP_BODY_TIMEOUT_S": "7",
            "MAASD_HTTP_SEND_TIMEOUT_S": "9",
            "MAASD_HTTP_TENANT_THREADS": "4",
            "MAASD_HTTP_KEEPALIVE_S": "12.5",
        }
    )
    assert s.http_keepalive_s == 12.5
    assert (s.http_max_connections, s.http_head_timeout_s) == (64, 2.5)
    assert (s.http_body_timeout_s, s.http_send_timeout_s) == (7.0, 9.0)
    assert s.http_tenant_threads == 4
    defaults = load(env={})
    assert (defaults.http_head_timeout_s, defaults.http_body_timeout_s) == (10.0, 30.0)
    assert defaults.http_tenant_threads == 16
    # longer than httpx's pool keeps an idle connection (5 s), so none is reused as it closes
    assert defaults.http_keepalive_s > httpx.Limits().keepalive_expiry  # type: ignore[operator]
    assert http_config(object(), s).timeout_keep_alive == 12.5


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MAASD_HTTP_MAX_CONNECTIONS", "0"),
        ("MAASD_HTTP_HEAD_TIMEOUT_S", "-1"),
        ("MAASD_HTTP_BODY_TIMEOUT_S", "0"),
        ("MAASD_HTTP_SEND_TIMEOUT_S", "nan"),
        ("MAASD_HTTP_TENANT_THREADS", "0"),
        ("MAASD_HTTP_KEEPALIVE_S", "0"),
        ("MAASD_HTTP_KEEPALIVE_S", "inf"),
        ("MAASD_HTTP_HEAD_TIMEOUT_S", "inf"),
    ],
)
def test_http_bounds_must_be_positive(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var.removeprefix("MAASD_").lower()):
        load(env={var: value})


@pytest.mark.parametrize(
    ("configured", "nofile", "cap"),
    [
        (512, 20000, 512),  # the limit leaves room: as configured
        (512, 1024, 256),  # a quarter of the open files at most
        (512, 16, 8),  # but never below 8
        (512, resource.RLIM_INFINITY, 512),
    ],
)
def test_the_cap_stays_below_the_open_files_limit(configured: int, nofile: int, cap: int) -> None:
    limits = HttpLimits.of(Settings(http_max_connections=configured), fd_limit=nofile)
    assert limits.max_connections == cap


class FakeConnection:
    """What the gate asks of a connection: to close itself (and leave the count)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.closed_for: str | None = None

    def close_for(self, reason: str) -> None:
        self.closed_for = reason
        self.gate.count_close(reason)
        self.gate.leave(Verdict.HELD, cast(Any, self))


def admitted(gate: Gate, *, idle: bool) -> FakeConnection:
    conn = FakeConnection(gate)
    assert gate.admit() is Verdict.HELD
    if idle:
        gate.idle(cast(Any, conn))
    return conn


def test_the_gate_sheds_the_oldest_idle_connection_at_the_cap() -> None:
    metrics = Metrics()
    gate = Gate(HttpLimits(max_connections=3), metrics)
    first, second = admitted(gate, idle=True), admitted(gate, idle=True)
    third = admitted(gate, idle=False)
    gate.busy(cast(Any, third))
    gate.idle(cast(Any, first))  # idle already: it keeps its place (a trickle buys nothing)
    assert gate.held == 3
    assert gate.admit() is Verdict.HELD  # the fourth takes the place of the oldest idle one
    assert (first.closed_for, second.closed_for, third.closed_for) == ("shed", None, None)
    assert gate.held == 3
    sample = metrics.registry.get_sample_value
    assert sample("maasd_http_connections_closed_total", {"reason": "shed"}) == 1
    assert sample("maasd_http_connections") == 3  # the gauge reads the gate


def test_with_nothing_idle_the_gate_refuses_then_drops() -> None:
    gate = Gate(HttpLimits(max_connections=8))
    conns = [admitted(gate, idle=False) for _ in range(8)]
    verdicts = [gate.admit() for _ in range(gate.limits.max_refusals + 2)]
    assert verdicts.count(Verdict.REFUSED) == gate.limits.max_refusals == 4
    assert verdicts[-2:] == [Verdict.DROPPED, Verdict.DROPPED]
    assert all(c.closed_for is None for c in conns)  # busy connections are never shed
    gate.leave(Verdict.REFUSED, cast(Any, None))
    assert gate.admit() is Verdict.REFUSED  # a refusal answered makes room for another
    gate.leave(Verdict.HELD, cast(Any, conns[0]))
    assert gate.admit() is Verdict.HELD


def test_the_refusal_is_a_resource_limit_problem_naming_the_limit() -> None:
    import msgspec

    problem = msgspec.json.decode(Gate(HttpLimits(max_connections=42)).refusal)
    assert problem["status"] == 507
    assert problem["type"].endswith("/resource-limit")
    assert "42 REST connections" in problem["detail"]
    assert "http_max_connections" in problem["detail"]


def test_a_callers_idle_connection_is_shed_after_every_anonymous_one() -> None:
    gate = Gate(HttpLimits(max_connections=4))
    tenant = admitted(gate, idle=False)
    gate.trust(cast(Any, tenant), "tenant:t")  # a request with t's key, in flight
    gate.idle(cast(Any, tenant))  # answered: idle, the oldest of all
    anonymous = [admitted(gate, idle=True) for _ in range(3)]
    for _ in range(3):  # three newcomers shed the three anonymous ones, oldest first
        assert gate.admit() is Verdict.HELD
    assert [c.closed_for for c in anonymous] == ["shed"] * 3
    assert tenant.closed_for is None
    newcomer = FakeConnection(gate)
    gate.leave(Verdict.HELD, cast(Any, newcomer))  # one goes
    assert gate.admit() is Verdict.HELD  # room again: nothing shed
    assert tenant.closed_for is None


def test_with_only_callers_idle_connections_left_the_oldest_of_them_is_shed() -> None:
    gate = Gate(HttpLimits(max_connections=2))
    first, second = admitted(gate, idle=False), admitted(gate, idle=False)
    for conn, caller in ((first, "tenant:a"), (second, "tenant:b")):
        gate.trust(cast(Any, conn), caller)
        gate.idle(cast(Any, conn))
    assert gate.admit() is Verdict.HELD  # callers keep all of the cap: no lock-out
    assert (first.closed_for, second.closed_for) == ("shed", None)


def test_a_caller_keeps_its_share_of_connections_the_rest_are_shed_as_anonymous() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    share = gate.limits.caller_share
    assert share == 4
    conns = [admitted(gate, idle=False) for _ in range(share + 2)]
    for conn in conns:
        gate.trust(cast(Any, conn), "tenant:greedy")
        gate.idle(cast(Any, conn))
    other = admitted(gate, idle=False)
    gate.trust(cast(Any, other), "tenant:other")
    gate.idle(cast(Any, other))
    for _ in range(16 - len(conns) - 1):
        admitted(gate, idle=False)
    assert gate.held == 16
    for _ in range(2):
        assert gate.admit() is Verdict.HELD
    # the two over the share were shed (as anonymous); the share and the other tenant's kept
    assert [c.closed_for for c in conns] == [None] * share + ["shed", "shed"]
    assert other.closed_for is None
    # a connection of the share that leaves makes room in it for another
    conns[0].close_for("gone")
    late = admitted(gate, idle=False)
    gate.trust(cast(Any, late), "tenant:greedy")
    gate.idle(cast(Any, late))
    # nothing anonymous idle, callers keep 5 of 16: the newcomer is refused, none shed
    assert gate.admit() is Verdict.REFUSED
    assert [c.closed_for for c in [*conns[1:share], late, other]] == [None] * (share + 1)


def test_callers_keeping_over_half_the_cap_have_their_oldest_idle_connection_shed() -> None:
    gate = Gate(HttpLimits(max_connections=8))
    kept = []
    for n in range(5):  # five callers, one connection each: 5 of 8 kept, over half
        conn = admitted(gate, idle=False)
        gate.trust(cast(Any, conn), f"tenant:{n}")
        gate.idle(cast(Any, conn))
        kept.append(conn)
    for _ in range(3):
        admitted(gate, idle=False)
    assert gate.admit() is Verdict.HELD
    assert [c.closed_for for c in kept] == ["shed", None, None, None, None]
    assert gate.admit() is Verdict.REFUSED  # 4 of 8 kept now: not over half


def test_trust_reaches_the_gate_only_from_a_held_connection_in_the_requests_state() -> None:
    from maasd.api.server import CONNECTION_STATE, protocol_for, trust

    gate = Gate(HttpLimits(max_connections=1))
    proto = protocol_for(gate).__new__(protocol_for(gate))  # no transport: only the state
    proto._verdict = Verdict.HELD
    assert gate.admit() is Verdict.HELD
    trust({CONNECTION_STATE: proto}, "tenant:t")
    gate.idle(cast(Any, proto))
    assert gate._idle_kept
    assert not gate._idle
    trust({}, "tenant:t")  # a request served otherwise (a test client): nothing
    trust(None, "tenant:t")
    refused = protocol_for(gate).__new__(protocol_for(gate))
    refused._verdict = Verdict.REFUSED
    trust({CONNECTION_STATE: refused}, "tenant:t")  # never held: not counted
    assert gate._kept == {"tenant:t": 1}


def test_a_request_cancelled_at_the_end_of_a_stop_is_one_warning_line() -> None:
    from maasd.api.server import CancelledAtStop

    exc = asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")
    msg = "Exception in ASGI application\n"
    record = logging.LogRecord(
        "uvicorn.error", logging.ERROR, "x", 1, msg, (), (type(exc), exc, None)
    )
    assert CancelledAtStop().filter(record)
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert "cancelled" in record.getMessage()
    other = logging.LogRecord("uvicorn.error", logging.ERROR, "x", 1, msg, (), None)
    assert CancelledAtStop().filter(other)
    assert other.levelno == logging.ERROR  # a real error stays one


def test_the_stops_cancellation_line_is_a_warning() -> None:
    from maasd.api.server import CancelledAtStop

    msg = "Cancel %s running task(s), timeout graceful shutdown exceeded"
    record = logging.LogRecord("uvicorn.error", logging.ERROR, "x", 1, msg, (1,), None)
    assert CancelledAtStop().filter(record)
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("Cancel 1 running task(s)")
