"""The pools' disk tiers and what each holds: the one owner of the books of the disk.

Three parts, one module each (docs/operations.md, "The disk tier")::

    disktier   (here) every pool's tier, the index of entries on disk by (tenant, key)
               with each entry's AES-GCM key (memory only), the room on disk — each tier
               evicts by S3-FIFO within its ``disk_bytes``, a tenant's bytes on all the
               host's tiers stay within its disk quota — and the admission filter
               (maasd.disk.policy.Admission: a DRAM hit counts a use of its key)
    demotion   what an entry's end means for the tier (Releaser's ``on_entry_end``): an
               eviction worth keeping encrypted and written by the writer thread, any
               other end erasing the key's copy (maasd.core.demotion.Demotions)
    promotion  a DRAM miss read back from disk into a fresh sealed memfd
               (maasd.core.promotion.Promotions)

Demotions and promotions change the books only through the methods below, each one
step under ``_lock``. A tenant's quota is enforced at each of its demotions (its own
coldest entries go first, on the tier demoted to, then on the others), so a quota
lowered below use holds from the tenant's next demotion on. Keys live in this object
only, so the tiers are emptied at start and at close.

Lock order: ``_lock`` is a leaf (never held while taking a buffer's lock or the ledger;
only the demotion writer's queue is taken inside it, to queue a write in admission order,
and the metrics' own leaf locks, to count a drop).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from maasd.core.livepools import LivePools
from maasd.disk.metrics import DiskMetrics
from maasd.disk.policy import Admission, S3Fifo
from maasd.disk.store import DiskDir, Sealed
from maasd.metrics import Metrics
from maasd.models import DiskTierInfo
from maasd.store import BufferRow, PoolRow

__all__ = ["DiskTiers", "OnDisk", "Tier"]

logger = logging.getLogger(__name__)


@dataclass
class OnDisk:
    """An entry in a tier's books (``written`` and ``gone`` change under the tiers' lock;
    ``promoted_as`` is set by the promotion that made it)."""

    sealed: Sealed
    tenant_id: str
    key: str
    pool_id: str
    disk: DiskDir  # its tier's directory (where to erase it, even from another tier's demotion)
    #: The entry's lease goes on on disk: it ends then (a release), as it would have in
    #: DRAM; a promotion leases the entry ``ttl_s`` again (what a lookup hit extends by).
    expires_at: float = math.inf
    ttl_s: int | None = None
    written: bool = False  # the file is whole and in place: it may be promoted
    promoted_as: str | None = None  # the DRAM entry last promoted from it (its bytes)
    gone: bool = False  # erased (a pending write skips it, and removes what it wrote)

    @classmethod
    def of(cls, row: BufferRow, sealed: Sealed, disk: DiskDir) -> OnDisk:
        """The demoted entry ``row`` (its key set), its bytes ``sealed`` on ``disk``."""
        return cls(
            sealed, row.tenant_id, row.key or "", row.pool_id, disk, row.expires_at, row.lease_s
        )

    def promotable(self, now: float) -> bool:
        """Its file is whole and its lease has not ended."""
        return self.written and self.expires_at > now

    def erase_file(self) -> None:
        """Its file removed, if it was written (a pending write skips or removes its own)."""
        if self.written:
            self.disk.erase(self.sealed)


@dataclass
class Tier:
    """One pool's tier: its directory and policy, and the entries it holds."""

    pool: str  # the pool's name, for metrics
    disk: DiskDir
    policy: S3Fifo
    entries: dict[str, OnDisk] = field(default_factory=dict)  # by file name
    tenant_bytes: dict[str, int] = field(default_factory=dict)


def _tenant_victims(
    tier: Tier, tiers: Iterable[Tier], tenant: str, size: int, quota: int
) -> Iterator[tuple[Tier, OnDisk]]:
    """The tenant's coldest entries on disk, taken out of their tier's policy, until
    ``size`` more bytes fit in its ``quota`` over all of ``tiers``: on ``tier`` (the one
    demoted to) first, then on the others. Its caller forgets each before the next (their
    bytes leave ``tenant_bytes``). Under the tiers' lock."""
    order = [tier, *(t for t in tiers if t is not tier)]
    while sum(t.tenant_bytes.get(tenant, 0) for t in order) + size > quota:
        at = next(t for t in order if t.tenant_bytes.get(tenant, 0) > 0)
        victim = at.policy.evict_one(lambda name: at.entries[name].tenant_id == tenant)  # type: ignore[index]  # noqa: B023
        assert victim is not None  # the tenant's bytes are its entries'
        yield at, at.entries[victim.key]  # type: ignore[index]


def _tier_info(used: int, entries: int, c: dict[str, int]) -> DiskTierInfo:
    """A tier's record: what it holds (``used`` bytes, ``entries``) and its counts."""
    return DiskTierInfo(
        used_bytes=used,
        entries=entries,
        demotions=c.get("demotions", 0),
        promotions=c.get("promotions", 0),
        drops={k[5:]: v for k, v in sorted(c.items()) if k.startswith("drop:")},
        read_bytes=c.get("read_bytes", 0),
        write_bytes=c.get("write_bytes", 0),
    )


def _erase(doomed: Iterable[OnDisk]) -> None:
    for entry in doomed:
        entry.erase_file()


class DiskTiers:
    """Every pool's disk tier on this host (a pool without ``disk_dir``/``disk_bytes`` has none)."""

    def __init__(self, live: LivePools, metrics: Metrics) -> None:
        self._live = live
        #: The tiers' series; the demotions and promotions count theirs here too.
        self.metrics = DiskMetrics(metrics.registry)
        self.metrics.attach(self.stats)
        self._lock = threading.Lock()
        self._tiers: dict[str, Tier] = {}
        self._index: dict[tuple[str, str], OnDisk] = {}
        self._admission = Admission()
        # (tenant, key) → the id of the entry whose demotion is being sealed: between
        # worth_writing and admit (a ledger read and an encryption) the key may be put
        # again and end, or its tenant be deleted; admit keeps only the demotion still named.
        self._pending: dict[tuple[str, str], str] = {}

    # -- the tiers -------------------------------------------------------------------------

    def start(self) -> None:
        for live in self._live.all():
            self.add(live.row)

    def add(self, row: PoolRow) -> None:
        """The pool's tier, emptied of what an earlier run left (its keys are gone)."""
        if not row.disk_dir or row.disk_bytes <= 0:
            return
        disk = DiskDir(row.disk_dir)
        try:
            removed = disk.open()
        except OSError as e:
            logger.exception("pool %s: disk tier %s unusable: %s", row.name, row.disk_dir, e)
            return
        if removed:
            logger.info("pool %s: disk tier emptied (%d files of a past run)", row.name, removed)
        with self._lock:
            self._tiers[row.id] = Tier(row.name, disk, S3Fifo(row.disk_bytes))

    def remove(self, pool_id: str) -> None:
        """The pool is gone: every entry of its tier erased."""
        with self._lock:
            tier = self._tiers.pop(pool_id, None)
            doomed = (
                [] if tier is None else [self._forget(e, tier) for e in list(tier.entries.values())]
            )
        _erase(doomed)

    def close(self) -> None:
        """Every tier erased (after the demotions' writer stopped: nothing is pending)."""
        for pool_id in list(self._tiers):
            self.remove(pool_id)

    def tier(self, pool_id: str) -> Tier | None:
        return self._tiers.get(pool_id)

    def usage(self, pool_id: str) -> DiskTierInfo | None:
        """What the pool's tier holds now (pending writes included) and has done."""
        with self._lock:
            tier = self._tiers.get(pool_id)
            if tier is None:
                return None
            used, entries = tier.policy.used, len(tier.entries)
        return _tier_info(used, entries, self.metrics.counts.of(tier.pool))

    def tenant_usage(self) -> dict[str, int]:
        """Bytes on this host's tiers (pending writes included), per tenant."""
        with self._lock:
            return dict(sum((Counter(t.tenant_bytes) for t in self._tiers.values()), Counter()))

    def stats(self) -> list[tuple[str, int, int]]:  # the gauges, at scrape time
        with self._lock:
            return [(t.pool, t.policy.used, len(t.entries)) for t in self._tiers.values()]

    # -- uses and ends of keys -------------------------------------------------------------

    def hit(self, tenant_id: str, key: str) -> None:
        """A DRAM hit: a use of the key, for the admission filter."""
        if not self._tiers:  # no pool has a tier: nothing to remember
            return
        with self._lock:
            self._admission.hit((tenant_id, key))

    def ended(self, tenant_id: str, key: str) -> None:
        """The key's entry ended otherwise than by an eviction: its uses forgotten, its
        copy on disk erased."""
        with self._lock:
            self._admission.forget((tenant_id, key))
            self._pending.pop((tenant_id, key), None)  # an older demotion of it: stale now
        self.erase_key(tenant_id, key)

    def erase_key(self, tenant_id: str, key: str) -> None:
        with self._lock:
            found = self._index.get((tenant_id, key))
            tier = None if found is None else self._tiers.get(found.pool_id)
            doomed = [] if found is None or tier is None else [self._forget(found, tier)]
        _erase(doomed)

    def drop_tenant(self, tenant_id: str) -> None:
        """The tenant is deleted: every entry of it on any tier erased."""
        with self._lock:
            keys = [k for k in self._index if k[0] == tenant_id]
            for ident in [k for k in self._pending if k[0] == tenant_id]:
                del self._pending[ident]  # a demotion being sealed: never admitted now
        for _, key in keys:
            self.erase_key(tenant_id, key)

    def expire(self, now: float | None = None) -> int:
        """Every entry on disk whose lease has ended erased (the reaper's pass: a lease
        that ends is a release, on disk as in DRAM); how many."""
        at = time.time() if now is None else now
        with self._lock:
            ended = [(e, t) for t in self._tiers.values() for e in t.entries.values()]
            doomed = [self._forget(e, t) for e, t in ended if e.expires_at <= at]
        _erase(doomed)
        return len(doomed)

    # -- what demotions write --------------------------------------------------------------

    def worth_writing(self, row: BufferRow) -> Tier | None:
        """The tier an evicted entry (``row``, with its key) is to be written to, or None:
        its pool has no tier, its copy is on disk still (it was promoted from it) or the
        admission filter finds it cold (counted). Another entry's bytes under its key
        (a put of it since) are erased."""
        assert row.key is not None
        ident = (row.tenant_id, row.key)
        with self._lock:
            self._pending.pop(ident, None)  # a newer entry of the key ended: older bytes
            tier = self._tiers.get(row.pool_id)
            if tier is None:
                self._admission.forget(ident)
                return None
            existing = self._index.get(ident)
            if existing is not None and existing.promoted_as == row.id:
                self._admission.forget(ident)  # its copy is on disk still: nothing to write
                existing.expires_at = row.expires_at  # its lease, as hits extended it
                return None
            stale = [] if existing is None else [self._forget(existing, tier)]
            cold = not self._admission.evicted(ident)
            if cold:
                self.metrics.dropped(tier.pool, "cold")
            else:
                self._pending[ident] = row.id
        _erase(stale)
        return None if cold else tier

    def abandon(self, row: BufferRow) -> None:
        """The demotion of ``row`` that :meth:`worth_writing` allowed stops before
        :meth:`admit` (the writer busy, the tenant being deleted, nothing to seal)."""
        ident = (row.tenant_id, row.key or "")
        with self._lock:
            if self._pending.get(ident) == row.id:
                del self._pending[ident]

    def admit(
        self,
        tier: Tier,
        row: BufferRow,
        sealed: Sealed,
        quota: int,
        queue: Callable[[OnDisk, list[OnDisk]], None],
    ) -> bool:
        """Make room (pool, then the tenant's ``quota``) and index the entry, then
        ``queue(entry, victims)`` its write, still under the lock: the writes run in
        admission order, so that the victims' files are gone before a later admission's
        bytes are written. False if it cannot be kept (larger than a limit, demoted
        meanwhile by another eviction, or overtaken since :meth:`worth_writing`: its key
        put again and ended, or its tenant deleted)."""
        size, tenant = sealed.size, row.tenant_id
        with self._lock:
            if self._pending.get((tenant, row.key or "")) != row.id:
                return False  # its key put again and ended, or its tenant deleted, meanwhile
            del self._pending[(tenant, row.key or "")]
            if (tenant, row.key) in self._index:  # demoted meanwhile by another eviction
                return False
            if size > quota or size > tier.policy.capacity:
                self.metrics.dropped(tier.pool, "quota" if size > quota else "full")
                return False
            doomed = [
                self._forget(victim, at, evicted=True)
                for at, victim in _tenant_victims(tier, self._tiers.values(), tenant, size, quota)
            ]
            for victim in tier.policy.insert(sealed.name, size):
                doomed.append(self._forget(tier.entries[victim.key], tier, evicted=True))  # type: ignore[index]
            entry = OnDisk.of(row, sealed, tier.disk)
            tier.entries[sealed.name] = entry
            tier.tenant_bytes[tenant] = tier.tenant_bytes.get(tenant, 0) + size
            self._index[(tenant, entry.key)] = entry
            self.metrics.demoted(tier.pool)
            queue(entry, doomed)
            return True

    def written(self, entry: OnDisk) -> None:
        """Its file is whole and in place: promotable from now on (unless erased)."""
        with self._lock:
            entry.written = not entry.gone

    def discard(self, tier: Tier, entry: OnDisk) -> bool:
        """Take ``entry`` out of the books (a failed write, a corrupt file); whether it was
        still in them (not erased meanwhile). Its file is the caller's to remove."""
        with self._lock:
            kept = not entry.gone
            self._forget(entry, tier)
        return kept

    def _forget(self, entry: OnDisk, tier: Tier, *, evicted: bool = False) -> OnDisk:
        """Take ``entry`` out of the books (its key dropped with it). Under ``_lock``."""
        entry.gone = True
        if tier.entries.pop(entry.sealed.name, None) is not None:
            if not evicted:
                tier.policy.remove(entry.sealed.name)
            left = tier.tenant_bytes.get(entry.tenant_id, 0) - entry.sealed.size
            if left > 0:
                tier.tenant_bytes[entry.tenant_id] = left
            else:
                tier.tenant_bytes.pop(entry.tenant_id, None)
            if evicted:
                self.metrics.dropped(tier.pool, "evicted")
        if self._index.get((entry.tenant_id, entry.key)) is entry:
            del self._index[(entry.tenant_id, entry.key)]
        return entry

    # -- what promotions read --------------------------------------------------------------

    def fill_ready(self, tenant_id: str, keys: list[str]) -> bool:
        """Whether one of ``keys`` is on disk, written (cheap: the event loop asks it)."""
        now = time.time()
        with self._lock:
            return any((e := self._index.get((tenant_id, k))) and e.promotable(now) for k in keys)

    def longest_written(self, tenant_id: str, keys: list[str]) -> tuple[Tier, OnDisk] | None:
        """The longest of ``keys`` on disk and written, and its tier, counted a hit by the
        tier's policy; None if none is."""
        now = time.time()
        with self._lock:
            found = next(
                (
                    e
                    for k in reversed(keys)
                    if (e := self._index.get((tenant_id, k))) and e.promotable(now)
                ),
                None,
            )
            tier = None if found is None else self._tiers.get(found.pool_id)
            if found is None or tier is None:
                return None
            tier.policy.hit(found.sealed.name)
            return tier, found
