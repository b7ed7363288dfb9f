"""The REST server's event loop: asyncio's, with an accept loop that backs off when it fails.

asyncio's own accept loop (``BaseSelectorEventLoop._accept_connection``, CPython
3.11–3.13) meets ``EMFILE`` by logging a traceback, taking the listener off the
selector and scheduling a retry in a second — and then *goes on* calling
``accept()`` up to ``backlog`` times (uvicorn's: 2048) in the same turn, each
failure logging its traceback and scheduling one more retry. A second later
every one of those retries re-arms the listener and the storm starts again: out
of files, the daemon wrote 286,000 tracebacks (190 MB of log) in 75 s and
REST served no one.

:class:`GuardedLoop` replaces that one method. A failed ``accept()`` (any
``OSError``: ``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM`` or anything
unexpected) ends the turn: the listener leaves the selector for a pause that
doubles from 10 ms to 1 s while the failures last (the queued connections wait
in the kernel's listen queue), and at most one log line a second says so, with
the count of failures since the last line. A successful accept ends the streak.
The worker socket's accept loop (:mod:`maasd.broker.acceptor`) does the same.

``maasd serve`` runs uvicorn on it (``loop=`` of :func:`maasd.api.server.http_config`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Any

from maasd.store import hotpath

__all__ = ["AcceptPacing", "GuardedLoop"]

logger = logging.getLogger("maasd.api.server")

#: The first pause after a failed accept, and the longest.
FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 1.0
#: At most one "accept failed" line in this many seconds.
LOG_EVERY_S = 1.0


class AcceptPacing:
    """The pause after each failed accept, and the rate-limited line that reports them."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.pause_s = 0.0
        self.failures = 0  # since the last line written
        self.total = 0
        self._logged: float | None = None

    def failed(self, exc: OSError) -> float:
        """Count a failure, log it if a second has passed since the last line; the pause."""
        self.pause_s = FIRST_PAUSE_S if self.pause_s == 0 else min(MAX_PAUSE_S, self.pause_s * 2)
        self.failures += 1
        self.total += 1
        now = self.clock()
        if self._logged is None or now - self._logged >= LOG_EVERY_S:
            self._logged = now
            logger.warning(
                "REST accept failed; pausing accepts",
                extra={
                    "error": exc.strerror or str(exc),
                    "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                    "failures": self.failures,
                    "pause_s": self.pause_s,
                },
            )
            self.failures = 0
        return self.pause_s

    def succeeded(self) -> None:
        self.pause_s = 0.0


class GuardedLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose accept loop pauses on failure (the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.accept_pacing = AcceptPacing()

    def run_forever(self) -> None:
        # Every request's authentication and response pass through this thread: a ledger
        # call on it would stall every REST request (maasd.store.hotpath counts any).
        hotpath.mark()
        super().run_forever()

    def _accept_connection(
        self,
        protocol_factory: Any,
        sock: socket.socket,
        sslcontext: Any = None,
        server: Any = None,
        backlog: int = 100,
        *timeouts: Any,
    ) -> None:
        for _ in range(backlog):
            try:
                conn, addr = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # nothing (more) queued
            except OSError as exc:
                pause = self.accept_pacing.failed(exc)
                self._remove_reader(sock.fileno())  # type: ignore[attr-defined]
                self.call_later(
                    pause,
                    self._resume,
                    protocol_factory,
                    sock,
                    sslcontext,
                    server,
                    backlog,
                    timeouts,
                )
                return
            try:
                conn.setblocking(False)
            except OSError:
                conn.close()
                continue
            self.accept_pacing.succeeded()
            accept = self._accept_connection2(  # type: ignore[attr-defined]
                protocol_factory, conn, {"peername": addr}, sslcontext, server, *timeouts
            )
            self.create_task(accept)

    def _resume(
        self,
        protocol_factory: Any,
        sock: socket.socket,
        sslcontext: Any,
        server: Any,
        backlog: int,
        timeouts: tuple[Any, ...],
    ) -> None:
        """Watch the listener again after a pause — unless the server closed meanwhile."""
        if sock.fileno() == -1 or (server is not None and not server.is_serving()):
            return
        self._start_serving(  # type: ignore[attr-defined]
            protocol_factory, sock, sslcontext, server, backlog, *timeouts
        )
