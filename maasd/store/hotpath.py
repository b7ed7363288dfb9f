"""Ledger calls made on a hot path — an event loop — counted: there must be none.

The worker socket's loop serves ``lookup``, ``attach`` and ``detach`` inline, from memory
(docs/scale-out.md, "Failure modes"); anything that needs the ledger runs on its slow pool.
The REST server's asyncio loop hands every service call to a thread. A ledger call on
either loop would make every worker (or every REST client) of the host wait for the
database, and stop them all while it is frozen. So both loops mark their thread
(:func:`mark`: :mod:`maasd.broker.loop`, :class:`maasd.api.loop.GuardedLoop`), every
ledger call (each connection a repository takes from
:class:`maasd.store.database.Database`) counts itself if made on a marked thread
(:func:`count`), and ``/metrics`` reports the count as
``maasd_ledger_calls_on_hot_path_total`` (:class:`HotPathCollector`), which the tests
check stays 0 while the ledger is frozen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["HotPathCollector", "calls", "count", "mark"]

_marked = threading.local()
_lock = threading.Lock()
_calls = 0


def mark() -> None:
    """The current thread is a hot path: it must never wait on the ledger."""
    _marked.hot = True


def count() -> None:
    """A ledger call is about to be made: counted if on a hot path (the cost elsewhere:
    one thread-local read)."""
    global _calls
    if getattr(_marked, "hot", False):
        with _lock:
            _calls += 1


def calls() -> int:
    """Ledger calls made on a hot path since the process started."""
    return _calls


class HotPathCollector(Collector):
    """``maasd_ledger_calls_on_hot_path_total``, read at scrape time."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "maasd_ledger_calls_on_hot_path",
            "Ledger calls made on an event loop, the worker socket's or the REST server's "
            "(none expected: neither may ever wait on the database)",
            value=calls(),
        )
