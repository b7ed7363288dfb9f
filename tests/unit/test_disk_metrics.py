"""The disk tiers' in-memory counts (GET /v1/pools) move from many threads at once — the
demotion writer, the socket threads' promotions, the tier's own lock — and lose none:
each count is exact, equal to its Prometheus series, and a reader copying them while
new names appear never fails."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from maasd.disk.metrics import DROP_REASONS, DiskMetrics, PoolCounts

THREADS = 8
ROUNDS = 2000


def test_concurrent_counts_are_exact_and_match_the_series() -> None:
    registry = CollectorRegistry()
    metrics = DiskMetrics(registry)
    start = threading.Barrier(THREADS + 1)
    stop = threading.Event()
    copies: list[dict[str, int]] = []
    failures: list[BaseException] = []

    def count(i: int) -> None:
        start.wait()
        for n in range(ROUNDS):
            pool = f"pool-{n % 2}"
            metrics.demoted(pool)
            metrics.promoted(pool)
            metrics.dropped(pool, DROP_REASONS[(i + n) % len(DROP_REASONS)])
            metrics.written(pool, 3)
            metrics.read(pool, 5)

    def read() -> None:
        start.wait()
        try:
            while not stop.is_set():
                copies.append(metrics.counts.of("pool-0"))
        except BaseException as e:  # a copy racing an insert: the defect this guards
            failures.append(e)

    reader = threading.Thread(target=read)
    workers = [threading.Thread(target=count, args=(i,)) for i in range(THREADS)]
    reader.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    reader.join()

    assert failures == []
    assert copies  # the reader did run alongside
    per_pool = THREADS * ROUNDS // 2
    for pool in ("pool-0", "pool-1"):
        c = metrics.counts.of(pool)
        assert c["demotions"] == c["promotions"] == per_pool
        assert c["write_bytes"] == 3 * per_pool
        assert c["read_bytes"] == 5 * per_pool
        drops = {k[5:]: v for k, v in c.items() if k.startswith("drop:")}
        assert sum(drops.values()) == per_pool
        series = {"demotions": "maasd_disk_demotions", "write_bytes": "maasd_disk_write_bytes"}
        for name, family in series.items():
            assert registry.get_sample_value(family + "_total", {"pool": pool}) == c[name]
        for reason, n in drops.items():
            labels = {"pool": pool, "reason": reason}
            assert registry.get_sample_value("maasd_disk_drops_total", labels) == n


def test_a_copy_is_a_snapshot_not_a_view() -> None:
    counts = PoolCounts()
    assert counts.of("none") == {}
    counts.add("p", "demotions")
    seen = counts.of("p")
    counts.add("p", "demotions", 4)
    counts.add("p", "drop:cold")
    assert seen == {"demotions": 1}
    assert counts.of("p") == {"demotions": 5, "drop:cold": 1}
    assert counts.of("none") == {}  # reading does not create a pool
