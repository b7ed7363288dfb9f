"""The write-behind queue: committed entries waiting for their turn to go to L2.

Bounded twice — at most ``max_entries`` jobs and ``max_bytes`` bytes of entries — and
never blocking the one who offers: a job that does not fit is refused, and its entry is
simply not written (the caller counts it). A job names an entry, it does not hold its
bytes: the writer reads them when the job's turn comes, if the entry is still there.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

__all__ = ["Job", "WriteQueue"]


@dataclass(frozen=True, slots=True)
class Job:
    """Write the committed entry ``buffer_id`` (``size`` bytes) to L2 under its tenant and
    key; or, with ``forget``, drop the value L2 holds under them (it was refused)."""

    tenant_id: str
    key: str
    buffer_id: str = ""
    size: int = 0
    forget: bool = False


class WriteQueue:
    """FIFO, thread-safe; :meth:`offer` never waits."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._jobs: collections.deque[Job] = collections.deque()
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def entries(self) -> int:
        return len(self._jobs)

    @property
    def bytes(self) -> int:
        return self._bytes

    def offer(self, job: Job) -> bool:
        """Queue ``job`` if it fits both bounds (and the queue is open); False otherwise."""
        with self._cond:
            if (
                self._closed
                or len(self._jobs) >= self.max_entries
                or self._bytes + job.size > self.max_bytes
            ):
                return False
            self._jobs.append(job)
            self._bytes += job.size
            self._cond.notify()
            return True

    def take(self, timeout: float) -> Job | None:
        """The oldest job, waiting up to ``timeout`` s for one; None if none came (or closed)."""
        with self._cond:
            if not self._jobs and not self._closed:
                self._cond.wait(timeout)
            if not self._jobs:
                return None
            job = self._jobs.popleft()
            self._bytes -= job.size
            return job

    def close(self) -> list[Job]:
        """Refuse further jobs, wake the taker; returns the jobs left (not to be done)."""
        with self._cond:
            self._closed = True
            left = list(self._jobs)
            self._jobs.clear()
            self._bytes = 0
            self._cond.notify_all()
            return left
