"""Revocations reach idle connections: a revoked key's workers are closed at once.

Each authenticated connection remembers the auth generation its key was checked
at. When :attr:`~maasd.core.Service.auth_generation` moves (any key was revoked),
every such connection's key is checked again on the slow pool — not only at its
next request, so an idle worker of a revoked key is closed now (a revoked key
answers 401 at once, on the socket too). Connections with a request in flight are
re-checked by that request, or here once its reply is out.
"""

from __future__ import annotations

from collections.abc import Callable

from .connection import Connection
from .dispatch import Dispatcher, Outcome, Session, UseCases
from .slowpool import SlowPool
from .table import ConnectionTable

__all__ = ["Revocations"]


class Revocations:
    """The event loop's sweep of connections after a revocation (loop thread only)."""

    def __init__(
        self,
        service: UseCases,
        table: ConnectionTable,
        dispatcher: Dispatcher,
        pool: SlowPool,
        post: Callable[[Connection, Outcome], None],
    ) -> None:
        self._service = service
        self._table = table
        self._dispatcher = dispatcher
        self._pool = pool
        self._post = post
        #: the auth generation of the last sweep, and the connections it found busy
        #: (re-checked once their reply is out)
        self.swept = service.auth.generation
        self.stale: set[Connection] = set()

    def due(self) -> bool:
        """Whether a sweep has work: a revocation since the last, or busy ones left."""
        return bool(self.stale) or self._service.auth.generation != self.swept

    def sweep(self) -> None:
        """Send every authenticated connection not checked since the last revocation to be
        checked again (the idle ones now, the busy ones when their reply is out)."""
        generation = self._service.auth.generation
        if generation != self.swept:
            self.swept = generation
            self.stale = {c for c in self._table.conns if c.principal is not None}
        for conn in list(self.stale):
            if conn.closed or conn.generation == generation:
                self.stale.discard(conn)
            elif not (conn.busy or conn.out):
                self.stale.discard(conn)
                self._recheck(conn)

    def _recheck(self, conn: Connection) -> None:
        assert conn.principal is not None
        assert conn.api_key is not None
        conn.busy = True  # nothing else of it runs until the check is back
        session = Session(conn.principal, conn.api_key, conn.generation, {}, frozenset())
        fields = conn.fields()

        def job() -> None:
            if not conn.closed:
                self._post(conn, self._dispatcher.recheck(session, fields))

        self._pool.submit(conn.tenant or "-", job)
