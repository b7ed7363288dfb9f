"""The core use-cases of maasd behind one facade: :class:`Service`.

Called by the REST API, the socket broker, the CLI and tests; synchronous and
thread-safe (the API runs it in worker threads, so prefaulting and scrubbing
never block the event loop). The core owns the rules; the store owns the SQL,
the allocator owns the memory.

The facade only wires the parts together and forwards to them; each use-case
lives in a module of its own:

=======================  ===========================================================
:mod:`.runtime`          live pools and regions, buffer locks, attachments, the use
                         batch — and the lock order of all of them
:mod:`.auth`             the admin key, tenant keys (cached), the role checks
:mod:`.hosts`            this host's claim and heartbeat; the hosts of the ledger
:mod:`.pools`            provisioning, creating and deleting pools; spill dirs
:mod:`.placement`        (pure) which pools could hold a request, best first
:mod:`.tenants`          tenants, quotas, keys, usage, the audit trail
:mod:`.buffers`          reserve, release, pin, renew, checkpoint, lookup
:mod:`.checkpoints`      writing a persistent buffer's checkpoint, restoring one
:mod:`.release`          every way a buffer ends: ledger first, scrub, then delete
:mod:`.handles`          memfd handles for the broker, attachment counts
:mod:`.entries`          the socket's put / commit / abort / lookup of immutable entries
:mod:`.shared`           the shared prefix tier (L2): commits written behind, a local
                         lookup miss filled from it
:mod:`.lifecycle`        start and close, recovery, the reaper; owns the reclaimer and
                         the warmer (the warm stock's refill thread)
:mod:`.limits`           the daemon's budget of open files and mappings for regions
=======================  ===========================================================

>>> svc = Service(settings); svc.start()                       # doctest: +SKIP
>>> who = svc.authenticate(api_key)                             # doctest: +SKIP
>>> buf = svc.reserve(who, ReserveSpec(size_bytes=1 << 20))     # doctest: +SKIP
>>> svc.release(who, buf.id); svc.close()                       # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container

from maasd.allocator import Warmer
from maasd.allocator.reclaim import Reclaimer
from maasd.core.auth import Auth, require_admin, require_tenant
from maasd.core.buffers import Buffers
from maasd.core.checkpoints import Checkpoints
from maasd.core.disktier import DiskTiers
from maasd.core.entries import Entries, Found
from maasd.core.handles import Handle, Handles
from maasd.core.hosts import Hosts
from maasd.core.lifecycle import Lifecycle
from maasd.core.limits import (
    MIN_USEFUL_REGIONS,
    RegionBudget,
    read_limits,
    settings_limits,
    too_few_regions,
)
from maasd.core.pools import Pools
from maasd.core.release import Releaser
from maasd.core.runtime import Runtime
from maasd.core.shared import Shared
from maasd.core.stale import LastKnownReads, degraded_checks
from maasd.core.strays import stray_pages
from maasd.core.tenants import Tenants
from maasd.core.tiers import Tiers
from maasd.errors import ConfigError
from maasd.metrics import (
    EntryCollector,
    LedgerCollector,
    Metrics,
    PlacementCollector,
    RuntimeCollector,
)
from maasd.models import (
    BufferInfo,
    Checkpoint,
    Event,
    HostInfo,
    KeyInfo,
    LookupHit,
    NewTenant,
    PoolInfo,
    PoolSpec,
    Principal,
    ReserveSpec,
    TenantInfo,
    Usage,
)
from maasd.settings import Settings
from maasd.store import Store
from maasd.store.hotpath import HotPathCollector
from maasd.topology import Topology, discover

__all__ = ["Found", "Handle", "Service"]


class Service:
    """One daemon's use-cases over its ledger, its pools and its regions.

    ``runtime`` is the in-process state (read it in tests: ``svc.runtime.region(id)``,
    ``svc.runtime.pending_uses()``); ``reclaimer`` gives released pages back in the
    background (``svc.reclaimer.drain()`` waits for it); ``warmer`` refills the pools'
    warm stock (``svc.warmer.run_once()`` does one round in the caller's thread);
    ``budget`` bounds the regions the process holds (from its open-files and mapping
    limits, read here), stocked ones included.
    """

    def __init__(
        self, settings: Settings, *, topology: Topology | None = None, store: Store | None = None
    ) -> None:
        self.settings = settings
        self.host = settings.node_name
        self.store = store or _open_store(settings)
        self.store.default_max_buffers = settings.max_buffers_per_tenant
        self.metrics = Metrics()
        self.runtime = Runtime()
        self.reclaimer = Reclaimer()
        self.budget = _region_budget(settings, self.store)
        self.warmer = Warmer(
            min_available=settings.warm_min_available_bytes,
            may_grow=self.budget.room_for_stock,
        )
        self._auth = Auth(settings, self.store)
        self._hosts = Hosts(settings, self.store, self.runtime)
        releaser = Releaser(self.store, self.runtime, self.metrics)
        checkpoints = Checkpoints(self.store, self.runtime, self.metrics)
        self._pools = Pools(
            settings,
            self.store,
            self.runtime,
            releaser,
            self.reclaimer,
            self.warmer,
            topology or discover(),
        )
        self._tenants = Tenants(
            self.store, self._auth, releaser, settings.max_buffers_per_tenant,
            held=functools.partial(self.runtime.holders.held_bytes_by, "tenant_id"),
            host=settings.node_name, remote_wait_s=3 * settings.reaper_interval_s,
            disk_factor=settings.disk_quota_factor, disk_used=lambda: self._disk.tenant_usage(),
        )  # fmt: skip
        self._buffers = Buffers(
            settings,
            self.store,
            self.runtime,
            self._pools,
            releaser,
            checkpoints,
            self.metrics,
            self.budget,
        )
        self._handles = Handles(self.runtime, self.metrics)
        self._entries = Entries(self.store, self.runtime, self._buffers, releaser, self.metrics)
        self._shared = Shared(settings, self.store, self._entries, self.metrics)
        self._disk = DiskTiers(
            settings, self.store, self.runtime, self._entries, releaser, self._pools, self.metrics
        )
        self._tiers = Tiers(self._entries, self._disk, self._shared, self._pools, self._tenants)
        self._life = Lifecycle(
            settings,
            self.store,
            self.runtime,
            self._auth,
            self._hosts,
            self._pools,
            self._tenants,
            self._buffers,
            releaser,
            checkpoints,
            self.metrics,
            self.reclaimer,
            self.warmer,
            budget=self.budget,
        )
        _attach_collectors(self)
        #: ``GET /v1/usage``, pools, buffers: as last known while the ledger is down
        self.last_known = LastKnownReads(
            lambda who: self.usage(who),
            lambda all_hosts: self.pools(all_hosts=all_hosts),
            lambda who, tenant_id, held: self.buffers(who, tenant_id, held),
        )
        # The ledger back: the uses and leases batched meanwhile are written at once.
        self.store.circuit.on_up(self._buffers.flush_uses)

    @property
    def topology(self) -> Topology:
        """The host's NUMA topology as last discovered."""
        return self._pools.topology

    @property
    def admin_key_generated(self) -> str | None:
        """The admin key if :meth:`start` generated it (print it once), else ``None``."""
        return self._auth.admin_key_generated

    # -- lifecycle (maasd.core.lifecycle) ---------------------------------------------------

    def start(self, *, reaper: bool = True) -> None:
        self._life.start(reaper=reaper)
        self._disk.start()
        self._shared.start()

    def close(self) -> None:
        self._shared.close()  # the writer stops before the entries it reads are released
        self._disk.close()  # its writer stopped, every tier erased (keys die with us)
        self._life.close()

    def health_checks(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        """The core's components for ``/healthz``: files can be opened. (Not the ledger: an
        outage of it answers 507 and is no reason to restart and lose every buffer.)"""
        return {"files": self.budget.health}

    def degraded_checks(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        """The components ``/healthz`` calls ``degraded`` (200) when failing: ledger, L2."""
        return degraded_checks(self.store.circuit, self._shared.health, self._shared.enabled)

    def reap(self, now: float | None = None) -> int:
        return self._life.reap(now)

    def recover(self) -> dict[str, int]:
        return self._life.recover()

    def flush_uses(self) -> None:
        self._buffers.flush_uses()

    # -- authentication (maasd.core.auth) ---------------------------------------------------

    def known_principal(self, token: str | None) -> Principal | None:
        return self._auth.known_principal(token)

    def authenticate(self, token: str | None) -> Principal:
        return self._auth.authenticate(token)

    @property
    def auth_generation(self) -> int:
        """Moves on every key revocation: a holder of a checked principal re-checks then."""
        return self._auth.generation

    def watch_revocations(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` right after every key revocation (the broker wakes with it)."""
        self._auth.watch_revocations(callback)

    def watch_releases(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(buffer_id)`` when an entry someone holds is released (broker)."""
        self.runtime.holders.listen(callback)

    require_admin = staticmethod(require_admin)
    require_tenant = staticmethod(require_tenant)

    # -- topology and pools (maasd.core.pools) ----------------------------------------------

    def refresh_topology(self) -> Topology:
        return self._pools.refresh_topology()

    def pools(self, *, all_hosts: bool = False) -> list[PoolInfo]:
        return self._pools.infos(all_hosts=all_hosts)

    def pool(self, id_or_name: str, *, any_host: bool = False) -> PoolInfo:
        return self._pools.info(id_or_name, any_host=any_host)

    def create_pool(self, spec: PoolSpec) -> PoolInfo:
        return self._tiers.create_pool(spec)

    def delete_pool(self, id_or_name: str, *, drain: bool = False) -> None:
        self._tiers.delete_pool(id_or_name, drain=drain)

    # -- hosts sharing the ledger (maasd.core.hosts) ----------------------------------------

    def hosts(self) -> list[HostInfo]:
        return self._hosts.infos()

    def forget_host(self, name: str) -> int:
        return self._hosts.forget(name)

    # -- tenants and keys (maasd.core.tenants) ----------------------------------------------

    def create_tenant(self, name: str, quota: int, disk_quota: int | None = None) -> NewTenant:
        return self._tenants.create(name, quota, disk_quota)

    def tenants(self) -> list[TenantInfo]:
        return self._tenants.infos()

    def tenant(self, id_or_name: str) -> TenantInfo:
        return self._tenants.info(id_or_name)

    def set_quota(self, id_or_name: str, quota_bytes: int) -> TenantInfo:
        return self._tenants.set_quota(id_or_name, quota_bytes)

    def update_tenant(self, id_or_name: str, **change: int | None) -> TenantInfo:
        """``quota_bytes``, ``max_buffers``, ``disk_quota_bytes``: see Tenants.update."""
        return self._tenants.update(id_or_name, **change)

    def delete_tenant(self, id_or_name: str) -> None:
        self._tiers.delete_tenant(id_or_name)

    def issue_key(self, id_or_name: str) -> KeyInfo:
        return self._tenants.issue_key(id_or_name)

    def revoke_key(self, id_or_name: str, key_id: str) -> None:
        self._tenants.revoke_key(id_or_name, key_id)

    def events(
        self, limit: int = 100, tenant: str | None = None, before: int | None = None
    ) -> list[Event]:
        return self._tenants.events(limit, tenant, before)

    def usage(self, who: Principal) -> Usage:
        return self._tenants.usage(who)

    # -- buffers (maasd.core.buffers) -------------------------------------------------------

    def reserve(self, who: Principal, req: ReserveSpec) -> BufferInfo:
        return self._buffers.reserve(who, req)

    def buffers(
        self, who: Principal, tenant: str | None = None, held: bool = False
    ) -> list[BufferInfo]:
        return self._buffers.buffers(who, tenant, held=held)

    def buffer(self, who: Principal, buffer_id: str) -> BufferInfo:
        return self._buffers.buffer(who, buffer_id)

    def pin(self, who: Principal, buffer_id: str, numa_node: int) -> BufferInfo:
        return self._buffers.pin(who, buffer_id, numa_node)

    def renew(self, who: Principal, buffer_id: str, ttl_s: int) -> BufferInfo:
        return self._buffers.renew(who, buffer_id, ttl_s)

    def checkpoint(self, who: Principal, buffer_id: str) -> Checkpoint:
        return self._buffers.checkpoint(who, buffer_id)

    def release(self, who: Principal, buffer_id: str) -> None:
        self._buffers.release(who, buffer_id)

    def lookup(self, who: Principal, lookup_keys: list[str]) -> LookupHit:
        return self._buffers.lookup(who, lookup_keys)

    # -- data plane (maasd.core.handles) ----------------------------------------------------

    def open_handle(self, who: Principal, buffer_id: str) -> Handle:
        return self._handles.open(who, buffer_id)

    def drop_handle(self, who: Principal, buffer_id: str) -> None:
        self._handles.drop(who, buffer_id)

    # -- entries (maasd.core.entries) -------------------------------------------------------

    def lookup_entry(
        self, who: Principal, lookup_keys: list[str], attached: Container[str] = ()
    ) -> Found:
        """From memory; a miss that the L2 tier will be asked about is not counted here.
        A hit on one of ``attached`` (buffers the caller holds) is not counted as a new
        attachment."""
        return self._tiers.lookup(who, lookup_keys, attached)

    def l2_ready(self) -> bool:
        """Whether an L2 tier is configured and its circuit breaker lets calls in."""
        return self._shared.ready()

    def fill_ready(self, who: Principal, lookup_keys: list[str]) -> bool:
        """Whether a DRAM miss should go on to :meth:`fill_entry` (maasd.core.tiers)."""
        return self._tiers.fill_ready(who, lookup_keys)

    def fill_entry(self, who: Principal, lookup_keys: list[str]) -> Found:
        """A DRAM miss asked of the disk tiers, then L2; may wait, so never on an event loop."""
        return self._tiers.fill(who, lookup_keys)

    def put_entry(
        self,
        who: Principal,
        key: str,
        size_bytes: int,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> Handle:
        return self._entries.put(who, key, size_bytes, pool, ttl_s)

    def commit_entry(self, who: Principal, buffer_id: str, *, owned: bool) -> None:
        self._entries.commit(who, buffer_id, owned=owned)

    def abort_entry(self, who: Principal, buffer_id: str, *, owned: bool) -> None:
        self._entries.abort(who, buffer_id, owned=owned)

    def abandon_entry(self, who: Principal, buffer_id: str) -> None:
        self._entries.abandon(who, buffer_id)

    def entry_staged(self, buffer_id: str) -> bool:
        """Whether ``buffer_id`` is still an entry awaiting its commit here (from memory);
        False once it is committed or released (its lease ended, a DELETE)."""
        held = self.runtime.held(buffer_id)
        return held is not None and not held.live


def _attach_collectors(svc: Service) -> None:
    """The metrics read at scrape time: the ledger's, the runtime's, the entries', the
    pages found off their pool's node."""
    svc.metrics.attach_ledger(LedgerCollector(svc.pools, svc.tenants))
    svc.metrics.registry.register(HotPathCollector())
    svc.metrics.attach_runtime(
        RuntimeCollector(
            svc.runtime.released_attached, lambda: (svc.budget.held(), svc.budget.budget)
        )
    )
    r = svc.runtime
    svc.metrics.attach_entries(
        EntryCollector(r.entry_stats, r.released_entry_bytes, r.holders.held_by)
    )
    svc.metrics.attach_placement(PlacementCollector(lambda: stray_pages(r)))


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
    if limits.region_budget < MIN_USEFUL_REGIONS:
        raise ConfigError(too_few_regions(limits))
    return RegionBudget(limits)
