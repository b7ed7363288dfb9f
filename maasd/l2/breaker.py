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

__all__ = ["Breaker", "TenantBreakers"]


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


class TenantBreakers:
    """One :class:`Breaker` per tenant whose L2 calls fail, so that a tenant's own
    failures (its values too large to move within their timeout, say) stop its own calls
    and nobody else's. Made on a tenant's first failure, dropped on its next success;
    at most ``max_tenants`` at once (past that, the oldest is dropped: it starts over)."""

    def __init__(
        self,
        failures: int,
        backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_tenants: int = 4096,
    ) -> None:
        Breaker(failures, backoff_s)  # the same checks of the arguments
        self._args = (failures, backoff_s, clock)
        self._max = max_tenants
        self._lock = threading.Lock()
        self._of: dict[str, Breaker] = {}
        self.opened = 0  # tenants' breakers opened (metrics, tests)

    def allow(self, tenant: str) -> bool:
        b = self._of.get(tenant)
        return b is None or b.allow()

    def ready(self, tenant: str) -> bool:
        b = self._of.get(tenant)
        return b is None or b.ready()

    def success(self, tenant: str) -> None:
        with self._lock:
            self._of.pop(tenant, None)

    def clear(self) -> None:
        """Forget every tenant's failures (the host's breaker closed after an outage: the
        calls that failed during it were the service's, not their tenants')."""
        with self._lock:
            self._of.clear()

    def release(self, tenant: str) -> None:
        b = self._of.get(tenant)
        if b is not None:
            b.release()

    def failure(self, tenant: str) -> bool:
        """Count a failure of ``tenant``'s call; True if its breaker opened now."""
        with self._lock:
            b = self._of.get(tenant)
            if b is None:
                if len(self._of) >= self._max:
                    self._of.pop(next(iter(self._of)))
                b = self._of[tenant] = Breaker(*self._args)
        was = b.opened
        b.failure()
        if b.opened > was:
            self.opened += 1
            return True
        return False
