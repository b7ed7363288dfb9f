"""A stand-in for a REST connection in the gate's unit tests (``maasd.api.server.Gate``)."""

from __future__ import annotations

from typing import Any, cast

from maasd.api.server import Gate, Verdict

__all__ = ["Conn", "held"]


class Conn:
    """What the gate asks of a connection: to close itself (and leave the count)."""

    def __init__(self, gate: Gate, verdict: Verdict) -> None:
        self.gate = gate
        self.verdict = verdict
        self.closed_for: str | None = None

    def close_for(self, reason: str) -> None:
        self.closed_for = reason
        self.gate.leave(self.verdict, cast(Any, self))
        self.verdict = Verdict.DROPPED


def held(gate: Gate, *, idle: bool, caller: str | None = None) -> Conn:
    conn = Conn(gate, gate.admit())
    assert conn.verdict is Verdict.HELD
    if caller is not None:
        gate.trust(cast(Any, conn), caller)
    if idle:
        gate.idle(cast(Any, conn))
    return conn
