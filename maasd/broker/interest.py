"""What the loop's selector watches each connection for: the one owner of ``Connection.events``.

A connection is watched for reading while it is idle (nothing in flight, nothing
unsent, no whole frame waiting), for writing while a reply waits for room in the
kernel's buffer, and for neither while a reply with fds waits for its peer to read
the one before (the socket is writable, the peer is not reading: a timer retries
it, :mod:`.inflight`). A refused socket lingering for the peer's first bytes, and a
drained one, are watched for reading only. Runs on the event loop thread only.
"""

from __future__ import annotations

import contextlib
import selectors

from .connection import Connection

__all__ = ["READ", "WRITE", "Interest"]

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class Interest:
    """Registers connections on ``sel`` for what they can do now."""

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel

    def rearm(self, conn: Connection) -> None:
        """Watch ``conn`` for what it can do now: read when idle, write when a reply waits."""
        if conn.closed:
            return
        want = (READ if conn.wants_read else 0) | (
            WRITE if conn.out and not conn.awaiting_peer else 0
        )
        if want == conn.events:
            return
        if conn.events == 0:
            self.sel.register(conn.sock, want, conn)
        elif want == 0:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, want, conn)
        conn.events = want

    def read_only(self, conn: Connection) -> None:
        """Watch ``conn`` for reading only, whatever it is (refused, or drained); raises
        what the selector raises (``OSError``, ``ValueError``, ``KeyError``)."""
        if conn.events:
            self.sel.modify(conn.sock, READ, conn)
        else:
            self.sel.register(conn.sock, READ, conn)
        conn.events = READ

    def unwatch(self, conn: Connection) -> None:
        """Stop watching ``conn`` (before its socket closes)."""
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.sock)
            conn.events = 0
