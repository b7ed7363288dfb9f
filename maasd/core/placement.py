"""Which pools could hold a reserve, best first: pure functions of the pools and the request.

The rules (docs/api.md, reserve): a pool qualifies if its ``latency_us`` is at most the one
asked for, its persistence is the one asked for and it is on the NUMA node asked
for (each only when asked); among those, the ones whose whole capacity could
hold the size; among those, the one with the most free space first.

>>> from maasd.models import ReserveSpec
>>> qos_text(ReserveSpec(size_bytes=1, latency_us=5, persistence="persistent"))
'no pool meets latency_us ≤ 5, persistence persistent'
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from maasd.errors import PlacementError, QosUnmet
from maasd.models import ReserveSpec
from maasd.sizes import check_fits
from maasd.store import PoolRow

__all__ = ["by_free_space", "candidates", "meets", "qos_text"]


def meets(row: PoolRow, req: ReserveSpec) -> bool:
    """Whether the pool has the QoS the request asks for."""
    return (
        (req.latency_us is None or row.latency_us <= req.latency_us)
        and (req.persistence is None or row.persistence == req.persistence)
        and (req.numa_node is None or row.numa_node == req.numa_node)
    )


def qos_text(req: ReserveSpec) -> str:
    """Why no pool qualifies, in the request's own terms."""
    parts = []
    if req.latency_us is not None:
        parts.append(f"latency_us ≤ {req.latency_us}")
    if req.persistence is not None:
        parts.append(f"persistence {req.persistence}")
    if req.numa_node is not None:
        parts.append(f"numa_node {req.numa_node}")
    return "no pool meets " + (", ".join(parts) or "the request")


def candidates(
    pools: Sequence[PoolRow], req: ReserveSpec, node_ids: Collection[int]
) -> list[PoolRow]:
    """The pools among ``pools`` that could ever hold ``req`` (order kept).

    ``pools`` is every pool of the host, or the one the request names. Raises
    :class:`PlacementError` for a NUMA node not in ``node_ids``, :class:`QosUnmet`
    when no pool has the QoS, :class:`TooLarge` when none that has it is big enough.
    """
    if req.numa_node is not None and req.numa_node not in node_ids:
        raise PlacementError(
            f"NUMA node {req.numa_node} does not exist on this host (nodes: {sorted(node_ids)})"
        )
    fit = [row for row in pools if meets(row, req)]
    if not fit:
        named = f" in pool {pools[0].name}" if req.pool is not None and pools else ""
        raise QosUnmet(qos_text(req) + named)
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
