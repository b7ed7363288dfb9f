"""A fixed set of threads for the broker's slow operations, shared fairly among tenants.

Fast operations (attach, detach) run on the broker's event loop: no thread hop.
Operations that may block for long — a renew that writes the ledger, later a
reserve that prefaults gigabytes or a commit that copies — run here, so that
they never hold up another connection. The threads are started once, with the
broker: a thread limit reached later cannot stop the pool from working.

Fairness: jobs queue per key (the tenant), and a free thread takes the oldest
job of the next key in turn whose running jobs are below ``per_key``. One
tenant with many slow jobs therefore cannot occupy every thread, and cannot
make another tenant's job wait behind all of its own.

    >>> import threading
    >>> done = threading.Event()
    >>> pool = SlowPool(workers=2, per_key=1)
    >>> pool.start()
    >>> pool.submit("tenant-a", done.set)
    >>> done.wait(5)
    True
    >>> pool.stop(timeout_s=5)
    True
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["SlowPool"]

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class SlowPool:
    """``workers`` threads; at most ``per_key`` jobs of one key run at once."""

    def __init__(self, workers: int, per_key: int, name: str = "maasd-broker-slow") -> None:
        self.workers = workers
        self.per_key = per_key
        self.name = name
        self._cv = threading.Condition()
        self._queues: collections.OrderedDict[str, collections.deque[Job]] = (
            collections.OrderedDict()
        )
        self._running: collections.Counter[str] = collections.Counter()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> None:
        """Start every thread now (raises if the system refuses one; none is left running)."""
        try:
            for i in range(self.workers):
                t = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:
            self.stop(timeout_s=1.0)
            raise

    def submit(self, key: str, job: Job) -> None:
        """Queue ``job`` under ``key``. It must not raise (exceptions are logged and dropped)."""
        with self._cv:
            self._queues.setdefault(key, collections.deque()).append(job)
            self._cv.notify()

    @property
    def queued(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    @property
    def alive(self) -> int:
        """Threads still running (all of them, unless the pool is stopping)."""
        return sum(t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float) -> bool:
        """Let running jobs finish, drop queued ones; True if every thread ended in time."""
        with self._cv:
            self._stopping = True
            self._queues.clear()
            self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _next(self) -> tuple[str, Job] | None:
        """The next job by turn among keys below ``per_key`` (caller holds the lock)."""
        for key, queue in self._queues.items():
            if self._running[key] < self.per_key:
                job = queue.popleft()
                if queue:
                    self._queues.move_to_end(key)  # its next job waits for the others' turn
                else:
                    del self._queues[key]
                self._running[key] += 1
                return key, job
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                item = None
                while not self._stopping and (item := self._next()) is None:
                    self._cv.wait()
                if item is None:
                    return
            key, job = item
            try:
                job()
            except Exception:  # the pool outlives any one job
                logger.exception("slow broker job failed", extra={"key": key})
            finally:
                with self._cv:
                    self._running[key] -= 1
                    if self._running[key] <= 0:
                        del self._running[key]
                    # A key below its cap again may have jobs waiting.
                    self._cv.notify()
