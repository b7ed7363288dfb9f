"""The :class:`Broker`: the socket file, the event loop thread, the slow pool, health.

Lifecycle::

    start()   remove a stale socket file (refuse a live one), bind, chmod/chown,
              listen; start the slow-pool threads and the loop thread
    healthy() (ok, reason): the loop is turning and can accept
    stop()    stop the loop (it closes every connection, dropping its attachments),
              let running slow operations finish, unlink the socket file —
              within STOP_TIMEOUT_S whatever the peers do
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable

from .dispatch import UseCases
from .limits import Limits
from .loop import EventLoop
from .pacing import LogLimiter
from .sink import discard_socket
from .slowpool import SlowPool

__all__ = ["Broker"]

logger = logging.getLogger("maasd.broker")

#: stop() returns within about this long, whatever peers or slow operations do.
STOP_TIMEOUT_S = 5.0
#: The loop turns at least once a second; not turning for this long means it is stuck.
STALL_UNHEALTHY_S = 10.0
#: Accepts failing (EMFILE, …) without a success for this long make the broker unhealthy.
ACCEPT_FAILING_UNHEALTHY_S = 5.0
#: One log line per kind of peer-caused event per this many seconds.
LOG_INTERVAL_S = 10.0


class Broker:
    """Serve worker handles on a Unix stream socket at ``path`` (:mod:`maasd.protocol`).

    ``service`` is the core's use-case objects the broker calls
    (:class:`maasd.broker.dispatch.UseCases`: ``Service.socket_use_cases()``). ``mode`` (and ``group``, a
    gid, when given) is applied to the socket file before it accepts
    connections. ``limits`` bounds connections, deadlines and slow work
    (defaults: :class:`Limits`). ``events`` (for metrics) is told ``shed``,
    ``refused``, ``hello_timeout`` or ``send_timeout`` each time a connection ends
    so, and ``fds_refused`` each time the kernel refuses a reply's fds.

    Example::

        broker = Broker(svc.socket_use_cases(), "/var/lib/maasd/maasd.sock",
                        limits=Limits.from_settings(s))
        broker.start()
        ok, why = broker.healthy()
        broker.stop()
    """

    def __init__(
        self,
        service: UseCases,
        path: str,
        mode: int = 0o660,
        group: int | None = None,
        limits: Limits | None = None,
        events: Callable[[str], None] | None = None,
    ) -> None:
        self.events = events
        self.service = service
        self.path = os.fspath(path)
        self.mode = mode
        self.group = group
        self.limits = limits or Limits()
        self.log = LogLimiter(logger, LOG_INTERVAL_S)
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._loop: EventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: SlowPool | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket, set its mode, start serving (raises if any of it fails)."""
        if self._listener is not None:
            raise RuntimeError("broker already started")
        sock = self._bind()
        pool = SlowPool(self.limits.slow_workers, self.limits.slow_per_tenant)
        try:
            pool.start()
            loop = EventLoop(sock, self.service, self.limits, pool, self.log, self.events)
            # A revocation made on another thread (REST, or another daemon's, heard by the
            # ledger listener) wakes the loop, so idle connections of the key are cut at
            # once instead of at the loop's next turn (up to a second later).
            self.service.auth.watch_revocations(loop.wake)
            # A released entry's holders are told to let go (its memory counts until then).
            self.service.entries.watch_releases(loop.pushes.released)
            thread = threading.Thread(target=loop.run, name="maasd-broker", daemon=True)
            thread.start()
        except BaseException:
            pool.stop(timeout_s=1.0)
            sock.close()
            self._unlink_own_socket()
            raise
        self._listener, self._pool, self._loop, self._thread = sock, pool, loop, thread
        logger.info("broker listening", extra={"path": self.path, "mode": f"{self.mode:o}"})

    def stop(self) -> None:
        """Close every connection (dropping its attachments), unlink the socket. Idempotent."""
        if self._listener is None:
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        assert self._loop is not None
        assert self._thread is not None
        assert self._pool is not None
        self._loop.stop()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("broker loop did not stop in time", extra={"path": self.path})
        if not self._pool.stop(max(0.0, deadline - time.monotonic())):
            logger.warning(
                "slow broker operations still running at stop", extra={"path": self.path}
            )
        discard_socket(self._listener)  # connections never accepted may hold fds
        self._listener = None
        self._unlink_own_socket()
        logger.info("broker stopped", extra={"path": self.path})

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- state -----------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Connections open now (admitted, not yet closed)."""
        loop = self._loop
        return 0 if loop is None or self._listener is None else len(loop.table)

    def healthy(self) -> tuple[bool, str]:
        """``(ok, reason)``: false when the socket cannot serve workers.

        That is: not started or stopped, the loop thread ended, the loop has not
        turned for :data:`STALL_UNHEALTHY_S` (a service call stuck on it), accepts
        have failed for :data:`ACCEPT_FAILING_UNHEALTHY_S` (out of fds), the kernel
        refuses the fds of replies (ETOOMANYREFS, lately), or the slow-pool threads
        are gone.
        """
        loop, thread, pool = self._loop, self._thread, self._pool
        if self._listener is None or loop is None or thread is None or pool is None:
            return False, "the worker socket is not serving"
        if not thread.is_alive():
            return False, f"the worker socket's event loop ended ({loop.crash or 'stopped'})"
        now = time.monotonic()
        stalled = now - loop.tick
        if stalled > STALL_UNHEALTHY_S:
            return False, f"the worker socket's event loop has not turned for {stalled:.0f} s"
        failing = loop.acceptor.failing_for(now)
        if failing > ACCEPT_FAILING_UNHEALTHY_S:
            return False, (
                f"the worker socket has not accepted a connection for {failing:.0f} s: "
                f"{loop.acceptor.last_error}"
            )
        refusal = loop.outbox.inflight.refusal(now)
        if refusal is not None:
            return False, refusal
        if pool.alive < pool.workers:
            return False, f"{pool.workers - pool.alive} of the socket's slow-op threads ended"
        return True, f"serving {len(loop.table)} connections on {self.path}"

    # --- the socket file -------------------------------------------------------------

    def _bind(self) -> socket.socket:
        self._remove_stale_socket()
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            # chmod before listen(): until listen() nobody can connect, so there
            # is no window in which the umask's mode is the effective one.
            os.chmod(self.path, self.mode)
            if self.group is not None:  # the workers' group: they connect through it (0660)
                os.chown(self.path, -1, self.group)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(self.path)
        except OSError:
            # Nobody listening: left behind by a crashed daemon.
            logger.info("removing stale socket", extra={"path": self.path})
            os.unlink(self.path)
            return
        finally:
            probe.close()
        raise FileExistsError(f"another process is serving {self.path}")

    def _unlink_own_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # the next start finds it stale and replaces it
                logger.warning(
                    "cannot remove the socket file", extra={"path": self.path, "error": str(exc)}
                )
