"""The demotion writer: one thread writing queued jobs in order, bounded by bytes in flight.

``reserve(n)`` takes ``n`` bytes of the bound or says no (the caller drops the entry rather
than wait: an eviction never stalls on the disk); ``submit`` queues the job that uses
them, ``cancel`` gives them back unused. The bytes are given back when the job is done.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Writer"]

logger = logging.getLogger(__name__)


class Writer:
    def __init__(self, limit_bytes: int, name: str = "maasd-disk") -> None:
        self._limit = limit_bytes
        self._name = name
        self._inflight = 0
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def inflight(self) -> int:
        return self._inflight

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def reserve(self, n: int) -> bool:
        with self._cond:
            if self._stopping or self._inflight + n > self._limit:
                return False
            self._inflight += n
            return True

    def cancel(self, n: int) -> None:
        with self._cond:
            self._inflight -= n

    def submit(self, n: int, job: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append((n, job))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                n, job = self._queue.popleft()
            try:
                job()
            except Exception:
                logger.exception("a disk tier write failed")
            finally:
                self.cancel(n)
