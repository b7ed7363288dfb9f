"""The allocator on two real nodes: regions, pins, warm stock, huge pages, a full node.

Every count is the kernel's (``move_pages`` in this process, :func:`placement.pages_by_node`),
and 100 % of the pages must be on the node asked for.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from maasd.allocator import MemoryPool, Region
from maasd.errors import BackingError, PlacementError, PoolExhausted
from maasd.topology import discover, node_room
from placement import HUGE, NODES, PAGE, MiB, all_on, huge_pages, pages_by_node

FAR = NODES[-1]  # the node that is not the default one


@pytest.mark.parametrize("node", NODES)
def test_a_region_lands_on_its_node(node: int) -> None:
    r = Region.create(8 * MiB, node=node)
    try:
        assert pages_by_node(r.address, r.size) == all_on(node, r.size)
        assert r.placement() == all_on(node, r.size)  # the daemon's own count agrees
    finally:
        r.close()


def test_pin_moves_every_page_and_reports_what_the_kernel_counts() -> None:
    r = Region.create(8 * MiB, node=0)
    try:
        r.view()[:] = b"\x5a" * r.size
        for node in (FAR, 0, FAR):
            reported = r.pin(node, frozenset(NODES))
            assert reported == all_on(node, r.size)
            assert pages_by_node(r.address, r.size) == reported
        assert bytes(r.view()) == b"\x5a" * r.size  # moved, not lost
    finally:
        r.close()


def test_pin_while_another_mapping_writes() -> None:
    """A second mapping of the same memfd (a worker's) keeps writing while the pages move:
    every page ends on the new node, in both mappings, and no write is lost."""
    import mmap
    import os

    r = Region.create(16 * MiB, node=0)
    fd = r.dup_fd()
    worker = mmap.mmap(fd, r.size, flags=mmap.MAP_SHARED)
    os.close(fd)
    views = [np.frombuffer(worker, dtype=np.uint64)]
    stop = threading.Event()
    rounds = [0]

    def write() -> None:
        while not stop.is_set():
            rounds[0] += 1
            views[0][:: PAGE // 8] = rounds[0]  # one word per page, every page

    t = threading.Thread(target=write)
    t.start()
    try:
        for node in (FAR, 0, FAR):
            assert r.pin(node, frozenset(NODES)) == all_on(node, r.size)
    finally:
        stop.set()
        t.join()
    try:
        assert rounds[0] > 0
        assert pages_by_node(views[0].ctypes.data, r.size) == all_on(FAR, r.size)
        assert pages_by_node(r.address, r.size) == all_on(FAR, r.size)
        assert set(views[0][:: PAGE // 8].tolist()) == {rounds[0]}  # the last round, everywhere
    finally:
        views.clear()
        worker.close()
        r.close()


def test_warm_stock_of_a_pool_on_the_far_node() -> None:
    pool = MemoryPool(name="far", numa_node=FAR, capacity=64 * MiB, warm_bytes=32 * MiB)
    size = 4 * MiB
    pool.release(pool.reserve(size))  # the demand the stock follows
    while pool.refill_step():
        pass
    assert pool.warm >= size
    held = pool.warm
    r = pool.reserve(size)
    try:
        assert pool.warm < held, "the reserve did not take from the warm stock"
        assert pages_by_node(r.address, r.size) == all_on(FAR, size)
    finally:
        pool.release(r)
        pool.close()


@pytest.mark.hugetlb
def test_hugetlb_pages_come_from_their_nodes_own_reserve() -> None:
    with huge_pages({0: 0, FAR: 4}):
        topo = discover()
        assert [n.hugepages_total for n in topo.nodes] == [0, 4]
        r = Region.create(4 * MiB, node=FAR, backing="hugetlb")
        try:
            assert pages_by_node(r.address, r.size, HUGE) == all_on(FAR, r.size, HUGE)
            assert discover().node(FAR).hugepages_free == 2  # type: ignore[union-attr]
        finally:
            r.close()
        # node 0 has none: a clear refusal, never a huge page of node FAR
        with pytest.raises(BackingError, match="EFAULT|ENOMEM"):
            Region.create(2 * MiB, node=0, backing="hugetlb")
        assert discover().node(FAR).hugepages_free == 4  # type: ignore[union-attr]


def test_a_full_node_refuses_and_never_places_elsewhere() -> None:
    room = node_room(FAR)
    assert room is not None
    with pytest.raises(PoolExhausted, match=f"NUMA node {FAR} has"):
        Region.create(room + 64 * MiB, node=FAR)
    # what fits is placed on that node, all of it
    r = Region.create(min(room // 2, 256 * MiB), node=FAR)
    try:
        assert pages_by_node(r.address, r.size) == all_on(FAR, r.size)
    finally:
        r.close()


def test_verify_node_sees_a_stray_page() -> None:
    """The check the daemon runs at reserve is not vacuous here: pages bound to one node
    but counted on another are named."""
    r = Region.create(2 * MiB, node=0)
    try:
        r.node = FAR  # the region claims a node its pages are not on
        with pytest.raises(PlacementError, match=f"bound to node {FAR} are on"):
            r.verify_node()
    finally:
        r.close()


def test_bandwidth_probe_measures_every_pair() -> None:
    """Correctness only: in a guest the distances are declared and both nodes are the
    host's memory, so the figures say nothing about remote access."""
    from maasd.probe import probe_bandwidth

    measured = probe_bandwidth(discover(), size=8 * MiB, rounds=1)
    assert [(b.cpu_node, b.mem_node) for b in measured] == [(c, m) for c in NODES for m in NODES]
    assert all(b.gib_per_s > 0 for b in measured)
