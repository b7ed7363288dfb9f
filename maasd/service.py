"""The core use-cases of maasd: reserve, pin, renew, checkpoint, release, reap, recover.

Called by the REST API, the socket broker and tests; synchronous and
thread-safe (the API runs it in worker threads, so prefaulting and scrubbing
never block the event loop). It owns the rules; the store owns the SQL, the
allocator owns the memory.

Every change that touches memory records its intent in the ledger first:

    reserve  ledger: row ``reserving`` (quota + capacity checked atomically)
             memory: region created, sealed, bound, prefaulted
             ledger: row ``live``
    release  ledger: row ``releasing``
             memory: scrubbed (every byte zero), closed
             ledger: row deleted, event recorded

so a crash at any point leaves rows that :meth:`Service.recover` can settle:
``reserving``/``releasing`` rows and volatile ``live`` rows of a previous run
are released (their memory died with the process); persistent ``live`` rows
are reloaded from their last checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec

from maasd import allocator
from maasd.allocator import Pool, Region
from maasd.allocator.reclaim import Reclaimer
from maasd.bounds import MAX_BYTES
from maasd.errors import (
    BackingError,
    ConfigError,
    Forbidden,
    InvalidRequest,
    NotFound,
    PlacementError,
    PoolExhausted,
    QosUnmet,
    StateConflict,
    TooLarge,
    Unauthorized,
)
from maasd.metrics import LedgerCollector, Metrics
from maasd.models import (
    BufferInfo,
    Checkpoint,
    Event,
    KeyInfo,
    LookupHit,
    NewTenant,
    PoolInfo,
    PoolSpec,
    Principal,
    ReserveSpec,
    TenantInfo,
    Usage,
    rfc3339,
)
from maasd.settings import Settings, default_pools
from maasd.store import ACCOUNTED_STATES, BufferRow, PoolRow, Store, TenantRow
from maasd.tenancy import keys, leases
from maasd.topology import Topology, discover

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class Handle:
    """A buffer as handed to a worker: ``fd`` is a dup the receiver of this object closes."""

    fd: int
    buffer_id: str
    size_bytes: int
    numa_node: int


@dataclass
class _LivePool:
    row: PoolRow
    pool: Pool


class Service:
    """One daemon's use-cases over its ledger, its pools and its regions.

    >>> svc = Service(settings); svc.start()                       # doctest: +SKIP
    >>> who = svc.authenticate(api_key)                             # doctest: +SKIP
    >>> buf = svc.reserve(who, ReserveSpec(size_bytes=1 << 20))  # doctest: +SKIP
    >>> svc.release(who, buf.id); svc.close()                       # doctest: +SKIP
    """

    def __init__(
        self, settings: Settings, *, topology: Topology | None = None, store: Store | None = None
    ) -> None:
        self.settings = settings
        self.host = settings.node_name
        self.topology = topology or discover()
        self.store = store or Store(settings.database_url)
        self.metrics = Metrics()
        self.metrics.attach_ledger(LedgerCollector(self.pools, self.tenants))
        #: Gives released pages back to the kernel in the background; started by start(),
        #: drained and stopped by close() (``reclaimer.drain()`` waits for it).
        self.reclaimer = Reclaimer()
        self._lock = threading.RLock()
        self._pools: dict[str, _LivePool] = {}
        self._regions: dict[str, Region] = {}
        # Per-buffer locks: a checkpoint or pin reads/moves a region's pages through the
        # daemon's mapping; releasing must wait for it, or it would unmap under the reader.
        self._busy: dict[str, threading.Lock] = {}
        self._attached: Counter[str] = Counter()
        self._touched: dict[str, float] = {}
        self._key_cache: dict[bytes, Principal] | None = None if self.store.is_postgres else {}
        self._key_generation = 0
        self._admin_digest = b""
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.admin_key_generated: str | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, *, reaper: bool = True) -> None:
        """Migrate the ledger, settle what a previous run left, provision pools, start reaping."""
        os.makedirs(self.settings.data_dir, mode=0o700, exist_ok=True)
        self.reclaimer.start()
        self.store.upgrade()
        self._admin_digest = keys.digest(self._admin_key())
        for row in self.store.pools(self.host):
            self._pools[row.id] = _LivePool(row, self._make_pool(row))
        self.recover()
        wanted = self.settings.pools or default_pools(
            self.topology, self.settings.default_pool_bytes
        )
        existing = {lp.row.name: lp.row for lp in self._pools.values()}
        for spec in wanted:
            have = existing.get(spec.name)
            if have is None:
                self.create_pool(spec)
            elif (have.numa_node, have.backing, have.persistence, have.latency_us, have.scrub) != (
                spec.numa_node,
                spec.backing,
                spec.persistence,
                spec.latency_us,
                spec.scrub,
            ) or have.capacity_bytes < spec.capacity_bytes:
                # The ledger's pool has live buffers bound to its properties: it wins.
                logger.warning(
                    "pool %s in the ledger differs from its configuration; keeping "
                    "the ledger's (delete the pool with drain to recreate it)",
                    spec.name,
                )
        if reaper:
            self._reaper = threading.Thread(
                target=self._reap_loop, name="maasd-reaper", daemon=True
            )
            self._reaper.start()

    def close(self) -> None:
        """Stop reaping; checkpoint persistent buffers; release volatile ones; drain and stop
        the reclaimer; close the store."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=10)
        self.flush_uses()
        for buffer_id in list(self._regions):
            row = self.store.buffer(buffer_id, None)
            if row is None:
                continue
            try:
                if row.persistence == "persistent" and self.settings.checkpoint_on_shutdown:
                    self._checkpoint_row(row)
                    self._drop_region(row, scrub=True)
                else:
                    self._release_row(row, reason="shutdown")
            except Exception:
                logger.exception("shutdown: could not settle buffer %s", buffer_id)
        self.reclaimer.stop()
        self.store.dispose()

    def _admin_key(self) -> str:
        if self.settings.admin_key:
            return self.settings.admin_key
        path = Path(self.settings.admin_key_path)
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise ConfigError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
            return path.read_text().strip()
        token = keys.new_token()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self.admin_key_generated = token
        return token

    # -- authentication -------------------------------------------------------------------

    def known_principal(self, token: str | None) -> Principal | None:
        """The principal of ``token`` if it can be told without I/O (admin, remembered key).

        None means "ask :meth:`authenticate`". Lets the API answer most requests'
        authentication on the event loop without a thread hop.
        """
        if not token:
            raise Unauthorized("missing API key (Authorization: Bearer <key>)")
        d = keys.digest(token)
        if hmac.compare_digest(d, self._admin_digest):
            return Principal(is_admin=True)
        return self._key_cache.get(d) if self._key_cache is not None else None

    def authenticate(self, token: str | None) -> Principal:
        """Map a bearer token to a principal; :class:`Unauthorized` if unknown or revoked.

        With SQLite the ledger has exactly one writer — this daemon (the data-dir
        lock) — so a key, once checked, is remembered until this process revokes
        any key; the check then costs one hash. With PostgreSQL another daemon may
        revoke, so every call asks the database: a revocation bites at once anywhere.
        """
        if not token:
            raise Unauthorized("missing API key (Authorization: Bearer <key>)")
        d = keys.digest(token)
        if hmac.compare_digest(d, self._admin_digest):
            return Principal(is_admin=True)
        cache = self._key_cache
        if cache is not None:
            who = cache.get(d)
            if who is not None:
                return who
            generation = self._key_generation
        row = self.store.key_by_digest(d)
        if row is None or not hmac.compare_digest(d, row.digest):
            raise Unauthorized("unknown or revoked API key")
        who = Principal(is_admin=False, tenant_id=row.tenant_id, key_id=row.id)
        if cache is not None:
            with self._lock:
                # A revocation since the read above bumps the generation: don't cache.
                if generation == self._key_generation:
                    if len(cache) >= 4096:
                        cache.clear()
                    cache[d] = who
        return who

    def _forget_keys(self) -> None:
        """Call after revoking any key (its commit done): no cached key outlives it."""
        with self._lock:
            self._key_generation += 1
            if self._key_cache is not None:
                self._key_cache.clear()

    @staticmethod
    def require_admin(who: Principal) -> None:
        if not who.is_admin:
            raise Forbidden("this operation needs the admin key")

    @staticmethod
    def require_tenant(who: Principal) -> str:
        if who.tenant_id is None:
            raise Forbidden("this operation needs a tenant key (the admin owns no buffers)")
        return who.tenant_id

    # -- topology and pools ---------------------------------------------------------------

    def refresh_topology(self) -> Topology:
        self.topology = discover()
        return self.topology

    def pools(self) -> list[PoolInfo]:
        usage = self.store.usage_by_pool(self.host)
        with self._lock:
            live = list(self._pools.values())
        return sorted(
            (self._pool_info(lp.row, usage.get(lp.row.id, (0, 0))) for lp in live),
            key=lambda p: p.name,
        )

    def pool(self, id_or_name: str) -> PoolInfo:
        lp = self._live_pool(id_or_name)
        used = self.store.usage_by_pool(self.host).get(lp.row.id, (0, 0))
        return self._pool_info(lp.row, used)

    def create_pool(self, spec: PoolSpec) -> PoolInfo:
        """Create a pool on this host. Name unique; node must exist; capacity rounded to pages."""
        if spec.numa_node not in self.topology.node_ids:
            raise PlacementError(
                f"NUMA node {spec.numa_node} does not exist on this host "
                f"(nodes: {sorted(self.topology.node_ids)})"
            )
        page = (
            self.topology.hugepage_bytes if spec.backing == "hugetlb" else self.topology.page_bytes
        )
        if spec.capacity_bytes > MAX_BYTES - page:  # it must stay below 2^63 rounded up
            raise InvalidRequest("capacity_bytes rounded up to whole pages must stay below 2^63")
        capacity = -(-spec.capacity_bytes // page) * page
        node = self.refresh_topology().node(spec.numa_node)
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
        spill_dir = spec.spill_dir
        if spec.persistence == "persistent":
            if spill_dir is not None and not os.path.isabs(spill_dir):
                raise InvalidRequest(f"spill_dir must be an absolute path, got {spill_dir!r}")
            spill_dir = spill_dir or os.path.join(self.settings.data_dir, "spill", spec.name)
            try:
                os.makedirs(spill_dir, mode=0o700, exist_ok=True)
                if not os.access(spill_dir, os.W_OK | os.X_OK):
                    raise PermissionError(13, "not writable")
            except OSError as e:
                raise InvalidRequest(
                    f"spill_dir {spill_dir!r} cannot be used: {e.strerror or e}"
                ) from e
        elif spill_dir is not None:
            raise InvalidRequest("spill_dir only applies to persistent pools")
        row = PoolRow(
            id=keys.new_id(),
            host=self.host,
            name=spec.name,
            numa_node=spec.numa_node,
            backing=spec.backing,
            persistence=spec.persistence,
            latency_us=spec.latency_us,
            capacity_bytes=capacity,
            page_bytes=page,
            prefault=spec.prefault,
            scrub=spec.scrub,
            spill_dir=spill_dir,
            created_at=time.time(),
        )
        pool = self._make_pool(row)
        with self._lock:
            self.store.add_pool(row)
            self._pools[row.id] = _LivePool(row, pool)
        logger.info(
            "pool %s created: node %d, %d bytes, %s/%s",
            row.name,
            row.numa_node,
            capacity,
            row.backing,
            row.persistence,
        )
        return self._pool_info(row, (0, 0))

    def delete_pool(self, id_or_name: str, *, drain: bool = False) -> None:
        """Delete an empty pool; with ``drain`` release (scrub) its buffers first."""
        lp = self._live_pool(id_or_name)
        rows = self.store.buffers(pool_id=lp.row.id, states=ACCOUNTED_STATES)
        if rows and not drain:
            raise StateConflict(
                f"pool {lp.row.name} holds {len(rows)} buffer(s); "
                "release them or delete with drain=true"
            )
        for row in rows:
            self._release_row(row, reason="pool_drain")
        with self._lock:
            self.store.delete_pool(lp.row.id)
            self._pools.pop(lp.row.id, None)

    def _make_pool(self, row: PoolRow) -> Pool:
        return Pool(
            row.name,
            numa_node=row.numa_node,
            capacity=row.capacity_bytes,
            backing=row.backing,
            persistence=row.persistence,
            latency_us=row.latency_us,
            prefault=row.prefault,
            scrub=row.scrub,
            page_bytes=row.page_bytes,
            reclaimer=self.reclaimer,
        )

    def _live_pool(self, id_or_name: str) -> _LivePool:
        with self._lock:
            lp = self._pools.get(id_or_name)
            if lp is None:
                lp = next((p for p in self._pools.values() if p.row.name == id_or_name), None)
        if lp is None:
            raise NotFound(f"no pool {id_or_name!r}")
        return lp

    @staticmethod
    def _pool_info(row: PoolRow, used: tuple[int, int]) -> PoolInfo:
        return PoolInfo(
            id=row.id,
            name=row.name,
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
        )

    # -- tenants and keys -----------------------------------------------------------------

    def create_tenant(self, name: str, quota_bytes: int) -> NewTenant:
        now = time.time()
        tenant_id = keys.new_id()
        token, key_id = keys.new_token(), keys.new_id()
        self.store.add_tenant(tenant_id, name, quota_bytes, now)
        self.store.add_key(key_id, tenant_id, keys.digest(token), now)
        return NewTenant(
            id=tenant_id,
            name=name,
            quota_bytes=quota_bytes,
            used_bytes=0,
            api_key=token,
            key_id=key_id,
        )

    def tenants(self) -> list[TenantInfo]:
        return [self._tenant_info(t) for t in self.store.tenants()]

    def tenant(self, id_or_name: str) -> TenantInfo:
        row = self.store.tenant(id_or_name)
        if row is None:
            raise NotFound(f"no tenant {id_or_name!r}")
        return self._tenant_info(row)

    def set_quota(self, id_or_name: str, quota_bytes: int) -> TenantInfo:
        t = self.tenant(id_or_name)
        self.store.set_quota(t.id, quota_bytes)
        return self.tenant(t.id)

    def delete_tenant(self, id_or_name: str) -> None:
        """Revoke the tenant's keys, release (scrub) all its buffers, delete it."""
        t = self.tenant(id_or_name)
        self.store.revoke_keys(t.id)
        self._forget_keys()
        for row in self.store.buffers(tenant_id=t.id, states=ACCOUNTED_STATES):
            self._release_row(row, reason="tenant_delete")
        self.store.delete_tenant(t.id)

    def issue_key(self, id_or_name: str) -> KeyInfo:
        t = self.tenant(id_or_name)
        now = time.time()
        token, key_id = keys.new_token(), keys.new_id()
        self.store.add_key(key_id, t.id, keys.digest(token), now)
        return KeyInfo(id=key_id, api_key=token, created_at=rfc3339(now))

    def revoke_key(self, id_or_name: str, key_id: str) -> None:
        t = self.tenant(id_or_name)
        revoked = self.store.revoke_key(t.id, key_id)
        self._forget_keys()
        if not revoked:
            raise NotFound(f"no active key {key_id!r} for tenant {t.name}")

    def events(
        self, limit: int = 100, tenant: str | None = None, before: int | None = None
    ) -> list[Event]:
        """The audit trail, newest first (admin): every reserve, release and why, key and quota change."""
        tenant_id = self.tenant(tenant).id if tenant is not None else None
        return [
            Event(
                id=e.id,
                at=rfc3339(e.at),
                kind=e.kind,
                tenant_id=e.tenant_id,
                buffer_id=e.buffer_id,
                pool_id=e.pool_id,
                bytes=e.bytes,
                detail=e.detail,
            )
            for e in self.store.events(limit, tenant_id=tenant_id, before=before)
        ]

    def usage(self, who: Principal) -> Usage:
        t = self.tenant(self.require_tenant(who))
        return Usage(
            tenant_id=t.id, quota_bytes=t.quota_bytes, used_bytes=t.used_bytes, buffers=t.buffers
        )

    @staticmethod
    def _tenant_info(row: TenantRow) -> TenantInfo:
        return TenantInfo(
            id=row.id,
            name=row.name,
            quota_bytes=row.quota_bytes,
            used_bytes=row.used_bytes,
            buffers=row.buffers,
            created_at=rfc3339(row.created_at),
        )

    # -- buffers --------------------------------------------------------------------------

    def reserve(self, who: Principal, req: ReserveSpec) -> BufferInfo:
        """Reserve a buffer in ``pool`` (id or name), or in the best pool meeting the QoS.

        Raises InvalidRequest (a lease beyond max_ttl_s), QosUnmet/PlacementError/TooLarge (never
        satisfiable), QuotaExceeded, DuplicateKey, PoolExhausted (not now).
        """
        tenant_id = self.require_tenant(who)
        started = time.perf_counter()
        try:
            buf = self._reserve(tenant_id, req)
        except Exception as e:
            self.metrics.reserve_total.labels(outcome=getattr(e, "code", "error")).inc()
            raise
        self.metrics.reserve_total.labels(outcome="granted").inc()
        self.metrics.reserve_seconds.observe(time.perf_counter() - started)
        return buf

    def _reserve(self, tenant_id: str, req: ReserveSpec) -> BufferInfo:
        size = req.size_bytes
        now = time.time()
        expires = leases.expires_at(now, req.ttl_s, self.settings.max_ttl_s)
        candidates = self._candidates(req, size)
        self.flush_uses()  # eviction picks by last use: let it see the latest attaches
        last_error: Exception | None = None
        for lp in candidates:
            rounded = lp.pool.rounded(size)
            row = BufferRow(
                id=keys.new_id(),
                tenant_id=tenant_id,
                pool_id=lp.row.id,
                host=self.host,
                size_bytes=rounded,
                numa_node=lp.row.numa_node,
                persistence=lp.row.persistence,
                label=req.label,
                key=req.key,
                evictable=req.evictable,
                state="reserving",
                created_at=now,
                expires_at=expires,
                last_used_at=now,
                kind="buffer",
            )
            try:
                victims = self.store.begin_reserve(row)
            except PoolExhausted as e:
                last_error = e
                continue
            for victim in victims:
                self._release_memory(victim, reason="evict")
                # Its "evict" event, naming this reserve, is in the ledger already.
                self.store.finish_release(victim.id, kind="evict", record=False)
                self.metrics.evictions.inc()
            try:
                region = lp.pool.reserve(rounded, name=f"maasd-{row.id[:8]}")
            except PoolExhausted as e:  # in-process guard disagreed with the ledger
                self.store.finish_release(row.id, kind="reserve_failed")
                last_error = e
                continue
            except BackingError as e:
                self.store.finish_release(row.id, kind="reserve_failed")
                if e.errno in (errno.ENOMEM, errno.ENOSPC):
                    raise PoolExhausted(
                        f"the kernel has no memory for {rounded} bytes on node "
                        f"{lp.row.numa_node} ({e.detail})"
                    ) from e
                raise
            if lp.row.prefault:
                # Placement is measured, not assumed (SPEC §2.5): a sample of pages, ~30 µs.
                try:
                    region.verify_node(sample=16)
                except Exception:
                    lp.pool.release(region)
                    self.store.finish_release(row.id, kind="reserve_failed")
                    raise
            with self._lock:
                self._regions[row.id] = region
            try:
                self.store.set_state(row.id, "live")
            except NotFound:
                # Released while reserving (its tenant or pool was deleted meanwhile):
                # the memory must not outlive its row.
                self._drop_region(row, scrub=True)
                raise
            return self._buffer_info(msgspec.structs.replace(row, state="live"))
        assert last_error is not None
        raise last_error

    def _candidates(self, req: ReserveSpec, size: int) -> list[_LivePool]:
        """The pools that could hold the request, most free space first."""
        if req.numa_node is not None and req.numa_node not in self.topology.node_ids:
            raise PlacementError(
                f"NUMA node {req.numa_node} does not exist on this host "
                f"(nodes: {sorted(self.topology.node_ids)})"
            )
        pool = req.pool
        with self._lock:
            pools = [self._live_pool(pool)] if pool is not None else list(self._pools.values())
        fit = [lp for lp in pools if self._meets(lp.row, req)]
        if not fit:
            raise QosUnmet(self._qos_text(req) + (f" in pool {pools[0].row.name}" if pool else ""))
        # Capacities are whole pages, so size ≤ capacity ⇔ rounded size ≤ capacity — and no
        # size below 2^63 is refused for rounding past it: too large is too large (422).
        big = [lp for lp in fit if size <= lp.row.capacity_bytes]
        if not big:
            biggest = max(lp.row.capacity_bytes for lp in fit)
            raise TooLarge(
                f"{size} bytes exceed the capacity of every pool that meets the QoS "
                f"(largest: {biggest} bytes)"
            )
        if len(big) > 1:
            usage = self.store.usage_by_pool(self.host)
            big.sort(
                key=lambda lp: lp.row.capacity_bytes - usage.get(lp.row.id, (0, 0))[0], reverse=True
            )
        return big

    @staticmethod
    def _meets(row: PoolRow, req: ReserveSpec) -> bool:
        return (
            (req.latency_us is None or row.latency_us <= req.latency_us)
            and (req.persistence is None or row.persistence == req.persistence)
            and (req.numa_node is None or row.numa_node == req.numa_node)
        )

    @staticmethod
    def _qos_text(req: ReserveSpec) -> str:
        parts = []
        if req.latency_us is not None:
            parts.append(f"latency_us ≤ {req.latency_us}")
        if req.persistence is not None:
            parts.append(f"persistence {req.persistence}")
        if req.numa_node is not None:
            parts.append(f"numa_node {req.numa_node}")
        return "no pool meets " + (", ".join(parts) or "the request")

    def buffers(self, who: Principal, tenant_id: str | None = None) -> list[BufferInfo]:
        if not who.is_admin:
            tenant_id = who.tenant_id
        elif tenant_id is not None:
            tenant_id = self.tenant(tenant_id).id
        return [self._buffer_info(r) for r in self.store.buffers(tenant_id=tenant_id)]

    def buffer(self, who: Principal, buffer_id: str) -> BufferInfo:
        """One buffer, with its ``placement`` as the kernel reports it now (pages per node)."""
        row = self._own_row(who, buffer_id)
        info = self._buffer_info(row)
        with self._buffer_lock(row.id):
            with self._lock:
                region = self._regions.get(row.id)
            if region is None or region.closed:
                return info
            placed = region.placement()
        return msgspec.structs.replace(info, placement={str(k): v for k, v in placed.items()})

    def pin(self, who: Principal, buffer_id: str, numa_node: int) -> BufferInfo:
        """Bind and migrate the buffer's pages to ``numa_node``; return it with its measured placement."""
        row = self._own_row(who, buffer_id, tenant_only=True)
        with self._buffer_lock(row.id):
            placement = self._region(row.id).pin(numa_node, self.topology.node_ids)
        self.store.set_numa_node(row.id, numa_node)
        info = self._buffer_info(msgspec.structs.replace(row, numa_node=numa_node))
        return msgspec.structs.replace(info, placement={str(k): v for k, v in placement.items()})

    def placement(self, who: Principal, buffer_id: str) -> dict[str, int]:
        row = self._own_row(who, buffer_id)
        with self._buffer_lock(row.id):
            return {str(k): v for k, v in self._region(row.id).placement().items()}

    def renew(self, who: Principal, buffer_id: str, ttl_s: int) -> BufferInfo:
        tenant_id = self.require_tenant(who)
        expires = leases.expires_at(time.time(), ttl_s, self.settings.max_ttl_s)
        return self._buffer_info(self.store.renew(buffer_id, tenant_id, expires))

    def checkpoint(self, who: Principal, buffer_id: str) -> Checkpoint:
        row = self._own_row(who, buffer_id, tenant_only=True)
        if row.persistence != "persistent":
            raise StateConflict("only buffers of persistent pools can be checkpointed")
        return self._checkpoint_row(row)

    def _checkpoint_row(self, row: BufferRow) -> Checkpoint:
        """Write a new checkpoint file, record it, then remove the previous one.

        Each checkpoint gets a file of its own: renaming over the previous file
        before the ledger records the new checksum would leave, after a crash
        between the two, a file that no longer matches the ledger's checksum —
        and the buffer would be lost instead of coming back from its last
        checkpoint.
        """
        lp = self._pools[row.pool_id]
        assert lp.row.spill_dir is not None
        path = os.path.join(lp.row.spill_dir, f"{row.id}.{time.time_ns():x}.ckpt")
        with self._buffer_lock(row.id):
            checksum = allocator.checkpoint(self._region(row.id), path)
            previous = self.store.buffer(row.id, None)
            try:
                self.store.set_checkpoint(row.id, path, checksum, time.time())
            except NotFound:
                os.unlink(path)
                raise
            if previous is not None and previous.checkpoint_path not in (None, path):
                self._remove_checkpoint(previous)
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_bytes.inc(row.size_bytes)
        return Checkpoint(checksum=checksum, bytes=row.size_bytes)

    def release(self, who: Principal, buffer_id: str) -> None:
        """Scrub and free a buffer; every byte is zero before this returns."""
        tenant_id = None if who.is_admin else who.tenant_id
        row = self.store.mark_releasing(buffer_id, tenant_id, only_live=True)
        self._release_row(row, reason="release", marked=True)

    def lookup(self, who: Principal, lookup_keys: list[str]) -> LookupHit:
        tenant_id = self.require_tenant(who)
        hit = self.store.lookup(tenant_id, lookup_keys, host=self.host)
        if hit is None:
            raise NotFound("no live buffer carries any of these keys")
        return LookupHit(key=hit[0], buffer=self._buffer_info(hit[1]))

    # -- data plane -----------------------------------------------------------------------

    def open_handle(self, who: Principal, buffer_id: str) -> Handle:
        """A dup of the buffer's sealed memfd for a worker; NotFound for foreign/unknown ids."""
        tenant_id = self.require_tenant(who)
        row = self.store.buffer(buffer_id, tenant_id)
        if row is None or row.state != "live":
            raise NotFound(f"no buffer {buffer_id!r}")
        with self._lock:
            region = self._regions.get(row.id)
            if region is None or region.closed:
                raise NotFound(f"no buffer {buffer_id!r}")
            fd = region.dup_fd()
            self._attached[tenant_id] += 1
        self.metrics.attached.labels(tenant=tenant_id).set(self._attached[tenant_id])
        with self._lock:
            self._touched[row.id] = time.time()
        return Handle(fd=fd, buffer_id=row.id, size_bytes=row.size_bytes, numa_node=row.numa_node)

    def drop_handle(self, who: Principal, buffer_id: str) -> None:
        del buffer_id  # part of the broker's interface: attachments are counted per tenant
        tenant_id = who.tenant_id
        if tenant_id is None:
            return
        with self._lock:
            self._attached[tenant_id] = max(0, self._attached[tenant_id] - 1)
            n = self._attached[tenant_id]
        self.metrics.attached.labels(tenant=tenant_id).set(n)

    # -- reaping and recovery -------------------------------------------------------------

    def reap(self, now: float | None = None) -> int:
        """Release every buffer of this host whose lease has ended. Returns how many."""
        count = 0
        now = time.time() if now is None else now
        for row in self.store.expired(now, self.host):
            # Compare-and-set: a lease renewed since the query above is left alone.
            marked = self.store.mark_expired(row.id, now)
            if marked is None:
                continue
            self._release_row(marked, reason="expire", marked=True)
            self.metrics.reaped.inc()
            count += 1
        return count

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.settings.reaper_interval_s):
            try:
                self.flush_uses()
                self.reap()
            except Exception:
                logger.exception("reaper pass failed; retrying")

    def flush_uses(self) -> None:
        """Write the attach times gathered since the last flush (the LRU order) to the ledger.

        An attach is on a worker's hot path; a synchronous commit there cost more
        than the rest of the attach together. Uses are batched instead: written by
        the reaper every interval, and before any reserve (which may evict by them).
        """
        with self._lock:
            if not self._touched:
                return
            uses, self._touched = self._touched, {}
        self.store.touch_many(uses)

    def recover(self) -> dict[str, int]:
        """Settle the ledger with what exists after a (possibly unclean) stop.

        ``reserving``/``staged``/``releasing`` rows and volatile ``live`` rows lost
        their memory with the old process: released. Persistent ``live`` rows are reloaded from
        their checkpoint (checksum verified); without a usable checkpoint they are
        released too. Checkpoint files no row refers to are removed. Meant for
        :meth:`start`, before serving; buffers this process already holds are left alone.
        """
        counts: Counter[str] = Counter()
        keep: set[str] = set()
        for row in self.store.buffers_on_host(self.host):
            lp = self._pools.get(row.pool_id)
            with self._lock:
                region = self._regions.get(row.id)
            if region is not None and row.state == "live":  # already ours (a second pass)
                keep.add(os.path.realpath(row.checkpoint_path or ""))
                continue
            if row.state == "live" and row.persistence == "persistent" and lp is not None:
                region = self._restore(row, lp)
                if region is not None:
                    lp.pool.adopt(region.size)
                    with self._lock:
                        self._regions[row.id] = region
                    keep.add(os.path.realpath(row.checkpoint_path or ""))
                    counts["restored"] += 1
                    continue
            self.store.finish_release(row.id, kind="recover")
            self._remove_checkpoint(row)
            counts["released"] += 1
        for lp in self._pools.values():
            spill = lp.row.spill_dir
            if spill and os.path.isdir(spill):
                for entry in os.scandir(spill):
                    if (
                        entry.name.endswith((".ckpt", ".ckpt.tmp"))
                        and os.path.realpath(entry.path) not in keep
                    ):
                        os.unlink(entry.path)
                        counts["orphans"] += 1
        if counts:
            logger.info("recovered ledger: %s", dict(counts))
        return dict(counts)

    def _restore(self, row: BufferRow, lp: _LivePool) -> Region | None:
        if not row.checkpoint_path or not row.checksum:
            logger.warning("persistent buffer %s was never checkpointed; releasing it", row.id)
            return None
        try:
            return allocator.restore(
                row.checkpoint_path,
                node=row.numa_node,
                backing=lp.row.backing,
                page_bytes=lp.row.page_bytes,
                size=row.size_bytes,
                expected_checksum=row.checksum,
            )
        except BackingError as e:
            # An expected outcome (missing or corrupt file): the detail says it all.
            logger.error("persistent buffer %s cannot be restored: %s", row.id, e.detail)  # noqa: TRY400
            return None

    # -- internals ------------------------------------------------------------------------

    def _release_row(self, row: BufferRow, *, reason: str, marked: bool = False) -> None:
        """Mark releasing (unless done), scrub and close the memory, delete the row."""
        if not marked:
            row = self.store.mark_releasing(row.id, None)
        self._release_memory(row, reason=reason)
        self.store.finish_release(row.id, kind=reason)

    def _release_memory(self, row: BufferRow, *, reason: str) -> None:
        started = time.perf_counter()
        self._drop_region(row, scrub=True)
        if row.persistence == "persistent":
            # A checkpoint that finished while we waited in _drop_region may have
            # recorded a newer file than the one ``row`` names: remove both.
            latest = self.store.buffer(row.id, None)
            if latest is not None and latest.checkpoint_path != row.checkpoint_path:
                self._remove_checkpoint(latest)
            self._remove_checkpoint(row)
        self.metrics.release_total.labels(reason=reason).inc()
        self.metrics.release_seconds.observe(time.perf_counter() - started)

    def _buffer_lock(self, buffer_id: str) -> threading.Lock:
        with self._lock:
            return self._busy.setdefault(buffer_id, threading.Lock())

    def _drop_region(self, row: BufferRow, *, scrub: bool) -> None:
        with self._buffer_lock(row.id), self._lock:  # waits for a checkpoint/pin in progress
            region = self._regions.pop(row.id, None)
            lp = self._pools.get(row.pool_id)
            self._busy.pop(row.id, None)
        if region is None:
            return
        mode = lp.row.scrub if lp is not None else "zero"
        started = time.perf_counter()
        if lp is not None:
            lp.pool.release(region) if scrub else region.close()
        else:
            region.scrub(mode)
            region.close()
        self.metrics.scrub_bytes.labels(mode=mode).inc(region.size)
        self.metrics.scrub_seconds.labels(mode=mode).inc(time.perf_counter() - started)

    def _remove_checkpoint(self, row: BufferRow) -> None:
        if row.checkpoint_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(row.checkpoint_path)

    def _own_row(self, who: Principal, buffer_id: str, *, tenant_only: bool = False) -> BufferRow:
        if tenant_only:
            self.require_tenant(who)
        row = self.store.buffer(buffer_id, None if who.is_admin else who.tenant_id)
        if row is None:
            raise NotFound(f"no buffer {buffer_id!r}")
        return row

    def _region(self, buffer_id: str) -> Region:
        with self._lock:
            region = self._regions.get(buffer_id)
        if region is None or region.closed:
            raise StateConflict(f"buffer {buffer_id} is not live")
        return region

    @staticmethod
    def _buffer_info(row: BufferRow) -> BufferInfo:
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
            checksum=row.checksum,
        )
