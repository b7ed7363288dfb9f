"""systemd's service notification protocol (``sd_notify(3)``), and the daemon's use of it.

The protocol is one datagram of ``KEY=value`` lines sent to the ``AF_UNIX`` socket
named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). It is
a few lines, so it is written here rather than taken from a package (``sdnotify``
has not changed since 2017; ``systemd-python`` and ``cysystemd`` link libsystemd).

What ``maasd serve`` says, with ``Type=notify`` and ``WatchdogSec=`` in its unit
(``deploy/systemd/maasd.service``)::

    READY=1       once the worker socket is open and REST listens (so /healthz answers)
    STATUS=…      what it serves, for ``systemctl status``
    WATCHDOG=1    every half of ``$WATCHDOG_USEC``, while /healthz's checks pass *and*
                  the event loop runs a callback; when one fails it stops pinging, so
                  systemd kills and restarts it after ``WatchdogSec``
    STOPPING=1    on SIGTERM/SIGINT, before it drains

Without ``$NOTIFY_SOCKET`` (not under systemd) every call is a no-op.

Example::

    systemd = Systemd.from_env(health)      # health: () -> {component: (ok, why)}
    ...                                     # serving now
    systemd.ready(loop, status="serving on 127.0.0.1:7878")
    ...
    systemd.stopping()
    systemd.close()
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

__all__ = ["Notifier", "Systemd", "Watchdog", "watchdog_interval"]

logger = logging.getLogger(__name__)

#: ``() -> {component: (ok, why)}``: the checks behind /healthz.
HealthCheck = Callable[[], Mapping[str, tuple[bool, str]]]


class Notifier:
    """Sends ``sd_notify`` datagrams to one address; a no-op when the address is ``None``."""

    def __init__(self, address: str | None) -> None:
        if address and address.startswith("@"):
            address = "\0" + address[1:]  # the abstract namespace
        elif address and not address.startswith("/"):
            logger.warning("NOTIFY_SOCKET=%r is neither a path nor @abstract; ignored", address)
            address = None
        self.address = address or None
        # Re-entrant: STOPPING=1 is sent from a signal handler, which may run on the main
        # thread while that thread is inside send().
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        return cls((os.environ if env is None else env).get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``"READY=1"``, …) as one datagram. False when disabled or refused:
        a notification that cannot be sent never stops the daemon."""
        if self.address is None:
            return False
        data = "\n".join(fields).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                self._sock.sendto(data, self.address)
            except OSError as e:
                logger.warning("sd_notify %s to %r failed: %s", fields, self.address, e)
                return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between two ``WATCHDOG=1`` (half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3)
    advises), or ``None`` when systemd watches no process or another one (``$WATCHDOG_PID``)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


class Watchdog:
    """A thread that sends ``WATCHDOG=1`` every ``interval`` seconds while ``healthy()`` says so.

    ``healthy() -> (ok, why)``; a check that raises counts as unhealthy. A change of state
    is logged once (not at every tick).
    """

    def __init__(
        self, notifier: Notifier, interval: float, healthy: Callable[[], tuple[bool, str]]
    ) -> None:
        self._notifier = notifier
        self._interval = interval
        self._healthy = healthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maasd-watchdog", daemon=True)
        self._was_ok = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        self.tick()
        while not self._stop.wait(self._interval):
            self.tick()

    def tick(self) -> bool:
        """One check; pings systemd when it passes. Returns whether it did."""
        try:
            ok, why = self._healthy()
        except Exception as e:
            ok, why = False, f"the check itself failed: {type(e).__name__}: {e}"
        if ok != self._was_ok:
            if ok:
                logger.info("healthy again: watchdog pings resume")
            else:
                logger.error("unhealthy (%s): watchdog pings stop, systemd will restart", why)
            self._was_ok = ok
        if ok:
            self._notifier.send("WATCHDOG=1")
            return True
        return False


def loop_answers(loop: asyncio.AbstractEventLoop, timeout: float) -> tuple[bool, str]:
    """Whether ``loop`` runs a callback within ``timeout`` seconds (it is not stuck)."""
    done = threading.Event()
    try:
        loop.call_soon_threadsafe(done.set)
    except RuntimeError:  # closed
        return False, "the REST event loop is closed"
    if not done.wait(timeout):
        return False, f"the REST event loop did not run a callback within {timeout:.1f} s"
    return True, ""


class Systemd:
    """What ``maasd serve`` tells systemd: ready, alive (watchdog), stopping."""

    def __init__(
        self, notifier: Notifier, health: HealthCheck | None, interval: float | None
    ) -> None:
        self.notifier = notifier
        self._health = health
        self._interval = interval
        self._watchdog: Watchdog | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_env(cls, health: HealthCheck | None = None) -> Systemd:
        return cls(Notifier.from_env(), health, watchdog_interval())

    def healthy(self) -> tuple[bool, str]:
        """/healthz's component checks, and the REST event loop runs callbacks."""
        if self._loop is not None:
            ok, why = loop_answers(self._loop, max(self._interval or 1.0, 0.5))
            if not ok:
                return ok, why
        failing = {
            name: why
            for name, (ok, why) in (self._health() if self._health else {}).items()
            if not ok
        }
        if failing:
            return False, "; ".join(
                f"{name}: {why or 'unhealthy'}" for name, why in failing.items()
            )
        return True, ""

    def ready(self, loop: asyncio.AbstractEventLoop | None = None, status: str = "") -> None:
        """Everything serves: say READY=1 and start the watchdog (when systemd asked for one)."""
        self._loop = loop
        self.notifier.send("READY=1", *([f"STATUS={status}"] if status else []))
        if self.notifier.enabled and self._interval is not None and self._watchdog is None:
            self._watchdog = Watchdog(self.notifier, self._interval, self.healthy)
            self._watchdog.start()

    def stopping(self) -> None:
        self.notifier.send("STOPPING=1", "STATUS=stopping: finishing requests, checkpointing")

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self.notifier.close()
