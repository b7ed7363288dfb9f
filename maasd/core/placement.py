"""Which pools could hold a reserve, best first: pure functions of the pools and the request.

The rules (docs/api.md, reserve): a pool qualifies if its latency class is at most the
``latency_us`` asked for, its persistence is the one asked for and it is on the NUMA node
asked for (each only when asked); among those, the ones whose whole capacity could
hold the size; among those, the one with the most free space first.

The latency class is the pool's declared ``latency_us``, or, for a reserve with
``latency_source = "measured"``, the one the daemon measured of the pool's node
(``measured``: µs by node, :mod:`maasd.core.latency`); a pool whose node is not measured
does not qualify then.

>>> from maasd.models import ReserveSpec
>>> qos_text(ReserveSpec(size_bytes=1, latency_us=5, persistence="persistent"))
'no pool meets latency_us ≤ 5, persistence persistent'
>>> qos_text(ReserveSpec(size_bytes=1, latency_us=0.2, latency_source="measured"), {})
'no pool meets measured latency_us ≤ 0.2 (no node measured yet)'
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from maasd.errors import PlacementError, QosUnmet
from maasd.models import ReserveSpec
from maasd.sizes import check_fits
from maasd.store import PoolRow

__all__ = ["by_free_space", "candidates", "latency_of", "meets", "qos_text"]

NO_MEASURE: Mapping[int, float] = {}


def latency_of(row: PoolRow, req: ReserveSpec, measured: Mapping[int, float]) -> float | None:
    """The pool's latency class the request is held to (``None``: not measured)."""
    if req.latency_source == "measured":
        return measured.get(row.numa_node)
    return row.latency_us


def meets(row: PoolRow, req: ReserveSpec, measured: Mapping[int, float] = NO_MEASURE) -> bool:
    """Whether the pool has the QoS the request asks for."""
    if req.latency_us is not None:
        latency = latency_of(row, req, measured)
        if latency is None or latency > req.latency_us:
            return False
    return (req.persistence is None or row.persistence == req.persistence) and (
        req.numa_node is None or row.numa_node == req.numa_node
    )


def qos_text(req: ReserveSpec, measured: Mapping[int, float] | None = None) -> str:
    """Why no pool qualifies, in the request's own terms (``measured``: as in :func:`meets`)."""
    parts = []
    if req.latency_us is not None:
        ceiling = f"{req.latency_us:g}"
        if req.latency_source == "measured":
            parts.append(f"measured latency_us ≤ {ceiling}")
            if not measured:
                parts[-1] += " (no node measured yet)"
        else:
            parts.append(f"latency_us ≤ {ceiling}")
    if req.persistence is not None:
        parts.append(f"persistence {req.persistence}")
    if req.numa_node is not None:
        parts.append(f"numa_node {req.numa_node}")
    return "no pool meets " + (", ".join(parts) or "the request")


def candidates(
    pools: Sequence[PoolRow],
    req: ReserveSpec,
    node_ids: Collection[int],
    measured: Mapping[int, float] = NO_MEASURE,
) -> list[PoolRow]:
    """The pools among ``pools`` that could ever hold ``req`` (order kept).

    ``pools`` is every pool of the host, or the one the request names; ``measured``: the
    measured latency class by node, in µs. Raises :class:`PlacementError` for a NUMA node
    not in ``node_ids``, :class:`QosUnmet` when no pool has the QoS, :class:`TooLarge`
    when none that has it is big enough.
    """
    if req.numa_node is not None and req.numa_node not in node_ids:
        raise PlacementError(
            f"NUMA node {req.numa_node} does not exist on this host (nodes: {sorted(node_ids)})"
        )
    fit = [row for row in pools if meets(row, req, measured)]
    if not fit:
        named = f" in pool {pools[0].name}" if req.pool is not None and pools else ""
        raise QosUnmet(qos_text(req, measured) + named)
    # Capacities are whole pages, so size ≤ capacity ⇔ rounded size ≤ capacity — and no
    # size below 2^63 is refused for rounding past it: too large is too large (422).
    big = [row for row in fit if req.size_bytes <= row.capacity_bytes]
    if not big:
        biggest = max(row.capacity_bytes for row in fit)
        check_fits(req.size_bytes, biggest, "the largest pool that meets the QoS")
    return big


def by_free_space(pools: Sequence[PoolRow], used: Mapping[str, int]) -> list[PoolRow]:
    """``pools`` with the most free bytes first (``used``: bytes in use by pool id)."""
    return sorted(pools, key=lambda row: row.capacity_bytes - used.get(row.id, 0), reverse=True)
