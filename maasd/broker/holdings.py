"""What each connection holds in the core, taken and given back: the one owner of
``Connection.held`` (attachments, one ``drop_handle`` owed for each) and
``Connection.staged`` (entries it put and has not committed or aborted).

An outcome's ``attached`` / ``staged`` are taken *before* its reply is sent, so that
whichever way the connection ends — the send fails, the peer never reads, a
deadline, stop — closing owes exactly what it took: :meth:`Holdings.give_back` drops
every attachment and abandons every staged entry (released and scrubbed on the slow
pool, off the loop; if the broker stops before that job runs, the daemon's close
releases it). A reply that never reaches its peer gives back what its outcome carried
(:meth:`Holdings.undo`, :meth:`Holdings.undeliverable`). An entry released behind the
connection's back (a lease ended, a DELETE, an eviction) is no longer its to give back
(:meth:`Holdings.released`, :meth:`Holdings.take`'s forgetting at each put).

Runs on the event loop thread only; never raises (a failure of the core is logged).
"""

from __future__ import annotations

import logging

from .connection import Connection
from .dispatch import Outcome, UseCases
from .pacing import LogLimiter
from .sink import discard
from .slowpool import SlowPool

__all__ = ["Holdings"]

logger = logging.getLogger("maasd.broker")


class Holdings:
    """Takes what outcomes hand a connection, and gives it back to the core."""

    def __init__(self, service: UseCases, pool: SlowPool, log: LogLimiter) -> None:
        self._service = service
        self._pool = pool
        self._log = log

    def take(self, conn: Connection, outcome: Outcome) -> None:
        """Apply what ``outcome`` changes in what ``conn`` holds (before its reply is sent)."""
        if outcome.attached is not None:
            conn.held[outcome.attached] += 1
        if outcome.staged is not None:
            self._forget_released(conn)
            conn.staged.add(outcome.staged)
        if outcome.unstaged is not None:
            conn.staged.discard(outcome.unstaged)
        if outcome.detached is not None and conn.held[outcome.detached] > 0:
            conn.held[outcome.detached] -= 1
            if conn.held[outcome.detached] == 0:
                del conn.held[outcome.detached]
            self.drop(conn, outcome.detached)

    def undo(self, conn: Connection, outcome: Outcome) -> None:
        """What :meth:`take` applied, for a reply that never reached the peer."""
        if outcome.attached is not None and conn.held[outcome.attached] > 0:
            conn.held[outcome.attached] -= 1
            if conn.held[outcome.attached] == 0:
                del conn.held[outcome.attached]
            self.drop(conn, outcome.attached)
        if outcome.staged is not None and outcome.staged in conn.staged:
            conn.staged.discard(outcome.staged)
            self.abandon(conn, outcome.staged)

    def undeliverable(self, conn: Connection, outcome: Outcome) -> None:
        """``conn`` closed before ``outcome`` was sent: give back what the outcome carries."""
        discard(outcome.fds)  # an entry released since: the last copy (sink module)
        if outcome.attached is not None:
            self.drop(conn, outcome.attached)
        if outcome.staged is not None:
            self.abandon(conn, outcome.staged)

    def give_back(self, conn: Connection) -> None:
        """``conn`` closed: drop every attachment it holds, abandon every entry it staged."""
        if conn.held:
            dropped = sum(conn.held.values())
            for buffer_id, count in conn.held.items():
                for _ in range(count):
                    self.drop(conn, buffer_id)
            conn.held.clear()
            logger.debug("attachments dropped on close", extra=conn.fields(count=dropped))
        for buffer_id in sorted(conn.staged):
            self.abandon(conn, buffer_id)
        conn.staged.clear()

    def released(self, conn: Connection, buffer_id: str) -> int:
        """``buffer_id`` was released: ``conn`` holds it no more (its attachments dropped).
        Returns how many attachments of it ``conn`` held (0: none, nothing done)."""
        count = conn.held.pop(buffer_id, 0)
        for _ in range(count):
            self.drop(conn, buffer_id)
        return count

    def drop(self, conn: Connection, buffer_id: str) -> None:
        """Give back one attachment of ``buffer_id`` (``drop_handle``)."""
        assert conn.principal is not None
        try:
            self._service.handles.drop(conn.principal, buffer_id)
        except Exception as exc:
            fields = conn.fields(buffer_id=buffer_id)
            self._log.log(logging.ERROR, "drop", "drop_handle failed", fields, exc_info=exc)

    def abandon(self, conn: Connection, buffer_id: str) -> None:
        """Release an entry ``conn`` put and never committed: on the slow pool (a scrub)."""
        principal = conn.principal
        if principal is None:
            return

        def job() -> None:
            try:
                self._service.entries.abandon(principal, buffer_id)
            except Exception as exc:
                fields = conn.fields(buffer_id=buffer_id)
                self._log.log(
                    logging.ERROR, "abandon", "releasing an entry failed", fields, exc_info=exc
                )

        try:
            self._pool.submit(conn.tenant or "-", job)
        except Exception as exc:
            fields = conn.fields(buffer_id=buffer_id)
            self._log.log(
                logging.ERROR, "abandon", "abandoning an entry failed", fields, exc_info=exc
            )

    def _forget_released(self, conn: Connection) -> None:
        """Forget the entries ``conn`` put that were released without its commit or abort
        (a lease ended, a DELETE): they are no longer its to commit or abandon. Done at
        each put, so what a connection remembers is bounded by what it holds."""
        gone = [b for b in conn.staged if not self._service.entries.staged(b)]
        conn.staged.difference_update(gone)
