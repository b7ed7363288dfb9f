"""The L2 tier's Prometheus series, on the daemon's registry.

No label carries the L2 address, a key or a tenant: what L2 holds is not a
metric's business, and its address stays with the daemon.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["L2Metrics"]

#: An L2 round trip on loopback is ~0.1 ms plus the value's transfer; the timeout ~100 ms.
L2_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class L2Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.lookups = Counter(
            "maasd_l2_lookups",
            "Local lookup misses asked of L2, by outcome: hit (restored here), miss, error "
            "(L2 failed or timed out), refused (a value the checks refused), unplaced (found, "
            "but no room here for it), skipped (circuit breaker open)",
            ["outcome"],
            registry=r,
        )
        self.refused = Counter(
            "maasd_l2_refused",
            "Values read from L2 that the daemon refused, by reason "
            "(format, namespace, size, checksum)",
            ["reason"],
            registry=r,
        )
        self.writes = Counter(
            "maasd_l2_writes", "Entries written behind to L2, by outcome", ["outcome"], registry=r
        )
        self.dropped = Counter(
            "maasd_l2_dropped_writes",
            "Committed entries not written to L2, by reason: queue_full, breaker_open, error, "
            "gone (released before its turn), too_large (more than the tenant's L2 cap), "
            "shutdown (still queued when the daemon stopped)",
            ["reason"],
            registry=r,
        )
        self.skipped_writes = Counter(
            "maasd_l2_skipped_writes",
            "Committed entries not sent to L2 by rule, by reason: over_value_limit (a value "
            "larger than maasd_l2_max_value_bytes)",
            ["reason"],
            registry=r,
        )
        self.max_value = Gauge(
            "maasd_l2_max_value_bytes",
            "The largest value (header and entry) sent to or read back from L2 (the "
            "l2_max_value_bytes setting)",
            registry=r,
        )
        self.tenant_breaker_trips = Counter(
            "maasd_l2_tenant_breaker_trips",
            "Times one tenant's L2 calls were paused for its own failures (the host's "
            "breaker stayed closed unless L2 failed a PING too)",
            registry=r,
        )
        self.evicted = Counter(
            "maasd_l2_evicted",
            "Values L2 dropped to keep a tenant under its L2 byte cap (oldest first)",
            registry=r,
        )
        self.bytes_in = Counter(
            "maasd_l2_read_bytes", "Bytes of values read from L2 (hits)", registry=r
        )
        self.bytes_out = Counter(
            "maasd_l2_written_bytes", "Bytes of values written to L2", registry=r
        )
        self.seconds = Histogram(
            "maasd_l2_seconds",
            "Time of one L2 request, by op (fetch, store, delete), failures included",
            ["op"],
            buckets=L2_BUCKETS,
            registry=r,
        )
        self.breaker_open = Gauge(
            "maasd_l2_breaker_open", "1 while the L2 circuit breaker is open", registry=r
        )
        self.breaker_trips = Counter(
            "maasd_l2_breaker_trips", "Times the L2 circuit breaker opened", registry=r
        )
        self._queues(r)

    def _queues(self, r: CollectorRegistry) -> None:
        """The write-behind queue's series, and the deletes'."""
        self.deletes = Counter(
            "maasd_l2_deletes",
            "Deletes of the values that released entries wrote (any release but an "
            "eviction), by outcome: deleted, absent (gone already, or another value there "
            "now: left), error (the call failed; tried again), given_up (after its tries: "
            "the value ages out), queue_full, shutdown (still queued when the daemon stopped)",
            ["outcome"],
            registry=r,
        )
        self.queued = Gauge(
            "maasd_l2_queue_entries", "Committed entries waiting to be written to L2", registry=r
        )
        self.queued_bytes = Gauge(
            "maasd_l2_queue_bytes", "Bytes of the entries waiting to be written", registry=r
        )
        self.queued_deletes = Gauge(
            "maasd_l2_delete_queue_entries",
            "Deletes of released entries' values waiting for L2",
            registry=r,
        )
