"""The pools' disk tiers: entries eviction would drop, demoted encrypted, promoted on a hit.

Three seams, none of which rewrites the path it hangs on (docs/operations.md, "The disk
tier")::

    release   Releaser calls ended(row, reason) for every entry before its region is
              dropped. An eviction (reason "evict") is offered for demotion: the policy
              (maasd.disk.policy.Admission) keeps it if it was looked up again or came
              back after a drop; its bytes are encrypted from the region's mapping in the
              caller's thread (no plaintext copy) and the ciphertext queued for the
              writer thread, within ``disk_inflight_bytes`` — past that, or at a limit
              the tier cannot make room under, it is dropped and counted. Any other end
              (a DELETE, a lease, a tenant's deletion) erases the key's copy on disk.
    lookup    a socket lookup that misses DRAM and names a key on disk goes to the slow
              pool (fill_ready), where promote() reads the file straight into a fresh
              sealed memfd of the tier's pool — Restores.materialise, the L2 fill's seam:
              quota, max_buffers, capacity and eviction as for any put — and answers
              it from memory. The copy on disk stays (a later eviction writes nothing).
    hit       a DRAM hit counts a use of its key for the admission filter.

Each tier evicts by S3-FIFO within its ``disk_bytes``; a tenant's bytes on all the
host's tiers stay within its disk quota (``tenants.disk_quota_bytes``, by default
``disk_quota_factor`` times its quota): its own coldest entries go first, on the tier
demoted to, then on the others, same rules. A quota lowered below use holds from the
tenant's next demotion on.
Nothing here fails a DRAM operation: a full or failing disk, a corrupt file or no room
is a drop or a miss, counted in ``maasd_disk_drops``. Keys live in this object only, so
the tiers are emptied at start and at close.

Lock order: ``_lock`` is a leaf (never held while taking a buffer's lock or the ledger).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec

from maasd.core.entries import Entries, EntryHandle
from maasd.core.livepools import LivePools
from maasd.core.pools import Pools
from maasd.core.regions import Regions
from maasd.core.release import Releaser
from maasd.core.restore import Restores
from maasd.core.tenants import disk_quota
from maasd.disk.metrics import DiskMetrics
from maasd.disk.policy import Admission, S3Fifo
from maasd.disk.store import DiskDir, Sealed, Unreadable
from maasd.disk.writer import Writer
from maasd.errors import DuplicateKey, MaasdError
from maasd.metrics import Metrics
from maasd.models import DiskTierInfo, Principal
from maasd.settings import Settings
from maasd.store import BufferRow, PoolRow, Store

__all__ = ["DiskTiers"]

logger = logging.getLogger(__name__)


@dataclass
class _OnDisk:
    sealed: Sealed
    tenant_id: str
    key: str
    pool_id: str
    disk: DiskDir  # its tier's directory (where to erase it, even from another tier's demotion)
    written: bool = False  # the file is whole and in place: it may be promoted
    promoted_as: str | None = None  # the DRAM entry last promoted from it (its bytes)
    gone: bool = False  # erased (a pending write skips it, and removes what it wrote)


@dataclass
class _Tier:
    pool: str  # the pool's name, for metrics
    disk: DiskDir
    policy: S3Fifo
    entries: dict[str, _OnDisk] = field(default_factory=dict)  # by file name
    tenant_bytes: dict[str, int] = field(default_factory=dict)


def _tenant_victims(
    tier: _Tier, tiers: Iterable[_Tier], tenant: str, size: int, quota: int
) -> Iterator[tuple[_Tier, _OnDisk]]:
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


def _erase(doomed: list[_OnDisk]) -> None:
    """The files of entries taken out of the books (those written: a pending write skips
    or removes its own)."""
    for entry in doomed:
        if entry.written:
            entry.disk.erase(entry.sealed)


class DiskTiers:
    """Every pool's disk tier on this host (a pool without ``disk_dir``/``disk_bytes`` has none)."""

    def __init__(
        self, settings: Settings, store: Store, regions: Regions, live: LivePools,
        entries: Entries, restores: Restores, releaser: Releaser, pools: Pools, metrics: Metrics,
    ) -> None:  # fmt: skip
        self._factor = settings.disk_quota_factor
        self.store, self._regions, self._live = store, regions, live
        self._entries = entries
        self._restores = restores
        self.metrics = DiskMetrics(metrics.registry)
        self.metrics.attach(self.stats)
        releaser.on_entry_end = self.ended
        pools.disk_usage = self.usage
        self._lock = threading.Lock()
        self._tiers: dict[str, _Tier] = {}
        self._index: dict[tuple[str, str], _OnDisk] = {}
        self._admission = Admission()
        self._writer = Writer(settings.disk_inflight_bytes)

    # -- the tiers -------------------------------------------------------------------------

    def start(self) -> None:
        for live in self._live.all():
            self.add(live.row)
        self._writer.start()

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
            self._tiers[row.id] = _Tier(row.name, disk, S3Fifo(row.disk_bytes))

    def remove(self, pool_id: str) -> None:
        """The pool is gone: every entry of its tier erased."""
        with self._lock:
            tier = self._tiers.pop(pool_id, None)
            doomed = (
                [] if tier is None else [self._forget(e, tier) for e in list(tier.entries.values())]
            )
        _erase(doomed)

    def close(self) -> None:
        self._writer.close()
        for pool_id in list(self._tiers):
            self.remove(pool_id)

    def usage(self, pool_id: str) -> DiskTierInfo | None:
        """What the pool's tier holds now (pending writes included) and has done."""
        with self._lock:
            tier = self._tiers.get(pool_id)
            if tier is None:
                return None
            used, entries = tier.policy.used, len(tier.entries)
        c: Mapping[str, int] = self.metrics.counts.get(tier.pool) or {}
        return DiskTierInfo(
            used_bytes=used,
            entries=entries,
            demotions=c.get("demotions", 0),
            promotions=c.get("promotions", 0),
            drops={k[5:]: v for k, v in sorted(c.items()) if k.startswith("drop:")},
            read_bytes=c.get("read_bytes", 0),
            write_bytes=c.get("write_bytes", 0),
        )

    def tenant_usage(self) -> dict[str, int]:
        """Bytes on this host's tiers (pending writes included), per tenant."""
        with self._lock:
            return dict(sum((Counter(t.tenant_bytes) for t in self._tiers.values()), Counter()))

    def stats(self) -> list[tuple[str, int, int]]:  # the gauges, at scrape time
        with self._lock:
            return [(t.pool, t.policy.used, len(t.entries)) for t in self._tiers.values()]

    # -- hooks -----------------------------------------------------------------------------

    def hit(self, tenant_id: str, key: str) -> None:
        if not self._tiers:  # no pool has a tier: nothing to remember
            return
        with self._lock:
            self._admission.hit((tenant_id, key))

    def ended(self, row: BufferRow, reason: str) -> None:
        """An entry's region is about to be dropped (see the module docstring). Its row
        no longer carries its key (a release gives it up): the regions still do."""
        if row.kind != "entry":
            return
        held = self._regions.held(row.id)
        key = row.key if held is None else held.key
        if key is None or (held is not None and not held.committed):
            return  # a staged entry (an abort, a failed commit or promotion): not its copy
        row = msgspec.structs.replace(row, key=key)
        if reason == "evict":
            try:
                self._demote(row)
            except Exception:  # never fails the eviction: the entry is just dropped
                tier = self._tiers.get(row.pool_id)
                self.metrics.dropped("" if tier is None else tier.pool, "error")
                logger.exception("demoting entry %s failed", row.id)
            return
        with self._lock:
            self._admission.forget((row.tenant_id, key))
        self.erase_key(row.tenant_id, key)

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
        for _, key in keys:
            self.erase_key(tenant_id, key)

    # -- demotion --------------------------------------------------------------------------

    def _demote(self, row: BufferRow) -> None:
        assert row.key is not None
        ident = (row.tenant_id, row.key)
        with self._lock:
            tier = self._tiers.get(row.pool_id)
            if tier is None:
                self._admission.forget(ident)
                return
            existing = self._index.get(ident)
            if existing is not None and existing.promoted_as == row.id:
                self._admission.forget(ident)  # its copy is on disk still: nothing to write
                return
            # Another entry's bytes under this key (a put of it since): they go.
            stale = [] if existing is None else [self._forget(existing, tier)]
            cold = not self._admission.evicted(ident)
            if cold:
                self.metrics.dropped(tier.pool, "cold")
        _erase(stale)
        if cold:
            return
        if not self._writer.reserve(row.size_bytes):
            self.metrics.dropped(tier.pool, "busy")
            return
        tenant = self.store.tenant(row.tenant_id)
        if tenant is not None and tenant.deleting_at is not None:
            tenant = None  # being deleted: nothing of it may stay behind on disk
        sealed_blob = None if tenant is None else self._seal(row)
        if tenant is not None and sealed_blob is not None:
            sealed, blob = sealed_blob
            with self._lock:
                doomed = self._admit(tier, row, sealed, disk_quota(tenant, self._factor))
                entry = self._index.get(ident)
                if doomed is not None and entry is not None:  # queued in admission order
                    write = functools.partial(self._write, tier, entry, blob, doomed)
                    self._writer.submit(row.size_bytes, write)
                    return
        self._writer.cancel(row.size_bytes)

    def _seal(self, row: BufferRow) -> tuple[Sealed, bytes] | None:
        """The entry's bytes encrypted, read under its lock (a release waits)."""
        assert row.key is not None
        with self._regions.buffer_lock(row.id):
            held = self._regions.held(row.id)
            if held is None or not held.committed or held.region.closed:
                return None
            view = held.region.view()
            try:
                return DiskDir.seal(row.tenant_id, row.key, view)
            finally:
                view.release()

    def _admit(
        self, tier: _Tier, row: BufferRow, sealed: Sealed, quota: int
    ) -> list[_OnDisk] | None:
        """Make room (pool, then tenant) and index the entry; the victims to erase, or
        None if it cannot be kept (larger than a limit). Under ``_lock``."""
        size, tenant = sealed.size, row.tenant_id
        if (tenant, row.key) in self._index:  # demoted meanwhile by another eviction
            return None
        if size > quota or size > tier.policy.capacity:
            self.metrics.dropped(tier.pool, "quota" if size > quota else "full")
            return None
        doomed = [
            self._forget(victim, at, evicted=True)
            for at, victim in _tenant_victims(tier, self._tiers.values(), tenant, size, quota)
        ]
        for victim in tier.policy.insert(sealed.name, size):
            doomed.append(self._forget(tier.entries[victim.key], tier, evicted=True))  # type: ignore[index]
        entry = _OnDisk(sealed, tenant, row.key or "", row.pool_id, tier.disk)
        tier.entries[sealed.name] = entry
        tier.tenant_bytes[tenant] = tier.tenant_bytes.get(tenant, 0) + size
        self._index[(tenant, entry.key)] = entry
        self.metrics.demoted(tier.pool)
        return doomed

    def _forget(self, entry: _OnDisk, tier: _Tier, *, evicted: bool = False) -> _OnDisk:
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

    def _write(self, tier: _Tier, entry: _OnDisk, blob: bytes, doomed: list[_OnDisk]) -> None:
        """(writer thread) The victims the admission chose erased first — the bytes on disk
        never pass a limit, not even for a moment —, then the entry written."""
        _erase(doomed)
        if entry.gone:  # erased before its turn
            return
        try:
            tier.disk.write(entry.sealed, blob)
        except OSError as e:
            reason = "full" if e.errno in (28, 122) else "io_error"  # ENOSPC, EDQUOT
            with self._lock:
                self._forget(entry, tier)
                self.metrics.dropped(tier.pool, reason)
            logger.info("pool %s: a demotion was dropped: %s", tier.pool, e)
            return
        with self._lock:
            entry.written = not entry.gone  # promotable from now on
        self.metrics.written(tier.pool, len(blob))  # (after: a metric seen is promotable)
        if entry.gone:  # erased while it was being written
            tier.disk.erase(entry.sealed)

    # -- promotion -------------------------------------------------------------------------

    def fill_ready(self, tenant_id: str, keys: list[str]) -> bool:
        """Whether one of ``keys`` is on disk, written (cheap: the event loop asks it)."""
        with self._lock:
            return any(
                (e := self._index.get((tenant_id, k))) is not None and e.written for k in keys
            )

    def promote(
        self, who: Principal, tenant_id: str, keys: list[str], attached: Container[str] = ()
    ) -> EntryHandle | None:
        """The longest of ``keys`` found on disk, restored as a committed entry and looked
        up (a hit, counted as an attachment unless one of ``attached``); None if none is
        on disk or it could not be restored (a miss)."""
        with self._lock:
            found = next(
                (
                    e
                    for k in reversed(keys)
                    if (e := self._index.get((tenant_id, k))) is not None and e.written
                ),
                None,
            )
            tier = None if found is None else self._tiers.get(found.pool_id)
            if found is not None and tier is not None:
                tier.policy.hit(found.sealed.name)
        if found is None or tier is None:
            return None
        try:
            found.promoted_as = self._restores.materialise_with(
                who, found.key, found.sealed.size, self._reader(tier, found), pool=found.pool_id
            )
        except DuplicateKey:
            pass  # restored (or being put) by another caller meanwhile
        except Unreadable as e:
            with self._lock:
                raced = found.gone  # erased meanwhile (a release): no corruption
                self._forget(found, tier)
            if not raced:
                logger.warning("pool %s: an entry on disk is lost: %s", tier.pool, e)
                self.metrics.dropped(tier.pool, "corrupt")
            tier.disk.erase(found.sealed)
            return None
        except MaasdError as e:  # no room in DRAM (quota, max_buffers, pool full …)
            logger.info("an entry on disk could not be promoted: %s", e.code)
            self.metrics.dropped(tier.pool, "unplaced")
            return None
        else:
            self.metrics.promoted(tier.pool)
        return self._entries.lookup(who, keys, count_miss=False, attached=attached)

    def _reader(self, tier: _Tier, entry: _OnDisk) -> Callable[[memoryview], None]:
        def fill(out: memoryview) -> None:
            self.metrics.read(tier.pool, tier.disk.read_into(entry.sealed, out))

        return fill
