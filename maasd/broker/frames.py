"""Serving each connection's frames: one in flight at a time, inline or on the slow pool.

A connection has at most one frame in flight: while an operation of it runs on the
slow pool, or a reply of it is not yet wholly in the kernel, the loop reads nothing
more from it. Fast operations run inline, so an attach costs one wake-up of the loop
thread and no thread hop; an op that may wait (the ledger, a copy, a scrub, a tier
asked about a local miss) runs on the slow pool, and its outcome comes back through
the :class:`~maasd.broker.inbox.Inbox`. A connection with whole frames left after
:data:`FRAMES_PER_TURN` of them (a burst) waits in the backlog for its next share, so
one peer cannot hold the loop. A failure while serving one connection closes that
connection and nothing else. Runs on the event loop thread, but for a slow op's body.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable

from maasd import errors
from maasd.core.answered import answering
from maasd.protocol import FrameError, Request

from .connection import Connection
from .dispatch import Dispatcher, Op, Outcome, Session
from .hellos import Hellos
from .inbox import Inbox
from .interest import READ, Interest
from .outbox import answer_now
from .pacing import Fields, LogLimiter
from .sink import discard
from .slowpool import SlowPool
from .table import ConnectionTable

__all__ = ["FRAMES_PER_TURN", "Frames"]

#: Frames served from one connection per turn before the others get theirs.
FRAMES_PER_TURN = 16


class Frames:
    """Reads whole frames off connections' input and serves them (loop thread)."""

    def __init__(
        self,
        table: ConnectionTable,
        interest: Interest,
        hellos: Hellos,
        dispatcher: Dispatcher,
        pool: SlowPool,
        inbox: Inbox,
        log: LogLimiter,
    ) -> None:
        self.table = table
        self.interest = interest
        self.hellos = hellos
        self.dispatcher = dispatcher
        self.pool = pool
        self.inbox = inbox
        self.log = log
        #: connections with whole frames left over from their last share, in turn order
        self.backlog: collections.deque[Connection] = collections.deque()

    def process(self, conn: Connection, data: bytes = b"") -> None:
        """Serve whole frames of ``conn`` (after adding ``data``) until one is in flight."""
        if conn.closed:
            return
        if conn.busy or conn.out:  # one frame in flight at a time; data only comes when idle
            self.interest.rearm(conn)
            return
        try:
            body = conn.reader.next_frame(data)
            budget = FRAMES_PER_TURN
            while body is not None:
                self._frame(conn, body)
                budget -= 1
                if conn.closed or conn.busy or conn.out:
                    break
                if budget == 0:
                    if conn.reader.has_frame and not conn.in_backlog:
                        conn.in_backlog = True
                        self.backlog.append(conn)
                    break
                body = conn.reader.next_frame() if conn.reader.pending else None
        except FrameError as exc:  # FrameTooLarge: the stream cannot be resynchronised
            fields = conn.fields(length=getattr(exc, "length", None))
            self.log.log(logging.WARNING, "frame-too-large", "bad stream, closing", fields)
            self.table.deliver(
                conn, self.dispatcher.error(errors.InvalidRequest(str(exc)), fields, close=True)
            )
        if not (conn.events == READ and not (conn.reader.pending or conn.busy or conn.out)):
            self.interest.rearm(conn)  # (the common case, idle and watched for reading, needs none)

    def _frame(self, conn: Connection, body: bytes) -> None:
        # The fds that came with this frame (a publish's memfd), if any: the frame's own
        # from here on, discarded (maasd.broker.sink) unless an op that takes them runs.
        fds: tuple[int, ...] = ()
        if conn.inbound.batch is not None:
            fds = conn.inbound.take(conn.reader.last_start, conn.reader.next_start)
        if conn.principal is None:
            if fds:
                discard(fds)
            self.hellos.hello(conn, body)
            return
        fields = conn.fields  # built only if a log line needs them
        decoded = self.dispatcher.decode(body, fields)
        if isinstance(decoded, Outcome):
            if fds:
                discard(fds)
            self.table.deliver(conn, decoded)
            return
        req, op = decoded
        if fds and not op.takes_fds:  # what the kernel dropped before the socket took fds
            discard(fds)
            fds = ()
        assert conn.api_key is not None
        assert conn.tenant is not None
        assert conn.principal is not None
        # Inline only if the key needs no new check (that may read the ledger).
        if not op.slow and self.dispatcher.current(conn.generation):
            session = Session(conn.principal, conn.api_key, conn.generation, conn.held, conn.staged)
            outcome = self.dispatcher.run(op, req, session, fields, inline=True)
            if not outcome.defer:
                self.table.deliver(conn, outcome)
                return
            # the op must wait for something (a lookup asking L2): on to the slow pool
        conn.busy = True
        # Snapshots: the loop may drop the live sets if the connection closes meanwhile.
        session = Session(
            conn.principal,
            conn.api_key,
            conn.generation,
            dict(conn.held),
            frozenset(conn.staged),
            fds,
        )
        job = functools.partial(self._slow, conn, op, req, session, fields)
        self.pool.submit(conn.tenant, job)

    def _slow(self, conn: Connection, op: Op, req: Request, session: Session, f: Fields) -> None:
        """On a slow-pool thread: serve, then hand the outcome back to the loop. The fds
        the frame came with are discarded once the op ran (or would not run)."""
        try:
            if conn.closed:  # gone while the job waited for its turn: nobody wants it done
                return
            # What the op owes past its answer (a commit's staging region to the reclaimer,
            # the warmer's wake: maasd.core.answered) runs once the reply is with the
            # kernel, or with the loop to send.
            with answering() as later:
                try:
                    outcome = answer_now(conn, self.dispatcher.run(op, req, session, f))
                finally:
                    later.run()
        finally:
            if session.fds:
                discard(session.fds)
        self.inbox.post(conn, outcome)

    def settle(self) -> None:
        """Apply the outcomes handed back by other threads; serve their connections on."""
        for conn, outcome in self.inbox.take():
            conn.busy = False
            if conn.closed:  # gone meanwhile: what the outcome carries is given back
                self.table.deliver(conn, outcome)
                continue
            self._guard(conn, self._answered, conn, outcome)

    def _answered(self, conn: Connection, outcome: Outcome) -> None:
        if outcome.hello is not None:  # a hello checked on the slow pool
            self.hellos.checked(conn, outcome)
        else:
            self.table.deliver(conn, outcome)
        self.process(conn)

    def resume(self, conn: Connection) -> None:
        """A reply held for ``conn``'s peer went out: serve its waiting frames."""
        self._guard(conn, self.process, conn)

    def run_backlog(self) -> None:
        """Serve each connection of the backlog its next share."""
        for _ in range(len(self.backlog)):
            conn = self.backlog.popleft()
            conn.in_backlog = False
            self._guard(conn, self.process, conn)

    def _guard(self, conn: Connection, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` for ``conn``; an unexpected failure closes only ``conn``."""
        try:
            fn(*args)
        except Exception as exc:
            self.table.failed(conn, exc)
