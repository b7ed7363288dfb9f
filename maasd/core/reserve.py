"""Reserving a buffer: the pool chosen, the room made, the region created, the row live.

A reserve records its intent in the ledger before it touches memory::

    ledger: row ``reserving`` (quota, capacity, key and eviction decided atomically)
    memory: victims scrubbed; region created, sealed, bound, prefaulted, placement checked
    ledger: row ``live``

so that a crash at any point leaves rows that recovery can settle; a failure after the
admission deletes its row (``reserve_failed``) and gives its memory back. An entry's
put is admitted ``staged`` (it stays so until its commit), and a plain buffer — no key,
never evicted — ``live`` at once; both go without the last write: a release of the row
before its region is held finds no region and leaves a note
(:mod:`maasd.core.inflight`), which the reserve reads once it holds the region,
instead of reading the row again. A plain buffer's row is live a moment before its
region is held, which nothing can tell: no one knows its id before the answer, no
eviction or key lookup chooses it, and recovery releases a live row whose memory died
with the process as it does a ``reserving`` one (a volatile one always; a persistent
one without a checkpoint). A keyed or evictable buffer keeps the two writes: a lookup
or an eviction could find its row before its memory.

Locks (their order: :mod:`maasd.core.regions`): a reserve holds none across its ledger
admission or its region's creation. Its victims' releases take their buffers' locks one
at a time (:mod:`maasd.core.release`); the regions lock (a put's note, the tenant's
region count, the hold) and the region budget's lock are each taken for a dict update
and let go. What a buffer does once reserved is :mod:`maasd.core.buffers`'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import msgspec

from maasd.allocator import F_SEAL_FUTURE_WRITE, Region
from maasd.core import placement, room
from maasd.core.attachments import Attachments
from maasd.core.auth import require_tenant
from maasd.core.buffers import buffer_info
from maasd.core.holders import Holders
from maasd.core.limits import RegionBudget, kernel_refusal
from maasd.core.livepools import LivePool, LivePools
from maasd.core.pools import Pools
from maasd.core.regions import HeldRegion, Regions
from maasd.core.release import Releaser
from maasd.core.uses import UseBatch
from maasd.errors import BackingError, NotFound, PoolExhausted, StateConflict
from maasd.metrics import Metrics
from maasd.models import BufferInfo, BufferKind, BufferState, Principal, ReserveSpec
from maasd.settings import Settings
from maasd.store import BufferRepo, BufferRow, PoolRepo, ReserveRepo, must_last
from maasd.tenancy import keys, leases

__all__ = ["Reserves"]


class Reserves:
    """The reserve use-case of one daemon: a REST reserve, a socket put's, a restore's."""

    def __init__(
        self,
        settings: Settings,
        store: ReserveRepo,
        buffer_rows: BufferRepo,
        pool_rows: PoolRepo,
        regions: Regions,
        live: LivePools,
        uses: UseBatch,
        attachments: Attachments,
        holders: Holders,
        pools: Pools,
        releaser: Releaser,
        metrics: Metrics,
        budget: RegionBudget,
    ) -> None:
        self._settings = settings
        self._budget = budget
        self._default_cap = settings.max_buffers_per_tenant  # a tenant with no max_buffers
        self._host = settings.node_name
        self._reserve_rows = store  # the row admitted (room.admit), or deleted if it fails
        self._buffer_rows = buffer_rows  # reserving → live
        self._pool_rows = pool_rows  # the pools' usage, to choose one
        self._regions = regions
        self._live = live
        self._uses = uses  # a reserve's admission writes the batch (room.admit)
        self._attachments = attachments  # which victims are attached (room.admit)
        self._holders = holders
        self._pools = pools
        self._releaser = releaser
        self._metrics = metrics

    @property
    def max_ttl_s(self) -> int:
        """The longest lease a reserve may ask for now (``MAASD_MAX_TTL_S``)."""
        return self._settings.max_ttl_s

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
        # A plain buffer (no key, never evicted) is admitted live at once: no write after
        # its region is held (the module docstring says why that is safe).
        straight = kind == "buffer" and not req.evictable and req.key is None
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
                state="live" if straight else "reserving",
                created_at=now,
                expires_at=expires,
                last_used_at=now,
                kind=kind,
                ttl_s=req.ttl_s,
            )
            # a row admitted in its final state (a put's staged, a plain buffer's live) and
            # released before its region is held: noted (maasd.core.inflight)
            in_flight = kind == "entry" or straight
            with (
                self._regions.puts.admitting(row.id, in_flight) as renamed,
                contextlib.ExitStack() as counted,
            ):
                try:
                    # The daemon's own budget of fds and mappings first (507 resource-limit),
                    # before the ledger is asked: a region is one of each; the tenant's
                    # fair share of it too. The region counts as the tenant's in flight
                    # until it is held (``counted.close`` in _go_live): a concurrent
                    # reserve of the tenant sees it one way or the other, never neither.
                    counted.enter_context(
                        self._budget.admit(
                            tenant_id,
                            self._regions.tenant_regions(tenant_id),
                            self._regions.tenant_region_fds(tenant_id),
                        )
                    )
                    # victims released; only bytes that really came free make room
                    row = room.admit(
                        self._reserve_rows,
                        self._attachments,
                        self._holders,
                        self._releaser,
                        row,
                        uses=uses,
                        leases=extended,
                        default_cap=self._default_cap,
                        renamed=renamed,
                    )  # uses and leases: written by the admitting transaction
                    region = self._create(row, live, frozen=frozen)
                except PoolExhausted as e:  # this pool is full now: try the next one
                    last_error = e
                    continue
                except BaseException:
                    self._uses.untake(uses, extended)  # unwritten: kept for later
                    raise
                self._check_placement(row, live, region)
                return self._go_live(row, region, held=counted.close)
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
            usage = self._pool_rows.usage_by_pool(self._host)
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
        self._reserve_rows.finish_release(
            row.id, kind="reserve_failed", durable=must_last(row.persistence)
        )

    def _go_live(
        self, row: BufferRow, region: Region, held: Callable[[], object] = lambda: None
    ) -> BufferInfo:
        """``region`` held for ``row`` (then ``held()``: the budget counts it as the tenant's
        from there), and the row made live or staged."""
        state: BufferState = "staged" if row.kind == "entry" else "live"
        # The region is held before the row goes live (or its put reads its note), so that
        # whoever releases the row from then on finds its memory.
        self._regions.hold(
            row.id,
            HeldRegion(
                region,
                row.tenant_id,
                row.pool_id,
                row.key,
                ttl_s=row.lease_s,  # what a lookup hit extends it by
                expires_at=row.expires_at,
            ),
        )
        held()
        if state == "staged":  # a release that found no region yet left a note: no read
            if self._regions.puts.settle(row.id):
                self._releaser.drop_region(row)
                raise NotFound(f"entry {row.id} was released while it was put")
            return buffer_info(msgspec.structs.replace(row, state=state))
        if row.state == "live":  # admitted live: the same note, then handles may be had
            if self._regions.puts.settle(row.id):
                self._releaser.drop_region(row)
                raise _claimed(row.id)
            self._regions.set_live(row.id)
            return buffer_info(row)
        # A volatile buffer's ledger writes do not wait for the disk (store/base.py).
        if not self._buffer_rows.advance(
            row.id, "reserving", "live", durable=must_last(row.persistence)
        ):
            # Claimed while reserving by a tenant delete or a pool drain: this reserve
            # lost, so it scrubs its own region (unless the claimer took it already)
            # and finishes the release the claimer began. The memory never outlives
            # its row, and no one ever saw it.
            self._releaser.drop_region(row)
            self._reserve_failed(row)
            raise _claimed(row.id)
        self._regions.set_live(row.id)
        return buffer_info(msgspec.structs.replace(row, state=state))


def _claimed(buffer_id: str) -> StateConflict:
    return StateConflict(
        f"buffer {buffer_id} was released while it was being reserved "
        "(its tenant or its pool is being deleted)"
    )
