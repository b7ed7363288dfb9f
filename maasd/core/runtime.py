"""What this daemon holds in memory: live pools, the buffers' regions, per-buffer locks,
attachments, the index of committed entries and the batch of uses not yet written to
the ledger.

The ledger says what *should* exist; the runtime holds what *does* in this
process — a buffer's memfd mapping exists only here. This daemon is the only
manager of its host's buffers, so the runtime also knows, for each region, its
tenant and whether it may be handed out: the worker socket's ``attach`` and
``lookup`` are answered from here, without the ledger. Every part of
:mod:`maasd.core` reaches that state through :class:`Runtime`, and only through
its methods: none of them keeps a reference to the dicts behind them.

Locks, and the order they are taken in
--------------------------------------

1. **A buffer's lock** (:meth:`Runtime.buffer_lock`), outermost. Held while a
   region's pages are read or moved through the daemon's mapping (checkpoint,
   pin, a placement count, an entry's commit), and while the region is taken out
   to be released — so a release waits for a checkpoint or commit in progress
   instead of unmapping under it. Held across I/O and ledger calls. Never taken
   while holding any other lock.
2. **The regions lock**: the held buffers, the entry index and the buffer locks
   map. Held only for dict operations, the ``dup(2)`` of an fd and the read-only
   re-open of a committed entry's memfd (so that a region being handed to a worker
   cannot be taken out and closed meanwhile), and around the attachments lock (so
   that a handle is counted in the same step it is made, and a release sees it).
3. **Leaf locks**, each guarding one thing and never held while taking another:
   the pools lock (the live pools map), the attachments lock, the uses lock, the
   holders' lock (:mod:`maasd.core.holders`, whose callbacks run outside it) —
   and outside this module the key cache's lock (:mod:`maasd.core.auth`), each
   allocator pool's lock, and the store's SQLite writer queue.

So a thread may go 1 → 2 → the attachments lock, 1 → a leaf, 2 → nothing else;
nothing waits for a lock while holding one taken later in this order, which rules
out deadlock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass

from maasd.allocator import Pool, Region
from maasd.core.holders import Holders
from maasd.core.inflight import PutsInFlight
from maasd.core.rofds import ReadOnlyFds
from maasd.errors import NotFound, StateConflict
from maasd.models import BufferKind
from maasd.store import PoolRow

__all__ = ["Held", "LivePool", "Opened", "Runtime"]


@dataclass
class LivePool:
    """A pool of this host: its ledger row and its in-process allocator."""

    row: PoolRow
    pool: Pool


@dataclass(slots=True)
class Held:
    """A buffer whose region this process holds, and what handing it out needs to know.

    ``live`` is False until the ledger says the buffer is live (a reserve finishing, an
    entry not yet committed): no worker gets a handle to it. A ``committed`` entry's
    memfd is sealed; its handles are ``O_RDONLY`` (:mod:`maasd.core.rofds`: an idle
    entry holds one fd, its memfd), and ``ttl_s`` is the lease a hit extends it to.
    """

    region: Region
    tenant_id: str
    pool_id: str
    key: str | None = None
    live: bool = False
    committed: bool = False
    ttl_s: int = 0


@dataclass(frozen=True, slots=True)
class Opened:
    """A handle made for a worker: ``fd`` is a new descriptor the receiver closes."""

    buffer_id: str
    fd: int
    size_bytes: int
    numa_node: int
    #: the tenant's handles now, this one included; ``None``: not counted (held already)
    tenant_attached: int | None
    key: str | None = None
    ttl_s: int = 0


class Runtime:
    """The in-process state of one daemon (see the module docstring for its locks)."""

    def __init__(self) -> None:
        self._pools_lock = threading.Lock()
        self._pools: dict[str, LivePool] = {}
        self._regions_lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._entries: dict[tuple[str, str], str] = {}  # (tenant, key) -> committed entry
        self._busy: dict[str, threading.Lock] = {}
        self._by_tenant: Counter[str] = Counter()  # held regions per tenant
        self.puts = PutsInFlight(self._regions_lock)  # admitted, not held yet
        self._ro = ReadOnlyFds()  # the hottest committed entries' read-only fds
        self._attach_lock = threading.Lock()
        self._attached_by_tenant: Counter[str] = Counter()
        self._attached_by_buffer: Counter[str] = Counter()
        # Buffers released while workers still had handles attached: tenant, kind, size —
        # until the last handle goes (released_attached).
        self._released_attached: dict[str, tuple[str, str, int]] = {}
        self._uses_lock = threading.Lock()
        self._uses: dict[str, float] = {}
        self._leases: dict[str, float] = {}
        #: who still holds committed entries' memfds, as the kernel reports it
        self.holders = Holders()

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

    # -- held regions ----------------------------------------------------------------------

    def region(self, buffer_id: str) -> Region | None:
        """The region of a buffer this process holds, or ``None``."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            return None if held is None else held.region

    def held(self, buffer_id: str) -> Held | None:
        """What this process holds for a buffer (a snapshot), or ``None``."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            return None if held is None else _copy(held)

    def live_region(self, buffer_id: str) -> Region:
        """The region of a buffer, open; :class:`StateConflict` if it is not live here."""
        region = self.region(buffer_id)
        if region is None or region.closed:
            raise StateConflict(f"buffer {buffer_id} is not live")
        return region

    def buffer_ids(self) -> list[str]:
        """The buffers whose regions this process holds."""
        with self._regions_lock:
            return list(self._held)

    def hold(self, buffer_id: str, held: Held) -> None:
        """Hold a buffer's region; a live committed entry is indexed under its key at once."""
        with self._regions_lock:
            if buffer_id not in self._held:
                self._by_tenant[held.tenant_id] += 1
            self._held[buffer_id] = held
            if held.live and held.committed and held.key is not None:
                self._entries[(held.tenant_id, held.key)] = buffer_id

    def set_live(self, buffer_id: str) -> bool:
        """Workers may get handles to the buffer from now on; False if it is not held."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            if held is None:
                return False
            held.live = True
            return True

    def commit(self, buffer_id: str, region: Region) -> Region | None:
        """Swap a staged entry's region for its sealed copy, publish it under its key; the
        staging region (the caller scrubs it), or ``None`` if the entry is no longer held."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            if held is None or held.live:
                return None
            staging, held.region, held.committed, held.live = held.region, region, True, True
            if held.key is not None:
                self._entries[(held.tenant_id, held.key)] = buffer_id
            return staging

    def buffer_lock(self, buffer_id: str) -> threading.Lock:
        """The lock that serialises work on this buffer's pages (lock 1 of the order)."""
        with self._regions_lock:
            return self._busy.setdefault(buffer_id, threading.Lock())

    def take_region(self, buffer_id: str) -> Region | None:
        """Take a buffer's region out (``None`` if none), once a checkpoint, pin or commit in
        progress ends (its lock); from then on no one finds it here, nor looks it up. Whether
        others still hold a committed entry's memfd is the caller's question (Holders.settle)."""
        with self.buffer_lock(buffer_id), self._regions_lock:
            self._busy.pop(buffer_id, None)
            held = self._held.pop(buffer_id, None)
            if held is None:
                self.puts.missing_locked(buffer_id)  # a put's, not held yet: it drops it
                return None
            self._by_tenant[held.tenant_id] -= 1
            self._ro.drop(buffer_id)
            if held.key is not None and self._entries.get((held.tenant_id, held.key)) == buffer_id:
                del self._entries[(held.tenant_id, held.key)]
            if held.committed:
                with self._attach_lock:
                    if self._attached_by_buffer[buffer_id] > 0:
                        self._released_attached[buffer_id] = (
                            held.tenant_id,
                            "entry",
                            held.region.size,
                        )
            return held.region

    def tenant_regions(self, tenant_id: str) -> int:
        """Regions this process holds for the tenant now (reserved, staged or committed)."""
        with self._regions_lock:
            return self._by_tenant[tenant_id]

    def dup_fd(self, buffer_id: str) -> int | None:
        """A new fd of a held buffer's memfd (writable), or ``None`` if it is not held here."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            if held is None or held.region.closed:
                return None
            return held.region.dup_fd()

    # -- handles for workers, answered from memory -----------------------------------------

    def open_handle(self, tenant_id: str, buffer_id: str) -> Opened | None:
        """A handle of a live buffer of ``tenant_id``, counted as attached; else ``None``
        (a committed entry's: read-only, :mod:`maasd.core.rofds`)."""
        with self._regions_lock:
            held = self._held.get(buffer_id)
            if held is None or held.tenant_id != tenant_id:
                return None
            return self._open(buffer_id, held)

    def lookup(
        self, tenant_id: str, keys: list[str], attached: Container[str] = ()
    ) -> Opened | None:
        """The committed entry of the last of ``keys`` that has one, opened read-only;
        counted as attached unless it is one of ``attached`` (held by the caller already)."""
        with self._regions_lock:
            for key in reversed(keys):
                buffer_id = self._entries.get((tenant_id, key))
                if buffer_id is not None:
                    held = self._held[buffer_id]
                    return self._open(buffer_id, held, count=buffer_id not in attached)
            return None

    def _open(self, buffer_id: str, held: Held, *, count: bool = True) -> Opened | None:
        """(regions lock held) open the fd and count the attachment in one step."""
        region = held.region
        if not held.live or region.closed:
            return None
        fd = self._ro.handle(buffer_id, region) if held.committed else region.dup_fd()
        n = None
        if count:
            with self._attach_lock:
                n = self._attach_locked(held.tenant_id, buffer_id)
        return Opened(buffer_id, fd, region.size, region.node, n, held.key, held.ttl_s)

    def entry_stats(self) -> dict[str, tuple[int, int]]:
        """Committed entries held now, per tenant: ``{tenant_id: (entries, bytes)}``."""
        stats: dict[str, tuple[int, int]] = {}
        with self._regions_lock:
            for buffer_id in self._entries.values():
                held = self._held[buffer_id]
                n, size = stats.get(held.tenant_id, (0, 0))
                stats[held.tenant_id] = (n + 1, size + held.region.size)
        return stats

    # -- attachments -----------------------------------------------------------------------

    def attach(self, tenant_id: str, buffer_id: str) -> int:
        """Count one more handle of this tenant on this buffer; returns the tenant's count."""
        with self._attach_lock:
            return self._attach_locked(tenant_id, buffer_id)

    def _attach_locked(self, tenant_id: str, buffer_id: str) -> int:
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

    def attached_ids(self) -> frozenset[str]:
        """The buffers some worker holds a handle of now."""
        with self._attach_lock:
            return frozenset(self._attached_by_buffer)

    def attached(self, buffer_id: str) -> int:
        """How many handles workers hold on this buffer now (attached, not yet dropped)."""
        with self._attach_lock:
            return self._attached_by_buffer[buffer_id]

    def note_released(self, buffer_id: str, tenant_id: str, kind: BufferKind, size: int) -> None:
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

    def released_entry_bytes(self) -> int:
        """Bytes of released entries some process still holds (:mod:`maasd.core.holders`)."""
        return self.holders.held_bytes()

    # -- uses (the LRU order) and lease extensions, batched --------------------------------

    def touch(self, buffer_id: str, when: float, expires_at: float | None = None) -> None:
        """Remember a use (and a lease extension to ``expires_at``), for :meth:`take_uses`."""
        with self._uses_lock:
            self._uses[buffer_id] = when
            if expires_at is not None and expires_at > self._leases.get(buffer_id, 0.0):
                self._leases[buffer_id] = expires_at

    def pending_uses(self) -> dict[str, float]:
        """The uses remembered and not yet taken (a copy)."""
        with self._uses_lock:
            return dict(self._uses)

    def pending_lease(self, buffer_id: str) -> float | None:
        """A lease extension remembered for the buffer and not yet taken, if any."""
        with self._uses_lock:
            return self._leases.get(buffer_id)

    def take_uses(self) -> tuple[dict[str, float], dict[str, float]]:
        """The uses and lease extensions remembered so far, forgotten here (for the writer)."""
        with self._uses_lock:
            uses, self._uses = self._uses, {}
            leases, self._leases = self._leases, {}
            return uses, leases

    def untake_uses(self, uses: dict[str, float], leases: dict[str, float]) -> None:
        """Remember again uses and lease extensions taken but not written (a newer use of
        a buffer, and a later lease end, win)."""
        with self._uses_lock:
            for buffer_id, when in uses.items():
                if self._uses.get(buffer_id, 0.0) < when:
                    self._uses[buffer_id] = when
            for buffer_id, until in leases.items():
                if self._leases.get(buffer_id, 0.0) < until:
                    self._leases[buffer_id] = until


def _copy(held: Held) -> Held:
    return Held(
        held.region, held.tenant_id, held.pool_id, held.key, held.live, held.committed, held.ttl_s
    )
