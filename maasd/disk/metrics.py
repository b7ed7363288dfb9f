"""The disk tiers' Prometheus series, on the daemon's registry (label: the pool's name).

No label carries a tenant or a key. The gauges (bytes, entries) are read from the tiers
at scrape time; the counters move as entries are demoted, promoted, dropped, written, read.
"""

from __future__ import annotations

import threading
from collections import Counter as CountsByName
from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["DROP_REASONS", "DiskMetrics", "PoolCounts"]

#: Why an entry eviction took out of DRAM did not reach (or stay on) disk.
DROP_REASONS = (
    "cold",  # seen once: not worth a write (the policy)
    "busy",  # the writer's in-flight bytes were at their bound
    "quota",  # larger than the tenant's disk quota
    "full",  # larger than the tier, or the disk was full (ENOSPC)
    "io_error",  # the write failed otherwise
    "evicted",  # made room for another on the tier (the policy)
    "corrupt",  # its file failed its tag (or was short, or gone) at promotion
    "unplaced",  # found, but no room in DRAM for its promotion
    "error",  # a bug: logged
)


class _Gauges(Collector):
    def __init__(self, stats: Callable[[], list[tuple[str, int, int]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily(
            "maasd_disk_bytes", "Bytes held by a pool's disk tier (pending writes included)",
            labels=["pool"],
        )  # fmt: skip
        count = GaugeMetricFamily(
            "maasd_disk_entries", "Entries held by a pool's disk tier", labels=["pool"]
        )
        for pool, nbytes, n in sorted(self._stats()):
            size.add_metric([pool], nbytes)
            count.add_metric([pool], n)
        yield from (size, count)


class PoolCounts:
    """Named counts per pool, safe from any thread: the one owner of the in-memory
    counts. They move from the demotion writer, the promotions (socket threads) and
    under the disk tier's lock; a ``+=`` on a shared ``Counter`` is a read then a write
    and could lose a count, and a reader copying it while a new name is added would fail.
    The lock is a leaf: taken last, held for one update or one copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, CountsByName[str]] = defaultdict(CountsByName)

    def add(self, pool: str, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[pool][name] += n

    def of(self, pool: str) -> dict[str, int]:
        """A copy of ``pool``'s counts (empty if none moved yet)."""
        with self._lock:
            c = self._counts.get(pool)
            return {} if c is None else dict(c)


class DiskMetrics:
    """The series, and the same counts by pool in memory (for GET /v1/pools)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.counts = PoolCounts()
        r = registry
        self.demotions = Counter(
            "maasd_disk_demotions", "Entries demoted from DRAM to disk", ["pool"], registry=r
        )
        self.promotions = Counter(
            "maasd_disk_promotions",
            "Socket lookups that missed DRAM and were answered from disk (hits)",
            ["pool"],
            registry=r,
        )
        self.drops = Counter(
            "maasd_disk_drops",
            "Entries not kept on disk, by reason: " + ", ".join(DROP_REASONS),
            ["pool", "reason"],
            registry=r,
        )
        self.write_bytes = Counter(
            "maasd_disk_write_bytes", "Bytes written to disk tiers", ["pool"], registry=r
        )
        self.read_bytes = Counter(
            "maasd_disk_read_bytes", "Bytes read from disk tiers", ["pool"], registry=r
        )

    def attach(self, stats: Callable[[], list[tuple[str, int, int]]]) -> None:
        self._registry.register(_Gauges(stats))

    def demoted(self, pool: str) -> None:
        self.demotions.labels(pool=pool).inc()
        self.counts.add(pool, "demotions")

    def promoted(self, pool: str) -> None:
        self.promotions.labels(pool=pool).inc()
        self.counts.add(pool, "promotions")

    def dropped(self, pool: str, reason: str) -> None:
        self.drops.labels(pool=pool, reason=reason).inc()
        self.counts.add(pool, "drop:" + reason)

    def written(self, pool: str, n: int) -> None:
        self.write_bytes.labels(pool=pool).inc(n)
        self.counts.add(pool, "write_bytes", n)

    def read(self, pool: str, n: int) -> None:
        self.read_bytes.labels(pool=pool).inc(n)
        self.counts.add(pool, "read_bytes", n)
