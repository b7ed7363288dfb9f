"""The write-behind queue: committed entries waiting for their turn to go to L2.

Bounded twice — at most ``max_entries`` jobs and ``max_bytes`` bytes of entries — and
never blocking the one who offers: a job that does not fit is refused, and its entry is
simply not written (the caller counts it). A job names an entry, it does not hold its
bytes: the writer reads them when the job's turn comes, if the entry is still there.

Fair between tenants: one tenant's jobs hold at most :data:`TENANT_SHARE` of either
bound, so a tenant flooding L2 with large entries fills its own share and has its own
further writes refused while another's still fit; and the jobs are taken round-robin
across tenants (FIFO within one), so another's small write waits for at most one of the
flooder's writes, not for all of its backlog.

A tenant deleted (:meth:`WriteQueue.drop_tenant`) has its jobs taken out, and is
remembered: its further offers are refused, and the writer drops what it was storing
for it (:meth:`WriteQueue.deleted`). An entry released before its turn has its job taken
out (:meth:`WriteQueue.drop_buffer`).

Deletes — of the values that released entries wrote (:mod:`maasd.l2.ends`) — wait in a
lane of their own, bounded by ``max_deletes``, and go first: a delete is one small
round trip, and a flood of writes must not hold it back (nor a full write queue refuse
it).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

__all__ = ["TENANT_SHARE", "Job", "WriteQueue"]

#: The part of each of the queue's bounds one tenant's jobs may hold.
TENANT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Job:
    """Write the committed entry ``buffer_id`` (``size`` bytes) to L2 under its tenant and
    key; or, with ``forget``, drop the value L2 holds under them (it was refused); or,
    with a ``digest``, drop that value only if it is still there (its entry was released;
    ``tries``: the calls that failed so far)."""

    tenant_id: str
    key: str
    buffer_id: str = ""
    size: int = 0
    forget: bool = False
    digest: bytes = b""
    tries: int = 0


class WriteQueue:
    """Thread-safe; :meth:`offer` never waits. FIFO per tenant, round-robin across them."""

    def __init__(self, max_entries: int, max_bytes: int, max_deletes: int = 4096) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_deletes = max_deletes
        self._deletes: collections.deque[Job] = collections.deque()
        self.tenant_entries = max(1, int(max_entries * TENANT_SHARE))
        self.tenant_bytes = max(1, int(max_bytes * TENANT_SHARE))
        # tenant → its jobs; the dict's order is the round-robin's (a tenant served goes last)
        self._jobs: dict[str, collections.deque[Job]] = {}
        self._bytes: dict[str, int] = {}
        self._count = 0
        self._total = 0
        self._closed = False
        self._cond = threading.Condition()
        self._deleted: set[str] = set()  # tenants deleted while this runs (never reused)

    @property
    def entries(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._total

    @property
    def deletes(self) -> int:
        return len(self._deletes)

    def offer(self, job: Job) -> bool:
        """Queue ``job`` if it fits both bounds and its tenant's share of them (and the
        queue is open); False otherwise."""
        t = job.tenant_id
        with self._cond:
            mine = self._jobs.get(t)
            held = 0 if mine is None else len(mine)
            held_bytes = self._bytes.get(t, 0)
            if (
                self._closed
                or t in self._deleted
                or self._count >= self.max_entries
                or self._total + job.size > self.max_bytes
                or held >= self.tenant_entries
                or (held and held_bytes + job.size > self.tenant_bytes)
            ):
                return False
            if mine is None:
                mine = self._jobs[t] = collections.deque()
            mine.append(job)
            self._bytes[t] = held_bytes + job.size
            self._count += 1
            self._total += job.size
            self._cond.notify()
            return True

    def offer_delete(self, job: Job, *, first: bool = False) -> bool:
        """Queue a delete (``job.digest``) in its lane, last — or ``first`` (one tried
        again); False if the lane is full or the queue closed."""
        with self._cond:
            if self._closed or len(self._deletes) >= self.max_deletes:
                return False
            if first:
                self._deletes.appendleft(job)
            else:
                self._deletes.append(job)
            self._cond.notify()
            return True

    def take(self, timeout: float, *, deletes: bool = True) -> Job | None:
        """The next job — a delete first, if ``deletes`` (L2 is answering), else the oldest
        write of the tenant whose turn it is — waiting up to ``timeout`` s for one; None
        if none came (or closed)."""
        with self._cond:
            if not self._count and not (deletes and self._deletes) and not self._closed:
                self._cond.wait(timeout)
            if deletes and self._deletes:
                return self._deletes.popleft()
            if not self._count:
                return None
            tenant = next(iter(self._jobs))
            mine = self._jobs.pop(tenant)
            job = mine.popleft()
            if mine:
                self._jobs[tenant] = mine  # to the back of the round
                self._bytes[tenant] -= job.size
            else:
                del self._bytes[tenant]
            self._count -= 1
            self._total -= job.size
            return job

    def drop_tenant(self, tenant_id: str) -> int:
        """The tenant was deleted: its jobs taken out (how many), its offers refused."""
        with self._cond:
            self._deleted.add(tenant_id)
            mine = self._jobs.pop(tenant_id, None) or ()
            self._count -= len(mine)
            self._total -= self._bytes.pop(tenant_id, 0)
            return len(mine)

    def drop_buffer(self, tenant_id: str, buffer_id: str) -> bool:
        """The entry ``buffer_id`` was released: its write taken out; whether one was queued."""
        with self._cond:
            mine = self._jobs.get(tenant_id)
            job = next((j for j in mine or () if j.buffer_id == buffer_id and not j.forget), None)
            if mine is None or job is None:
                return False
            mine.remove(job)
            if mine:
                self._bytes[tenant_id] -= job.size
            else:
                del self._jobs[tenant_id], self._bytes[tenant_id]
            self._count -= 1
            self._total -= job.size
            return True

    def deleted(self, tenant_id: str) -> bool:
        """Whether the tenant was deleted (:meth:`drop_tenant`)."""
        return tenant_id in self._deleted

    def close(self) -> list[Job]:
        """Refuse further jobs, wake the taker; returns the jobs left (not to be done),
        the deletes among them."""
        with self._cond:
            self._closed = True
            left = [job for jobs in self._jobs.values() for job in jobs]
            left.extend(self._deletes)
            self._deletes.clear()
            self._jobs.clear()
            self._bytes.clear()
            self._count = self._total = 0
            self._cond.notify_all()
            return left
