"""Frames the daemon pushes unasked: ``released {buffer_id}`` to the connections holding an
entry that was released or evicted.

A committed entry is sealed, so its pages stay resident (zeroed), counted in its tenant's
quota, until every fd and mapping of it is gone (:mod:`maasd.core.holders`). The daemon
tells each connection that holds it (looked up or attached, not detached): the client
drops its cached mapping at once, and the daemon drops that connection's attachments of
it (no detach is owed). The release runs on any thread; :class:`Pushes` queues the ids
and the loop sends the frames on its own thread, as it sends replies (a frame without
fds, queued behind a reply the peer has not read yet).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from maasd.protocol import Released

from .dispatch import Outcome
from .holdings import Holdings
from .table import ConnectionTable

__all__ = ["Pushes"]

logger = logging.getLogger("maasd.broker")


class Pushes:
    """Released entries to tell their connections about; :meth:`released` from any thread,
    :meth:`send` on the loop's."""

    def __init__(
        self, table: ConnectionTable, holdings: Holdings, wake: Callable[[], None]
    ) -> None:
        self._table = table
        self._holdings = holdings
        self._wake = wake
        self._lock = threading.Lock()
        self._ids: collections.deque[str] = collections.deque()

    def released(self, buffer_id: str) -> None:
        """An entry was released (any thread): the loop tells who holds it, soon."""
        with self._lock:
            self._ids.append(buffer_id)
        self._wake()

    def __bool__(self) -> bool:
        return bool(self._ids)

    def send(self) -> None:
        """(loop thread) Push ``released`` to every open connection holding a queued id."""
        with self._lock:
            ids, self._ids = set(self._ids), collections.deque()
        if not ids:
            return
        for conn in list(self._table.conns):
            if conn.closed or conn.principal is None:
                continue
            for buffer_id in ids.intersection(conn.held):
                logger.info(
                    "released entry still held by a connection",
                    extra=conn.fields(buffer_id=buffer_id, handles=conn.held[buffer_id]),
                )
                self._holdings.released(conn, buffer_id)
                self._table.deliver(conn, Outcome(reply=Released(buffer_id=buffer_id)))
