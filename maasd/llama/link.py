"""``Link``: a ``maasd.client.Worker`` that is opened on first use and re-opened after it broke.

A cache in front of llama.cpp must never fail a completion because maasd is down, was
restarted, or revoked the key: while the link is down every operation is a miss, and
the connection is tried again after a back-off (0.5 s, doubling, at most 30 s). Each
change between up and down is logged once, loudly, and reported to ``on_change``.

What breaks a link (the socket can no longer be trusted): ``ConnectionFailed``,
``ProtocolError``, ``Unauthorized`` (the daemon closes the connection after a 401) and
``OSError``. Any other answer of the daemon (a miss, a duplicate key, a full quota or
pool) is a refusal of one request: the link stays up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from maasd.client import errors as ce
from maasd.client.worker import Worker

__all__ = ["BREAKING", "Link"]

logger = logging.getLogger(__name__)

#: errors after which the connection is closed and opened again later
BREAKING: tuple[type[BaseException], ...] = (
    ce.ConnectionFailed,
    ce.ProtocolError,
    ce.Unauthorized,
    OSError,
)

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0


class Link:
    """One worker connection to maasd, opened lazily; thread-safe.

    ``open_worker(socket_path, api_key)`` makes the connection (default:
    :class:`maasd.client.Worker` itself). ``on_change(up, why)`` is called
    when the link goes up or down (not on every retry).
    """

    def __init__(
        self,
        socket_path: str,
        api_key: str,
        *,
        open_worker: Callable[[str, str], Worker] = Worker,
        on_change: Callable[[bool, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self._key = api_key
        self._open = open_worker
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._retry_at = 0.0
        self._backoff = FIRST_RETRY_S
        self._up: bool | None = None  # None: never tried
        self._closed = False
        self.why = "not connected yet"

    @property
    def up(self) -> bool:
        """Whether the last attempt (or use) found maasd there."""
        return bool(self._up)

    def get(self) -> Worker | None:
        """The open worker, or ``None`` while maasd is unreachable (within the back-off)."""
        with self._lock:
            if self._worker is not None and not self._worker.closed:
                return self._worker
            if self._closed or self._clock() < self._retry_at:
                return None
            try:
                self._worker = self._open(self.socket_path, self._key)
            except BREAKING + (ce.MaasdClientError,) as exc:
                self._down_locked(f"cannot connect to maasd at {self.socket_path}: {exc}")
                return None
            self._backoff = FIRST_RETRY_S
            self._set_locked(True, f"connected to maasd at {self.socket_path}")
            return self._worker

    def failed(self, exc: BaseException) -> None:
        """A request raised ``exc``: close the connection if it broke it."""
        if isinstance(exc, BREAKING):
            with self._lock:
                self._close_worker_locked()
                self._down_locked(f"lost maasd at {self.socket_path}: {exc}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close_worker_locked()

    # -- internals (lock held)

    def _close_worker_locked(self) -> None:
        w, self._worker = self._worker, None
        if w is not None:
            with contextlib.suppress(Exception):
                w.close()

    def _down_locked(self, why: str) -> None:
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_RETRY_S)
        self._set_locked(False, why)

    def _set_locked(self, up: bool, why: str) -> None:
        changed = self._up is not up
        self._up, self.why = up, why
        if not changed:
            return
        if up:
            logger.info("prefix sharing on: %s", why)
        else:
            logger.warning("PREFIX SHARING OFF: %s (tried again on later requests)", why)
        if self._on_change is not None:
            self._on_change(up, why)
