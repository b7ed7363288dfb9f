"""``maasd router``'s Prometheus metrics (prometheus-client, a registry of its own).

Per backend (label ``backend``: its index; ``maasd_router_backend_info`` maps it to a
URL): requests by outcome; prompt tokens restored from maasd, held by the slot already,
and evaluated by the server (its own ``timings``); restore and save latency; busy
slots; errors by kind; restarts. For the router: whether prefix sharing is on (0: maasd
is unreachable and the router is a plain balancer) and entry lookups and publishes by
outcome.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

#: The Prometheus text format's media type as litestar takes it: litestar appends
#: ``; charset=utf-8`` to every ``text/`` type itself (prometheus-client's
#: ``CONTENT_TYPE_LATEST``, which carries it already, made the header say it twice).
CONTENT_TYPE = "text/plain; version=0.0.4"

disable_created_metrics()  # the *_created samples double the exposition; nothing reads them

STATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        b = ["backend"]
        self.requests = Counter(
            "maasd_router_requests",
            "Completions by backend and outcome",
            [*b, "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "maasd_router_prompt_tokens",
            "Prompt tokens by how the backend got them: restored (from maasd), held (in the "
            "slot already) or evaluated; and those evaluated for a publish's prefix-only "
            "prefill (publish)",
            [*b, "kind"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            "maasd_router_restore_seconds",
            "A restore from maasd: lookup, checks, copy and the server's restore",
            b,
            buckets=STATE_BUCKETS,
            registry=r,
        )
        self.save_seconds = Histogram(
            "maasd_router_save_seconds",
            "A publish: prefix-only prefill, the server's save, copy and commit",
            b,
            buckets=STATE_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "maasd_router_ttft_seconds",
            "Request arrival to the backend's first response byte",
            b,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "maasd_router_tokenize_seconds",
            "A prompt's tokens from a backend (/apply-template and /tokenize)",
            buckets=STATE_BUCKETS,
            registry=r,
        )
        self.slot_wait_seconds = Histogram(
            "maasd_router_slot_wait_seconds", "A request waiting for an idle slot",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.lead_wait_seconds = Histogram(
            "maasd_router_lead_wait_seconds",
            "A request waiting for another's publish of the prefix they share",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.slots_busy = Gauge("maasd_router_slots_busy", "Slots in use", b, registry=r)
        self.slots = Gauge("maasd_router_slots", "Slots of the backend", b, registry=r)
        self.backend_up = Gauge(
            "maasd_router_backend_up", "1 when the backend answers", b, registry=r
        )
        self.backend_info = Gauge(
            "maasd_router_backend_info", "The backend's URL", [*b, "url"], registry=r
        )
        self.restarts = Counter(
            "maasd_router_backend_restarts", "Backends the router restarted", b, registry=r
        )
        self.errors = Counter(
            "maasd_router_errors", "Errors by backend and kind", [*b, "kind"], registry=r
        )
        self.entries = Counter(
            "maasd_router_entries",
            "Entry lookups (hit, miss, refused, released) and publishes (ok, duplicate, refused)",
            ["op", "outcome"],
            registry=r,
        )
        self.sharing = Gauge(
            "maasd_router_sharing",
            "1 when prefixes are shared through maasd, 0 when the router is a plain balancer",
            registry=r,
        )

    def count_entry(self, op: str, outcome: str) -> None:
        self.entries.labels(op, outcome).inc()

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
