"""Hellos off the loop: a key the daemon cannot tell from memory is checked on the slow pool.

Checking an API key it has not seen (or cannot trust its cache for: PostgreSQL with its
revocation listener down) reads the ledger. On the event loop that read would make every
connection of the host wait for the database — a slow ledger would slow every worker's
``lookup``, a frozen one would stop them all. So such a hello runs on the slow pool, like
any op that may wait on the ledger; its connection reads nothing more meanwhile (busy), and
the loop hands the outcome back (:meth:`Hellos.checked`). A key told from memory (the
admin, a remembered key), or a hello refused without a check, is answered inline as before.

Either way :meth:`Hellos.welcome` applies the check: the connection is authenticated and
counted against its tenant's cap (:meth:`maasd.broker.admission.ConnectionAdmission.welcome`), or
refused and closed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from maasd import errors
from maasd.models import Principal

from .admission import ConnectionAdmission
from .connection import Connection
from .dispatch import Dispatcher, Outcome
from .slowpool import SlowPool
from .table import ConnectionTable

__all__ = ["Hellos"]


class Hellos:
    """Each connection's first frame: checked (inline, or on the slow pool), then applied."""

    def __init__(
        self,
        table: ConnectionTable,
        admission: ConnectionAdmission,
        dispatcher: Dispatcher,
        pool: SlowPool,
        post: Callable[[Connection, Outcome], None],
    ) -> None:
        self._table, self._admission = table, admission
        self._dispatcher, self._pool, self._post = dispatcher, pool, post

    def hello(self, conn: Connection, body: bytes) -> None:
        """Serve ``conn``'s first frame, inline if no ledger read is needed."""
        if self._dispatcher.hello_inline(body):
            self.welcome(conn, *self._dispatcher.hello(body, conn.pid, conn.fields()))
            return
        conn.busy = True
        # one queue per peer uid: a flood of unknown keys from one uid waits behind its
        # own hellos, not in front of another uid's (the pool is fair between queues)
        self._pool.submit(f"hello:uid={conn.uid}", functools.partial(self._check, conn, body))

    def _check(self, conn: Connection, body: bytes) -> None:
        """On a slow-pool thread."""
        if conn.closed:  # gone (or its hello deadline passed) while the job waited
            return
        outcome, principal, key = self._dispatcher.hello(body, conn.pid, conn.fields())
        outcome.hello = (principal, key)
        self._post(conn, outcome)

    def checked(self, conn: Connection, outcome: Outcome) -> None:
        """(loop thread) A hello checked on the slow pool came back: apply it."""
        assert outcome.hello is not None
        (principal, key), outcome.hello = outcome.hello, None
        self.welcome(conn, outcome, principal, key)

    def welcome(
        self, conn: Connection, outcome: Outcome, principal: Principal | None, key: str | None
    ) -> None:
        """Apply a checked hello: welcome, counted, or refuse and close."""
        if principal is not None:
            reason = self._admission.welcome(conn, principal, key, outcome.authed or 0)
            if reason is not None:
                err = errors.LimitExceeded(reason)
                outcome = self._dispatcher.error(err, conn.fields(), close=True)
        self._table.deliver(conn, outcome)
