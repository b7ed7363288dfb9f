"""PostgreSQL ``LISTEN`` on a connection of its own, in a thread that reconnects.

Used for one thing: every daemon sharing the ledger learns at once that a key
was revoked (migration 0003's trigger notifies :data:`KEYS_CHANNEL` when a
revoking transaction commits), so that a key cache never outlives a
revocation made through another daemon.

The listener says what it knows through three callbacks, all called on its
thread: ``on_up()`` once ``LISTEN`` is in place *and proven* — the listener
notifies itself a probe and waits for it, so that a connection that cannot
receive notifications (a transaction-pooling proxy between the daemon and
PostgreSQL) is never taken for a listening one; from then on, no commit that
notifies can be missed — ``on_event()`` for each notification (probes aside),
``on_down()``
when the connection is lost or the listener stops (notifications may be
missed until the next ``on_up()``). A lost connection is noticed within
``check_s`` plus the TCP timeouts below: between notifications the listener
sends ``SELECT 1``. It reconnects with exponential backoff (0.1 s to 5 s).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

__all__ = ["KEYS_CHANNEL", "Listener"]

logger = logging.getLogger(__name__)

#: The channel migration 0003's trigger on ``api_keys`` notifies.
KEYS_CHANNEL = "maasd_keys"

#: libpq options of the listening connection: a dead server or network is noticed
#: within seconds (the kernel's defaults would take minutes), not only when it closes.
_LIVENESS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 5000,
}
_BACKOFF = (0.1, 5.0)
#: Payloads starting with this are listeners' probes, not news.
PROBE = "probe:"
#: How long a listener waits for its own probe before it gives up on the connection.
PROBE_TIMEOUT_S = 5.0


class Listener:
    """``LISTEN channel`` on its own connection (autocommit), in a daemon thread.

    >>> lst = Listener(store.engine, "maasd_keys", on_up=..., on_event=..., on_down=...)  # doctest: +SKIP
    >>> lst.start(); ...; lst.stop()                                                      # doctest: +SKIP
    """

    def __init__(
        self,
        engine: Engine,
        channel: str,
        *,
        on_up: Callable[[], None],
        on_event: Callable[[], None],
        on_down: Callable[[], None],
        check_s: float = 1.0,
    ) -> None:
        if not channel.isidentifier():
            raise ValueError(f"not a channel name: {channel!r}")
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        self._connect_args: tuple[list[Any], dict[str, Any]] = (
            list(args),
            {**kwargs, **_LIVENESS, "application_name": "maasd-listener", "autocommit": True},
        )
        self.channel = channel
        self._on_up, self._on_event, self._on_down = on_up, on_event, on_down
        self._check_s = check_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Whether LISTEN is in place now (read by tests and health reports).
        self.listening = False

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="maasd-listener", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening; returns within about ``check_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        delay = _BACKOFF[0]
        while not self._stop.is_set():
            try:
                self._listen()
                delay = _BACKOFF[0]  # it was up: the next attempt comes at once
            except Exception as exc:
                logger.warning(
                    "listener on %s lost its connection (%s); retrying in %.1f s",
                    self.channel,
                    exc,
                    delay,
                )
                self._stop.wait(delay)
                delay = min(delay * 2, _BACKOFF[1])

    def _listen(self) -> None:
        import psycopg

        args, kwargs = self._connect_args
        with psycopg.connect(*args, **kwargs) as conn:
            conn.execute(f"LISTEN {self.channel}")
            self._prove(conn)
            self.listening = True
            try:
                self._on_up()
                while not self._stop.is_set():
                    for n in conn.notifies(timeout=self._check_s):
                        if not n.payload.startswith(PROBE):
                            self._on_event()
                    conn.execute("SELECT 1")  # still there? raises when it is not
            finally:
                self.listening = False
                self._on_down()

    def _prove(self, conn: Any) -> None:
        """Notify a probe and wait for it: a connection that does not hear it is no listener."""
        probe = PROBE + os.urandom(8).hex()
        conn.execute("SELECT pg_notify(%s, %s)", (self.channel, probe))
        for n in conn.notifies(timeout=PROBE_TIMEOUT_S):
            if n.payload == probe:
                return
        raise RuntimeError(
            f"LISTEN {self.channel} did not hear its own notification in {PROBE_TIMEOUT_S:g} s "
            "(a transaction-pooling proxy in front of PostgreSQL?); key caching stays off"
        )
