"""The REST gate's kept connections (``maasd.api.server.Gate``): what a key refused since
takes back, and no count left behind by any order of events.

The daemon-level attacks are in ``tests/integration/test_attacks_rest_gate_round13.py``;
here the gate alone, with connections that only close themselves when shed.
"""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from gate_fakes import Conn, held
from maasd.api.server import CONNECTION_STATE, Gate, HttpLimits, Verdict, distrust, protocol_for


def test_a_kept_connection_whose_key_is_refused_since_is_anonymous_again() -> None:
    gate = Gate(HttpLimits(max_connections=4))
    kept = held(gate, idle=True, caller="tenant:t")
    for _ in range(3):
        held(gate, idle=False)
    assert gate.admit() is Verdict.REFUSED  # 1 of 4 kept, not over half: not shed
    gate.leave(Verdict.REFUSED, cast(Any, None))
    gate.busy(cast(Any, kept))  # its next request: a revoked key, answered 401
    gate.distrust(cast(Any, kept))
    gate.idle(cast(Any, kept))
    assert gate.admit() is Verdict.HELD  # anonymous now: shed for the newcomer
    assert kept.closed_for == "shed"


def test_a_refused_key_on_an_idle_kept_connection_makes_it_anonymous_and_frees_its_place() -> None:
    gate = Gate(HttpLimits(max_connections=16))
    share = gate.limits.caller_share
    kept = [held(gate, idle=True, caller="tenant:t") for _ in range(share)]
    late = held(gate, idle=True, caller="tenant:t")  # over the share: anonymous
    gate.distrust(cast(Any, kept[1]))  # idle: among the anonymous ones now
    gate.distrust(cast(Any, kept[1]))  # once only
    gate.distrust(cast(Any, Conn(gate, Verdict.DROPPED)))  # never kept: nothing
    gate.trust(cast(Any, late), "tenant:t")  # the place given back is taken
    for _ in range(16 - gate.held):
        held(gate, idle=False)
    assert gate.admit() is Verdict.HELD
    assert kept[1].closed_for == "shed"
    assert [c.closed_for for c in [kept[0], *kept[2:], late]] == [None] * share
    assert gate.admit() is Verdict.REFUSED  # the rest are kept: nothing anonymous is idle


def test_distrust_reaches_the_gate_from_the_requests_state() -> None:
    gate = Gate(HttpLimits(max_connections=4))
    cls = protocol_for(gate)
    proto = cls.__new__(cls)  # no transport: only the state
    proto._verdict = gate.admit()
    proto.trusted_by("tenant:t")
    assert gate._kept == {"tenant:t": 1}
    distrust({})  # a request served otherwise (a test client): nothing
    distrust(None)
    distrust({CONNECTION_STATE: proto})
    assert gate._kept == {}
    assert not gate._caller_of


def check(gate: Gate, live: list[Conn]) -> None:
    """The gate's books agree with the connections that are still open."""
    holding = {id(c) for c in live if c.verdict is Verdict.HELD}
    assert gate.held == len(holding)
    assert gate.refusing == sum(c.verdict is Verdict.REFUSED for c in live)
    assert {id(c) for c in gate._caller_of} <= holding
    assert {id(c) for c in gate._idle} <= holding
    assert {id(c) for c in gate._idle_kept} <= {id(c) for c in gate._caller_of}
    assert not set(gate._idle) & set(gate._idle_kept)
    assert sum(gate._kept.values()) == len(gate._caller_of)
    assert all(0 < n <= gate.limits.caller_share for n in gate._kept.values())
    for conn, caller in gate._caller_of.items():
        assert caller in gate._kept, conn


@pytest.mark.parametrize("seed", range(8))
def test_no_order_of_events_leaves_a_count_behind(seed: int) -> None:
    """Connections come, carry keys (valid or refused), go idle or busy, are shed, time out
    or close, in a random order: the gate's books always agree with what is open, and
    are empty once everything is closed."""
    rng = random.Random(seed)
    gate = Gate(HttpLimits(max_connections=8))
    live: list[Conn] = []
    callers = [f"tenant:{n}" for n in range(4)] + ["admin"]
    for _ in range(3000):
        live = [c for c in live if c.closed_for is None]
        step = rng.random()
        if step < 0.25 or not live:
            conn = Conn(gate, gate.admit())
            if conn.verdict is Verdict.DROPPED:
                conn.closed_for = "dropped"
            else:
                if conn.verdict is Verdict.HELD:
                    gate.idle(cast(Any, conn))
                live.append(conn)
        else:
            conn = rng.choice(live)
            held_now = conn.verdict is Verdict.HELD
            if step < 0.45 and held_now:
                gate.busy(cast(Any, conn))
                gate.trust(cast(Any, conn), rng.choice(callers))
            elif step < 0.55:
                gate.distrust(cast(Any, conn))
            elif step < 0.7 and held_now:
                gate.idle(cast(Any, conn))
            elif step < 0.8 and held_now:
                gate.busy(cast(Any, conn))
            elif step < 0.9:
                conn.close_for(rng.choice(["head_timeout", "body_timeout", "send_timeout"]))
            else:  # connection_lost: the gate is told once more, as GuardedH11 does
                conn.close_for("lost")
                gate.leave(Verdict.DROPPED, cast(Any, conn))
        check(gate, [c for c in live if c.closed_for is None])
    for conn in live:
        if conn.closed_for is None:
            conn.close_for("lost")
    assert (gate.held, gate.refusing) == (0, 0)
    assert not gate._idle
    assert not gate._idle_kept
    assert not gate._caller_of
    assert not gate._kept


def test_uvicorns_per_request_warnings_are_each_let_through_once_a_minute() -> None:
    """Each server built adds no second filter for a message (a daemon, and tests, build
    several); a flood of upgrade requests' warnings is one line a minute."""
    import logging

    from maasd.api.server import NOT_HTTP_WARNING, UPGRADE_WARNINGS, OnceAMinute, http_config
    from maasd.settings import Settings

    log = logging.getLogger("uvicorn.error")
    for _ in range(2):
        http_config(object(), Settings())
    quiet = [f.message for f in log.filters if isinstance(f, OnceAMinute)]
    assert sorted(quiet) == sorted([NOT_HTTP_WARNING, *UPGRADE_WARNINGS])
    said = [
        log.filter(logging.LogRecord(log.name, logging.WARNING, __file__, 1, m, (), None))
        for _ in range(100)
        for m in UPGRADE_WARNINGS
    ]
    assert sum(map(bool, said)) <= len(UPGRADE_WARNINGS)


def test_newcomers_are_refused_for_kept_connections_only_for_a_grace(monkeypatch) -> None:
    """Two callers' idle connections and a busy rest: a newcomer is refused rather than
    one of those shed — for :data:`KEPT_GRACE_S` of refusals; past it, with still nothing
    anonymous idle, the oldest kept one is shed for each newcomer (no lock-out)."""
    from maasd.api.server import KEPT_GRACE_S, STREAK_S

    clock = [1000.0]
    monkeypatch.setattr("maasd.api.server.time.monotonic", lambda: clock[0])
    gate = Gate(HttpLimits(max_connections=4))
    kept = [held(gate, idle=True, caller=f"tenant:{n}") for n in range(2)]
    busy = [held(gate, idle=False) for _ in range(2)]

    def refused_then_left() -> bool:
        verdict = gate.admit()
        if verdict is Verdict.REFUSED:
            gate.leave(verdict, cast(Any, None))  # answered 507, closed
        return verdict is Verdict.REFUSED

    assert refused_then_left()
    clock[0] += KEPT_GRACE_S / 2
    assert refused_then_left()
    clock[0] += KEPT_GRACE_S / 2
    assert gate.admit() is Verdict.HELD  # starved for the grace: the oldest kept one goes
    assert (kept[0].closed_for, kept[1].closed_for) == ("shed", None)
    # an anonymous idle connection shed: they come and go, the grace starts over
    newcomer = Conn(gate, Verdict.HELD)
    gate.idle(cast(Any, newcomer))
    assert gate.admit() is Verdict.HELD
    assert newcomer.closed_for == "shed"
    assert refused_then_left()
    clock[0] += KEPT_GRACE_S / 2
    assert refused_then_left()
    # a refusal long after the last one is not the same stretch: it starts over too
    clock[0] += STREAK_S + KEPT_GRACE_S
    assert refused_then_left()
    assert kept[1].closed_for is None
    assert all(c.closed_for is None for c in busy)
