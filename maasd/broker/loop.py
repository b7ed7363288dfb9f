"""The broker's event loop: one thread, non-blocking sockets, every connection on one selector.

Per turn::

    select(timeout = the earliest deadline, at most 1 s)
      listener readable  → Acceptor: accept, admit (caps) or refuse (429)
      wake pipe          → Inbox: slow-pool results are waiting
      connection         → write what is queued; read, hand the bytes to Frames
    results of slow operations → applied, that connection's frames served on
    connections with frames left over (a burst) → their next share
    deadlines: hello (absolute, from accept), send (a reply nobody reads), linger
    a key revoked since the last turn → idle connections' keys re-checked (slow pool)
    a hello whose key is not known from memory → checked on the slow pool (it reads the ledger)

The loop owns the thread, the selector and the turn; what it serves has its owners,
which it builds and wires here, once, by constructor::

    Acceptor ─→ ConnectionTable ─→ ConnectionAdmission, Holdings, Outbox, Interest
    Frames ──→ Hellos, ConnectionTable, Inbox        (the one-frame-in-flight rule)
    Revocations, Pushes ─→ ConnectionTable

A failure while serving one connection closes that connection and nothing else.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from maasd.store import hotpath

from .acceptor import Acceptor
from .admission import ConnectionAdmission
from .connection import Connection
from .dispatch import Dispatcher, UseCases
from .frames import Frames
from .hellos import Hellos
from .holdings import Holdings
from .inbox import Inbox
from .interest import READ, WRITE, Interest
from .limits import Limits
from .outbox import Outbox
from .pacing import LogLimiter
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


def _ignore(_event: str) -> None:
    pass


class EventLoop:
    """Serves every connection of one listener; :meth:`run` is the loop thread's body.

    ``events`` (the daemon's metrics) is told each ``shed``, ``refused``,
    ``hello_timeout``, ``send_timeout`` and ``fds_refused``.
    """

    def __init__(
        self,
        listener: socket.socket,
        service: UseCases,
        limits: Limits,
        pool: SlowPool,
        log: LogLimiter,
        events: Callable[[str], None] | None = None,
    ) -> None:
        count = events or _ignore
        self.log = log
        self.sel = selectors.DefaultSelector()
        dispatcher = Dispatcher(service, log)
        interest = Interest(self.sel)
        holdings = Holdings(service, pool, log)
        self.inbox = Inbox(self.sel, holdings.undeliverable)
        self.outbox = Outbox(interest, holdings, dispatcher, limits, log, count)
        admission = ConnectionAdmission(limits, log, count)
        self.table = ConnectionTable(interest, admission, holdings, self.outbox, dispatcher, log)
        self.acceptor = Acceptor(listener, self.sel, interest, dispatcher, log, self.table.admit)
        hellos = Hellos(self.table, admission, dispatcher, pool, self.inbox.post)
        self.frames = Frames(self.table, interest, hellos, dispatcher, pool, self.inbox, log)
        self.revocations = Revocations(service, self.table, dispatcher, pool, self.inbox.post)
        self.pushes = Pushes(self.table, holdings, self.inbox.wake)
        self.stopping = threading.Event()
        self.tick = time.monotonic()
        self.crash: str | None = None

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
        if self.frames.backlog or self.inbox or self.pushes:
            timeout = 0.0
        elif due is None:
            timeout = MAX_WAIT_S
        else:
            timeout = min(MAX_WAIT_S, max(0.0, due - self.tick))
        for key, mask in self.sel.select(timeout):
            self._event(key.data, mask)
        if self.inbox:
            self.frames.settle()
        if self.frames.backlog:
            self.frames.run_backlog()
        if self.pushes:
            self.pushes.send()
        if self.revocations.due():
            self.revocations.sweep()
        if due is not None and (now := time.monotonic()) >= due:
            for conn in self.table.expire(now):
                self.frames.resume(conn)
            self.acceptor.tick(now)

    def stop(self) -> None:
        """Make the loop end (any thread): it closes every connection on its way out."""
        self.stopping.set()
        self.inbox.wake()

    def wake(self) -> None:
        """Make the loop turn now (any thread): e.g. a key was revoked."""
        self.inbox.wake()

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
                self.table.failed(data, exc)
        elif data is self.inbox:
            self.inbox.drain()
        elif data is self.acceptor:
            try:
                self.acceptor.accept_batch()
            except Exception as exc:  # never let accepting end
                self.log.log(logging.ERROR, "accept-bug", "accept failed", exc_info=exc)

    def _conn_event(self, conn: Connection, mask: int) -> None:
        if mask & WRITE and not self.table.flush(conn):
            return
        if not (mask & READ and conn.wants_read):
            self.frames.process(conn)
            return
        try:
            data = conn.receive(RECV_BYTES)  # and the fds a publish sends with its frame
        except BlockingIOError:
            return
        except OSError as exc:
            self.table.close(conn, f"recv failed: {exc}")
            return
        if not data:
            why = "peer closed mid-frame" if conn.reader.pending else "peer closed"
            self.table.close(conn, why)
            return
        self.frames.process(conn, data)

    def _shutdown(self) -> None:
        self.inbox.finish()
        self.table.close_all("broker stopping")
        try:
            self.acceptor.close()
        except Exception:
            logger.exception("closing the acceptor failed")
        self.sel.close()
        self.inbox.close()
