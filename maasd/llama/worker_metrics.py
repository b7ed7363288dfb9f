"""``maasd worker``'s metrics: prompt tokens restored vs evaluated, lookups, saves, TTFT.

Every series carries the ``pid`` of the process that counted it. The processes of one
worker share one port, so a scrape reaches one of them at random: each writes its
values to prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, a
private directory the supervisor makes, cleans at start and removes at exit), and
``GET /metrics`` of any process answers for all of them. Without that variable (one
process run by hand, tests) the values live in this process alone.

Time to first token is measured in the process, from the arrival of the request (an
ASGI middleware, before it waits for the model's lock) to the first token the model
samples — the same for streamed and whole answers.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["COMPLETION_PATHS", "PID_HEADER", "WorkerMetrics"]

#: the routes whose requests are timed to their first token
COMPLETION_PATHS = frozenset(
    ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")
)
#: a response header naming the process that answered
PID_HEADER = b"x-maasd-worker-pid"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
STATE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

_ARRIVED: contextvars.ContextVar[float] = contextvars.ContextVar("maasd_request_arrived")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def multiprocess_dir() -> str | None:
    """The shared metrics directory of this worker's processes, if there is one."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return path if path and os.path.isdir(path) else None


class WorkerMetrics:
    """The metrics of one worker process; a ``maasd.llama.cache.CacheObserver``."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = str(os.getpid() if pid is None else pid)
        self.shared_dir = multiprocess_dir()
        # Multiprocess values go to files whatever the registry; a registry of our own
        # serves them when there is no shared directory.
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = ["pid"]
        self.tokens = Counter(
            "maasd_worker_prompt_tokens",
            "Prompt tokens by where their state came from: restored (from maasd), held "
            "(already in this process's context), evaluated",
            [*p, "source"],
            registry=r,
        )
        self.lookups = Counter(
            "maasd_worker_cache_lookups",
            "Completions by what the prefix lookup found (hit, miss, not_better, held, "
            "refused, error, down)",
            [*p, "outcome"],
            registry=r,
        )
        self.saves = Counter(
            "maasd_worker_cache_saves",
            "Entry saves by outcome (saved, duplicate, refused, error, down, stale)",
            [*p, "outcome"],
            registry=r,
        )
        self.saved_bytes = Counter(
            "maasd_worker_cache_saved_bytes", "Bytes of state saved to maasd", p, registry=r
        )
        self.restored_bytes = Counter(
            "maasd_worker_cache_restored_bytes",
            "Bytes of state restored from maasd",
            p,
            registry=r,
        )
        self.save_seconds = Histogram(
            "maasd_worker_cache_save_seconds",
            "Time to save a completion's state (every key)",
            p,
            buckets=STATE_BUCKETS,
            registry=r,
        )
        self.restore_seconds = Histogram(
            "maasd_worker_cache_restore_seconds",
            "Time to restore a prefix (lookup, load, checks)",
            p,
            buckets=STATE_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "maasd_worker_ttft_seconds",
            "Time from a completion request's arrival to its first sampled token",
            p,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # liveall: the collector labels it with the pid and forgets it when the process
        # is marked dead.
        self.sharing_gauge = Gauge(
            "maasd_worker_sharing_enabled",
            "1 while this process shares prefixes through maasd, 0 while it cannot",
            registry=r,
            multiprocess_mode="liveall",
        )
        # This process's series exist from its start, at zero: a dashboard's rate() or
        # histogram_quantile() sees them before the first save or restore, and a scrape
        # lists the same families whichever process answers it.
        for metric in (
            self.saved_bytes,
            self.restored_bytes,
            self.save_seconds,
            self.restore_seconds,
            self.ttft,
        ):
            metric.labels(self.pid)
        self._armed: float | None = None
        self._lock = threading.Lock()

    # -- CacheObserver

    def looked_up(self, prompt: int, held: int, restored: int, outcome: str) -> None:
        """A completion starts: count its prompt, and arm the first-token clock."""
        with self._lock:
            self._armed = _ARRIVED.get(None) or time.perf_counter()
        pid = self.pid
        self.lookups.labels(pid, outcome).inc()
        done = min(max(held, restored), max(prompt - 1, 0))
        self.tokens.labels(pid, "restored").inc(restored)
        self.tokens.labels(pid, "held").inc(held if restored == 0 else 0)
        self.tokens.labels(pid, "evaluated").inc(prompt - done)

    def saved(self, outcomes: Sequence[str], nbytes: int, seconds: float) -> None:
        for outcome in outcomes:
            self.saves.labels(self.pid, outcome).inc()
        self.saved_bytes.labels(self.pid).inc(nbytes)
        self.save_seconds.labels(self.pid).observe(seconds)

    def restored(self, nbytes: int, seconds: float) -> None:
        self.restored_bytes.labels(self.pid).inc(nbytes)
        self.restore_seconds.labels(self.pid).observe(seconds)

    def sharing(self, up: bool) -> None:
        self.sharing_gauge.set(1 if up else 0)

    # -- time to first token

    def first_token(self) -> None:
        """The model sampled a token: the first since a completion started is timed."""
        with self._lock:
            t0, self._armed = self._armed, None
        if t0 is not None:
            self.ttft.labels(self.pid).observe(time.perf_counter() - t0)

    def hook_sampling(self, model: Any) -> None:
        """Time ``model``'s first sampled token of each completion (``model.sample`` of the
        instance: what ``Llama.generate`` calls for every token)."""
        sample = model.sample

        def timed_sample(*args: Any, **kwargs: Any) -> Any:
            token = sample(*args, **kwargs)
            if self._armed is not None:
                self.first_token()
            return token

        model.sample = timed_sample

    def middleware(self, app: App) -> App:
        """An ASGI middleware: stamps completion requests' arrival, names the process."""
        header = (PID_HEADER, self.pid.encode())

        async def timed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if scope.get("path") in COMPLETION_PATHS:
                _ARRIVED.set(time.perf_counter())

            async def send_named(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), header]
                await send(message)

            await app(scope, receive, send_named)

        return timed

    # -- exposition

    def render(self) -> tuple[bytes, str]:
        """The text of ``GET /metrics``: every process of the worker, or this one alone."""
        if self.shared_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.shared_dir)
        return generate_latest(registry), CONTENT_TYPE_LATEST
