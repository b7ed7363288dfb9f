"""Demotion: what an entry's end means for the disk tiers, and the writer that fills them.

The Releaser calls :meth:`Demotions.ended` for every entry before its region is dropped
(its ``on_entry_end``, given at its construction). An eviction is offered for demotion:
the tiers' admission filter (:meth:`DiskTiers.worth_writing`) keeps it if it was looked
up again or came back after a drop; its bytes are encrypted from the region's mapping in
the caller's thread (no plaintext copy) and the ciphertext queued for the writer thread,
within ``disk_inflight_bytes`` — past that, or at a limit the tier cannot make room
under, it is dropped and counted. Any other end (a DELETE, a lease, a tenant's deletion)
erases the key's copy on disk. Nothing here fails a DRAM operation: a full or failing
disk or no room is a drop, counted in ``maasd_disk_drops``.

No lock of its own: the books' changes are :class:`DiskTiers`' (its lock a leaf, inside
which only the writer's queue is taken), and the bytes are read under the buffer's lock,
never held together with the books'.
"""

from __future__ import annotations

import functools
import logging

import msgspec

from maasd.core.disktier import DiskTiers, OnDisk, Tier
from maasd.core.regions import Regions
from maasd.core.tenants import disk_quota
from maasd.disk.store import DiskDir, Sealed
from maasd.disk.writer import Writer
from maasd.models import ReleaseReason
from maasd.settings import Settings
from maasd.store import BufferRow, TenantRepo

__all__ = ["Demotions"]

logger = logging.getLogger(__name__)


class Demotions:
    """Evicted entries written down to their pool's disk tier, in the background."""

    def __init__(
        self, settings: Settings, store: TenantRepo, regions: Regions, disk: DiskTiers
    ) -> None:
        self._factor = settings.disk_quota_factor
        self._tenant_rows, self._regions, self._disk = store, regions, disk
        self._metrics = disk.metrics
        self._writer = Writer(settings.disk_inflight_bytes)

    def start(self) -> None:
        self._writer.start()

    def close(self) -> None:
        """What is queued written, then the writer stopped (before the tiers are erased)."""
        self._writer.close()

    def ended(self, row: BufferRow, reason: ReleaseReason) -> None:
        """An entry's region is about to be dropped (see the module docstring). Its row
        no longer carries its key (a release gives it up): the regions still do."""
        if row.kind != "entry":
            return
        held = self._regions.held(row.id)
        key = row.key if held is None else held.key
        if key is None or (held is not None and not held.committed):
            return  # a staged entry (an abort, a failed commit or promotion): not its copy
        row = msgspec.structs.replace(row, key=key)
        if reason != "evict":
            self._disk.ended(row.tenant_id, key)
            return
        try:
            self._demote(row)
        except Exception:  # never fails the eviction: the entry is just dropped
            self._disk.abandon(row)
            tier = self._disk.tier(row.pool_id)
            self._metrics.dropped("" if tier is None else tier.pool, "error")
            logger.exception("demoting entry %s failed", row.id)

    def _demote(self, row: BufferRow) -> None:
        tier = self._disk.worth_writing(row)
        if tier is None:
            return
        if not self._writer.reserve(row.size_bytes):
            self._metrics.dropped(tier.pool, "busy")
            self._disk.abandon(row)
            return
        tenant = self._tenant_rows.tenant(row.tenant_id)
        if tenant is not None and tenant.deleting_at is not None:
            tenant = None  # being deleted: nothing of it may stay behind on disk
        sealed_blob = None if tenant is None else self._seal(row)
        if tenant is not None and sealed_blob is not None:
            sealed, blob = sealed_blob

            def queue(entry: OnDisk, doomed: list[OnDisk]) -> None:
                write = functools.partial(self._write, tier, entry, blob, doomed)
                self._writer.submit(row.size_bytes, write)

            if self._disk.admit(tier, row, sealed, disk_quota(tenant, self._factor), queue):
                return
        self._disk.abandon(row)
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

    def _write(self, tier: Tier, entry: OnDisk, blob: bytes, doomed: list[OnDisk]) -> None:
        """(writer thread) The victims the admission chose erased first — the bytes on disk
        never pass a limit, not even for a moment —, then the entry written."""
        for victim in doomed:
            victim.erase_file()
        if entry.gone:  # erased before its turn
            return
        try:
            tier.disk.write(entry.sealed, blob)
        except OSError as e:
            reason = "full" if e.errno in (28, 122) else "io_error"  # ENOSPC, EDQUOT
            self._disk.discard(tier, entry)
            self._metrics.dropped(tier.pool, reason)
            logger.info("pool %s: a demotion was dropped: %s", tier.pool, e)
            return
        self._disk.written(entry)
        self._metrics.written(tier.pool, len(blob))  # (after: a metric seen is promotable)
        if entry.gone:  # erased while it was being written
            tier.disk.erase(entry.sealed)
