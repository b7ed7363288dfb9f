"""The core's side of the shared prefix tier (docs/scale-out.md, "The L2 tier").

Three hooks, all off the worker's hot path, and a tenant's end::

    commit        the entry's key and id go to the L2 tier's write-behind queue (never
                  waits; the writer thread reads the bytes later with Restores.read)
    lookup miss   the order of the tiers is maasd.core.tiers' (the one place): a local
                  miss while L2 is ready goes to fill(), off the event loop: one L2
                  round trip for all the keys, the value's checks, then the entry
                  materialised here like any put (quota, max_buffers, eviction) and the
                  lookup answered from memory
    entry released unless evicted, the value in L2 it wrote (or was restored from)
                  deleted later by the tier's writer thread, so that no lookup restores
                  what was deleted or ended (maasd.l2.ends says which ends, and how a
                  release racing its write-behind is handled); never waits for L2
    tenant deleted the tenant's values in L2 dropped (by the daemon that took the DELETE,
                  once the hosts released their share: a write-behind still queued on
                  one of them then finds its entry gone)

A hit restored from L2 is a local entry from then on: the next lookup on this host
finds it in memory. Nothing here ever fails a lookup for L2's sake: an error, a timeout,
a refused value or no room here for the entry all answer as a miss (``None``).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import TYPE_CHECKING

from maasd.core.auth import require_tenant
from maasd.core.entries import Entries, EntryHandle
from maasd.core.restore import Restores
from maasd.errors import ConfigError, DuplicateKey, MaasdError
from maasd.l2 import open_tier
from maasd.metrics import Metrics
from maasd.models import Principal, ReleaseReason
from maasd.settings import Settings
from maasd.store import BufferRow, Database

if TYPE_CHECKING:
    from maasd.l2.tier import L2Tier

__all__ = ["Shared"]

logger = logging.getLogger(__name__)


class Shared:
    """The L2 tier as the core uses it; inert (``enabled`` False) without ``l2_url``."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        entries: Entries,
        restores: Restores,
        metrics: Metrics,
    ) -> None:
        self._entries = entries
        self._restores = restores
        self._circuit = db.circuit
        self._tier: L2Tier | None = None
        if settings.l2_url is None:
            return
        if not db.is_postgres:
            raise ConfigError(
                "--l2-url needs the shared PostgreSQL ledger: L2 keys are namespaced by "
                f"tenant id, and tenant ids are global only there (this ledger is {db.dialect})"
            )
        self._tier = open_tier(settings, metrics.registry, restores.read)
        entries.on_commit(self._tier.write_behind)

    @property
    def enabled(self) -> bool:
        return self._tier is not None

    def ready(self) -> bool:
        """Whether a local miss should be handed on to :meth:`fill` (its breaker is closed,
        or due for a probe). A cheap read: the broker asks it on its event loop."""
        # While the ledger is down nothing found could be restored here (a new row): no
        # L2 round trip for it.
        return self._tier is not None and self._circuit.down_since is None and self._tier.ready()

    def health(self) -> tuple[bool, str]:
        """L2's state for ``/healthz`` (``degraded`` while its breaker is open)."""
        if self._tier is None or self._tier.breaker.closed:
            return True, ""
        return False, "L2 is failing (circuit breaker open): lookups miss it, writes are dropped"

    def skipped(self) -> None:
        """A local miss not asked of L2 because its breaker is open (counted if enabled)."""
        if self._tier is not None:
            self._tier.skipped()

    def start(self) -> None:
        if self._tier is not None:
            self._tier.start()

    def close(self) -> None:
        if self._tier is not None:
            self._tier.close()

    def drop_tenant(self, tenant_id: str) -> None:
        """The tenant was deleted: its values in L2 go too (bounded by L2's timeout)."""
        if self._tier is not None:
            self._tier.drop_tenant(tenant_id)

    def ended(self, row: BufferRow, reason: ReleaseReason) -> None:
        """An entry is being released (the releaser's hook): unless evicted, the value it
        wrote to L2, or was restored from, goes too — later, off this thread. Never
        raises, never waits for L2."""
        if self._tier is None:
            return
        try:
            self._tier.ended(row.tenant_id, row.id, reason)
        except Exception:  # a bug: the release goes on (the value then ages out of L2)
            logger.exception("forgetting a released entry's L2 value failed")

    def fill(
        self, who: Principal, keys: list[str], attached: Container[str] = ()
    ) -> EntryHandle | None:
        """A local lookup that missed, asked again after L2 (see the module docstring); a
        hit is counted as an attachment unless one of ``attached``; ``None``: a miss."""
        tenant_id = require_tenant(who)
        again = self._entries.lookup(who, keys, count_miss=False, attached=attached)
        if again is not None:  # another lookup restored it meanwhile
            return again
        tier = self._tier
        fetched = None if tier is None else tier.fetch(tenant_id, keys)
        if tier is not None and fetched is not None:
            try:
                restored = self._restores.materialise(who, fetched.key, fetched.data)
            except DuplicateKey:
                pass  # restored (or being put) by another caller: the lookup finds it, or not
            except MaasdError as exc:  # no room here (quota, max_buffers, pool full …)
                tier.counted("unplaced")
                logger.info(
                    "an entry found in L2 could not be restored here",
                    extra={"tenant": tenant_id, "reason": exc.code},
                )
            except Exception:  # a bug or the kernel: still a miss, never a failed lookup
                tier.counted("error")
                logger.exception("restoring an entry found in L2 failed")
            else:
                tier.restored(restored, tenant_id, fetched)
                tier.counted("hit")
        return self._entries.lookup(who, keys, attached=attached)
