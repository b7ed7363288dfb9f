"""Promotion: an entry on a disk tier read back into memory for a lookup that missed DRAM.

A socket lookup that misses DRAM and names a key on disk (:meth:`DiskTiers.fill_ready`)
goes to the broker's slow pool, where :meth:`Promotions.promote` reads the file straight
into a fresh sealed memfd of the tier's pool — ``Restores.materialise_with``, the L2
fill's seam: quota, max_buffers, capacity and eviction as for any put — and answers it
from memory. The copy on disk stays (a later eviction writes nothing). A corrupt file
or no room in DRAM is a miss, counted in ``maasd_disk_drops``.

No lock of its own: the books' changes are :class:`DiskTiers`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container

from maasd.core.disktier import DiskTiers, OnDisk, Tier
from maasd.core.entries import Entries, EntryHandle
from maasd.core.restore import Restores
from maasd.disk.store import Unreadable
from maasd.errors import DuplicateKey, MaasdError
from maasd.models import Principal

__all__ = ["Promotions"]

logger = logging.getLogger(__name__)


class Promotions:
    """Entries on this host's disk tiers restored into DRAM on a lookup's miss."""

    def __init__(self, disk: DiskTiers, restores: Restores, entries: Entries) -> None:
        self._disk = disk
        self._metrics = disk.metrics
        self._restores = restores
        self._entries = entries

    def promote(
        self, who: Principal, tenant_id: str, keys: list[str], attached: Container[str] = ()
    ) -> EntryHandle | None:
        """The longest of ``keys`` found on disk, restored as a committed entry and looked
        up (a hit, counted as an attachment unless one of ``attached``); None if none is
        on disk or it could not be restored (a miss)."""
        on_disk = self._disk.longest_written(tenant_id, keys)
        if on_disk is None:
            return None
        tier, found = on_disk
        try:
            found.promoted_as = self._restores.materialise_with(
                who,
                found.key,
                found.sealed.size,
                self._reader(tier, found),
                pool=found.pool_id,
                ttl_s=found.ttl_s,  # its own lease again, as a hit extends it
            ).id
        except DuplicateKey:
            pass  # restored (or being put) by another caller meanwhile
        except Unreadable as e:
            if self._disk.discard(tier, found):  # else erased meanwhile (a release): no corruption
                logger.warning("pool %s: an entry on disk is lost: %s", tier.pool, e)
                self._metrics.dropped(tier.pool, "corrupt")
            tier.disk.erase(found.sealed)
            return None
        except MaasdError as e:  # no room in DRAM (quota, max_buffers, pool full …)
            logger.info("an entry on disk could not be promoted: %s", e.code)
            self._metrics.dropped(tier.pool, "unplaced")
            return None
        else:
            self._metrics.promoted(tier.pool)
        return self._entries.lookup(who, keys, count_miss=False, attached=attached)

    def _reader(self, tier: Tier, entry: OnDisk) -> Callable[[memoryview], None]:
        def fill(out: memoryview) -> None:
            self._metrics.read(tier.pool, tier.disk.read_into(entry.sealed, out))

        return fill
