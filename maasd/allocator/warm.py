"""Keeping the pools' warm stock filled, off the request path.

A :class:`Warmer` is one background thread for all of a daemon's pools. Woken by
every reserve of a pool with a warm budget (and once a second regardless), it
takes :meth:`~maasd.allocator.pool.MemoryPool.refill_step` after step over the pools
— one region per pool per round, so no pool waits for another's big region —
until none has anything left to do.

It also watches the host's memory: while ``MemAvailable`` is below
``min_available`` it gives the stock of every ``memfd`` pool back and makes
none; it refills only while ``MemAvailable`` would stay above twice that
after the new region (the gap keeps it from shedding and refilling in turns).
Huge pages are not part of ``MemAvailable``: a ``hugetlb`` pool refills while
the kernel has free huge pages (a refused one is logged and retried on the next
round), and a reserve that finds none gives the other pools' ``hugetlb`` stock
back first (:meth:`Warmer.shed`).

Its owner starts it and stops it; a pool registers itself (``MemoryPool(warmer=...)``)
and leaves at :meth:`~maasd.allocator.pool.MemoryPool.close`. ``may_grow`` (the daemon's
region budget, :mod:`maasd.core.limits`) says whether one more region may be made:
every region holds an open file and a mapping of the daemon, stocked or not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from maasd.allocator import _sys
from maasd.bounds import Backing

logger = logging.getLogger(__name__)

__all__ = ["Stocked", "Warmer", "default_min_available", "mem_available"]


class Stocked(Protocol):
    """What the warmer asks of a pool (:class:`~maasd.allocator.pool.MemoryPool` is one)."""

    @property
    def backing(self) -> Backing: ...

    def refill_step(self, room: int | None = None) -> bool: ...

    def shed(self, *, now: bool = False) -> int: ...

    def interrupt_refill(self) -> None: ...


MiB = 1 << 20


def _meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes, or ``None`` when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available() -> int | None:
    """The host's ``MemAvailable`` in bytes (``None`` if unknown: no limit is applied)."""
    return _meminfo("MemAvailable")


def default_min_available() -> int:
    """The default threshold: 1/16 of the host's memory, at least 512 MiB."""
    return max(512 * MiB, (_meminfo("MemTotal") or 0) // 16)


def _at_once(fn: Callable[[], object]) -> None:
    fn()


class Warmer:
    """One thread that refills every registered pool's warm stock. Thread-safe.

    ``send_wake(fn)`` sends a wake-up (``fn`` sets the thread's event): at once by
    default. The daemon passes :func:`maasd.core.answered.after_answer`, so that the
    refill a request's reserve causes starts once that request is answered — the
    thread it wakes would otherwise compete with the rest of the request for the
    interpreter and, on a busy host, a CPU.
    """

    def __init__(
        self,
        *,
        min_available: int | None = None,
        available: Callable[[], int | None] = mem_available,
        interval_s: float = 1.0,
        may_grow: Callable[[], bool] = lambda: True,
        send_wake: Callable[[Callable[[], object]], None] = _at_once,
    ) -> None:
        self._send_wake = send_wake
        #: Below this much ``MemAvailable`` the memfd stock is given back.
        self.min_available = default_min_available() if min_available is None else min_available
        self._available = available
        self._interval_s = interval_s
        self._may_grow = may_grow
        self._lock = threading.Lock()
        self._pools: list[Stocked] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def add(self, pool: Stocked) -> None:
        with self._lock:
            if pool not in self._pools:
                self._pools.append(pool)
        self.wake()

    def remove(self, pool: Stocked) -> None:
        with self._lock:
            self._pools = [p for p in self._pools if p is not pool]

    def pools(self) -> list[Stocked]:
        with self._lock:
            return list(self._pools)

    def wake(self) -> None:
        """Have the thread look at the pools (a reserve changed the demand or the stock):
        now, or once the current request is answered (``send_wake``)."""
        self._send_wake(self._wake.set)

    def start(self) -> None:
        """Start the thread (idempotent)."""
        with self._lock:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="maasd-warm", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread, stopping a refill in flight (idempotent). The stock stays."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._wake.set()
        for pool in self.pools():
            pool.interrupt_refill()
        thread.join()

    def shed(self, backing: Backing | None = None) -> int:
        """Give back (and close, before returning) the stock of every pool of ``backing``
        (all when ``None``); returns the bytes freed. For a reserve the kernel refused."""
        freed = sum(pool.shed(now=True) for pool in self.pools() if backing in (None, pool.backing))
        if freed:
            logger.info("warm stock: %d bytes given back (memory short)", freed)
        return freed

    def run_once(self) -> bool:
        """One round over the pools; ``True`` if any pool's stock changed."""
        available = self._available()
        if available is not None and available < self.min_available:
            freed = sum(pool.shed() for pool in self.pools() if pool.backing == "memfd")
            if freed:
                logger.warning(
                    "warm stock: %d bytes given back, MemAvailable %d < %d",
                    freed,
                    available,
                    self.min_available,
                )
            return False
        changed = False
        for pool in self.pools():
            if self._stop.is_set():
                break
            room = None
            if pool.backing == "memfd" and (available := self._available()) is not None:
                room = available - 2 * self.min_available
            if not self._may_grow():
                room = 0  # no new region; a surplus is still given back
            changed |= pool.refill_step(room)
        return changed

    def _run(self) -> None:
        _sys.set_thread_name("maasd-warm")
        while not self._stop.is_set():
            self._wake.clear()
            try:
                busy = self.run_once()
            except Exception:
                logger.exception("warm stock refill failed; retrying")
                busy = False
            if not busy:
                self._wake.wait(self._interval_s)
