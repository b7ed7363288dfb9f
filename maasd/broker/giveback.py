"""What a connection gives back: attachments (``drop_handle``), uncommitted entries, and
the entries released behind its back (a lease ended, a DELETE).

The base of :class:`maasd.broker.table.ConnectionTable`, for replies that never
reach their peer and connections that end. Runs on the event loop thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from .connection import Connection
from .dispatch import Outcome, UseCases
from .pacing import LogLimiter

__all__ = ["GiveBack"]


class GiveBack:
    """Gives back what an outcome or a connection holds; never raises."""

    service: UseCases
    log: LogLimiter
    #: releases an entry a connection put and never committed (off the loop), or None
    abandon: Callable[[Connection, str], None] | None

    def _undo(self, conn: Connection, outcome: Outcome) -> None:
        """What ``deliver`` applied for a reply that never reached the peer."""
        if outcome.attached is not None and conn.held[outcome.attached] > 0:
            conn.held[outcome.attached] -= 1
            if conn.held[outcome.attached] == 0:
                del conn.held[outcome.attached]
            self._drop(conn, outcome.attached)
        if outcome.staged is not None and outcome.staged in conn.staged:
            conn.staged.discard(outcome.staged)
            self._abandon(conn, outcome.staged)

    def undeliverable(self, conn: Connection, outcome: Outcome) -> None:
        """``conn`` closed before ``outcome`` was sent: give back what the outcome carries."""
        for fd in outcome.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if outcome.attached is not None:
            self._drop(conn, outcome.attached)
        if outcome.staged is not None:
            self._abandon(conn, outcome.staged)

    def _abandon(self, conn: Connection, buffer_id: str) -> None:
        if self.abandon is None:
            return
        try:
            self.abandon(conn, buffer_id)
        except Exception as exc:
            fields = conn.fields(buffer_id=buffer_id)
            self.log.log(
                logging.ERROR, "abandon", "abandoning an entry failed", fields, exc_info=exc
            )

    def _drop(self, conn: Connection, buffer_id: str) -> None:
        assert conn.principal is not None
        try:
            self.service.handles.drop(conn.principal, buffer_id)
        except Exception as exc:
            fields = conn.fields(buffer_id=buffer_id)
            self.log.log(logging.ERROR, "drop", "drop_handle failed", fields, exc_info=exc)

    def _forget_released(self, conn: Connection) -> None:
        """Forget the entries ``conn`` put that were released without its commit or abort
        (a lease ended, a DELETE): they are no longer its to commit or abandon. Done at
        each put, so what a connection remembers is bounded by what it holds."""
        gone = [b for b in conn.staged if not self.service.entries.staged(b)]
        conn.staged.difference_update(gone)
