"""Pure: a circuit breaker, so that a dead or slow L2 costs nothing after a few failures.

::

    closed ──K failures in a row──► open ──backoff elapsed──► half-open (one probe)
      ▲                               ▲                            │
      └───────── probe succeeds ──────┼──────── probe fails ───────┘

While it is open, nothing asks L2: a local lookup miss is answered at once (on the
broker's event loop, no thread hop), committed entries are not queued. After the
backoff exactly one caller is let through (:meth:`Breaker.allow`); its success closes
the breaker, its failure opens it for another backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Breaker"]


class Breaker:
    """Thread-safe; ``clock`` is injectable for tests (monotonic seconds)."""

    def __init__(
        self, failures: int, backoff_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1 or backoff_s <= 0:
            raise ValueError("a breaker needs failures ≥ 1 and backoff_s > 0")
        self.failures = failures
        self.backoff_s = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failed = 0  # consecutive failures while closed
        self._opened_at: float | None = None  # None: closed
        self._probing = False  # half-open: one caller is trying
        self.opened = 0  # how many times it opened (for the metrics and tests)

    @property
    def closed(self) -> bool:
        return self._opened_at is None

    def ready(self) -> bool:
        """Whether a call would be let through now (no state change; a cheap read)."""
        opened_at = self._opened_at
        if opened_at is None:
            return True
        return not self._probing and self._clock() >= opened_at + self.backoff_s

    def allow(self) -> bool:
        """Take the right to call L2 now: always while closed; once per backoff while open."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() < self._opened_at + self.backoff_s:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failed = 0
            self._opened_at = None
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            if self._opened_at is not None:  # the probe failed: another backoff
                self._opened_at = self._clock()
                self._probing = False
                return
            self._failed += 1
            if self._failed >= self.failures:
                self._opened_at = self._clock()
                self._failed = 0
                self.opened += 1

    def release(self) -> None:
        """A caller let through did not reach L2 after all (nothing to judge it by)."""
        with self._lock:
            self._probing = False
