"""Prometheus metrics of one daemon (prometheus-client, a registry per service).

Counters and histograms are updated on the request path; the gauges that
describe the ledger (pool capacity/used, tenant used) are read from the
database at scrape time by :class:`LedgerCollector`, so they can never drift
from the ledger they describe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from maasd.errors import LedgerUnavailable

if TYPE_CHECKING:
    from maasd.models import PoolInfo, TenantInfo

# The *_created samples double the exposition size and no dashboard of ours reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: The Prometheus text format's media type, as litestar takes it: it appends
#: ``; charset=utf-8`` to every ``text/`` type itself (with it here, the header said it twice).
CONTENT_TYPE = "text/plain; version=0.0.4"


class LedgerCollector(Collector):
    def __init__(
        self, pools: Callable[[], Iterable[PoolInfo]], tenants: Callable[[], Iterable[TenantInfo]]
    ) -> None:
        self._pools = pools
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        cap = GaugeMetricFamily(
            "maasd_pool_capacity_bytes", "Pool capacity", labels=["pool", "node"]
        )
        used = GaugeMetricFamily(
            "maasd_pool_used_bytes", "Bytes in live buffers of the pool", labels=["pool", "node"]
        )
        nbuf = GaugeMetricFamily(
            "maasd_pool_buffers", "Live buffers in the pool", labels=["pool", "node"]
        )
        warm = GaugeMetricFamily(
            "maasd_pool_warm_bytes",
            "Bytes of fresh, prefaulted regions the pool holds ready (its warm stock)",
            labels=["pool", "node"],
        )
        warm_target = GaugeMetricFamily(
            "maasd_pool_warm_target_bytes", "The pool's warm stock budget", labels=["pool", "node"]
        )
        latency = GaugeMetricFamily(
            "maasd_pool_latency_seconds",
            "The pool's latency class: declared, and measured of its node once probed",
            labels=["pool", "node", "source"],
        )
        try:
            pools, tenants = list(self._pools()), list(self._tenants())
        except LedgerUnavailable:  # its gauges are left out; the rest of /metrics answers
            pools, tenants = [], []
        for p in pools:
            labels = [p.name, str(p.numa_node)]
            latency.add_metric([*labels, "declared"], p.latency_us / 1e6)
            if p.measured_latency_us is not None:
                latency.add_metric([*labels, "measured"], p.measured_latency_us / 1e6)
            cap.add_metric(labels, p.capacity_bytes)
            used.add_metric(labels, p.used_bytes)
            nbuf.add_metric(labels, p.buffers)
            warm.add_metric(labels, p.warm_bytes)
            warm_target.add_metric(labels, p.warm_target_bytes)
        tused = GaugeMetricFamily(
            "maasd_tenant_used_bytes",
            "Bytes in live buffers of the tenant",
            labels=["tenant", "name"],
        )
        tquota = GaugeMetricFamily(
            "maasd_tenant_quota_bytes", "Tenant quota", labels=["tenant", "name"]
        )
        for t in tenants:
            tused.add_metric([t.id, t.name], t.used_bytes)
            tquota.add_metric([t.id, t.name], t.quota_bytes)
        yield from (cap, used, nbuf, warm, warm_target, latency, tused, tquota)


class RuntimeCollector(Collector):
    """What the daemon holds outside the ledger, read at scrape time.

    ``released_attached`` gives ``(tenant, kind, size_bytes, handles)`` of the buffers
    released while workers still had handles attached (a handle can fault fresh pages
    in after the scrub: memory no quota counts); ``regions`` gives ``(held, budget,
    held_fds, file_budget)`` of the daemon's buffer regions (each one mapping) and of
    those that hold an open file (all but idle entries, where they park:
    :mod:`maasd.allocator.parking`).
    """

    def __init__(
        self,
        released_attached: Callable[[], Iterable[tuple[str, str, int, int]]],
        regions: Callable[[], tuple[int, int, int, int]],
    ) -> None:
        self._released_attached = released_attached
        self._regions = regions

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant", "kind"]
        nbuf = GaugeMetricFamily(
            "maasd_released_attached_buffers",
            "Released buffers that workers still hold handles on (attached, not detached)",
            labels=labels,
        )
        nbytes = GaugeMetricFamily(
            "maasd_released_attached_bytes",
            "Size of the released buffers that workers still hold handles on",
            labels=labels,
        )
        handles = GaugeMetricFamily(
            "maasd_released_attached_handles",
            "Handles still attached on released buffers",
            labels=labels,
        )
        totals: dict[tuple[str, str], list[int]] = {}
        for tenant, kind, size, n in self._released_attached():
            t = totals.setdefault((tenant, kind), [0, 0, 0])
            t[0], t[1], t[2] = t[0] + 1, t[1] + size, t[2] + n
        for (tenant, kind), (count, size, n) in sorted(totals.items()):
            nbuf.add_metric([tenant, kind], count)
            nbytes.add_metric([tenant, kind], size)
            handles.add_metric([tenant, kind], n)
        held, budget, held_fds, file_budget = self._regions()
        regions = GaugeMetricFamily(
            "maasd_buffer_regions", "Buffer regions the daemon holds (one mapping each)"
        )
        regions.add_metric([], held)
        cap = GaugeMetricFamily(
            "maasd_buffer_region_budget",
            "Buffer regions the daemon may hold at once (from RLIMIT_NOFILE and vm.max_map_count)",
        )
        cap.add_metric([], budget)
        fds = GaugeMetricFamily(
            "maasd_buffer_region_fds",
            "Of the buffer regions, those holding an open file (idle entries may hold none)",
        )
        fds.add_metric([], held_fds)
        fd_cap = GaugeMetricFamily(
            "maasd_buffer_region_fd_budget",
            "Buffer regions holding an open file the daemon may have at once (RLIMIT_NOFILE)",
        )
        fd_cap.add_metric([], file_budget)
        yield from (nbuf, nbytes, handles, regions, cap, fds, fd_cap)


class PlacementCollector(Collector):
    """Where the pages of each pool's buffers are, sampled at scrape time.

    ``sample`` gives ``(pool, node, sampled, off_node)`` per pool: pages asked about with
    ``move_pages`` (a few per buffer, never populating) and, of those, pages found on
    another node than the buffer's own (its pool's, or the one it was pinned to). Expected
    0: anything else is a placement fault of the host (docs/allocator.md, "Placement").
    """

    def __init__(self, sample: Callable[[], Iterable[tuple[str, int, int, int]]]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "node"]
        sampled = GaugeMetricFamily(
            "maasd_pool_pages_sampled",
            "Pages of the pool's buffers whose node was asked at this scrape (move_pages)",
            labels=labels,
        )
        off = GaugeMetricFamily(
            "maasd_pool_pages_off_node",
            "Of the sampled pages, those found on another NUMA node than their buffer's",
            labels=labels,
        )
        for pool, node, n_sampled, n_off in self._sample():
            sampled.add_metric([pool, str(node)], n_sampled)
            off.add_metric([pool, str(node)], n_off)
        yield from (sampled, off)


class EntryCollector(Collector):
    """The gauges of committed entries, read from the daemon's memory at scrape time."""

    def __init__(
        self,
        stats: Callable[[], dict[str, tuple[int, int]]],
        released: Callable[[], int],
        held: Callable[[], Iterable[Any]] = tuple,
    ) -> None:
        self._stats = stats
        self._released = released
        #: released entries still held: records with tenant_id, pool_id, size_bytes
        self._held = held

    def collect(self) -> Iterator[Metric]:
        count = GaugeMetricFamily(
            "maasd_entries", "Committed entries held in this daemon's memory", labels=["tenant"]
        )
        size = GaugeMetricFamily(
            "maasd_entry_bytes", "Bytes of committed entries held", labels=["tenant"]
        )
        for tenant, (n, nbytes) in sorted(self._stats().items()):
            count.add_metric([tenant], n)
            size.add_metric([tenant], nbytes)
        released = GaugeMetricFamily(
            "maasd_released_entry_bytes",
            "Bytes of released entries that some process still holds open "
            "(resident, zeroed, counted in their tenant's quota until the last fd or mapping goes)",
        )
        released.add_metric([], self._released())
        held = GaugeMetricFamily(
            "maasd_held_bytes",
            "Bytes of released entries still held open, per tenant and pool (counted in both)",
            labels=["tenant", "pool"],
        )
        totals: dict[tuple[str, str], int] = {}
        for h in self._held():
            totals[h.tenant_id, h.pool_id] = totals.get((h.tenant_id, h.pool_id), 0) + h.size_bytes
        for (tenant, pool), nbytes in sorted(totals.items()):
            held.add_metric([tenant, pool], nbytes)
        yield from (count, size, released, held)


@dataclass(frozen=True, slots=True)
class TenantMetrics:
    """The per-tenant series the socket's hot path updates, bound once per tenant (a
    ``labels()`` call costs a lock and a tuple of label values: µs on every lookup)."""

    attached: Any
    hits: Any
    misses: Any
    restored: Any


class Metrics:
    """The daemon's metric objects. One instance per :class:`maasd.core.Service`."""

    def __init__(self) -> None:
        self._tenants: dict[str, TenantMetrics] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self._buffer_series(self.registry)
        self._entry_series(self.registry)
        self._connection_series(self.registry)

    def _buffer_series(self, r: CollectorRegistry) -> None:
        """Reserves, releases, scrubs, evictions, leases, attachments and checkpoints."""
        self.reserve_total = Counter(
            "maasd_reserve", "Reserve requests by outcome", ["outcome"], registry=r
        )
        self.reserve_seconds = Histogram(
            "maasd_reserve_seconds", "Time to reserve a buffer", buckets=LATENCY_BUCKETS, registry=r
        )
        self.release_total = Counter(
            "maasd_release", "Buffers released, by reason", ["reason"], registry=r
        )
        self.release_seconds = Histogram(
            "maasd_release_seconds",
            "Time to release (scrub) a buffer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.scrub_bytes = Counter("maasd_scrub_bytes", "Bytes scrubbed", ["mode"], registry=r)
        self.scrub_seconds = Counter(
            "maasd_scrub_seconds", "Seconds spent scrubbing", ["mode"], registry=r
        )
        self.evictions = Counter(
            "maasd_evictions", "Evictable buffers released to make room", registry=r
        )
        self.reaped = Counter(
            "maasd_leases_reaped", "Buffers released because their lease ended", registry=r
        )
        self.attached = Gauge(
            "maasd_attached_handles",
            "Buffers attached by workers over the socket",
            ["tenant"],
            registry=r,
        )
        self.checkpoints = Counter("maasd_checkpoints", "Checkpoints written", registry=r)
        self.checkpoint_bytes = Counter(
            "maasd_checkpoint_bytes", "Bytes written by checkpoints", registry=r
        )

    def _entry_series(self, r: CollectorRegistry) -> None:
        """The socket's entries: lookups, puts, commits, aborts, evictions."""
        self.entry_lookups = Counter(
            "maasd_entry_lookups",
            "Socket lookups of entries, by tenant and outcome (hit, miss)",
            ["tenant", "outcome"],
            registry=r,
        )
        self.entry_restored_bytes = Counter(
            "maasd_entry_restored_bytes",
            "Bytes of the entries lookups found (what workers can restore)",
            ["tenant"],
            registry=r,
        )
        self.entry_puts = Counter(
            "maasd_entry_puts",
            "Entry puts, by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.entry_commits = Counter(
            "maasd_entry_commits",
            "Entry commits, by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.entry_publishes = Counter(
            "maasd_entry_publishes",
            "Entry publishes (a put and a commit in one, from the writer's memfd), by tenant "
            "and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.entry_committed_bytes = Counter(
            "maasd_entry_committed_bytes",
            "Bytes of the entries committed, by tenant (what workers saved to share)",
            ["tenant"],
            registry=r,
        )
        self.entry_aborts = Counter(
            "maasd_entry_aborts",
            "Staged entries released before their commit, by tenant and reason "
            "(abort, disconnect, commit_failed)",
            ["tenant", "reason"],
            registry=r,
        )
        self.entry_evictions = Counter(
            "maasd_entry_evictions",
            "Committed entries evicted to make room, by tenant",
            ["tenant"],
            registry=r,
        )

    def _connection_series(self, r: CollectorRegistry) -> None:
        """The REST server's and the worker socket's connections."""
        self.http_connections = Gauge(
            "maasd_http_connections", "REST connections held open", registry=r
        )
        self.http_closed = Counter(
            "maasd_http_connections_closed",
            "REST connections the daemon closed or refused (head_timeout, body_timeout, "
            "send_timeout, shed, refused, dropped, unread)",
            ["reason"],
            registry=r,
        )
        self.socket_closed = Counter(
            "maasd_socket_connections_closed",
            "Worker socket connections the daemon closed or refused at a limit (shed, "
            "refused, hello_timeout, send_timeout)",
            ["reason"],
            registry=r,
        )
        self.socket_fds_refused = Counter(
            "maasd_socket_fds_refused",
            "Replies whose fds the kernel refused (ETOOMANYREFS), answered 507 instead",
            registry=r,
        )

    def socket_event(self, event: str) -> None:
        """What the worker socket reports (``maasd.broker.Broker``'s ``events``)."""
        if event == "fds_refused":
            self.socket_fds_refused.inc()
        else:
            self.socket_closed.labels(reason=event).inc()

    def tenant(self, tenant_id: str) -> TenantMetrics:
        """The hot path's series of one tenant (made on first use, then reused)."""
        bound = self._tenants.get(tenant_id)
        if bound is None:
            lookups = self.entry_lookups
            bound = TenantMetrics(
                attached=self.attached.labels(tenant=tenant_id),
                hits=lookups.labels(tenant=tenant_id, outcome="hit"),
                misses=lookups.labels(tenant=tenant_id, outcome="miss"),
                restored=self.entry_restored_bytes.labels(tenant=tenant_id),
            )
            self._tenants[tenant_id] = bound
        return bound

    def attach_ledger(self, collector: LedgerCollector) -> None:
        self.registry.register(collector)

    def attach_entries(self, collector: EntryCollector) -> None:
        self.registry.register(collector)

    def attach_runtime(self, collector: RuntimeCollector) -> None:
        self.registry.register(collector)

    def attach_placement(self, collector: PlacementCollector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
