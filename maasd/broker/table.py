"""The open connections: admission against the caps, replies, deadlines, closing.

Everything a connection owns is given back in :meth:`ConnectionTable.close`,
whichever way it ends (EOF, a failed send, a deadline, stop): its counts, its
selector registration, its unsent replies' fds, one ``drop_handle`` per
attachment it still holds, and the entries it put but never committed (handed to
``abandon``, which releases them off the loop). Runs on the event loop thread only.

Fds in flight: a reply with fds waits until the peer read the one before, and a
connection closed before its peer read its fds is drained (:mod:`.inflight`).

Before ``hello``. At the caps on connections waiting for ``hello`` (per uid,
and in total) the oldest such connection is shed — of that uid, or of the uid
holding most of them — instead of the new one refused: idle connects cannot
lock a worker out that says ``hello`` at once.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from collections.abc import Callable

from maasd import errors
from maasd.models import Principal
from maasd.protocol import FrameTooLarge, encode_frame

from .connection import Connection, FdsRefused
from .deadlines import Deadlines
from .dispatch import Dispatcher, Outcome, UseCases, tenant_of
from .giveback import GiveBack
from .inflight import REFUSED_DETAIL, InFlight, oldest_waiting, peer_ended
from .limits import ConnectionCounts, Limits
from .pacing import LogLimiter

__all__ = ["ConnectionTable"]

logger = logging.getLogger("maasd.broker")

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


def _ignore(_event: str) -> None:
    pass


class ConnectionTable(GiveBack):
    """Admitted connections, their counts and deadlines, on one selector."""

    def __init__(
        self,
        sel: selectors.BaseSelector,
        service: UseCases,
        dispatcher: Dispatcher,
        limits: Limits,
        log: LogLimiter,
        abandon: Callable[[Connection, str], None] | None = None,
        resume: Callable[[Connection], None] | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        """``abandon(conn, buffer_id)`` releases an entry ``conn`` put and never committed
        (the loop hands it to the slow pool: it scrubs); ``resume(conn)`` serves the frames
        ``conn`` has waiting, once a reply held for its peer went out; ``count(event)`` is
        told each ``shed``, ``refused``, ``hello_timeout``, ``send_timeout`` and
        ``fds_refused`` (the daemon's metrics)."""
        self.abandon = abandon
        self.resume = resume
        self.count: Callable[[str], None] = count or _ignore
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
        self.inflight = InFlight()

    def __len__(self) -> int:
        return len(self.conns)

    # --- admission -----------------------------------------------------------------

    def admit(self, conn: Connection) -> str | None:
        """A new connection: take it (None) or say which cap refuses it."""
        shed = self.counts.shed_for(conn.uid)
        if shed is not None:
            self._shed(shed)
        reason = self.counts.admit_peer(conn.uid)
        if reason is not None:
            self.count("refused")
            return reason
        self.conns.add(conn)
        self.hello_due.start(conn, time.monotonic())
        logger.debug("socket accepted", extra=conn.fields(peer_gid=conn.gid))
        try:
            self.rearm(conn)
        except (OSError, ValueError) as exc:  # epoll_ctl refused (ENOMEM, ENOSPC)
            self.close(conn, f"cannot watch it: {exc}")
        return None

    def _shed(self, uid: int) -> None:
        """Close the oldest connection of ``uid`` still waiting for hello."""
        conn = oldest_waiting(self.hello_due, uid)
        if conn is None:  # pragma: no cover - the counts say there is one
            return
        self.log.log(
            logging.INFO,
            "shed",
            "connections waiting for hello at the cap: the oldest is closed",
            conn.fields(),
        )
        self.count("shed")
        err = errors.LimitExceeded(
            "no hello yet, and newer connections are waiting for theirs "
            f"(socket_max_unauthenticated = {self.limits.max_unauthenticated}): "
            "the oldest is closed"
        )
        self.deliver(conn, self.dispatcher.error(err, conn.fields(), close=True))

    def welcome(
        self, conn: Connection, outcome: Outcome, principal: Principal | None, key: str | None
    ) -> None:
        """Apply a checked hello (:mod:`.hellos`): welcome, counted, or refuse and close."""
        fields = conn.fields()
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
        if outcome.hello is not None:  # a hello checked on the slow pool
            (principal, key), outcome.hello = outcome.hello, None
            return self.welcome(conn, outcome, principal, key)
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
        if self._send(conn, frame, outcome) and outcome.close:
            self.close(conn, "closed after its reply")

    def _send(self, conn: Connection, frame: bytes, outcome: Outcome) -> bool:
        """Send (or queue) ``outcome``'s reply; False if ``conn`` is closed or answered else."""
        try:
            done = conn.send(frame, outcome.fds, outcome)
        except FdsRefused:
            self._fds_refused(conn)
            return False
        except OSError as exc:
            self.close(conn, f"send failed: {exc}")
            return False
        if not done:
            self.waiting(conn)
        elif outcome.fds and self.inflight.refused_at is not None:
            self.inflight.refused_at = None  # fds pass again
        return True

    def flush(self, conn: Connection) -> bool:
        """Send what is queued; True when all of it is in the kernel (False: closed or waiting)."""
        try:
            done = conn.flush()
        except FdsRefused:
            self._fds_refused(conn)
            return False
        except OSError as exc:
            self.close(conn, f"send failed: {exc}")
            return False
        if done:
            self.send_due.cancel(conn)
        else:
            self.waiting(conn)
        return done

    def waiting(self, conn: Connection) -> None:
        """A reply of ``conn`` is queued: for the kernel's buffer (watch for writing) or,
        with fds, for the peer to read the one before (retry on a timer)."""
        now = time.monotonic()
        if conn not in self.send_due:
            self.send_due.start(conn, now)
        if conn.awaiting_peer:
            self.inflight.held.start(conn, now)
            self.rearm(conn)  # not for writing: the socket is writable, the peer is not reading

    def _fds_refused(self, conn: Connection) -> None:
        """The kernel refused the queued reply's fds: undo it, answer 507 in its place."""
        about = conn.take_refused()
        if isinstance(about, Outcome):
            self._undo(conn, about)
        self.inflight.refuse(time.monotonic())
        self.count("fds_refused")
        err = errors.ResourceLimit(REFUSED_DETAIL)
        self.deliver(conn, self.dispatcher.error(err, conn.fields()))

    # --- selector interest, deadlines, closing ---------------------------------------

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

    def next_due(self) -> float | None:
        dues = (self.hello_due.next(), self.send_due.next(), self.inflight.next_due())
        return min((d for d in dues if d is not None), default=None)

    def expire(self, now: float) -> None:
        """Close connections past their hello or send deadline."""
        for conn in self.hello_due.expired(now):
            self.log.log(logging.INFO, "hello-timeout", "no hello in time, closing", conn.fields())
            err = errors.InvalidRequest(
                f"no hello within {self.limits.hello_timeout_s:g} s of connecting"
            )
            self.count("hello_timeout")
            self.deliver(conn, self.dispatcher.error(err, conn.fields(), close=True))
        for conn in self.send_due.expired(now):
            fields = conn.fields()
            self.log.log(
                logging.WARNING, "send-timeout", "peer does not read its replies, closing", fields
            )
            self.count("send_timeout")
            self.close(conn, "send timeout")
        for conn in self.inflight.held.expired(now):
            if not conn.closed and self.flush(conn) and self.resume is not None:
                self.resume(conn)
        for conn in self.inflight.drained(now):
            self.close(conn, "peer read what it was sent", final=True)

    def drain_read(self, conn: Connection) -> None:
        """A drained connection is readable: drop what the peer sends; its EOF ends it."""
        if peer_ended(conn):
            self.close(conn, "peer closed", final=True)

    def close(self, conn: Connection, why: str, *, final: bool = False) -> None:
        """End ``conn`` and give back everything it holds. Idempotent.

        If its peer has not read fds sent to it, the socket and the counts stay until it
        does or hangs up (drained; ``final`` ends that at once).
        """
        if conn.closed:
            if conn.draining and final:
                self._unwatch(conn)
                self.inflight.draining.cancel(conn)
                conn.close()
                self._leave(conn, why)
            return
        self.hello_due.cancel(conn)
        self.send_due.cancel(conn)
        self.inflight.held.cancel(conn)
        if not final and conn.fds_sent and conn.unread():
            conn.shut()
            try:
                if conn.events:
                    self.sel.modify(conn.sock, READ, conn)
                else:
                    self.sel.register(conn.sock, READ, conn)
                conn.events = READ
            except (OSError, ValueError, KeyError):  # cannot watch it: the timer alone will do
                self._unwatch(conn)
            self.inflight.draining.start(conn, time.monotonic())
        else:
            self._unwatch(conn)
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
        if not conn.draining:
            self._leave(conn, why)

    def _unwatch(self, conn: Connection) -> None:
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn.sock)
            conn.events = 0

    def _leave(self, conn: Connection, why: str) -> None:
        # Last, so that a connection no longer counted holds nothing any more.
        self.counts.leave(conn.uid, conn.tenant)
        self.conns.discard(conn)
        logger.debug("socket closed", extra=conn.fields(reason=why))

    def close_all(self, why: str) -> None:
        for conn in list(self.conns):
            try:
                self.close(conn, why, final=True)
            except Exception:
                logger.exception("closing a connection failed", extra=conn.fields())
