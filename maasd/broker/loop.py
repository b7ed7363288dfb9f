"""The broker's event loop: one thread, non-blocking sockets, every connection on one selector.

Per turn::

    select(timeout = the earliest deadline, at most 1 s)
      listener readable  → Acceptor: accept, admit (caps) or refuse (429)
      wake pipe          → slow-pool results are waiting
      connection         → write what is queued; read, split frames, dispatch
    results of slow operations → send them, resume that connection's frames
    connections with frames left over (a burst) → their next share
    deadlines: hello (absolute, from accept), send (a reply nobody reads), linger
    a key revoked since the last turn → idle connections' keys re-checked (slow pool)
    a hello whose key is not known from memory → checked on the slow pool (it reads the ledger)

A connection has at most one frame in flight: while an operation of it runs
on the slow pool, or a reply of it is not yet wholly in the kernel, the loop
reads nothing more from it. Fast operations run inline, so an attach costs
one wake-up of this thread and no thread hop. A failure while serving one
connection closes that connection and nothing else.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from maasd import errors
from maasd.protocol import ProtocolError, Request, encode_frame
from maasd.store import hotpath

from .acceptor import Acceptor
from .connection import Connection
from .dispatch import Dispatcher, Op, Outcome, Session, UseCases
from .hellos import Hellos
from .limits import Limits
from .pacing import Fields, LogLimiter
from .pushes import Pushes
from .revocations import Revocations
from .slowpool import SlowPool
from .table import ConnectionTable

__all__ = ["EventLoop"]

logger = logging.getLogger("maasd.broker")

#: Longest sleep of the loop: it turns at least this often, which the health check reads.
MAX_WAIT_S = 1.0
#: Bytes read from a connection at once (a larger frame arrives over several reads).
RECV_BYTES = 16 * 1024
#: Frames served from one connection per turn before the others get theirs.
FRAMES_PER_TURN = 16

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class EventLoop:
    """Serves every connection of one listener; :meth:`run` is the loop thread's body."""

    def __init__(
        self,
        listener: socket.socket,
        service: UseCases,
        limits: Limits,
        pool: SlowPool,
        log: LogLimiter,
        events: Callable[[str], None] | None = None,  # the table's count: its metrics
    ) -> None:
        self.service = service
        self.limits = limits
        self.pool = pool
        self.log = log
        self.dispatcher = Dispatcher(service, log)
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.sel.register(self.wake_r, READ, None)
        self.table = ConnectionTable(
            self.sel, service, self.dispatcher, limits, log, self._abandon, self._resume, events
        )
        self.acceptor = Acceptor(listener, self.sel, self.dispatcher, log, self.table.admit)
        self.backlog: collections.deque[Connection] = collections.deque()
        self.results: collections.deque[tuple[Connection, Outcome]] = collections.deque()
        self.stopping = threading.Event()
        self.tick = time.monotonic()
        self.crash: str | None = None
        self.revocations = Revocations(service, self.table, self.dispatcher, pool, self.post)
        self.hellos = Hellos(self.table, self.dispatcher, pool, self.post)
        self.pushes = Pushes(self.table, self.wake)
        self._finished = False
        self._post_lock = threading.Lock()

    # --- the loop ------------------------------------------------------------------

    def run(self) -> None:
        hotpath.mark()  # nothing on this thread may wait on the ledger: counted if it does
        try:
            while not self.stopping.is_set():
                self.tick = time.monotonic()
                try:
                    self._turn()
                except Exception as exc:  # a bug or ENOMEM: log it, pause, keep serving
                    self.log.log(logging.ERROR, "loop", "broker loop error", exc_info=exc)
                    time.sleep(0.1)
        except BaseException as exc:
            self.crash = f"{type(exc).__name__}: {exc}"
            logger.critical("broker event loop crashed", exc_info=True)
            raise
        finally:
            self._shutdown()

    def _turn(self) -> None:
        due = self._next_due()
        if self.backlog or self.results or self.pushes:
            timeout = 0.0
        elif due is None:
            timeout = MAX_WAIT_S
        else:
            timeout = min(MAX_WAIT_S, max(0.0, due - self.tick))
        for key, mask in self.sel.select(timeout):
            self._event(key.data, mask)
        if self.results:
            self._run_results()
        if self.backlog:
            self._run_backlog()
        if self.pushes:
            self.pushes.send()
        if self.revocations.due():
            self.revocations.sweep()
        if due is not None and (now := time.monotonic()) >= due:
            self.table.expire(now)
            self.acceptor.tick(now)

    def stop(self) -> None:
        self.stopping.set()
        with self._post_lock:
            if not self._finished:
                self._wake()

    def _next_due(self) -> float | None:
        """The earliest deadline of any connection, refused socket or accept pause."""
        table, acceptor = self.table.next_due(), self.acceptor.next_due()
        if table is None or acceptor is None:
            return acceptor if table is None else table
        return min(table, acceptor)

    def _event(self, data: object, mask: int) -> None:
        if isinstance(data, Connection):
            if data.closed:  # closed earlier in this turn, or drained
                if data.draining:
                    self.table.drain_read(data)
                return
            if data.lingering:
                self.acceptor.linger_read(data)
                return
            try:
                self._conn_event(data, mask)
            except Exception as exc:  # a failure for one connection ends only that one
                self._failed(data, exc)
        elif data is None:
            self._drain_wake()
        elif data is self.acceptor:
            try:
                self.acceptor.accept_batch()
            except Exception as exc:  # never let accepting end
                self.log.log(logging.ERROR, "accept-bug", "accept failed", exc_info=exc)

    def _conn_event(self, conn: Connection, mask: int) -> None:
        if mask & WRITE and not self.table.flush(conn):
            return
        if not (mask & READ and conn.wants_read):
            self._process(conn)
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self.table.close(conn, f"recv failed: {exc}")
            return
        if not data:
            why = "peer closed mid-frame" if conn.reader.pending else "peer closed"
            self.table.close(conn, why)
            return
        self._process(conn, data)

    def _guard(self, conn: Connection, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` for ``conn``; an unexpected failure closes only ``conn``."""
        try:
            fn(*args)
        except Exception as exc:
            self._failed(conn, exc)

    def _failed(self, conn: Connection, exc: Exception) -> None:
        self.log.log(logging.ERROR, "conn-bug", "connection failed", conn.fields(), exc_info=exc)
        self.table.close(conn, "internal error")

    # --- reading and dispatching -----------------------------------------------------

    def _process(self, conn: Connection, data: bytes = b"") -> None:
        """Serve whole frames of ``conn`` (after adding ``data``) until one is in flight."""
        if conn.closed:
            return
        if conn.busy or conn.out:  # one frame in flight at a time; data only comes when idle
            self.table.rearm(conn)
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
        except ProtocolError as exc:  # FrameTooLarge: the stream cannot be resynchronised
            fields = conn.fields(length=getattr(exc, "length", None))
            self.log.log(logging.WARNING, "frame-too-large", "bad stream, closing", fields)
            self.table.deliver(
                conn, self.dispatcher.error(errors.InvalidRequest(str(exc)), fields, close=True)
            )
        if not (conn.events == READ and not (conn.reader.pending or conn.busy or conn.out)):
            self.table.rearm(conn)  # (the common case, idle and watched for reading, needs none)

    def _frame(self, conn: Connection, body: bytes) -> None:
        if conn.principal is None:
            self.hellos.hello(conn, body)
            return
        fields = conn.fields  # built only if a log line needs them
        decoded = self.dispatcher.decode(body, fields)
        if isinstance(decoded, Outcome):
            self.table.deliver(conn, decoded)
            return
        req, op = decoded
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
            conn.principal, conn.api_key, conn.generation, dict(conn.held), frozenset(conn.staged)
        )
        job = functools.partial(self._slow, conn, op, req, session, fields)
        self.pool.submit(conn.tenant, job)

    def _slow(self, conn: Connection, op: Op, req: Request, session: Session, f: Fields) -> None:
        """On a slow-pool thread: serve, then hand the outcome back to the loop."""
        if conn.closed:  # gone while the job waited for its turn: nobody wants it done
            return
        self.post(conn, _answer_now(conn, self.dispatcher.run(op, req, session, f)))

    def _abandon(self, conn: Connection, buffer_id: str) -> None:
        """``conn`` went away holding a staged entry: release it on the slow pool (a scrub).

        If the broker stops before the job runs, the daemon's close releases it.
        """
        principal = conn.principal
        if principal is None:
            return

        def job() -> None:
            try:
                self.service.entries.abandon(principal, buffer_id)
            except Exception as exc:
                fields = conn.fields(buffer_id=buffer_id)
                self.log.log(
                    logging.ERROR, "abandon", "releasing an entry failed", fields, exc_info=exc
                )

        self.pool.submit(conn.tenant or "-", job)

    def post(self, conn: Connection, outcome: Outcome) -> None:
        """Hand ``outcome`` to the loop (any thread); cleaned up here if the loop is gone."""
        with self._post_lock:
            if not self._finished:
                self.results.append((conn, outcome))
                self._wake()
                return
        self.table.undeliverable(conn, outcome)

    def _run_results(self) -> None:
        while self.results:
            conn, outcome = self.results.popleft()
            conn.busy = False
            if conn.closed:
                self.table.undeliverable(conn, outcome)
                continue
            self._guard(conn, self._deliver_and_go_on, conn, outcome)

    def _deliver_and_go_on(self, conn: Connection, outcome: Outcome) -> None:
        self.table.deliver(conn, outcome)
        if outcome.queued and not conn.closed:  # the rest of a reply sent by a slow thread
            self.table.waiting(conn)
        if outcome.passed_fds:  # as a reply with fds the loop sends: fds pass again
            self.table.inflight.refused_at = None
        self._process(conn)

    def _resume(self, conn: Connection) -> None:
        """A reply held for ``conn``'s peer went out: serve its waiting frames."""
        self._guard(conn, self._process, conn)

    def _run_backlog(self) -> None:
        for _ in range(len(self.backlog)):
            conn = self.backlog.popleft()
            conn.in_backlog = False
            self._guard(conn, self._process, conn)

    # --- waking, shutting down -------------------------------------------------------

    def wake(self) -> None:
        """Make the loop turn now (any thread): e.g. a key was revoked."""
        with self._post_lock:
            if not self._finished:
                self._wake()

    def _wake(self) -> None:
        """Make select() return (caller holds ``_post_lock`` and the loop is not finished)."""
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            os.write(self.wake_w, b"\0")

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:
            pass

    def _shutdown(self) -> None:
        with self._post_lock:
            self._finished = True
        self.table.close_all("broker stopping")
        try:
            self.acceptor.close()
        except Exception:
            logger.exception("closing the acceptor failed")
        while self.results:
            conn, outcome = self.results.popleft()
            self.table.undeliverable(conn, outcome)
        self.sel.close()
        with self._post_lock:  # nobody writes the wake pipe after this
            for fd in (self.wake_r, self.wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


def _answer_now(conn: Connection, outcome: Outcome) -> Outcome:
    """(a slow-pool thread) Send ``outcome``'s reply to the peer now, if the connection
    can take it without the loop (:meth:`Connection.try_send`): the peer has its answer
    without waiting for the loop thread to wake. The loop still applies the rest of the
    outcome (what the connection holds, ``busy``) before it reads the peer's next frame.
    A reply that closes the connection, or that does not encode, is the loop's to send.
    Returns ``outcome``."""
    if outcome.reply is None or outcome.close or outcome.defer:
        return outcome
    try:
        frame = encode_frame(outcome.reply)
    except ProtocolError:  # FrameTooLarge: the loop answers 500 in its place
        return outcome
    sent = conn.try_send(frame, outcome.fds)
    if sent is not None:
        outcome.passed_fds = bool(outcome.fds)
        outcome.reply, outcome.fds, outcome.queued = None, (), not sent
    return outcome
