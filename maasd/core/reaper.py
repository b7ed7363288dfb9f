"""The reaper: a thread that, every ``reaper_interval_s``, beats this host's heartbeat
(and joins again if its claim is gone), finishes the ends of held entries the ledger
refused during an outage, releases every buffer whose lease ended, and releases this
host's share of a tenant deleted through another daemon (and its entries on this host's
disk tiers, which the ledger does not list).
"""

from __future__ import annotations

import logging
import threading
import time

from maasd.core.disktier import DiskTiers
from maasd.core.hosts import Hosts
from maasd.core.pools import Pools
from maasd.core.recovery import Recovery
from maasd.core.regions import Regions
from maasd.core.release import Releaser
from maasd.core.tenants import Tenants
from maasd.core.uses import UseBatch
from maasd.errors import ConfigError, LedgerUnavailable
from maasd.metrics import Metrics
from maasd.settings import Settings
from maasd.store import BufferRepo, must_last

__all__ = ["Reaper"]

logger = logging.getLogger(__name__)


class Reaper:
    """Releases expired buffers; its thread also keeps this host's claim (see the module)."""

    def __init__(
        self,
        settings: Settings,
        store: BufferRepo,
        hosts: Hosts,
        pools: Pools,
        tenants: Tenants,
        uses: UseBatch,
        releaser: Releaser,
        recovery: Recovery,
        metrics: Metrics,
        disk: DiskTiers | None = None,
        regions: Regions | None = None,
    ) -> None:
        self._settings = settings
        self._host = settings.node_name
        self._buffer_rows = store
        self._hosts = hosts
        self._pools = pools
        self._tenants = tenants
        self._uses = uses
        self._releaser = releaser
        self._recovery = recovery
        self._metrics = metrics
        self._disk = disk  # entries on disk tiers: their leases end there too
        self._regions = regions  # what lookups know of leases (_refresh_lapsed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fenced = False  # this host lost its claim and has not joined again

    def start(self) -> None:
        self._thread = threading.Thread(target=self._reap_loop, name="maasd-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def reap(self, now: float | None = None) -> int:
        """Release every buffer of this host whose lease has ended. Returns how many.

        The leases lookup hits extended in memory are written first, and one extended
        since is honoured too: an entry in use is never reaped.
        """
        count = 0
        self._uses.flush()
        now = time.time() if now is None else now
        for row in self._buffer_rows.expired(now, self._host):
            if (self._uses.pending_lease(row.id) or 0.0) > now:
                continue  # a hit since the flush: the next pass writes its lease
            # Compare-and-set: a lease renewed since the query above is left alone.
            marked = self._buffer_rows.mark_expired(row.id, now, durable=must_last(row.persistence))
            if marked is None:
                continue
            self._releaser.release_row(marked, reason="expire", marked=True)
            self._metrics.reaped.inc()
            count += 1
        if self._disk is not None:
            self._disk.expire(now)
        if self._regions is not None:
            self._refresh_lapsed(now)
        return count

    def _refresh_lapsed(self, now: float) -> None:
        """Buffers lookups and attaches missed for their lease's end and that are still
        held (not reaped above): their lease was extended elsewhere (a renew through
        another host's daemon writes only the ledger). Lookups and attaches find them
        again from the ledger's lease, and hits extend it by its length there."""
        assert self._regions is not None
        for buffer_id, known in self._regions.take_lapsed().items():
            row = self._buffer_rows.buffer(buffer_id)
            if row is not None and row.expires_at > max(known, now):
                self._regions.set_lease(buffer_id, row.expires_at, row.lease_s)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self._settings.reaper_interval_s):
            try:
                if not self._hosts.heartbeat():
                    self._rejoin()
                self._releaser.finish_unfinished()  # held entries freed during an outage
                self.reap()
                # A tenant deleted through another daemon: release this host's share,
                # and erase its entries on this host's disk tiers.
                self._tenants.finish_deletes()
                if self._disk is not None:
                    self._tenants.forget_deleted(list(self._disk.tenant_usage()))
            except LedgerUnavailable as exc:  # an outage: said once, by the store's circuit
                logger.debug("reaper pass skipped: %s", exc.detail)
            except Exception:
                logger.exception("reaper pass failed; retrying")

    def _rejoin(self) -> None:
        """This host's claim is gone (forgotten while cut off, or taken over): fence, then
        join again as a fresh host — or, while another daemon serves the name, stay fenced
        and try again at the next heartbeat."""
        if not self._fenced:
            self._fenced = True
            dropped = self._hosts.fence()
            self._pools.unload()
            logger.error(
                "host %s lost its claim in the ledger (forgotten or taken over): "
                "%d buffer(s) scrubbed and dropped; joining again",
                self._hosts.name,
                dropped,
            )
        try:
            self._hosts.claim(wait=False)
        except ConfigError as e:  # another daemon serves the name now
            logger.warning("host %s stays fenced: %s", self._hosts.name, e.detail)
            return
        self._fenced = False
        self._pools.load()
        self._recovery.recover()
        self._pools.provision()
