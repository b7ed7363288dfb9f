"""The open connections: admitted, answered, expired and closed — the parts' one junction.

The table owns which connections are open (:attr:`ConnectionTable.conns`) and the
order of what happens to one; each piece of a connection's state has its own owner,
which the table calls:

=================  ==============================================================
:mod:`.admission`  the caps' counts, shedding before ``hello``, the hello deadline
:mod:`.holdings`   attachments and staged entries: taken, undone, given back
:mod:`.outbox`     replies into the kernel, the send deadline, fds in flight,
                   the socket's end (closed, or drained)
:mod:`.interest`   what the selector watches each connection for
=================  ==============================================================

Everything a connection owns is given back in :meth:`ConnectionTable.close`,
whichever way it ends (EOF, a failed send, a deadline, stop): its selector
registration, its unsent replies' fds, one ``drop_handle`` per attachment it still
holds, the entries it put but never committed (abandoned: released off the loop),
and last its counts — once its socket is closed, which for a connection whose peer
has not read the fds sent to it waits until it has (drained). Runs on the event
loop thread only.
"""

from __future__ import annotations

import logging

from .admission import ConnectionAdmission
from .connection import Connection
from .dispatch import Dispatcher, Outcome
from .holdings import Holdings
from .inflight import peer_ended
from .interest import Interest
from .outbox import Outbox, PeerGone
from .pacing import LogLimiter

__all__ = ["ConnectionTable"]

logger = logging.getLogger("maasd.broker")


class ConnectionTable:
    """Admitted connections, from admission to their last count given back."""

    def __init__(
        self,
        interest: Interest,
        admission: ConnectionAdmission,
        holdings: Holdings,
        outbox: Outbox,
        dispatcher: Dispatcher,
        log: LogLimiter,
    ) -> None:
        self.interest = interest
        self.admission = admission
        self.holdings = holdings
        self.outbox = outbox
        self.dispatcher = dispatcher
        self.log = log
        self.conns: set[Connection] = set()

    def __len__(self) -> int:
        return len(self.conns)

    def admit(self, conn: Connection) -> str | None:
        """A new connection (the acceptor's): take it (None) or say which cap refuses it."""
        shed = self.admission.shed_first(conn.uid)
        if shed is not None:
            oldest, err = shed
            self.deliver(oldest, self.dispatcher.error(err, oldest.fields(), close=True))
        reason = self.admission.admit(conn)
        if reason is not None:
            return reason
        self.conns.add(conn)
        logger.debug("socket accepted", extra=conn.fields(peer_gid=conn.gid))
        try:
            self.interest.rearm(conn)
        except (OSError, ValueError) as exc:  # epoll_ctl refused (ENOMEM, ENOSPC)
            self.close(conn, f"cannot watch it: {exc}")
        return None

    def deliver(self, conn: Connection, outcome: Outcome) -> None:
        """Apply what ``outcome`` changes for ``conn``, then send its reply."""
        if conn.closed:
            self.holdings.undeliverable(conn, outcome)
            return
        if outcome.authed is not None:
            conn.generation = outcome.authed
        # Taken before sending: if the send fails, closing gives it back.
        self.holdings.take(conn, outcome)
        if outcome.reply is None:
            if outcome.queued or outcome.passed_fds:  # sent from a slow thread already
                self.outbox.sent_early(conn, outcome)
            if outcome.close:
                self.close(conn, "closed")
            return
        try:
            sent = self.outbox.send(conn, outcome)
        except PeerGone as exc:
            self.close(conn, str(exc))
            return
        if sent and outcome.close:
            self.close(conn, "closed after its reply")

    def flush(self, conn: Connection) -> bool:
        """Send what is queued; True when all of it is in the kernel (False: closed or waiting)."""
        try:
            return self.outbox.flush(conn)
        except PeerGone as exc:
            self.close(conn, str(exc))
            return False

    def next_due(self) -> float | None:
        hello, out = self.admission.next_due(), self.outbox.next_due()
        if hello is None or out is None:
            return out if hello is None else hello
        return min(hello, out)

    def expire(self, now: float) -> list[Connection]:
        """Close connections past their hello or send deadline, end drained ones whose peer
        read what it was sent, retry held replies: returns the connections whose held
        reply went out now (their next frames are to be served)."""
        for conn, err in self.admission.overdue(now):
            self.deliver(conn, self.dispatcher.error(err, conn.fields(), close=True))
        for conn in self.outbox.overdue(now):
            self.close(conn, "send timeout")
        resumed = [c for c in self.outbox.held_due(now) if not c.closed and self.flush(c)]
        for conn in self.outbox.drained(now):
            self.close(conn, "peer read what it was sent", final=True)
        return resumed

    def drain_read(self, conn: Connection) -> None:
        """A drained connection is readable: drop what the peer sends; its EOF ends it."""
        if peer_ended(conn):
            self.close(conn, "peer closed", final=True)

    def failed(self, conn: Connection, exc: Exception) -> None:
        """Serving ``conn`` failed unexpectedly (a bug): that ends ``conn`` and nothing else."""
        self.log.log(logging.ERROR, "conn-bug", "connection failed", conn.fields(), exc_info=exc)
        self.close(conn, "internal error")

    def close(self, conn: Connection, why: str, *, final: bool = False) -> None:
        """End ``conn`` and give back everything it holds. Idempotent.

        If its peer has not read fds sent to it, the socket and the counts stay until it
        does or hangs up (drained; ``final`` ends that at once).
        """
        if conn.closed:
            if conn.draining and final:
                self.outbox.end_drain(conn)
                self._leave(conn, why)
            return
        self.admission.closing(conn)
        self.outbox.close(conn, final=final)
        self.holdings.give_back(conn)
        if not conn.draining:
            self._leave(conn, why)

    def _leave(self, conn: Connection, why: str) -> None:
        # Last, so that a connection no longer counted holds nothing any more.
        self.admission.leave(conn)
        self.conns.discard(conn)
        logger.debug("socket closed", extra=conn.fields(reason=why))

    def close_all(self, why: str) -> None:
        for conn in list(self.conns):
            try:
                self.close(conn, why, final=True)
            except Exception:
                logger.exception("closing a connection failed", extra=conn.fields())
