"""What this daemon holds in memory: live pools, live regions, per-buffer locks,
attachments and the batch of uses not yet written to the ledger.

The ledger says what *should* exist; the runtime holds what *does* in this
process — a buffer's memfd mapping exists only here. Every part of
:mod:`maasd.core` reaches that state through :class:`Runtime`, and only through
its methods: none of them keeps a reference to the dicts behind them.

Locks, and the order they are taken in
--------------------------------------

1. **A buffer's lock** (:meth:`Runtime.buffer_lock`), outermost. Held while a
   region's pages are read or moved through the daemon's mapping (checkpoint,
   pin, a placement count), and while the region is taken out to be released —
   so a release waits for a checkpoint in progress instead of unmapping under
   it. Held across I/O and ledger calls. Never taken while holding any other lock.
2. **The regions lock**: the regions and the buffer locks maps. Held only for
   dict operations and the ``dup(2)`` of an fd (so that a region being handed
   to a worker cannot be taken out and closed meanwhile).
3. **Leaf locks**, each guarding one thing and never held while taking another:
   the pools lock (the live pools map), the attachments lock, the uses lock —
   and outside this module the key cache's lock (:mod:`maasd.core.auth`), each
   allocator pool's lock, and the store's SQLite writer queue.

So a thread may go 1 → 2, 1 → a leaf, 2 → nothing; nothing waits for a lock
while holding one taken later in this order, which rules out deadlock.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from maasd.allocator import Pool, Region
from maasd.errors import NotFound, StateConflict
from maasd.store import PoolRow

__all__ = ["LivePool", "Runtime"]


@dataclass
class LivePool:
    """A pool of this host: its ledger row and its in-process allocator."""

    row: PoolRow
    pool: Pool


class Runtime:
    """The in-process state of one daemon (see the module docstring for its locks)."""

    def __init__(self) -> None:
        self._pools_lock = threading.Lock()
        self._pools: dict[str, LivePool] = {}
        self._regions_lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._busy: dict[str, threading.Lock] = {}
        self._attach_lock = threading.Lock()
        self._attached_by_tenant: Counter[str] = Counter()
        self._attached_by_buffer: Counter[str] = Counter()
        # Buffers released while workers still had handles attached: tenant, kind, size.
        self._released_attached: dict[str, tuple[str, str, int]] = {}
        self._uses_lock = threading.Lock()
        self._uses: dict[str, float] = {}

    # -- live pools ------------------------------------------------------------------------

    def add_pool(self, live: LivePool) -> None:
        with self._pools_lock:
            self._pools[live.row.id] = live

    def remove_pool(self, pool_id: str) -> None:
        with self._pools_lock:
            self._pools.pop(pool_id, None)

    def pool(self, pool_id: str) -> LivePool | None:
        """The live pool with this id, or ``None``."""
        with self._pools_lock:
            return self._pools.get(pool_id)

    def find_pool(self, id_or_name: str) -> LivePool:
        """The live pool with this id (preferred) or name; :class:`NotFound` otherwise."""
        with self._pools_lock:
            live = self._pools.get(id_or_name)
            if live is None:
                live = next((p for p in self._pools.values() if p.row.name == id_or_name), None)
        if live is None:
            raise NotFound(f"no pool {id_or_name!r}")
        return live

    def pools(self) -> list[LivePool]:
        with self._pools_lock:
            return list(self._pools.values())

    # -- live regions ----------------------------------------------------------------------

    def region(self, buffer_id: str) -> Region | None:
        """The region of a buffer this process holds, or ``None``."""
        with self._regions_lock:
            return self._regions.get(buffer_id)

    def live_region(self, buffer_id: str) -> Region:
        """The region of a buffer, open; :class:`StateConflict` if it is not live here."""
        region = self.region(buffer_id)
        if region is None or region.closed:
            raise StateConflict(f"buffer {buffer_id} is not live")
        return region

    def buffer_ids(self) -> list[str]:
        """The buffers whose regions this process holds."""
        with self._regions_lock:
            return list(self._regions)

    def add_region(self, buffer_id: str, region: Region) -> None:
        with self._regions_lock:
            self._regions[buffer_id] = region

    def buffer_lock(self, buffer_id: str) -> threading.Lock:
        """The lock that serialises work on this buffer's pages (lock 1 of the order)."""
        with self._regions_lock:
            return self._busy.setdefault(buffer_id, threading.Lock())

    def take_region(self, buffer_id: str) -> Region | None:
        """Take a buffer's region out (``None`` if none), after any work on it ends.

        Waits for the buffer's lock, so a checkpoint or pin in progress finishes
        first; from then on no one can find the region here.
        """
        with self.buffer_lock(buffer_id), self._regions_lock:
            self._busy.pop(buffer_id, None)
            return self._regions.pop(buffer_id, None)

    def dup_fd(self, buffer_id: str) -> int | None:
        """A new fd of a live buffer's memfd, or ``None`` if it is not live here."""
        with self._regions_lock:
            region = self._regions.get(buffer_id)
            if region is None or region.closed:
                return None
            return region.dup_fd()

    # -- attachments -----------------------------------------------------------------------

    def attach(self, tenant_id: str, buffer_id: str) -> int:
        """Count one more handle of this tenant on this buffer; returns the tenant's count."""
        with self._attach_lock:
            self._attached_by_buffer[buffer_id] += 1
            self._attached_by_tenant[tenant_id] += 1
            return self._attached_by_tenant[tenant_id]

    def detach(self, tenant_id: str, buffer_id: str) -> int:
        """Count one handle less; returns the tenant's count.

        A buffer with no handle counted changes nothing: counts never go below zero,
        and the tenant's count stays the sum of its buffers'.
        """
        with self._attach_lock:
            if self._attached_by_buffer[buffer_id] > 0:
                for counts, key in (
                    (self._attached_by_buffer, buffer_id),
                    (self._attached_by_tenant, tenant_id),
                ):
                    counts[key] -= 1
                    if counts[key] <= 0:
                        del counts[key]
                if buffer_id not in self._attached_by_buffer:
                    self._released_attached.pop(buffer_id, None)
            return self._attached_by_tenant[tenant_id]

    def attached(self, buffer_id: str) -> int:
        """How many handles workers hold on this buffer now (attached, not yet dropped)."""
        with self._attach_lock:
            return self._attached_by_buffer[buffer_id]

    def note_released(self, buffer_id: str, tenant_id: str, kind: str, size: int) -> None:
        """A buffer was released: if workers still have handles attached, remember it until
        they detach (their fds can fault fresh pages in that no ledger counts)."""
        with self._attach_lock:
            if self._attached_by_buffer[buffer_id] > 0:
                self._released_attached[buffer_id] = (tenant_id, kind, size)

    def released_attached(self) -> list[tuple[str, str, int, int]]:
        """``(tenant_id, kind, size_bytes, handles)`` of every buffer released while
        handles on it were attached, as long as they still are."""
        with self._attach_lock:
            return [
                (tenant, kind, size, self._attached_by_buffer[buffer_id])
                for buffer_id, (tenant, kind, size) in self._released_attached.items()
            ]

    def tenant_attached(self, tenant_id: str) -> int:
        """How many handles this tenant's workers hold now, over all its buffers."""
        with self._attach_lock:
            return self._attached_by_tenant[tenant_id]

    # -- uses (the LRU order), batched -----------------------------------------------------

    def touch(self, buffer_id: str, when: float) -> None:
        """Remember a use of the buffer; written to the ledger by :meth:`take_uses`' caller."""
        with self._uses_lock:
            self._uses[buffer_id] = when

    def pending_uses(self) -> dict[str, float]:
        """The uses remembered and not yet taken (a copy)."""
        with self._uses_lock:
            return dict(self._uses)

    def take_uses(self) -> dict[str, float]:
        """The uses remembered so far, forgotten here (the caller writes them)."""
        with self._uses_lock:
            uses, self._uses = self._uses, {}
            return uses

    def untake_uses(self, uses: dict[str, float]) -> None:
        """Remember again uses taken but not written (a newer use of a buffer wins)."""
        with self._uses_lock:
            for buffer_id, when in uses.items():
                if self._uses.get(buffer_id, 0.0) < when:
                    self._uses[buffer_id] = when
