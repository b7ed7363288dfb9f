"""Whether a connection may stay: the caps' counts, shedding before ``hello``, the hello deadline.

The one owner of the broker's :class:`~maasd.broker.limits.ConnectionCounts` and of
the deadline by which an accepted connection must have said ``hello``. It decides and
counts; the table (:mod:`.table`) sends what it decides and closes::

    accept ─ shed_first(uid)  the oldest connection still waiting for hello to close
       │                      first, at the caps on them (of that uid, or of the uid
       │                      holding most): idle connects lock no worker out
       ├─ admit(conn)         counted (peer uid, unauthenticated, total), the hello
       │                      deadline started; or the cap that refuses it
       ├─ welcome(conn, …)    hello checked: moved to its tenant's count; or refused
       ├─ overdue(now)        no hello in time
       └─ leave(conn)         closed (or drained): every count given back, once

Runs on the event loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from maasd import errors
from maasd.models import Principal

from .connection import Connection
from .deadlines import Deadlines
from .dispatch import tenant_of
from .limits import ConnectionCounts, Limits
from .pacing import LogLimiter

__all__ = ["ConnectionAdmission"]

logger = logging.getLogger("maasd.broker")


class ConnectionAdmission:
    """The counts of open connections against the caps, and the hello deadline.

    ``count(event)`` is told each ``shed``, ``refused`` (at accept) and ``hello_timeout``
    (the daemon's metrics).
    """

    def __init__(self, limits: Limits, log: LogLimiter, count: Callable[[str], None]) -> None:
        self.limits = limits
        self.counts = ConnectionCounts(limits)
        #: absolute: a connection must say hello this long after accept, however it trickles
        self.hello_due: Deadlines[Connection] = Deadlines(limits.hello_timeout_s)
        self._log = log
        self._count = count

    def shed_first(self, uid: int) -> tuple[Connection, errors.LimitExceeded] | None:
        """Before :meth:`admit` of a connection of ``uid``: the connection waiting for hello
        to close first to make room, and the error it is told; or None."""
        shed = self.counts.shed_for(uid)
        if shed is None:
            return None
        conn = next((c for c in self.hello_due if c.uid == shed), None)  # the oldest
        if conn is None:  # pragma: no cover - the counts say there is one
            return None
        self._log.log(
            logging.INFO,
            "shed",
            "connections waiting for hello at the cap: the oldest is closed",
            conn.fields(),
        )
        self._count("shed")
        return conn, errors.LimitExceeded(
            "no hello yet, and newer connections are waiting for theirs "
            f"(socket_max_unauthenticated = {self.limits.max_unauthenticated}): "
            "the oldest is closed"
        )

    def admit(self, conn: Connection) -> str | None:
        """A new connection: count it and start its hello deadline (None), or say which
        cap refuses it (nothing counted)."""
        reason = self.counts.admit_peer(conn.uid)
        if reason is not None:
            self._count("refused")
            return reason
        self.hello_due.start(conn, time.monotonic())
        return None

    def welcome(
        self, conn: Connection, principal: Principal, key: str | None, generation: int
    ) -> str | None:
        """``conn``'s hello was checked as ``principal``: count it against its tenant and
        authenticate it (None), or say which cap refuses it (it stays unauthenticated)."""
        reason = self.counts.admit_tenant(conn.uid, tenant_of(principal))
        if reason is not None:
            fields = {**conn.fields(), "reason": reason}
            self._log.log(logging.WARNING, "refused", "connection refused at a limit", fields)
            return reason
        conn.principal, conn.api_key, conn.generation = principal, key, generation
        self.hello_due.cancel(conn)
        logger.debug("hello", extra=conn.fields())
        return None

    def overdue(self, now: float) -> list[tuple[Connection, errors.InvalidRequest]]:
        """The connections that did not say hello in time, each with what it is told."""
        late = []
        for conn in self.hello_due.expired(now):
            self._log.log(logging.INFO, "hello-timeout", "no hello in time, closing", conn.fields())
            err = errors.InvalidRequest(
                f"no hello within {self.limits.hello_timeout_s:g} s of connecting"
            )
            self._count("hello_timeout")
            late.append((conn, err))
        return late

    def next_due(self) -> float | None:
        return self.hello_due.next()

    def closing(self, conn: Connection) -> None:
        """``conn`` is closing: it has no hello left to wait for."""
        self.hello_due.cancel(conn)

    def leave(self, conn: Connection) -> None:
        """``conn`` is gone (its socket closed): give back its counts. Once per admitted one."""
        self.counts.leave(conn.uid, conn.tenant)
