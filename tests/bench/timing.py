"""Timing helpers the benchmarks share: medians in milliseconds, and a measurement paired
with its floor, back to back, so that the machine's load drifts out of the ratio."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def ms(times: list[float]) -> float:
    """The median of ``times`` (seconds), in milliseconds."""
    return statistics.median(times) * 1e3


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """``fn()`` run ``repeat`` times: the median, in milliseconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return ms(times)


def paired(a: Callable[[], Any], b: Callable[[], Any], n: int) -> tuple[float, float, float]:
    """Run ``a`` and ``b`` back to back ``n`` times: (median a ms, median b ms, median a/b)."""
    ta, tb, ratios = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return ms(ta), ms(tb), statistics.median(ratios)
