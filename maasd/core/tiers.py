"""The order a socket lookup goes through the tiers: DRAM → local disk → L2 → miss.

    DRAM   the runtime's index, on the broker's event loop (Entries.lookup); a hit is a
           use of its key for the disk tier's admission filter
    disk   a miss that names a key on this pool's disk tier (or L2 is ready) is handed to
           the slow pool: the disk tier promotes it into a fresh sealed memfd
    L2     then the shared tier, if configured and its breaker lets calls in (Shared.fill)
    miss   counted once, by whichever step answered it

A DRAM hit on a shorter key is answered at once, even if a longer one is on disk or in
L2: the event loop never waits, and the worker asks again for what it computes next.
"""

from __future__ import annotations

from collections.abc import Container

from maasd.core.auth import require_tenant
from maasd.core.disktier import DiskTiers
from maasd.core.entries import Entries, Found
from maasd.core.pools import Pools
from maasd.core.shared import Shared
from maasd.core.tenants import Tenants
from maasd.errors import NotFound
from maasd.models import PoolInfo, PoolSpec, Principal

__all__ = ["Tiers"]


class Tiers:
    """The lookup order, and the use-cases whose end reaches the disk tiers too."""

    def __init__(
        self,
        entries: Entries,
        disk: DiskTiers,
        shared: Shared,
        pools: Pools,
        tenants: Tenants,
    ) -> None:
        self._store = disk.store
        self._runtime = disk.runtime
        self._entries = entries
        self._disk = disk
        self._shared = shared
        self._pools = pools
        self._tenants = tenants

    def create_pool(self, spec: PoolSpec) -> PoolInfo:
        info = self._pools.create(spec)
        self._disk.add(self._runtime.find_pool(info.id).row)
        return info

    def delete_pool(self, id_or_name: str, *, drain: bool) -> None:
        """The pool deleted (Pools.delete), then every entry of its disk tier erased."""
        try:
            pool_id: str | None = self._runtime.find_pool(id_or_name).row.id
        except NotFound:
            pool_id = None  # another host's, or none: Pools.delete answers it
        self._pools.delete(id_or_name, drain=drain)
        if pool_id is not None:
            self._disk.remove(pool_id)

    def delete_tenant(self, id_or_name: str) -> None:
        """The tenant deleted (Tenants.delete), then every entry of it on disk erased."""
        row = self._store.tenant(id_or_name)
        self._tenants.delete(id_or_name)
        if row is not None:
            self._disk.drop_tenant(row.id)

    def lookup(self, who: Principal, keys: list[str], attached: Container[str] = ()) -> Found:
        """DRAM only; a miss that a later tier will be asked about is not counted here."""
        tenant_id = require_tenant(who)
        l2 = self._shared.ready()
        ready = l2 or self._disk.fill_ready(tenant_id, keys)
        try:
            found = self._entries.lookup(who, keys, count_miss=not ready, attached=attached)
        except NotFound:
            if not l2:
                self._shared.skipped()
            raise
        self._disk.hit(tenant_id, found.key)
        return found

    def fill_ready(self, who: Principal, keys: list[str]) -> bool:
        """Whether a DRAM miss goes on to :meth:`fill` (cheap: asked on the event loop)."""
        return self._disk.fill_ready(require_tenant(who), keys) or self._shared.ready()

    def fill(self, who: Principal, keys: list[str]) -> Found:
        """A DRAM miss asked of the disk tiers, then of L2; may wait for either (never on
        an event loop). NotFound when neither has it."""
        found = self._disk.promote(who, require_tenant(who), keys)
        if found is not None:
            return found
        if self._shared.ready():
            return self._shared.fill(who, keys)
        return self._entries.lookup(who, keys)
