"""The listening side of the event loop: accept, admit or refuse, back off when out of fds.

An accept that fails for lack of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM —
or anything else unexpected) never ends accepting: the listener is taken off
the selector for a pause that doubles from 10 ms to 1 s while the failure
lasts, and the log line says so at most once per interval, with a count of the
lines it held back. Without the pause the listener stays readable (the
connection is still queued), and the loop would spin at 100 % CPU on it.

A peer refused at a cap gets an ``error`` frame (429 ``limit-exceeded``, the
detail names the cap), its write side is shut, and the socket lingers for up
to :data:`LINGER_S` until the peer sends its first bytes: a worker that
connects and then sends ``hello`` reads the 429 instead of a broken pipe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import time
from collections.abc import Callable

from maasd import errors
from maasd.protocol import encode_frame

from .connection import Connection
from .deadlines import Deadlines
from .dispatch import Dispatcher
from .interest import Interest
from .pacing import Backoff, LogLimiter
from .sink import discard_socket, recv_discarding

__all__ = ["Acceptor"]

logger = logging.getLogger("maasd.broker")

#: Connections taken off the listen queue per turn of the loop (others get their turn).
ACCEPT_BATCH = 64
#: How long a refused socket waits for the peer's first bytes before it is closed.
LINGER_S = 1.0
#: Refused sockets kept lingering at once; beyond this a refusal closes at once.
MAX_LINGERING = 32


class Acceptor:
    """Takes connections off ``listener`` and hands admitted ones to ``admit``."""

    def __init__(
        self,
        listener: socket.socket,
        sel: selectors.BaseSelector,
        interest: Interest,
        dispatcher: Dispatcher,
        log: LogLimiter,
        admit: Callable[[Connection], str | None],
    ) -> None:
        self.listener = listener
        self.sel = sel
        self.interest = interest  # the refused sockets' registrations
        self.dispatcher = dispatcher
        self.log = log
        self.admit = admit  # returns None (taken) or the reason it is refused
        self.backoff = Backoff(first_s=0.01, cap_s=1.0)
        self.resume_at: float | None = None
        self.last_error = ""
        self.lingering: Deadlines[Connection] = Deadlines(LINGER_S)
        self._ids = 0
        listener.setblocking(False)
        sel.register(listener, selectors.EVENT_READ, self)

    # --- accepting ---------------------------------------------------------------

    def accept_batch(self) -> None:
        """Accept what is queued (up to :data:`ACCEPT_BATCH`); pause on a failure."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _addr = self.listener.accept()
            except BlockingIOError:
                self.backoff.succeed()  # nothing queued: the listener works
                return
            except (InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                self._pause(exc)
                return
            self.backoff.succeed()
            self._ids += 1
            try:
                conn = Connection(sock, str(self._ids))
            except OSError:
                discard_socket(sock)
                continue
            reason = self.admit(conn)
            if reason is not None:
                self.refuse(conn, reason)

    def _pause(self, exc: OSError) -> None:
        now = time.monotonic()
        delay = self.backoff.fail(now)
        self.last_error = str(exc)
        if self.resume_at is None:
            self.sel.unregister(self.listener)
        self.resume_at = now + delay
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self.log.log(
            logging.WARNING,
            "accept",
            "accept failed; pausing accepts",
            {"error": str(exc), "errno": name, "pause_s": delay},
        )

    def tick(self, now: float) -> None:
        """Resume accepting once a pause is over; close refused sockets whose linger ended."""
        for conn in self.lingering.expired(now):
            self._close(conn)
        if self.resume_at is not None and now >= self.resume_at:
            self.resume_at = None
            self.sel.register(self.listener, selectors.EVENT_READ, self)
            self.accept_batch()

    def next_due(self) -> float | None:
        due = self.lingering.next()
        if self.resume_at is not None:
            due = self.resume_at if due is None else min(due, self.resume_at)
        return due

    def failing_for(self, now: float) -> float:
        """How long accepts have been failing without a success in between (0: they work)."""
        return self.backoff.failing_for(now)

    # --- refusing ---------------------------------------------------------------

    def refuse(self, conn: Connection, reason: str) -> None:
        """Answer 429 naming the cap, shut the write side, linger briefly, close."""
        self.log.log(
            logging.WARNING, "refused", "connection refused at a limit", conn.fields(reason=reason)
        )
        reply = self.dispatcher.error(errors.LimitExceeded(reason), conn.fields()).reply
        assert reply is not None  # an error outcome always has its frame
        try:
            conn.send(encode_frame(reply))  # a fresh socket's buffer takes it whole
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if len(self.lingering) >= MAX_LINGERING:
            conn.close()
            return
        conn.lingering = True
        self.lingering.start(conn, time.monotonic())
        self.interest.read_only(conn)

    def linger_read(self, conn: Connection) -> None:
        """The refused peer sent something (or closed): it will read the 429 now; close."""
        with contextlib.suppress(OSError):
            recv_discarding(conn.sock, 65536)
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        self.lingering.cancel(conn)
        self.interest.unwatch(conn)
        conn.close()

    def close(self) -> None:
        """Close every lingering socket and stop watching the listener (the owner closes it)."""
        for conn in self.lingering.drain():
            self._close(conn)
        if self.resume_at is None:
            with contextlib.suppress(KeyError, ValueError, OSError):  # closed by stop() already
                self.sel.unregister(self.listener)
        self.resume_at = float("inf")
