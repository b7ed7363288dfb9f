"""The write path: replies on their way into the kernel, fds in flight, and a socket's end.

A reply is sent at once, as far as the kernel takes it (:meth:`Connection.send`);
the rest is queued, the connection watched for writing, and the send deadline
started: a peer that does not take its reply within ``socket_send_timeout_s`` is
closed. A reply with fds waits until the peer has read the one before (watched for
neither, retried on a short timer: :mod:`.inflight`). If the kernel refuses a reply's
fds (ETOOMANYREFS), what its outcome handed the connection is undone and a 507 goes
in its place. A connection whose peer has not read fds sent to it is not closed but
drained (shut for writing, kept until the peer reads them or hangs up).

:class:`Outbox` never closes a connection itself — that is the table's, which gives
back everything else the connection holds — it raises :class:`PeerGone` and the
table closes. A slow operation's thread sends its own reply when it simply can
(:func:`answer_now`). Runs on the event loop thread, but for :func:`answer_now`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from maasd import errors
from maasd.protocol import FrameError, FrameTooLarge, encode_frame

from .connection import Connection, FdsRefused
from .deadlines import Deadlines
from .dispatch import Dispatcher, Outcome
from .holdings import Holdings
from .inflight import REFUSED_DETAIL, InFlight
from .interest import Interest
from .limits import Limits
from .pacing import LogLimiter

__all__ = ["Outbox", "PeerGone", "answer_now"]


class PeerGone(Exception):
    """A send failed (EPIPE, ECONNRESET, …): the connection is to close; ``str()`` says why."""


class Outbox:
    """Every connection's replies not yet wholly in the kernel, and its fds in flight.

    ``count(event)`` is told each ``send_timeout`` and ``fds_refused`` (the daemon's metrics).
    """

    def __init__(
        self,
        interest: Interest,
        holdings: Holdings,
        dispatcher: Dispatcher,
        limits: Limits,
        log: LogLimiter,
        count: Callable[[str], None],
    ) -> None:
        self._interest = interest
        self._holdings = holdings
        self._dispatcher = dispatcher
        self._log = log
        self._count = count
        #: a reply queued this long ago and still not taken by the peer closes it
        self.send_due: Deadlines[Connection] = Deadlines(limits.send_timeout_s)
        self.inflight = InFlight()

    # --- sending ---------------------------------------------------------------------

    def send(self, conn: Connection, outcome: Outcome) -> bool:
        """Send (or queue) ``outcome``'s reply: True. False: the kernel refused its fds and
        a 507 went in its place. Raises :class:`PeerGone`."""
        assert outcome.reply is not None
        try:
            frame = encode_frame(outcome.reply)
        except FrameTooLarge as exc:  # a reply of ours over 64 KiB is a bug: answer 500
            reply = self._dispatcher.error(exc, conn.fields()).reply
            assert reply is not None  # an error outcome always has its frame
            frame = encode_frame(reply)
        try:
            done = conn.send(frame, outcome.fds, outcome)
        except FdsRefused:
            self._refused(conn)
            return False
        except OSError as exc:
            raise PeerGone(f"send failed: {exc}") from exc
        if not done:
            self._queued(conn)
        elif outcome.fds and self.inflight.refused_at is not None:
            self.inflight.refused_at = None  # fds pass again
        return True

    def flush(self, conn: Connection) -> bool:
        """Send what is queued; True when all of it is in the kernel (False: still waiting,
        or a 507 went in place of refused fds). Raises :class:`PeerGone`."""
        try:
            done = conn.flush()
        except FdsRefused:
            self._refused(conn)
            return False
        except OSError as exc:
            raise PeerGone(f"send failed: {exc}") from exc
        if done:
            self.send_due.cancel(conn)
        else:
            self._queued(conn)
        return done

    def sent_early(self, conn: Connection, outcome: Outcome) -> None:
        """``outcome``'s reply left from a slow thread (:func:`answer_now`): watch for the
        rest if some is queued; fds that went say the kernel passes them again."""
        if outcome.queued and not conn.closed:
            self._queued(conn)
        if outcome.passed_fds:
            self.inflight.refused_at = None

    def _queued(self, conn: Connection) -> None:
        """A reply of ``conn`` is queued: for the kernel's buffer (watch for writing) or,
        with fds, for the peer to read the one before (retry on a timer)."""
        now = time.monotonic()
        if conn not in self.send_due:
            self.send_due.start(conn, now)
        if conn.awaiting_peer:
            self.inflight.held.start(conn, now)
            self._interest.rearm(
                conn
            )  # not for writing: the socket is writable, the peer is not reading

    def _refused(self, conn: Connection) -> None:
        """The kernel refused the queued reply's fds: undo it, answer 507 in its place."""
        about = conn.take_refused()
        if isinstance(about, Outcome):
            self._holdings.undo(conn, about)
        self.inflight.refuse(time.monotonic())
        self._count("fds_refused")
        err = errors.ResourceLimit(REFUSED_DETAIL)
        self.send(conn, self._dispatcher.error(err, conn.fields()))

    # --- deadlines -------------------------------------------------------------------

    def next_due(self) -> float | None:
        send, inflight = self.send_due.next(), self.inflight.next_due()
        if send is None or inflight is None:
            return inflight if send is None else send
        return min(send, inflight)

    def overdue(self, now: float) -> list[Connection]:
        """The connections whose peer has not taken a reply in time (to close)."""
        late = self.send_due.expired(now)
        for conn in late:
            fields = conn.fields()
            self._log.log(
                logging.WARNING, "send-timeout", "peer does not read its replies, closing", fields
            )
            self._count("send_timeout")
        return late

    def held_due(self, now: float) -> list[Connection]:
        """The connections whose reply with fds is to be tried again (:meth:`flush`)."""
        return self.inflight.held.expired(now)

    def drained(self, now: float) -> list[Connection]:
        """Drained connections whose peer has now read everything (to close for good)."""
        return self.inflight.drained(now)

    # --- the socket's end ------------------------------------------------------------

    def close(self, conn: Connection, *, final: bool) -> None:
        """``conn`` is closing: its replies go. Its socket closes, or, if its peer has not
        read fds sent to it (and not ``final``), it is shut and drained until it has."""
        self.send_due.cancel(conn)
        self.inflight.held.cancel(conn)
        if not final and conn.fds_sent and conn.unread():
            conn.shut()
            try:
                self._interest.read_only(conn)
            except (OSError, ValueError, KeyError):  # cannot watch it: the timer alone will do
                self._interest.unwatch(conn)
            self.inflight.draining.start(conn, time.monotonic())
        else:
            self._interest.unwatch(conn)
            conn.close()

    def end_drain(self, conn: Connection) -> None:
        """A drained connection ends for good: its socket closes."""
        self._interest.unwatch(conn)
        self.inflight.draining.cancel(conn)
        conn.close()


def answer_now(conn: Connection, outcome: Outcome) -> Outcome:
    """(a slow-pool thread) Send ``outcome``'s reply to the peer now, if the connection
    can take it without the loop (:meth:`Connection.try_send`): the peer has its answer
    without waiting for the loop thread to wake. The loop still applies the rest of the
    outcome (what the connection holds, ``busy``) before it reads the peer's next frame
    (:meth:`Outbox.sent_early`). A reply that closes the connection, or that does not
    encode, is the loop's to send. Returns ``outcome``."""
    if outcome.reply is None or outcome.close or outcome.defer:
        return outcome
    try:
        frame = encode_frame(outcome.reply)
    except FrameError:  # FrameTooLarge: the loop answers 500 in its place
        return outcome
    sent = conn.try_send(frame, outcome.fds)
    if sent is not None:
        outcome.passed_fds = bool(outcome.fds)
        outcome.reply, outcome.fds, outcome.queued = None, (), not sent
    return outcome
