"""The ledger row a pool spec makes (``maasd.core.pools.new_pool_row``): pure but for the
directories it makes, checked on the two-node sysfs fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from maasd.core.pools import new_pool_row
from maasd.errors import InvalidRequest, PlacementError, TooLarge
from maasd.models import PoolSpec
from maasd.store import PoolRow
from maasd.topology import discover

TWO_NODES = Path(__file__).resolve().parents[1] / "data" / "sysfs_two_nodes"


def _row(spec: PoolSpec, tmp_path: Path) -> PoolRow:
    topo = discover(TWO_NODES)
    return new_pool_row(spec, topo, topo.node, host="h", data_dir=str(tmp_path), live=[])


def test_capacity_is_rounded_up_to_whole_pages(tmp_path: Path) -> None:
    row = _row(PoolSpec(name="p", numa_node=1, capacity_bytes=4097), tmp_path)
    assert (row.capacity_bytes, row.page_bytes, row.numa_node, row.host) == (8192, 4096, 1, "h")


def test_a_node_the_host_lacks_is_refused_naming_the_nodes(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match=r"nodes: \[0, 1\]"):
        _row(PoolSpec(name="p", numa_node=7, capacity_bytes=4096), tmp_path)


def test_capacity_past_2_63_or_the_nodes_memory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="2\\^63"):
        _row(PoolSpec(name="p", numa_node=0, capacity_bytes=(1 << 63) - 1), tmp_path)
    topo = discover(TWO_NODES)
    node = topo.node(0)
    assert node is not None
    assert node.mem_total_bytes
    with pytest.raises(TooLarge, match="exceeds node 0's memory"):
        _row(PoolSpec(name="p", numa_node=0, capacity_bytes=node.mem_total_bytes + 4096), tmp_path)


def test_what_a_changed_pool_table_differs_in(tmp_path: Path) -> None:
    """A pool's table edited after the pool was made: the ledger's row is kept, and the
    start logs what differs — a capacity larger or smaller (compared in whole pages), a
    property its buffers are bound to, a moved spill dir; nothing for the same table."""
    from maasd.core.pools import differs

    spec = PoolSpec(name="p", numa_node=1, capacity_bytes=4097, persistence="persistent")
    row = _row(spec, tmp_path)
    assert differs(row, spec) == []
    assert (
        differs(
            row,
            PoolSpec(
                name="p",
                numa_node=1,
                capacity_bytes=8192,
                persistence="persistent",
                spill_dir=row.spill_dir,
            ),
        )
        == []
    )
    smaller = PoolSpec(name="p", numa_node=1, capacity_bytes=4096, persistence="persistent")
    assert differs(row, smaller) == ["capacity_bytes"]
    assert differs(row, smaller, configured=False) == []  # a default pool's capacity moves
    moved = PoolSpec(
        name="p",
        numa_node=1,
        capacity_bytes=8192,
        persistence="persistent",
        scrub="punch",
        spill_dir=str(tmp_path / "elsewhere"),
    )
    assert differs(row, moved) == ["scrub", "spill_dir"]
