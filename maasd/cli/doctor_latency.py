"""``maasd doctor``'s latency check: each pool's declared ``latency_us`` beside the class
measured of its node (:mod:`maasd.probe`'s pointer chase, :func:`maasd.core.latency.node_classes`).

A declared class is what the pool's creator typed; a reserve with a ``latency_us`` ceiling
is held to it (``latency_source = "declared"``, the default). The check warns where the
two disagree in a way a reserve would feel: a pool measured slower than it declares, or two
pools whose declared order the measurement reverses (by more than :data:`MARGIN`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from maasd.cli.doctor_check import Check
from maasd.models import Measured, PoolSpec
from maasd.settings import Settings, default_pools
from maasd.topology import Topology

__all__ = ["MARGIN", "check_latency", "latency_findings"]

#: A reversed order counts only past this factor (the probe's run-to-run noise is ~15 %).
MARGIN = 1.25


def latency_findings(
    pools: Sequence[PoolSpec], classes: Mapping[int, Measured]
) -> tuple[list[str], list[str]]:
    """``(one line per pool, the problems)``: measured slower than declared, or an order
    of two pools' declared classes that the measurement reverses.

    >>> from maasd.models import Measured, PoolSpec
    >>> fast = PoolSpec(name="fast", numa_node=0, capacity_bytes=1, latency_us=1)
    >>> slow = PoolSpec(name="slow", numa_node=1, capacity_bytes=1, latency_us=2)
    >>> m = {0: Measured(latency_us=0.3, cpu_node=0), 1: Measured(latency_us=0.1, cpu_node=1)}
    >>> latency_findings([fast, slow], m)[1]
    ['fast declares a lower class than slow (1 < 2 µs) but measures 3.0 × slower']
    """
    lines, problems = [], []
    for p in pools:
        m = classes.get(p.numa_node)
        if m is None:
            lines.append(f"{p.name}: declared {p.latency_us} µs, node {p.numa_node} not measured")
            continue
        lines.append(
            f"{p.name}: declared {p.latency_us} µs, measured {m.latency_us:.3f} µs "
            f"(cpu node {m.cpu_node})"
        )
        if m.latency_us > p.latency_us:
            problems.append(
                f"{p.name} measures {m.latency_us:.3f} µs > its declared {p.latency_us}"
            )
    for a in pools:
        for b in pools:
            ma, mb = classes.get(a.numa_node), classes.get(b.numa_node)
            if ma is None or mb is None or not a.latency_us < b.latency_us:
                continue
            if ma.latency_us > MARGIN * mb.latency_us:
                problems.append(
                    f"{a.name} declares a lower class than {b.name} ({a.latency_us} < "
                    f"{b.latency_us} µs) but measures {ma.latency_us / mb.latency_us:.1f} × slower"
                )
    return lines, problems


def check_latency(topology: Topology, settings: Settings) -> Check:
    """Measure each node's load-to-use latency (a short probe) and hold the pools the
    daemon would serve (configured, else the default ones) to it."""
    from maasd.core.latency import node_classes
    from maasd.probe import Probe, probe_latency

    name = "latency classes"
    pools = settings.pools or default_pools(
        topology, settings.default_pool_bytes, settings.default_warm_bytes
    )
    measured = Probe(latency=probe_latency(topology, rounds=8), bandwidth=[])
    pairs = ", ".join(f"cpu {x.cpu_node}→mem {x.mem_node} {x.ns:.0f} ns" for x in measured.latency)
    lines, problems = latency_findings(pools, node_classes(topology, measured, time.time()))
    detail = f"{pairs}; " + "; ".join(lines)
    if problems:
        return Check(
            name,
            "warn",
            f"{detail}: " + "; ".join(problems),
            "declare latency_us to match (a new pool; a reserve may also pass "
            'latency_source "measured" to be held to the measured class)',
        )
    return Check(name, "ok", detail)
