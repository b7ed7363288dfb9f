"""A tenant's buffers: reserve, look at, pin, renew, checkpoint, release, look up by key.

A reserve records its intent in the ledger before it touches memory::

    ledger: row ``reserving`` (quota, capacity, key and eviction decided atomically)
    memory: victims scrubbed; region created, sealed, bound, prefaulted, placement checked
    ledger: row ``live``

so that a crash at any point leaves rows that recovery can settle. An entry's put
is admitted ``staged`` (it stays so until its commit) and goes without the last
write: a release of the row before its region is held finds no region and leaves a
note in the runtime (:mod:`maasd.core.inflight`), which the put reads once it holds the
region, instead of reading the row again.
"""

from __future__ import annotations

import time

import msgspec

from maasd.allocator import F_SEAL_FUTURE_WRITE, Region
from maasd.core import placement, room
from maasd.core.attachments import Attachments
from maasd.core.auth import require_admin, require_tenant
from maasd.core.checkpoints import Checkpoints
from maasd.core.holders import Holders, holder_pids
from maasd.core.limits import RegionBudget, kernel_refusal
from maasd.core.livepools import LivePool, LivePools
from maasd.core.pools import Pools
from maasd.core.regions import Held, Regions
from maasd.core.release import Releaser
from maasd.core.uses import UseBatch
from maasd.errors import BackingError, NotFound, PoolExhausted, StateConflict
from maasd.metrics import Metrics
from maasd.models import (
    BufferInfo,
    BufferKind,
    BufferState,
    Checkpoint,
    LookupHit,
    Principal,
    ReserveSpec,
    rfc3339,
)
from maasd.settings import Settings
from maasd.store import BufferRow, Store, must_last
from maasd.tenancy import keys, leases

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


def held_infos(store: Store, holders: Holders, tenant_id: str | None) -> list[BufferInfo]:
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


class Buffers:
    """The buffer use-cases of one daemon."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        regions: Regions,
        live: LivePools,
        uses: UseBatch,
        attachments: Attachments,
        holders: Holders,
        pools: Pools,
        releaser: Releaser,
        checkpoints: Checkpoints,
        metrics: Metrics,
        budget: RegionBudget,
    ) -> None:
        self._settings = settings
        self._budget = budget
        self._host = settings.node_name
        self._store = store
        self._regions = regions
        self._live = live
        self._uses = uses  # a reserve's admission writes the batch (room.admit)
        self._attachments = attachments
        self._holders = holders
        self._pools = pools
        self._releaser = releaser
        self._checkpoints = checkpoints
        self._metrics = metrics

    def reserve(
        self, who: Principal, req: ReserveSpec, *, kind: BufferKind = "buffer", frozen: bool = False
    ) -> BufferInfo:
        """Reserve a buffer in ``req.pool`` (id or name), or in the best pool meeting the QoS.

        ``kind="entry"`` is a socket ``put`` (ends ``staged``: handed to its writer only);
        ``frozen``: sealed ``F_SEAL_FUTURE_WRITE`` from the start, for an entry only the
        daemon writes before committing it in place. Raises InvalidRequest, QosUnmet/
        PlacementError/TooLarge, QuotaExceeded, DuplicateKey, PoolExhausted (not now).
        """
        tenant_id = require_tenant(who)
        started = time.perf_counter()
        try:
            buf = self._reserve(tenant_id, req, kind, frozen)
        except Exception as e:
            self._metrics.reserve_total.labels(outcome=getattr(e, "code", "error")).inc()
            raise
        self._metrics.reserve_total.labels(outcome="granted").inc()
        self._metrics.reserve_seconds.observe(time.perf_counter() - started)
        return buf

    def _reserve(
        self, tenant_id: str, req: ReserveSpec, kind: BufferKind, frozen: bool
    ) -> BufferInfo:
        now = time.time()
        expires = leases.expires_at(now, req.ttl_s, self._settings.max_ttl_s)
        candidates = self._candidates(req)
        # Eviction picks by last use: the admitting transaction writes the latest
        # attaches and lookup hits first (saving a commit of their own); unwritten,
        # they are kept.
        uses, extended = self._uses.take()
        last_error: Exception | None = None
        for live in candidates:
            row = BufferRow(
                id=keys.new_id(),
                tenant_id=tenant_id,
                pool_id=live.row.id,
                host=self._host,
                size_bytes=live.pool.rounded(req.size_bytes),
                numa_node=live.row.numa_node,
                persistence=live.row.persistence,
                label=req.label,
                key=req.key,
                evictable=req.evictable,
                state="reserving",
                created_at=now,
                expires_at=expires,
                last_used_at=now,
                kind=kind,
            )
            # a put's row released before its region is held: noted (maasd.core.inflight)
            with self._regions.puts.admitting(row.id, kind == "entry"):
                try:
                    # The daemon's own budget of fds and mappings first (507 resource-limit),
                    # before the ledger is asked: a region is one of each; the tenant's
                    # fair share of it too.
                    with self._budget.admit(tenant_id, self._regions.tenant_regions(tenant_id)):
                        # victims released; only bytes that really came free make room
                        row = room.admit(
                            self._store,
                            self._attachments,
                            self._holders,
                            self._releaser,
                            row,
                            uses=uses,
                            leases=extended,
                        )  # uses and leases: written by the admitting transaction
                        region = self._create(row, live, frozen=frozen)
                except PoolExhausted as e:  # this pool is full now: try the next one
                    last_error = e
                    continue
                except BaseException:
                    self._uses.untake(uses, extended)  # unwritten: kept for later
                    raise
                self._check_placement(row, live, region)
                return self._go_live(row, region)
        self._uses.untake(uses, extended)
        assert last_error is not None
        raise last_error

    def _create(self, row: BufferRow, live: LivePool, *, frozen: bool) -> Region:
        """``row`` is admitted (its victims gone): its region made. A failure finishes
        the row (``reserve_failed``) and says which limit the kernel met."""
        try:
            return live.pool.reserve(
                row.size_bytes,
                name=f"maasd-{row.id[:8]}",
                # frozen: no one but the daemon may write it, and every page is
                # present (writing it through the daemon's mapping cannot fault)
                extra_seals=F_SEAL_FUTURE_WRITE if frozen else 0,
                prefault=True if frozen else None,
            )
        except PoolExhausted:  # the in-process guard disagreed with the ledger
            self._reserve_failed(row)
            raise
        except BackingError as e:
            self._reserve_failed(row)
            refusal = kernel_refusal(
                e,
                self._budget,
                f"{row.size_bytes} bytes on node {row.numa_node}",
                hugetlb=live.row.backing == "hugetlb",
            )
            if refusal is None:
                raise
            raise refusal from e

    def _candidates(self, req: ReserveSpec) -> list[LivePool]:
        """The live pools that could hold the request, most free space first; a pool being
        deleted takes no reserve (named: 409; otherwise it is not a candidate)."""
        if req.pool is not None:
            live = [self._live.find(req.pool)]
            if live[0].row.deleting_at is not None:
                raise StateConflict(f"pool {live[0].row.name!r} is being deleted")
        else:
            live = [p for p in self._live.all() if p.row.deleting_at is None]
        node_ids, measured = self._pools.topology.node_ids, self._pools.measured.classes()
        rows = placement.candidates([p.row for p in live], req, node_ids, measured)
        if len(rows) > 1:
            usage = self._store.usage_by_pool(self._host)
            rows = placement.by_free_space(rows, {k: v[0] for k, v in usage.items()})
        by_id = {p.row.id: p for p in live}
        return [by_id[row.id] for row in rows]

    def _check_placement(self, row: BufferRow, live: LivePool, region: Region) -> None:
        """Placement is measured, not assumed (``move_pages``, a sample: ~30 µs); a stocked
        region's was, when the warmer faulted it in."""
        if not live.row.prefault or region.placed:
            return  # no pages yet: nothing to measure
        try:
            region.verify_node(sample=16)
        except Exception:
            live.pool.release(region)
            self._reserve_failed(row)
            raise

    def _reserve_failed(self, row: BufferRow) -> None:
        """Delete the row of a reserve that failed after its admission (its memory is
        gone or never was); a volatile buffer's without waiting for the disk."""
        self._store.finish_release(
            row.id, kind="reserve_failed", durable=must_last(row.persistence)
        )

    def _go_live(self, row: BufferRow, region: Region) -> BufferInfo:
        state: BufferState = "staged" if row.kind == "entry" else "live"
        ttl_s = max(1, round(row.expires_at - row.created_at))  # what a lookup hit extends by
        # The region is held before the row goes live (or its put reads its note), so that
        # whoever releases the row from then on finds its memory.
        self._regions.hold(row.id, Held(region, row.tenant_id, row.pool_id, row.key, ttl_s=ttl_s))
        if state == "staged":  # a release that found no region yet left a note: no read
            if self._regions.puts.settle(row.id):
                self._releaser.drop_region(row)
                raise NotFound(f"entry {row.id} was released while it was put")
            return buffer_info(msgspec.structs.replace(row, state=state))
        # A volatile buffer's ledger writes do not wait for the disk (store/base.py).
        if not self._store.advance(row.id, "reserving", "live", durable=must_last(row.persistence)):
            # Claimed while reserving by a tenant delete or a pool drain: this reserve
            # lost, so it scrubs its own region (unless the claimer took it already)
            # and finishes the release the claimer began. The memory never outlives
            # its row, and no one ever saw it.
            self._releaser.drop_region(row)
            self._reserve_failed(row)
            raise StateConflict(
                f"buffer {row.id} was released while it was being reserved "
                "(its tenant or its pool is being deleted)"
            )
        self._regions.set_live(row.id)
        return buffer_info(msgspec.structs.replace(row, state=state))

    # -- the others -------------------------------------------------------------------------

    def buffers(
        self, who: Principal, tenant_id: str | None = None, *, held: bool = False
    ) -> list[BufferInfo]:
        """The caller's live buffers; the admin's: everyone's, or ``tenant_id``'s (id or name).
        ``held`` (admin only): the released entries some process still holds, and who."""
        if held:
            require_admin(who)
        if not who.is_admin:
            tenant_id = who.tenant_id
        elif tenant_id is not None:
            row = self._store.tenant(tenant_id)
            if row is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            tenant_id = row.id
        if held:
            return held_infos(self._store, self._holders, tenant_id)
        return [buffer_info(r) for r in self._store.buffers(tenant_id=tenant_id)]

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
        self._store.set_numa_node(row.id, numa_node)
        return buffer_info(msgspec.structs.replace(row, numa_node=numa_node), placed)

    def renew(self, who: Principal, buffer_id: str, ttl_s: int) -> BufferInfo:
        """Extend a live buffer's (or a staged entry's) lease to ``ttl_s`` seconds from now
        (at most ``max_ttl_s``)."""
        tenant_id = require_tenant(who)
        expires = leases.expires_at(time.time(), ttl_s, self._settings.max_ttl_s)
        return buffer_info(self._store.renew(buffer_id, tenant_id, expires))

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
        durable = held_durable(self._regions, self._live, who, buffer_id)
        if durable is None:  # not held here for the caller: the ledger says what it is
            durable = must_last(self._held_here(self._own_row(who, buffer_id)).persistence)
        row = self._store.mark_releasing(buffer_id, tenant_id, only_leased=True, durable=durable)
        self._releaser.release_row(row, reason="release", marked=True)

    def lookup(self, who: Principal, lookup_keys: list[str]) -> LookupHit | None:
        """The longest of ``lookup_keys`` (ordered short → long) with a live buffer here;
        ``None`` for a miss (the REST edge answers it 404)."""
        tenant_id = require_tenant(who)
        hit = self._store.lookup(tenant_id, lookup_keys, host=self._host)
        if hit is None:
            return None
        return LookupHit(key=hit[0], buffer=buffer_info(hit[1]))

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
        row = self._store.buffer(buffer_id, None if who.is_admin else who.tenant_id)
        if row is None or (hide_releasing and row.state == "releasing" and not who.is_admin):
            raise NotFound(f"no buffer {buffer_id!r}")
        return row


def _committed(row: BufferRow, what: str) -> BufferRow:
    """``row`` unless it is an entry its writer has not committed yet (:class:`StateConflict`):
    its bytes are still being written, and its commit moves them to another region."""
    if row.state == "staged":
        raise StateConflict(f"entry {row.id} is not committed yet: it cannot be {what}")
    return row
