"""A tenant's buffers once reserved: look at, pin, renew, checkpoint, release, look up.

Reserving one (pool choice, room, region, the ``reserving`` → ``live`` rows) is
:mod:`maasd.core.reserve`'s; it builds its answer with :func:`buffer_info`. A buffer's
region is read or moved here under its buffer lock (the order: :mod:`maasd.core.regions`).
"""

from __future__ import annotations

import time

import msgspec

from maasd.core.auth import require_admin, require_tenant
from maasd.core.checkpoints import Checkpoints
from maasd.core.holders import Holders, holder_pids
from maasd.core.livepools import LivePools
from maasd.core.pools import Pools
from maasd.core.regions import Regions
from maasd.core.release import Releaser
from maasd.core.uses import UseBatch
from maasd.errors import NotFound, StateConflict
from maasd.models import BufferInfo, Checkpoint, LookupHit, Principal, rfc3339
from maasd.settings import Settings
from maasd.store import BufferRepo, BufferRow, TenantRepo, must_last
from maasd.tenancy import leases

__all__ = ["Buffers", "buffer_info"]


def buffer_info(row: BufferRow, placed: dict[int, int] | None = None) -> BufferInfo:
    """The API record of a buffer; ``placed`` is its measured pages per node, when counted."""
    return BufferInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        pool_id=row.pool_id,
        size_bytes=row.size_bytes,
        numa_node=row.numa_node,
        persistence=row.persistence,
        label=row.label,
        key=row.key,
        evictable=row.evictable,
        state=row.state,
        created_at=rfc3339(row.created_at),
        expires_at=rfc3339(row.expires_at),
        placement=None if placed is None else {str(k): v for k, v in placed.items()},
        checksum=row.checksum,
    )


def held_infos(store: BufferRepo, holders: Holders, tenant_id: str | None) -> list[BufferInfo]:
    """Released entries some process still holds (of ``tenant_id``, or all), each with the
    pids that hold it (a scan of /proc: the admin's question, not a request path's)."""
    held = [h for h in holders.held_by() if tenant_id in (None, h.tenant_id)]
    pids = holder_pids(h.inode for h in held)
    infos = []
    for h in held:
        row = store.buffer(h.buffer_id)
        if row is not None:
            infos.append(msgspec.structs.replace(buffer_info(row), holder_pids=pids.get(h.inode)))
    return infos


def held_durable(regions: Regions, live: LivePools, who: Principal, buffer_id: str) -> bool | None:
    """Whether releasing a buffer this process holds for ``who`` waits for the disk (its
    pool's persistence), without a ledger read: a region held here is a row of this host,
    and the release's compare-and-set checks the rest (the tenant, a live or staged row).
    ``None`` when it is not held here for ``who``."""
    held = regions.held(buffer_id)
    if held is None or (not who.is_admin and held.tenant_id != who.tenant_id):
        return None
    pool = live.get(held.pool_id)
    return None if pool is None else must_last(pool.row.persistence)


#: The largest buffer whose release scrubs it inside its one ledger transaction
#: (:meth:`Releaser.release_live`): the memset of its present pages, at most, holds the
#: ledger's writer lock (~0.1 ms per populated MiB here; none for an unwritten one).
RELEASE_AT_ONCE_MAX = 4 << 20


def at_once(regions: Regions, live: LivePools, who: Principal, buffer_id: str) -> bool:
    """Whether a release of ``buffer_id`` by ``who`` may end its row and scrub its memory in
    one ledger transaction (:meth:`Releaser.release_live`): held here for ``who``, live
    (workers may hold handles), not an entry, in a volatile pool, and small."""
    held = regions.held(buffer_id)
    if held is None or not held.live or held.committed:
        return False
    if not who.is_admin and held.tenant_id != who.tenant_id:
        return False
    pool = live.get(held.pool_id)
    return (
        pool is not None
        and not must_last(pool.row.persistence)
        and held.region.size <= RELEASE_AT_ONCE_MAX
    )


class Buffers:
    """The use-cases of one daemon's buffers once reserved (a reserve: :mod:`.reserve`)."""

    def __init__(
        self,
        settings: Settings,
        store: BufferRepo,
        tenant_rows: TenantRepo,
        regions: Regions,
        live: LivePools,
        holders: Holders,
        pools: Pools,
        releaser: Releaser,
        checkpoints: Checkpoints,
        uses: UseBatch | None = None,
    ) -> None:
        self._settings = settings
        #: lease extensions of lookup hits not written yet (a lease ends at the later)
        self._uses = uses
        self._host = settings.node_name
        self._buffer_rows = store
        self._tenant_rows = tenant_rows  # an admin's tenant reference (id or name) resolved
        self._regions = regions
        self._live = live
        self._holders = holders
        self._pools = pools
        self._releaser = releaser
        self._checkpoints = checkpoints

    def buffers(
        self, who: Principal, tenant_id: str | None = None, *, held: bool = False
    ) -> list[BufferInfo]:
        """The caller's live buffers and staged entries; the admin's: everyone's, or ``tenant_id``'s (id or name).
        ``held`` (admin only): the released entries some process still holds, and who."""
        if held:
            require_admin(who)
        if not who.is_admin:
            tenant_id = who.tenant_id
        elif tenant_id is not None:
            row = self._tenant_rows.tenant(tenant_id)
            if row is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            tenant_id = row.id
        if held:
            return held_infos(self._buffer_rows, self._holders, tenant_id)
        # what usage counts and GET /v1/buffers/{id} answers: a put entry too, until its commit
        rows = self._buffer_rows.buffers(tenant_id=tenant_id, states=("live", "staged"))
        return [buffer_info(r) for r in rows]

    def buffer(self, who: Principal, buffer_id: str) -> BufferInfo:
        """One buffer, with its ``placement`` as the kernel reports it now (pages per node)."""
        row = self._own_row(who, buffer_id, hide_releasing=True)
        with self._regions.buffer_lock(row.id):
            region = self._regions.region(row.id)
            if region is None or region.closed:
                return buffer_info(row)
            return buffer_info(row, region.placement())

    def pin(self, who: Principal, buffer_id: str, numa_node: int) -> BufferInfo:
        """Bind and migrate the buffer's pages to ``numa_node``; return it with its measured placement."""
        require_tenant(who)
        row = _committed(self._held_here(self._own_row(who, buffer_id)), "pinned")
        with self._regions.buffer_lock(row.id):
            placed = self._regions.live_region(row.id).pin(numa_node, self._pools.topology.node_ids)
        self._buffer_rows.set_numa_node(row.id, numa_node)
        return buffer_info(msgspec.structs.replace(row, numa_node=numa_node), placed)

    def renew(self, who: Principal, buffer_id: str, ttl_s: int) -> BufferInfo:
        """Extend a live buffer's (or a staged entry's) lease to ``ttl_s`` seconds from now
        (at most ``max_ttl_s``)."""
        tenant_id = require_tenant(who)
        now = time.time()
        expires = leases.expires_at(now, ttl_s, self._settings.max_ttl_s)
        # A lease that has ended is over (the reaper releases it at its next pass), unless
        # a lookup hit extended it in memory and it is not written yet.
        alive_after = 0.0 if self._pending_lease(buffer_id) > now else now
        row = self._buffer_rows.renew(
            buffer_id, tenant_id, expires, alive_after, ttl_s=ttl_s, now=now
        )
        # The lease is what the tenant asked for now, even shorter, and its length is what
        # hits extend it by from here on. A lookup hit's extension from before must not be
        # written over it: one the batch still holds is dropped — after the new length is
        # set, so that no hit between the two remembers the old one again —, and one taken
        # already (a flush, a reserve's admission) the ledger refuses (its hit was before
        # the renew's ``lease_set_at``).
        self._regions.set_lease(buffer_id, expires, ttl_s)
        if self._uses is not None:
            self._uses.forget_lease(buffer_id)
        return buffer_info(row)

    def checkpoint(self, who: Principal, buffer_id: str) -> Checkpoint:
        """Write a persistent buffer to its pool's spill dir; :class:`StateConflict` if volatile."""
        require_tenant(who)
        row = _committed(self._held_here(self._own_row(who, buffer_id)), "checkpointed")
        if row.persistence != "persistent":
            raise StateConflict("only buffers of persistent pools can be checkpointed")
        return self._checkpoints.write(row)

    def release(self, who: Principal, buffer_id: str) -> None:
        """Scrub and free a buffer (a staged entry too: its commit then answers 409); every
        byte is zero before this returns."""
        tenant_id = None if who.is_admin else who.tenant_id
        if at_once(self._regions, self._live, who, buffer_id) and self._releaser.release_live(
            buffer_id, tenant_id
        ):
            return
        durable = held_durable(self._regions, self._live, who, buffer_id)
        if durable is None:  # not held here for the caller: the ledger says what it is
            durable = must_last(self._held_here(self._own_row(who, buffer_id)).persistence)
        row = self._buffer_rows.mark_releasing(
            buffer_id, tenant_id, only_leased=True, durable=durable
        )
        self._releaser.release_row(row, reason="release", marked=True)

    def lookup(self, who: Principal, lookup_keys: list[str]) -> LookupHit | None:
        """The longest of ``lookup_keys`` (ordered short → long) with a live buffer here;
        ``None`` for a miss (the REST edge answers it 404)."""
        tenant_id = require_tenant(who)
        now = time.time()

        def leased(row: BufferRow) -> bool:  # its lease not ended (the reaper's lag aside)
            return max(row.expires_at, self._pending_lease(row.id)) > now

        hit = self._buffer_rows.lookup(tenant_id, lookup_keys, host=self._host, alive=leased)
        if hit is None:
            return None
        return LookupHit(key=hit[0], buffer=buffer_info(hit[1]))

    def _pending_lease(self, buffer_id: str) -> float:
        pending = None if self._uses is None else self._uses.pending_lease(buffer_id)
        return pending or 0.0

    def _held_here(self, row: BufferRow) -> BufferRow:
        """``row`` if this host's memory holds it; :class:`StateConflict` naming its host if
        another's does (only the holder can pin, checkpoint or scrub it; see
        docs/scale-out.md)."""
        if row.host != self._host:
            raise StateConflict(
                f"buffer {row.id} is held by host {row.host}, not {self._host}: "
                "do this through that host's daemon"
            )
        return row

    def _own_row(self, who: Principal, buffer_id: str, hide_releasing: bool = False) -> BufferRow:
        """The buffer if ``who`` may see it (the admin sees all); :class:`NotFound` otherwise.
        ``hide_releasing``: one being released is gone to its tenant (the admin still sees
        it, e.g. a committed entry a worker holds open, still in the quota)."""
        row = self._buffer_rows.buffer(buffer_id, None if who.is_admin else who.tenant_id)
        if row is None or (hide_releasing and row.state == "releasing" and not who.is_admin):
            raise NotFound(f"no buffer {buffer_id!r}")
        return row


def _committed(row: BufferRow, what: str) -> BufferRow:
    """``row`` unless it is an entry its writer has not committed yet (:class:`StateConflict`):
    its bytes are still being written, and its commit moves them to another region."""
    if row.state == "staged":
        raise StateConflict(f"entry {row.id} is not committed yet: it cannot be {what}")
    return row
