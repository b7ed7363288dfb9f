"""Last-known answers of the ledger's reads, given while the ledger cannot be read.

``GET /v1/usage``, ``GET /v1/pools`` and ``GET /v1/buffers`` read the ledger. While it is
down (:class:`~maasd.errors.LedgerUnavailable`), each answers what it answered last for
the same caller and question, with ``stale_since`` set to when that was read: the REST
API marks such an answer stale (the ``Maasd-Stale`` header, docs/api.md) and keeps its
shape. A question never answered before still gets the 507.

Bounded: at most :data:`MAX_ANSWERS` remembered (emptied when full), each the last one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from maasd.errors import LedgerUnavailable
from maasd.models import BufferInfo, PoolInfo, Principal, Usage
from maasd.store.circuit import LedgerCircuit

__all__ = [
    "MAX_ANSWERS",
    "LastKnown",
    "LastKnownReads",
    "Maybe",
    "degraded_checks",
    "ledger_health",
]

T = TypeVar("T")

#: Answers remembered at most (per kind of question).
MAX_ANSWERS = 4096


class Maybe(Generic[T]):
    """An answer and, when it is a remembered one, when it was read (wall time)."""

    __slots__ = ("stale_since", "value")

    def __init__(self, value: T, stale_since: float | None = None) -> None:
        self.value = value
        self.stale_since = stale_since


class LastKnown(Generic[T]):
    """Remembers the last answer to each question; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[Hashable, tuple[T, float]] = {}

    def answer(self, question: Hashable, read: Callable[[], T]) -> Maybe[T]:
        """``read()``, remembered; while the ledger is down, the last one remembered."""
        try:
            value = read()
        except LedgerUnavailable:
            with self._lock:
                known = self._answers.get(question)
            if known is None:
                raise
            return Maybe(known[0], known[1])
        with self._lock:
            if len(self._answers) >= MAX_ANSWERS and question not in self._answers:
                self._answers.clear()
            self._answers[question] = (value, self._clock())
        return Maybe(value)


class LastKnownReads:
    """The service's three reads that answer as last known (``Service.last_known``)."""

    def __init__(
        self,
        usage: Callable[[Principal], Usage],
        pools: Callable[[bool], list[PoolInfo]],
        buffers: Callable[[Principal, str | None, bool], list[BufferInfo]],
    ) -> None:
        self._usage, self._pools, self._buffers = usage, pools, buffers
        self._last_usage: LastKnown[Usage] = LastKnown()
        self._last_pools: LastKnown[list[PoolInfo]] = LastKnown()
        self._last_buffers: LastKnown[list[BufferInfo]] = LastKnown()

    def usage(self, who: Principal) -> Maybe[Usage]:
        return self._last_usage.answer(who.tenant_id, lambda: self._usage(who))

    def pools(self, all_hosts: bool = False) -> Maybe[list[PoolInfo]]:
        return self._last_pools.answer(all_hosts, lambda: self._pools(all_hosts))

    def buffers(
        self, who: Principal, tenant_id: str | None = None, held: bool = False
    ) -> Maybe[list[BufferInfo]]:
        question = (who.is_admin, who.tenant_id, tenant_id, held)
        return self._last_buffers.answer(question, lambda: self._buffers(who, tenant_id, held))


def ledger_health(circuit: LedgerCircuit) -> tuple[bool, str]:
    """The ledger's state for ``/healthz``: degraded while its circuit is open."""
    since = circuit.down_since
    if since is None:
        return True, ""
    what = "can be read but not written" if circuit.writes_only else "cannot serve"
    return False, (
        f"the ledger database {what} ({circuit.why}) for {time.time() - since:.0f} s: "
        "lookups, attaches and detaches answer from memory; reserves, puts and commits 507"
    )


def degraded_checks(
    circuit: LedgerCircuit, l2_health: Callable[[], tuple[bool, str]], l2: bool
) -> dict[str, Callable[[], tuple[bool, str]]]:
    """The components whose failure leaves the daemon serving (``/healthz`` says
    ``degraded``, 200): the ledger (the data plane answers from memory), and L2 if set."""
    checks: dict[str, Callable[[], tuple[bool, str]]] = {"ledger": lambda: ledger_health(circuit)}
    if l2:
        checks["l2"] = l2_health
    return checks
