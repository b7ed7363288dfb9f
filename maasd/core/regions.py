"""The buffers' regions this daemon holds, their locks, and the index of committed entries.

The ledger says what *should* exist; :class:`Regions` holds what *does* in this
process — a buffer's memfd mapping exists only here. This daemon is the only manager
of its host's buffers, so it also knows, for each region, its tenant and whether it
may be handed out: the worker socket's ``attach`` and ``lookup`` are answered from
here, without the ledger. Every part of :mod:`maasd.core` reaches a region only
through these methods; none keeps a reference to the dicts behind them.

Who owns which state: the regions, their locks and the entry index here (changed
by :mod:`.reserve` — hold, go live —, :mod:`.entries` — commit —, :mod:`.release`
— take out —, and at start and close by :mod:`.recovery` and :mod:`.lifecycle`);
the live pools :class:`~maasd.core.livepools.LivePools` (changed by :mod:`.pools`);
the attachment counts :class:`~maasd.core.attachments.Attachments` (changed by
:mod:`.handles` and by a lookup hit here); the use/lease batch
:class:`~maasd.core.uses.UseBatch` (which writes itself to the ledger); who holds released
entries :class:`~maasd.core.holders.Holders`.

Locks, and the order they are taken in
--------------------------------------

1. **A buffer's lock** (:meth:`Regions.buffer_lock`), outermost. Held while a
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
   the live pools' lock (:mod:`maasd.core.livepools`), the attachments lock
   (:mod:`maasd.core.attachments`), the use batch's lock (:mod:`maasd.core.uses`),
   the holders' lock (:mod:`maasd.core.holders`, whose callbacks run outside it), the
   disk tiers' books (:mod:`maasd.core.disktier`) — and the key cache's lock (:mod:`maasd.core.auth`), each allocator pool's lock,
   and the store's SQLite writer queue.

So a thread may go 1 → 2 → the attachments lock, 1 → a leaf, 2 → nothing else;
nothing waits for a lock while holding one taken later in this order, which rules
out deadlock.

One exception, bounded: a small volatile buffer's release in one ledger transaction
(:meth:`maasd.core.release.Releaser.release_live`) scrubs it *inside* that
transaction, so it holds the SQLite writer queue and the ledger's locks on the
buffer's, tenant's and pool's rows while it takes that live, non-entry buffer's lock
(1), then 2 and the leaves of a release. No deadlock follows: whoever holds such a
buffer's lock (a pin, a placement count) makes no ledger call under it — only
checkpoints (persistent pools) and entries' commits, restores and demotions do, and
those buffers never take this path — and 2 and the leaves are never held across a
ledger call.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass

from maasd.allocator import Region
from maasd.core.attachments import Attachments
from maasd.core.inflight import PutsInFlight
from maasd.core.rofds import ReadOnlyFds
from maasd.errors import StateConflict

__all__ = ["HeldRegion", "Opened", "Regions"]


@dataclass(slots=True)
class HeldRegion:
    """A buffer whose region this process holds, and what handing it out needs to know.

    ``live`` is False until the ledger says the buffer is live (a reserve finishing, an
    entry not yet committed): no worker gets a handle to it. A ``committed`` entry's
    memfd is sealed; its handles are ``O_RDONLY`` (:mod:`maasd.core.rofds`: an idle
    entry holds one fd, its memfd), and ``ttl_s`` is the lease a hit extends it to.
    ``expires_at`` is its lease end as this process knows it (from its row, a renew, a
    hit; 0: not known): a lookup from then on misses it (:meth:`Regions.lookup`).
    """

    region: Region
    tenant_id: str
    pool_id: str
    key: str | None = None
    live: bool = False
    committed: bool = False
    ttl_s: int = 0
    expires_at: float = 0.0


#: Entries a lookup found past their lease, kept for the reaper to check (at most).
LAPSED_MAX = 1024


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


class Regions:
    """The regions of one daemon (see the module docstring for its locks)."""

    def __init__(self, attachments: Attachments, *, park: bool = False) -> None:
        self._lock = threading.Lock()
        #: committed ``memfd`` entries let their fd go (:meth:`Region.park`)
        self._park = park
        self._parked_by_tenant: Counter[str] = Counter()  # of those held, parked
        self._held: dict[str, HeldRegion] = {}
        self._entries: dict[tuple[str, str], str] = {}  # (tenant, key) -> committed entry
        self._busy: dict[str, threading.Lock] = {}
        self._by_tenant: Counter[str] = Counter()  # held regions per tenant
        self.puts = PutsInFlight(self._lock)  # admitted, not held yet
        self._ro = ReadOnlyFds()  # the hottest committed entries' read-only fds
        self._attachments = attachments
        self._lapsed: set[str] = set()  # lookups found past their lease (take_lapsed)

    def region(self, buffer_id: str) -> Region | None:
        """The region of a buffer this process holds, or ``None``."""
        with self._lock:
            held = self._held.get(buffer_id)
            return None if held is None else held.region

    def held(self, buffer_id: str) -> HeldRegion | None:
        """What this process holds for a buffer (a snapshot), or ``None``."""
        with self._lock:
            held = self._held.get(buffer_id)
            return None if held is None else _copy(held)

    def live_region(self, buffer_id: str) -> Region:
        """The region of a buffer, open; :class:`StateConflict` if it is not live here."""
        region = self.region(buffer_id)
        if region is None or region.closed:
            raise StateConflict(f"buffer {buffer_id} is not live")
        return region

    def set_lease(self, buffer_id: str, expires_at: float, ttl_s: int | None = None) -> None:
        """The buffer's lease ends at ``expires_at`` (a renew's, or the ledger's); with
        ``ttl_s``, a lookup hit extends it by that from now on."""
        with self._lock:
            held = self._held.get(buffer_id)
            if held is not None:
                held.expires_at = expires_at
                if ttl_s is not None:
                    held.ttl_s = ttl_s

    def take_lapsed(self) -> dict[str, float]:
        """The buffers lookups or attaches missed for their lease's end since the last call,
        still held, with the lease end this process knows (the reaper checks them against
        the ledger: a renew through another host's daemon extends a lease only there)."""
        with self._lock:
            lapsed, self._lapsed = self._lapsed, set()
            return {b: self._held[b].expires_at for b in lapsed if b in self._held}

    def buffer_ids(self) -> list[str]:
        """The buffers whose regions this process holds."""
        with self._lock:
            return list(self._held)

    def hold(self, buffer_id: str, held: HeldRegion) -> None:
        """Hold a buffer's region; a live committed entry is indexed under its key at once."""
        with self._lock:
            old = self._held.get(buffer_id)
            if old is None:
                self._by_tenant[held.tenant_id] += 1
            elif old.region.parked and old.region is not held.region:
                self._parked_by_tenant[old.tenant_id] -= 1
            self._held[buffer_id] = held
            if held.live and held.committed:
                self._park_locked(held)
                if held.key is not None:
                    self._entries[(held.tenant_id, held.key)] = buffer_id

    def _park_locked(self, held: HeldRegion) -> None:
        """(regions lock held) an idle committed entry keeps no fd, where the daemon may."""
        if self._park and not held.region.parked and held.region.park():
            self._parked_by_tenant[held.tenant_id] += 1

    def set_live(self, buffer_id: str) -> bool:
        """Workers may get handles to the buffer from now on; False if it is not held."""
        with self._lock:
            held = self._held.get(buffer_id)
            if held is None:
                return False
            held.live = True
            return True

    def commit(self, buffer_id: str, region: Region) -> Region | None:
        """Swap a staged entry's region for its sealed copy, publish it under its key; the
        staging region (the caller scrubs it), or ``None`` if the entry is no longer held."""
        with self._lock:
            held = self._held.get(buffer_id)
            if held is None or held.live:
                return None
            staging, held.region, held.committed, held.live = held.region, region, True, True
            self._park_locked(held)
            if held.key is not None:
                self._entries[(held.tenant_id, held.key)] = buffer_id
            return staging

    def buffer_lock(self, buffer_id: str) -> threading.Lock:
        """The lock that serialises work on this buffer's pages (lock 1 of the order)."""
        with self._lock:
            return self._busy.setdefault(buffer_id, threading.Lock())

    def take_region(self, buffer_id: str) -> Region | None:
        """Take a buffer's region out (``None`` if none), once a checkpoint, pin or commit in
        progress ends (its lock); from then on no one finds it here, nor looks it up. Whether
        others still hold a committed entry's memfd is the caller's question (Holders.settle)."""
        with self.buffer_lock(buffer_id), self._lock:
            self._busy.pop(buffer_id, None)
            held = self._held.pop(buffer_id, None)
            if held is None:
                self.puts.missing_locked(buffer_id)  # a put's, not held yet: it drops it
                return None
            self._by_tenant[held.tenant_id] -= 1
            if held.region.parked:
                self._parked_by_tenant[held.tenant_id] -= 1
            self._ro.drop(buffer_id)
            if held.key is not None and self._entries.get((held.tenant_id, held.key)) == buffer_id:
                del self._entries[(held.tenant_id, held.key)]
            if held.committed:
                self._attachments.note_released(
                    buffer_id, held.tenant_id, "entry", held.region.size
                )
            return held.region

    def tenant_regions(self, tenant_id: str) -> int:
        """Regions this process holds for the tenant now (reserved, staged or committed)."""
        with self._lock:
            return self._by_tenant[tenant_id]

    def tenant_region_fds(self, tenant_id: str) -> int:
        """Of :meth:`tenant_regions`, those that hold an fd (all but parked entries)."""
        with self._lock:
            return self._by_tenant[tenant_id] - self._parked_by_tenant[tenant_id]

    def dup_fd(self, buffer_id: str) -> int | None:
        """A new fd of a held buffer's memfd (writable), or ``None`` if it is not held here."""
        with self._lock:
            held = self._held.get(buffer_id)
            if held is None or held.region.closed:
                return None
            return held.region.dup_fd()

    # -- handles for workers, answered from memory -----------------------------------------

    def open_handle(self, tenant_id: str, buffer_id: str) -> Opened | None:
        """A handle of a live buffer of ``tenant_id``, counted as attached; else ``None``
        (a committed entry's: read-only, :mod:`maasd.core.rofds`). A buffer past its lease
        end is not handed out, as a lookup misses it (the reaper checks it against the
        ledger, as :meth:`lookup`'s misses)."""
        with self._lock:
            held = self._held.get(buffer_id)
            if held is None or held.tenant_id != tenant_id:
                return None
            if self._lapsed_now(buffer_id, held, time.time()):
                return None
            return self._open(buffer_id, held)

    def lookup(
        self, tenant_id: str, keys: list[str], attached: Container[str] = ()
    ) -> Opened | None:
        """The committed entry of the last of ``keys`` that has one whose lease has not
        ended, opened read-only (its lease extended by its ``ttl_s`` from now); counted as
        attached unless it is one of ``attached`` (held by the caller already).

        An entry past its lease is missed, before the reaper releases it: a hit would
        extend its lease and bring it back (it lived on as long as it was looked up)."""
        now = time.time()
        with self._lock:
            for key in reversed(keys):
                buffer_id = self._entries.get((tenant_id, key))
                if buffer_id is None:
                    continue
                held = self._held[buffer_id]
                if self._lapsed_now(buffer_id, held, now):
                    continue
                opened = self._open(buffer_id, held, count=buffer_id not in attached)
                if opened is not None:
                    held.expires_at = now + held.ttl_s  # as the hit's batched extension
                return opened
            return None

    def _lapsed_now(self, buffer_id: str, held: HeldRegion, now: float) -> bool:
        """(regions lock held) whether the buffer's lease has ended as this process knows
        it; if so it is noted for the reaper (:meth:`take_lapsed`)."""
        if not 0 < held.expires_at <= now:
            return False
        if len(self._lapsed) < LAPSED_MAX:
            self._lapsed.add(buffer_id)
        return True

    def _open(self, buffer_id: str, held: HeldRegion, *, count: bool = True) -> Opened | None:
        """(regions lock held) open the fd and count the attachment in one step."""
        region = held.region
        if not held.live or region.closed:
            return None
        fd = self._ro.handle(buffer_id, region) if held.committed else region.dup_fd()
        n = self._attachments.attach(held.tenant_id, buffer_id) if count else None
        return Opened(buffer_id, fd, region.size, region.node, n, held.key, held.ttl_s)

    def entry_stats(self) -> dict[str, tuple[int, int]]:
        """Committed entries held now, per tenant: ``{tenant_id: (entries, bytes)}``."""
        stats: dict[str, tuple[int, int]] = {}
        with self._lock:
            for buffer_id in self._entries.values():
                held = self._held[buffer_id]
                n, size = stats.get(held.tenant_id, (0, 0))
                stats[held.tenant_id] = (n + 1, size + held.region.size)
        return stats


def _copy(held: HeldRegion) -> HeldRegion:
    return HeldRegion(
        held.region,
        held.tenant_id,
        held.pool_id,
        held.key,
        held.live,
        held.committed,
        held.ttl_s,
        held.expires_at,
    )
