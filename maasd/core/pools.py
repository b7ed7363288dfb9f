"""Pools of this host: loading them, provisioning the configured ones, creating, deleting.

A pool exists twice: as a ledger row (the authority, shared with other hosts
through PostgreSQL) and as an in-process :class:`~maasd.allocator.MemoryPool` (the
allocator that accounts its capacity), held together as a
:class:`~maasd.core.livepools.LivePool`; :class:`Pools` owns the
:class:`~maasd.core.livepools.LivePools` (the only part that adds or removes one). Persistent pools also own a spill
directory for their checkpoints, and pools with a warm budget keep a stock of
prefaulted regions that the lifecycle's :class:`~maasd.allocator.Warmer` refills.

Pool names repeat on every host (``node0`` on each): a name always means this
host's pool, and only this host's pools take reserves here. Another host's
pools are only *read* from the ledger, for the admin's listing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

import msgspec

from maasd.allocator import MemoryPool, Warmer
from maasd.allocator.arith import round_up
from maasd.allocator.reclaim import Reclaimer
from maasd.allocator.stock import warm_budget
from maasd.bounds import MAX_BYTES
from maasd.core.holders import Holders
from maasd.core.latency import Measurements
from maasd.core.livepools import LivePool, LivePools
from maasd.core.release import Releaser
from maasd.errors import InvalidRequest, NotFound, PlacementError, StateConflict, TooLarge
from maasd.models import DiskTierInfo, PoolInfo, PoolSpec
from maasd.settings import Settings, default_pools
from maasd.store import ACCOUNTED_STATES, BufferRepo, PoolRepo, PoolRow
from maasd.tenancy import keys
from maasd.topology import Node, Topology, discover

__all__ = ["Pools", "pool_info"]

logger = logging.getLogger(__name__)


def pool_info(
    row: PoolRow,
    used: tuple[int, int],
    warm: int = 0,
    held: int = 0,
    disk: DiskTierInfo | None = None,
) -> PoolInfo:
    """The API record of a pool; ``used`` is ``(used_bytes, buffers)``, ``warm`` its stock.

    ``used_bytes`` are the buffers' (the ledger's); the warm stock is part of
    ``free_bytes``, since a reserve takes it or gives it back.
    """
    return PoolInfo(
        id=row.id,
        name=row.name,
        host=row.host,
        numa_node=row.numa_node,
        backing=row.backing,
        persistence=row.persistence,
        latency_us=row.latency_us,
        capacity_bytes=row.capacity_bytes,
        used_bytes=used[0],
        free_bytes=row.capacity_bytes - used[0],
        page_bytes=row.page_bytes,
        prefault=row.prefault,
        scrub=row.scrub,
        buffers=used[1],
        warm_bytes=warm,
        warm_target_bytes=row.warm_bytes,
        held_bytes=held,
        disk_dir=row.disk_dir,
        disk_bytes=row.disk_bytes,
        disk=disk,
    )


def disk_dir_of(spec: PoolSpec, data_dir: str, pools: Iterable[LivePool]) -> str | None:
    """The directory of a pool's disk tier, made and checked; ``None`` without one. Each
    pool needs a directory of its own (none of ``pools``'): a tier empties it at start."""
    if not spec.disk_bytes:
        if spec.disk_dir is not None:
            raise InvalidRequest("disk_dir needs disk_bytes > 0")
        return None
    if spec.disk_dir is not None and not os.path.isabs(spec.disk_dir):
        raise InvalidRequest(f"disk_dir must be an absolute path, got {spec.disk_dir!r}")
    disk_dir = os.path.normpath(spec.disk_dir or os.path.join(data_dir, "disk", spec.name))
    real = os.path.realpath(disk_dir)  # one directory under another name (a symlink)
    for live in pools:
        theirs = live.row.disk_dir
        if theirs and (theirs == disk_dir or os.path.realpath(theirs) == real):
            raise StateConflict(f"disk_dir {disk_dir!r} is pool {live.row.name}'s already")
    try:
        os.makedirs(disk_dir, mode=0o700, exist_ok=True)
        if not os.access(disk_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise InvalidRequest(f"disk_dir {disk_dir!r} cannot be used: {e.strerror or e}") from e
    return disk_dir


def spill_dir_of(spec: PoolSpec, data_dir: str) -> str | None:
    """The directory a persistent pool checkpoints to, made and checked; ``None`` otherwise."""
    if spec.persistence != "persistent":
        if spec.spill_dir is not None:
            raise InvalidRequest("spill_dir only applies to persistent pools")
        return None
    if spec.spill_dir is not None and not os.path.isabs(spec.spill_dir):
        raise InvalidRequest(f"spill_dir must be an absolute path, got {spec.spill_dir!r}")
    spill_dir = spec.spill_dir or os.path.join(data_dir, "spill", spec.name)
    try:
        os.makedirs(spill_dir, mode=0o700, exist_ok=True)
        if not os.access(spill_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise InvalidRequest(f"spill_dir {spill_dir!r} cannot be used: {e.strerror or e}") from e
    return spill_dir


def follow_disk(spec: PoolSpec, store: PoolRepo, live_pools: LivePools, data_dir: str) -> None:
    """Give a pool the disk tier its configuration asks for now. It binds no buffer (the
    tier is emptied at every start), so a change applies at this start."""
    live = live_pools.find(spec.name)
    if (live.row.disk_dir, live.row.disk_bytes) == (spec.disk_dir, spec.disk_bytes):
        return
    if spec.disk_bytes == live.row.disk_bytes and spec.disk_dir is None and live.row.disk_dir:
        return  # the default directory, as made when the pool was
    others = [p for p in live_pools.all() if p is not live]
    disk_dir = disk_dir_of(spec, data_dir, others)
    store.set_pool_disk(live.row.id, disk_dir, spec.disk_bytes)
    live.row = msgspec.structs.replace(live.row, disk_dir=disk_dir, disk_bytes=spec.disk_bytes)
    logger.info("pool %s: disk tier %s, %d bytes", spec.name, disk_dir, spec.disk_bytes)


def follow_warm(spec: PoolSpec, store: PoolRepo, live_pools: LivePools) -> None:
    """Give a pool the warm budget its configuration asks for now.

    Unlike the other properties, the budget binds no buffer: a changed
    ``warm_bytes`` (or ``MAASD_DEFAULT_WARM_BYTES``) applies at the next start.
    """
    live = live_pools.find(spec.name)
    if live.row.warm_bytes == spec.warm_bytes or not live.row.prefault:
        return
    live.pool.set_warm_bytes(min(spec.warm_bytes, live.row.capacity_bytes))
    store.set_pool_warm(live.row.id, live.pool.warm_bytes)
    live.row = msgspec.structs.replace(live.row, warm_bytes=live.pool.warm_bytes)
    logger.info("pool %s: warm stock budget %d bytes", spec.name, live.pool.warm_bytes)


def new_pool_row(
    spec: PoolSpec,
    topology: Topology,
    fresh_node: Callable[[int], Node | None],
    *,
    host: str,
    data_dir: str,
    live: Iterable[LivePool],
) -> PoolRow:
    """The ledger row ``spec`` makes on this host, checked: the node exists (in
    ``topology``), the capacity rounded up to whole pages stays below 2^63 and, for
    memfd, within the node's memory as ``fresh_node`` reads it now; its spill and disk
    directories are made (:func:`spill_dir_of`, :func:`disk_dir_of`)."""
    if spec.numa_node not in topology.node_ids:
        raise PlacementError(
            f"NUMA node {spec.numa_node} does not exist on this host "
            f"(nodes: {sorted(topology.node_ids)})"
        )
    page = topology.page_bytes_of(spec.backing)
    if spec.capacity_bytes > MAX_BYTES - page:  # it must stay below 2^63 rounded up
        raise InvalidRequest("capacity_bytes rounded up to whole pages must stay below 2^63")
    capacity = -(-spec.capacity_bytes // page) * page
    warm = warm_budget(spec.warm_bytes, capacity, page, spec.prefault)
    node = fresh_node(spec.numa_node)
    if (
        spec.backing == "memfd"
        and node is not None
        and node.mem_total_bytes
        and capacity > node.mem_total_bytes
    ):
        raise TooLarge(
            f"capacity {capacity} bytes exceeds node {spec.numa_node}'s memory "
            f"({node.mem_total_bytes} bytes)"
        )
    return PoolRow(
        id=keys.new_id(),
        host=host,
        name=spec.name,
        numa_node=spec.numa_node,
        backing=spec.backing,
        persistence=spec.persistence,
        latency_us=spec.latency_us,
        capacity_bytes=capacity,
        page_bytes=page,
        prefault=spec.prefault,
        scrub=spec.scrub,
        spill_dir=spill_dir_of(spec, data_dir),
        created_at=time.time(),
        warm_bytes=warm,
        disk_dir=disk_dir_of(spec, data_dir, live),
        disk_bytes=spec.disk_bytes,
    )


#: The properties of a pool that its buffers are bound to: a config file's change of one
#: (or of the capacity) is logged and not followed (the ledger's is kept).
BOUND = ("numa_node", "backing", "persistence", "latency_us", "scrub")


def differs(have: PoolRow, spec: PoolSpec, *, configured: bool = True) -> list[str]:
    """The properties in which a pool in the ledger is not what its configuration asks
    for (a capacity larger or smaller, a spill dir moved): the ledger's are kept, and the
    caller logs these names. A default pool (``configured=False``) is not compared by
    capacity: its default follows the node's free memory, which changes at every start."""
    names = [name for name in BOUND if getattr(have, name) != getattr(spec, name)]
    if configured and have.capacity_bytes != round_up(spec.capacity_bytes, have.page_bytes):
        names.append("capacity_bytes")
    if (
        spec.spill_dir is not None
        and have.spill_dir is not None
        and os.path.realpath(spec.spill_dir) != os.path.realpath(have.spill_dir)
    ):
        names.append("spill_dir")
    return names


class Pools:
    """The pools of this host (``settings.node_name``) and the host's topology."""

    def __init__(
        self,
        settings: Settings,
        store: PoolRepo,
        buffer_rows: BufferRepo,
        live: LivePools,
        holders: Holders,
        releaser: Releaser,
        reclaimer: Reclaimer,
        warmer: Warmer,
        topology: Topology,
        *,
        disk_usage: Callable[[str], DiskTierInfo | None] = lambda _pool_id: None,
        on_created: Callable[[PoolRow], None] = lambda _row: None,
        on_deleted: Callable[[str], None] = lambda _pool_id: None,
    ) -> None:
        self._settings = settings
        self._host = settings.node_name
        self._pool_rows = store
        self._buffer_rows = buffer_rows  # what a pool still holds, before it goes
        self._live = live  # this module adds and removes them; others only read them
        self._holders = holders
        self._releaser = releaser
        self._reclaimer = reclaimer
        self._warmer = warmer
        #: The NUMA topology as last discovered.
        self.topology = topology
        #: A pool's disk tier now, by pool id (the disk tiers' ``usage``); an admin's new
        #: pool's tier opened, a deleted pool's erased (their ``add`` and ``remove``).
        self._disk_usage = disk_usage
        self._on_created = on_created
        self._on_deleted = on_deleted
        #: Each node's measured latency class, once the probe (started by provision) answers.
        self.measured = Measurements(bool(settings.latency_probe), settings.latency_probe_timeout_s)

    def refresh_topology(self) -> Topology:
        """Discover the topology again (free memory changes) and keep it."""
        self.topology = discover()
        return self.topology

    # -- start ------------------------------------------------------------------------------

    def load(self) -> None:
        """Make the ledger's pools of this host live (before recovery adopts their buffers)."""
        for row in self._pool_rows.pools(self._host):
            self._live.add(LivePool(row, self._make_pool(row)))

    def provision(self) -> None:
        """Create the configured pools (or the default ones) that the ledger lacks.

        A pool already in the ledger keeps the ledger's properties — it has live
        buffers bound to them — and a difference from the configuration is logged;
        only its warm stock budget follows the configuration.
        A default pool (no ``[[pools]]`` configured) that an admin deleted stays deleted:
        the audit trail's ``pool_delete`` event for it is the record. A configured pool
        is the configuration's to declare, so it is made again.
        """
        wanted = self._settings.pools or default_pools(
            self.topology, self._settings.default_pool_bytes, self._settings.default_warm_bytes
        )
        existing = {live.row.name: live.row for live in self._live.all()}
        if not self._settings.pools:
            missing = [spec.name for spec in wanted if spec.name not in existing]
            deleted = self._pool_rows.deleted_pools(self._host, missing)
            for name in sorted(deleted):
                logger.info(
                    "default pool %s was deleted by an admin: not made again "
                    "(maasctl pools create makes it)",
                    name,
                )
            wanted = [spec for spec in wanted if spec.name not in deleted]
        for spec in wanted:
            have = existing.get(spec.name)
            if have is None:
                self._create(spec)  # its disk tier opens with the others' (DiskTiers.start)
                continue
            follow_warm(spec, self._pool_rows, self._live)
            follow_disk(spec, self._pool_rows, self._live, self._settings.data_dir)
            if changed := differs(have, spec, configured=bool(self._settings.pools)):
                logger.warning(
                    "pool %s in the ledger differs from its configuration in %s; keeping "
                    "the ledger's (delete the pool with drain to recreate it)",
                    spec.name,
                    ", ".join(changed),
                )
        self.measured.start(self.topology)

    def _make_pool(self, row: PoolRow) -> MemoryPool:
        return MemoryPool(
            row.name,
            numa_node=row.numa_node,
            capacity=row.capacity_bytes,
            backing=row.backing,
            persistence=row.persistence,
            latency_us=row.latency_us,
            prefault=row.prefault,
            scrub=row.scrub,
            page_bytes=row.page_bytes,
            warm_bytes=row.warm_bytes,
            reclaimer=self._reclaimer,
            warmer=self._warmer,
        )

    # -- use-cases --------------------------------------------------------------------------

    def infos(self, *, all_hosts: bool = False) -> list[PoolInfo]:
        """Every pool of this host with its usage, by name; ``all_hosts``: every host's
        (from the ledger), by host then name. This host's show their measured class."""
        return self.measured.annotate(self._infos(all_hosts), self._host)

    def _infos(self, all_hosts: bool) -> list[PoolInfo]:
        held = self._holders.held_bytes_by("pool_id")
        warm = {live.row.id: live.pool.warm for live in self._live.all()}
        if all_hosts:
            rows, usage = self._pool_rows.all_pools(), self._pool_rows.usage_by_pool(None)
        else:
            rows = sorted((live.row for live in self._live.all()), key=lambda r: r.name)
            usage = self._pool_rows.usage_by_pool(self._host)
        return [
            pool_info(
                row,
                usage.get(row.id, (0, 0)),
                warm.get(row.id, 0),
                held.get(row.id, 0),
                self._disk_usage(row.id),
            )
            for row in rows
        ]

    def info(self, id_or_name: str, *, any_host: bool = False) -> PoolInfo:
        """One pool of this host (id or name) with its usage; ``any_host``: else another
        host's pool by id (read from the ledger). :class:`NotFound` otherwise."""
        live = self._live.named(id_or_name)
        if live is None:
            other = self._pool_rows.pool_row(id_or_name) if any_host else None
            if other is None:
                raise NotFound(f"no pool {id_or_name!r} on host {self._host}")
            return pool_info(other, self._pool_rows.usage_by_pool(other.host).get(other.id, (0, 0)))
        used = self._pool_rows.usage_by_pool(self._host).get(live.row.id, (0, 0))
        held = self._holders.held_bytes_by("pool_id").get(live.row.id, 0)
        info = pool_info(live.row, used, live.pool.warm, held, self._disk_usage(live.row.id))
        return self.measured.annotate([info], self._host)[0]

    def create(self, spec: PoolSpec) -> PoolInfo:
        """Create a pool on this host, and open its disk tier if it has one. Name unique;
        node must exist; capacity rounded to pages."""
        row = self._create(spec)
        self._on_created(row)
        return self.measured.annotate([pool_info(row, (0, 0))], self._host)[0]

    def _create(self, spec: PoolSpec) -> PoolRow:
        """The pool's ledger row added and its allocator made live."""
        row = new_pool_row(
            spec,
            self.topology,
            lambda n: self.refresh_topology().node(n),
            host=self._host,
            data_dir=self._settings.data_dir,
            live=self._live.all(),
        )
        pool = self._make_pool(row)
        try:
            self._pool_rows.add_pool(row)
        except BaseException:
            pool.close()  # it registered with the warmer: take it back out
            raise
        self._live.add(LivePool(row, pool))
        logger.info(
            "pool %s created: node %d, %d bytes, %s/%s",
            row.name,
            row.numa_node,
            row.capacity_bytes,
            row.backing,
            row.persistence,
        )
        return row

    def delete(self, id_or_name: str, *, drain: bool = False) -> None:
        """Delete an empty pool of this host; with ``drain`` release (scrub) its buffers first;
        then every entry of its disk tier is erased.

        Another host's pool is a :class:`NotFound` that names its host: only the
        daemon holding a pool's memory can scrub its buffers. Without ``drain`` a
        pool holding buffers answers :class:`StateConflict` and nothing changes. A
        drain never stops half-way: the pool is marked deleting (from then on no
        reserve lands in it: 409 when it is named, and it is no candidate otherwise),
        its warm stock is given back, every buffer is released — also those whose
        reserve is in flight, which lose their compare-and-set to ``live`` and scrub
        their own region — and the pool goes once it is empty. A pool whose drain
        began (and a daemon stopped) finishes it whether or not ``drain`` is given
        again.
        """
        live = self._live.named(id_or_name)
        if live is None:
            other = self._pool_rows.pool_row(id_or_name)
            if other is None:
                raise NotFound(f"no pool {id_or_name!r}")
            raise NotFound(
                f"pool {id_or_name!r} is on host {other.host}, not {self._host}: "
                "delete it through that host's daemon"
            )
        if not drain and live.row.deleting_at is None:
            try:
                self._pool_rows.delete_pool(live.row.id)  # counts its buffers in the transaction
            except StateConflict:
                n = len(self._buffer_rows.buffers(pool_id=live.row.id, states=ACCOUNTED_STATES))
                raise StateConflict(
                    f"pool {live.row.name} holds {n} buffer(s); "
                    "release them or delete with drain=true"
                ) from None
            self._live.remove(live.row.id)
            live.pool.close()  # its warm stock goes with it
        else:
            at = self._pool_rows.mark_pool_deleting(live.row.id)
            live.row = msgspec.structs.replace(live.row, deleting_at=at)
            self._finish_delete(live)
        self._on_deleted(live.row.id)

    def unload(self) -> None:
        """Forget every live pool (a fence: this host's claim is gone; :meth:`load` again)."""
        for live in self._live.all():
            self._live.remove(live.row.id)

    def finish_deletes(self) -> int:
        """Finish the drains of this host's pools that a previous run began (at start)."""
        draining = [live for live in self._live.all() if live.row.deleting_at is not None]
        for live in draining:
            logger.info("finishing the drain of pool %s", live.row.name)
            self._finish_delete(live)
        return len(draining)

    def _finish_delete(self, live: LivePool) -> None:
        """Release the draining pool's buffers until it holds none, then delete it."""
        pool_id = live.row.id
        live.pool.close()  # no stock for a pool on its way out (releases still work)
        self._releaser.release_all(
            lambda: self._buffer_rows.buffers(pool_id=pool_id, states=ACCOUNTED_STATES),
            lambda: self._pool_rows.delete_pool(pool_id),
            reason="pool_drain",
            what=f"pool {live.row.name}",
        )
        self._live.remove(pool_id)
        logger.info("pool %s deleted", live.row.name)
