"""The open connections: admission against the caps, replies, deadlines, closing.

Everything a connection owns is given back in :meth:`ConnectionTable.close`,
whichever way it ends (EOF, a failed send, a deadline, stop): its counts, its
selector registration, its unsent replies' fds, one ``drop_handle`` per
attachment it still holds, and the entries it put but never committed (handed to
``abandon``, which releases them off the loop). Runs on the event loop thread only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import time
from collections.abc import Callable

from maasd import errors
from maasd.protocol import FrameTooLarge, encode_frame

from .connection import Connection
from .deadlines import Deadlines
from .dispatch import Dispatcher, HandleService, Outcome, tenant_of
from .limits import ConnectionCounts, Limits
from .pacing import LogLimiter

__all__ = ["ConnectionTable"]

logger = logging.getLogger("maasd.broker")

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class ConnectionTable:
    """Admitted connections, their counts and deadlines, on one selector."""

    def __init__(
        self,
        sel: selectors.BaseSelector,
        service: HandleService,
        dispatcher: Dispatcher,
        limits: Limits,
        log: LogLimiter,
        abandon: Callable[[Connection, str], None] | None = None,
    ) -> None:
        """``abandon(conn, buffer_id)`` releases an entry ``conn`` put and never committed
        (the loop hands it to the slow pool: it scrubs)."""
        self.abandon = abandon
        self.sel = sel
        self.service = service
        self.dispatcher = dispatcher
        self.limits = limits
        self.log = log
        self.counts = ConnectionCounts(limits)
        self.conns: set[Connection] = set()
        #: absolute: a connection must say hello this long after accept, however it trickles
        self.hello_due: Deadlines[Connection] = Deadlines(limits.hello_timeout_s)
        #: a reply queued this long ago and still not taken by the peer closes it
        self.send_due: Deadlines[Connection] = Deadlines(limits.send_timeout_s)

    def __len__(self) -> int:
        return len(self.conns)

    # --- admission -----------------------------------------------------------------

    def admit(self, conn: Connection) -> str | None:
        """A new connection: take it (None) or say which cap refuses it."""
        reason = self.counts.admit_peer(conn.uid)
        if reason is not None:
            return reason
        self.conns.add(conn)
        self.hello_due.start(conn, time.monotonic())
        logger.debug("socket accepted", extra=conn.fields(peer_gid=conn.gid))
        try:
            self.rearm(conn)
        except (OSError, ValueError) as exc:  # epoll_ctl refused (ENOMEM, ENOSPC)
            self.close(conn, f"cannot watch it: {exc}")
        return None

    def hello(self, conn: Connection, body: bytes) -> None:
        """Serve the first frame: welcome (and count it for its tenant) or refuse and close."""
        fields = conn.fields()
        outcome, principal, key = self.dispatcher.hello(body, conn.pid, fields)
        if principal is not None:
            reason = self.counts.admit_tenant(conn.uid, tenant_of(principal))
            if reason is None:
                conn.principal, conn.api_key = principal, key
                conn.generation = outcome.authed or 0
                self.hello_due.cancel(conn)
                logger.debug("hello", extra=conn.fields())
            else:
                self.log.log(
                    logging.WARNING,
                    "refused",
                    "connection refused at a limit",
                    {**fields, "reason": reason},
                )
                outcome = self.dispatcher.error(errors.LimitExceeded(reason), fields, close=True)
        self.deliver(conn, outcome)

    # --- replies -------------------------------------------------------------------

    def deliver(self, conn: Connection, outcome: Outcome) -> None:
        """Apply what ``outcome`` changes for ``conn``, then send its reply."""
        if conn.closed:
            self.undeliverable(conn, outcome)
            return
        if outcome.authed is not None:
            conn.generation = outcome.authed
        if outcome.attached is not None:
            # Counted before sending: if the send fails, closing owes one drop_handle.
            conn.held[outcome.attached] += 1
        if outcome.staged is not None:
            self._forget_released(conn)
            conn.staged.add(outcome.staged)  # likewise: closing abandons it
        if outcome.unstaged is not None:
            conn.staged.discard(outcome.unstaged)
        if outcome.detached is not None and conn.held[outcome.detached] > 0:
            conn.held[outcome.detached] -= 1
            if conn.held[outcome.detached] == 0:
                del conn.held[outcome.detached]
            self._drop(conn, outcome.detached)
        if outcome.reply is None:
            if outcome.close:
                self.close(conn, "closed")
            return
        try:
            frame = encode_frame(outcome.reply)
        except FrameTooLarge as exc:  # a reply of ours over 64 KiB is a bug: answer 500
            reply = self.dispatcher.error(exc, conn.fields()).reply
            assert reply is not None  # an error outcome always has its frame
            frame = encode_frame(reply)
        try:
            done = conn.send(frame, outcome.fds)
        except OSError as exc:
            self.close(conn, f"send failed: {exc}")
            return
        if not done and conn not in self.send_due:
            self.send_due.start(conn, time.monotonic())
        if outcome.close:
            self.close(conn, "closed after its reply")

    def flush(self, conn: Connection) -> bool:
        """Send what is queued; True when all of it is in the kernel (False: closed or waiting)."""
        try:
            done = conn.flush()
        except OSError as exc:
            self.close(conn, f"send failed: {exc}")
            return False
        if done:
            self.send_due.cancel(conn)
        elif conn not in self.send_due:
            self.send_due.start(conn, time.monotonic())
        return done

    def undeliverable(self, conn: Connection, outcome: Outcome) -> None:
        """``conn`` closed before ``outcome`` was sent: give back what the outcome carries."""
        for fd in outcome.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if outcome.attached is not None:
            self._drop(conn, outcome.attached)
        if outcome.staged is not None:
            self._abandon(conn, outcome.staged)

    def _forget_released(self, conn: Connection) -> None:
        """Forget the entries ``conn`` put that were released without its commit or abort
        (a lease ended, a DELETE): they are no longer its to commit or abandon. Done at
        each put, so what a connection remembers is bounded by what it holds."""
        gone = [b for b in conn.staged if not self.service.entry_staged(b)]
        conn.staged.difference_update(gone)

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
            self.service.drop_handle(conn.principal, buffer_id)
        except Exception as exc:
            fields = conn.fields(buffer_id=buffer_id)
            self.log.log(logging.ERROR, "drop", "drop_handle failed", fields, exc_info=exc)

    # --- selector interest, deadlines, closing ---------------------------------------

    def rearm(self, conn: Connection) -> None:
        """Watch ``conn`` for what it can do now: read when idle, write when a reply waits."""
        if conn.closed:
            return
        want = (READ if conn.wants_read else 0) | (WRITE if conn.out else 0)
        if want == conn.events:
            return
        if conn.events == 0:
            self.sel.register(conn.sock, want, conn)
        elif want == 0:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, want, conn)
        conn.events = want

    def next_due(self) -> float | None:
        hello, send = self.hello_due.next(), self.send_due.next()
        if hello is None or send is None:
            return send if hello is None else hello
        return min(hello, send)

    def expire(self, now: float) -> None:
        """Close connections past their hello or send deadline."""
        for conn in self.hello_due.expired(now):
            self.log.log(logging.INFO, "hello-timeout", "no hello in time, closing", conn.fields())
            err = errors.InvalidRequest(
                f"no hello within {self.limits.hello_timeout_s:g} s of connecting"
            )
            self.deliver(conn, self.dispatcher.error(err, conn.fields(), close=True))
        for conn in self.send_due.expired(now):
            fields = conn.fields()
            self.log.log(
                logging.WARNING, "send-timeout", "peer does not read its replies, closing", fields
            )
            self.close(conn, "send timeout")

    def close(self, conn: Connection, why: str) -> None:
        """End ``conn`` and give back everything it holds. Idempotent."""
        if conn.closed:
            return
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.sock)
            conn.events = 0
        self.hello_due.cancel(conn)
        self.send_due.cancel(conn)
        conn.close()
        if conn.held:
            dropped = sum(conn.held.values())
            for buffer_id, count in conn.held.items():
                for _ in range(count):
                    self._drop(conn, buffer_id)
            conn.held.clear()
            logger.debug("attachments dropped on close", extra=conn.fields(count=dropped))
        for buffer_id in sorted(conn.staged):
            self._abandon(conn, buffer_id)
        conn.staged.clear()
        # Last, so that a connection no longer counted holds nothing any more.
        self.counts.leave(conn.uid, conn.tenant)
        self.conns.discard(conn)
        logger.debug("socket closed", extra=conn.fields(reason=why))

    def close_all(self, why: str) -> None:
        for conn in list(self.conns):
            try:
                self.close(conn, why)
            except Exception:
                logger.exception("closing a connection failed", extra=conn.fields())
