"""The composition root: every part of one daemon's core, built once, and its life.

:class:`Service` builds each part with the parts it needs (constructors only: nothing
is patched in afterwards, not even the disk tier's hooks), names the start and
close sequences once (:mod:`maasd.core.lifecycle` explains their order), and hands
the parts out as attributes. It forwards nothing: the REST controllers get the
per-noun objects through litestar's ``Provide`` (:mod:`maasd.api.dependencies`), the
broker gets :meth:`socket_use_cases` through its constructor, tests call the parts.

>>> svc = Service(settings); svc.start()                             # doctest: +SKIP
>>> who = svc.auth.authenticate(api_key)                              # doctest: +SKIP
>>> buf = svc.reserves.reserve(who, ReserveSpec(size_bytes=1 << 20))  # doctest: +SKIP
>>> svc.buffers.release(who, buf.id); svc.close()                     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from maasd.allocator import Warmer
from maasd.allocator.reclaim import Reclaimer
from maasd.core.answered import after_answer
from maasd.core.attachments import Attachments
from maasd.core.auth import Auth
from maasd.core.buffers import Buffers
from maasd.core.checkpoints import Checkpoints
from maasd.core.demotion import Demotions
from maasd.core.disktier import DiskTiers
from maasd.core.entries import Entries
from maasd.core.handles import Handles
from maasd.core.holders import Holders
from maasd.core.hosts import Hosts
from maasd.core.lifecycle import Shutdown
from maasd.core.limits import (
    MIN_USEFUL_REGIONS,
    RegionBudget,
    read_limits,
    settings_limits,
    too_few_regions,
)
from maasd.core.livepools import LivePools
from maasd.core.pools import Pools
from maasd.core.promotion import Promotions
from maasd.core.publish import Publishes
from maasd.core.reaper import Reaper
from maasd.core.recovery import Recovery
from maasd.core.regions import Regions
from maasd.core.release import Releaser
from maasd.core.reserve import Reserves
from maasd.core.restore import Restores
from maasd.core.shared import Shared
from maasd.core.spillfs import SpillFilesystems
from maasd.core.stale import LastKnownReads, degraded_checks
from maasd.core.strays import stray_pages
from maasd.core.tenants import Tenants
from maasd.core.tiers import Tiers
from maasd.core.uses import UseBatch
from maasd.errors import ConfigError
from maasd.metrics import (
    EntryCollector,
    LedgerCollector,
    Metrics,
    PlacementCollector,
    RuntimeCollector,
)
from maasd.models import ReleaseReason
from maasd.settings import Settings
from maasd.store import BufferRow, Store
from maasd.store.hotpath import HotPathCollector
from maasd.topology import Topology, discover

__all__ = ["Service", "SocketUseCases"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SocketUseCases:
    """The parts the worker socket's broker calls (:class:`maasd.broker.dispatch.UseCases`)."""

    auth: Auth
    handles: Handles
    buffers: Buffers
    entries: Entries
    lookups: Tiers
    publishes: Publishes


class Service:
    """One daemon's core: its ledger, its live state and its use-cases, wired once.

    The live state, each piece with one owner (the module that changes it):
    ``regions`` (:mod:`.regions`: held regions, buffer locks, the entry index),
    ``attachments`` (:mod:`.attachments`), ``live`` (:mod:`.livepools`, owned by
    ``pools``), ``uses`` (:mod:`.uses`: the use/lease batch), ``holders``
    (:mod:`.holders`). The use-cases, by noun: ``auth``, ``hosts``, ``pools``,
    ``tenants``, ``reserves`` (reserving a buffer), ``buffers`` (a buffer's life once
    reserved), ``handles``, ``entries``, ``publishes`` (an entry from a writer's memfd),
    ``tiers`` (the lookup order), ``disk`` (what the disk tiers hold), ``demotions`` and
    ``promotions`` (writing to them, reading back), ``shared`` (L2); the
    daemon's own: ``recovery``, ``reaper``, ``reclaimer`` (``drain()`` waits for it),
    ``warmer`` (``run_once()`` refills the warm stock in the caller's thread),
    ``budget`` (the regions the process may hold, from its open-files and mapping
    limits, read here).
    """

    def __init__(
        self, settings: Settings, *, topology: Topology | None = None, store: Store | None = None
    ) -> None:
        self.settings = settings
        self.host = settings.node_name
        self.store = store or _open_store(settings)
        self.metrics = Metrics()
        self.reclaimer = Reclaimer()
        self.budget = _region_budget(settings, self.store)
        self.warmer = Warmer(
            min_available=settings.warm_min_available_bytes,
            may_grow=self.budget.room_for_stock,
            send_wake=after_answer,  # a request's refill starts once it is answered
        )
        self.attachments = Attachments()
        self.regions = Regions(self.attachments, park=self.budget.limits.parks_entries)
        self.live = LivePools()
        self.holders = Holders()
        self.uses = UseBatch(self.store.buffers)
        self._build_use_cases(settings, topology or discover())
        _attach_collectors(self)
        #: ``GET /v1/usage``, pools, buffers: as last known while the ledger is down
        self.last_known = LastKnownReads(
            self.tenants.usage,
            lambda all_hosts: self.pools.infos(all_hosts=all_hosts),
            lambda who, tenant_id, held: self.buffers.buffers(who, tenant_id, held=held),
        )
        # The ledger back: the uses and leases batched meanwhile are written at once.
        self.store.circuit.on_up(self.uses.flush)

    def _build_use_cases(self, settings: Settings, topology: Topology) -> None:
        """Each part gets the repositories of the aggregates it reads or writes, and no
        other (``tests/unit/test_ownership.py``); the store itself stays here."""
        store, metrics, regions, live, holders = (
            self.store, self.metrics, self.regions, self.live, self.holders
        )  # fmt: skip
        buffers, reserves = store.buffers, store.reserves  # the two halves of one aggregate
        self.auth = Auth(settings, store.tenants)
        self.hosts = Hosts(settings, store.hosts, regions)
        self.disk = DiskTiers(live, metrics)
        self.demotions = Demotions(settings, store.tenants, regions, self.disk)
        releaser = Releaser(
            buffers, reserves, regions, self.attachments, live, holders, metrics,
            on_entry_end=self._entry_ended,
        )  # fmt: skip
        spill_fs = SpillFilesystems(settings.data_dir)
        checkpoints = Checkpoints(buffers, regions, live, metrics, spill_fs)
        self.pools = Pools(
            settings, store.pools, buffers, live, holders, releaser, self.reclaimer,
            self.warmer, topology, disk_usage=self.disk.usage, on_created=self.disk.add,
            on_deleted=self.disk.remove,
        )  # fmt: skip
        self.tenants = Tenants(
            store.tenants, buffers, store.events, self.auth, releaser,
            settings.max_buffers_per_tenant,
            held=functools.partial(holders.held_bytes_by, "tenant_id"),
            host=settings.node_name, remote_wait_s=3 * settings.reaper_interval_s,
            disk_factor=settings.disk_quota_factor, disk_used=self.disk.tenant_usage,
            on_deleted=self._tenant_deleted,
        )  # fmt: skip
        self.reserves = Reserves(
            settings, reserves, buffers, store.pools, regions, live, self.uses,
            self.attachments, holders, self.pools, releaser, metrics, self.budget,
        )  # fmt: skip
        self.buffers = Buffers(
            settings, buffers, store.tenants, regions, live, holders, self.pools, releaser,
            checkpoints, self.uses,
        )  # fmt: skip
        self.handles = Handles(regions, self.attachments, self.uses, metrics)
        self.entries = Entries(
            buffers, regions, live, holders, self.uses, self.reserves, releaser, metrics
        )
        restores = Restores(buffers, regions, holders, self.reserves, self.entries)
        self.publishes = Publishes(restores, self.entries, metrics)
        self.shared = Shared(settings, store.db, self.entries, restores, metrics)
        self.promotions = Promotions(self.disk, restores, self.entries)
        self.tiers = Tiers(self.entries, self.disk, self.promotions, self.shared)
        self.recovery = Recovery(
            self.host, buffers, reserves, regions, live, holders, checkpoints, self.budget,
            spill_fs,
        )  # fmt: skip
        self.reaper = Reaper(
            settings, buffers, self.hosts, self.pools, self.tenants, self.uses, releaser,
            self.recovery, metrics, self.disk, regions,
        )  # fmt: skip
        self._shutdown = Shutdown(
            settings, buffers, reserves, regions, checkpoints, releaser, metrics,
            self.uses.flush,
        )  # fmt: skip

    def _entry_ended(self, row: BufferRow, reason: ReleaseReason) -> None:
        """An entry is being released, its region not yet dropped: an eviction may be
        demoted to disk; any other end erases its copy on disk and its value in L2."""
        self.demotions.ended(row, reason)
        self.shared.ended(row, reason)

    def _tenant_deleted(self, tenant_id: str) -> None:
        """A tenant's delete, once its buffers are released: its entries on the disk tiers
        erased and its values in L2 dropped."""
        self.disk.drop_tenant(tenant_id)
        self.shared.drop_tenant(tenant_id)

    def socket_use_cases(self) -> SocketUseCases:
        """What the broker is built with (``Broker(svc.socket_use_cases(), path)``)."""
        return SocketUseCases(
            self.auth, self.handles, self.buffers, self.entries, self.tiers, self.publishes
        )

    # -- life (the order: maasd.core.lifecycle) ----------------------------------------------

    def start(self, *, reaper: bool = True, release_lost_checkpoints: bool = False) -> None:
        """Migrate the ledger, settle what a previous run left, provision pools, start reaping.

        ``release_lost_checkpoints``: release the persistent buffers of a spill directory
        whose filesystem is gone (:mod:`maasd.core.spillfs`) rather than refuse to start."""
        os.makedirs(self.settings.data_dir, mode=0o700, exist_ok=True)
        self.reclaimer.start()
        self.holders.prepare()
        self.store.upgrade()
        self.auth.load_admin_key()
        self.hosts.claim()
        self.auth.start()
        self.pools.load()
        self.recovery.recover(start=True, release_lost=release_lost_checkpoints)
        # Deletes a previous run began (SIGKILL in the middle) finish before serving.
        self.tenants.finish_deletes()
        self.pools.finish_deletes()
        self.pools.provision()
        self.warmer.start()
        if reaper:
            self.reaper.start()
        self.disk.start()
        self.demotions.start()
        self.shared.start()

    def close(self) -> None:
        """Stop the tiers and the reaper; checkpoint persistent buffers, release volatile
        ones; close the store."""
        self.shared.close()  # the writer stops before the entries it reads are released
        self.demotions.close()  # the writer stopped, then every tier erased (keys die with us)
        self.disk.close()
        self.reaper.stop()
        self.warmer.stop()
        for live in self.live.all():
            live.pool.close()  # the warm stock is nobody's: given back first
        self._shutdown.settle()
        self.holders.close()  # entries workers still hold: their rows went above
        self.auth.stop()
        try:
            self.hosts.stopped()
        except Exception:  # the ledger is unreachable: the host just stops beating
            logger.exception("shutdown: could not mark host %s stopped", self.hosts.name)
        self.reclaimer.stop()
        self.store.dispose()

    def health_checks(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        """The core's components for ``/healthz``: files can be opened. (Not the ledger: an
        outage of it answers 507 and is no reason to restart and lose every buffer.)"""
        return {"files": self.budget.health}

    def degraded_checks(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        """The components ``/healthz`` calls ``degraded`` (200) when failing: ledger, L2."""
        return degraded_checks(self.store.circuit, self.shared.health, self.shared.enabled)


def _attach_collectors(svc: Service) -> None:
    """The metrics read at scrape time: the ledger's, the live state's, the entries', the
    pages found off their pool's node."""
    svc.metrics.attach_ledger(LedgerCollector(svc.pools.infos, svc.tenants.infos))
    svc.metrics.registry.register(HotPathCollector())
    svc.metrics.attach_runtime(
        RuntimeCollector(
            svc.attachments.released_attached,
            lambda: (
                svc.budget.held(),
                svc.budget.budget,
                svc.budget.held_fds(),
                svc.budget.file_budget,
            ),
        )
    )
    holders = svc.holders
    svc.metrics.attach_entries(
        EntryCollector(svc.regions.entry_stats, holders.held_bytes, holders.held_by)
    )
    svc.metrics.attach_placement(PlacementCollector(lambda: stray_pages(svc.live, svc.regions)))


def _open_store(settings: Settings) -> Store:
    return Store(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_s=settings.db_statement_timeout_s,
    )


def _region_budget(settings: Settings, store: Store) -> RegionBudget:
    """The daemon-wide region budget: the open-files limit less the ledger's connections,
    the sockets' and REST's caps and the threads' transient files (docs/operations.md,
    "Limits"). A :class:`ConfigError` when it leaves too few regions to be of use."""
    limits = read_limits()  # this process's RLIMIT_NOFILE and vm.max_map_count
    limits = settings_limits(
        settings, limits.open_files, limits.max_map_count, postgres=store.is_postgres
    )
    if min(limits.region_budget, limits.file_budget) < MIN_USEFUL_REGIONS:
        raise ConfigError(too_few_regions(limits))
    return RegionBudget(limits)
