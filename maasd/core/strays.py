"""Pages found off their node: a sample of every held region's pages, per pool, for /metrics.

A reserve checks a sample of a new buffer's pages once (``Region.verify_node``); this asks
again at every scrape, so that a page the kernel moved later (a NUMA balancer, memory
hot-remove, a migration the daemon did not ask for) shows up as ``maasd_pool_pages_off_node``.
A region's node is the one it is bound to now: its pool's, or the one it was pinned to.

The sample never populates (``move_pages`` on the daemon's own mapping, a few pages per
region, at most :data:`MAX_REGIONS` regions a scrape): a page not present is not counted.
"""

from __future__ import annotations

import itertools

from maasd.core.livepools import LivePools
from maasd.core.regions import Regions
from maasd.errors import BackingError

__all__ = ["MAX_REGIONS", "PAGES_PER_REGION", "stray_pages"]

#: Pages asked about per region (evenly spread over it).
PAGES_PER_REGION = 8
#: Regions sampled per scrape (the first ones held): ~10 µs each.
MAX_REGIONS = 512


def stray_pages(
    live: LivePools,
    regions: Regions,
    per_region: int = PAGES_PER_REGION,
    max_regions: int = MAX_REGIONS,
) -> list[tuple[str, int, int, int]]:
    """``(pool name, pool node, pages sampled, pages off their node)`` for each live pool."""
    pools = {live.row.id: live.row for live in live.all()}
    counts = {pool_id: [0, 0] for pool_id in pools}
    for buffer_id in itertools.islice(regions.buffer_ids(), max_regions):
        held = regions.held(buffer_id)
        if held is None or held.pool_id not in counts or held.region.closed:
            continue
        region = held.region
        try:
            placed = region.placement(sample=per_region)
        except BackingError:  # closed since: released between the two calls
            continue
        tally = counts[held.pool_id]
        for node, n in placed.items():
            if node >= 0:
                tally[0] += n
                tally[1] += n if node != region.node else 0
    return [
        (row.name, row.numa_node, *counts[pool_id])  # type: ignore[misc]
        for pool_id, row in sorted(pools.items(), key=lambda item: item[1].name)
    ]
