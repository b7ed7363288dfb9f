"""Topology discovery: a fabricated two-node sysfs tree, and the real host."""

from __future__ import annotations

from pathlib import Path

import pytest

from maasd.settings import DEFAULT_POOL_CAP, GiB, default_pools
from maasd.topology import (
    Node,
    Topology,
    discover,
    node_room,
    parse_cpulist,
    parse_node_meminfo,
)

TWO_NODES = Path(__file__).resolve().parents[1] / "data" / "sysfs_two_nodes"
KiB = 1024


def node(topo: Topology, node_id: int) -> Node:
    """``topo.node(node_id)``, which must exist."""
    n = topo.node(node_id)
    assert n is not None, f"no node {node_id} in {sorted(topo.node_ids)}"
    return n


@pytest.fixture
def two_nodes() -> Topology:
    return discover(sysfs_root=TWO_NODES, hugepage_bytes=2 << 20)


class TestParsers:
    @pytest.mark.parametrize(
        ("text", "cpus"),
        [
            ("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]),
            ("0\n", [0]),
            ("", []),
            ("\n", []),
            ("0-1", [0, 1]),
            ("5,7", [5, 7]),
        ],
    )
    def test_cpulist(self, text, cpus):
        assert parse_cpulist(text) == cpus

    def test_meminfo_kb_to_bytes_counts_as_is(self):
        text = "Node 1 MemTotal:  16 kB\nNode 1 MemFree:   8 kB\nNode 1 HugePages_Total:  4\n"
        assert parse_node_meminfo(text) == {
            "MemTotal": 16 * KiB,
            "MemFree": 8 * KiB,
            "HugePages_Total": 4,
        }

    def test_meminfo_ignores_junk(self):
        assert parse_node_meminfo("garbage\n\nNode x MemFree: 1 kB\n") == {}


class TestTwoNodeFixture:
    def test_two_nodes_in_order(self, two_nodes):
        assert [n.id for n in two_nodes.nodes] == [0, 1]
        assert two_nodes.node_ids == frozenset({0, 1})

    def test_cpus(self, two_nodes):
        assert two_nodes.node(0).cpus == [0, 1, 2, 3, 8]
        assert two_nodes.node(1).cpus == [4, 5, 6, 7, 9, 10]

    def test_memory_in_bytes(self, two_nodes):
        n0, n1 = two_nodes.node(0), two_nodes.node(1)
        assert n0.mem_total_bytes == 128 * GiB
        assert n0.mem_free_bytes == 64 * GiB
        assert n1.mem_total_bytes == 16 * GiB
        assert n1.mem_free_bytes == 8 * GiB

    def test_distances(self, two_nodes):
        assert two_nodes.node(0).distances == [10, 21]
        assert two_nodes.node(1).distances == [21, 10]

    def test_hugepages_of_the_asked_size(self, two_nodes):
        assert two_nodes.hugepage_bytes == 2 << 20
        assert (two_nodes.node(0).hugepages_total, two_nodes.node(0).hugepages_free) == (64, 48)
        assert (two_nodes.node(1).hugepages_total, two_nodes.node(1).hugepages_free) == (16, 16)
        assert two_nodes.hugepages_free == 64

    def test_gigantic_pages_are_a_separate_pool(self):
        topo = discover(sysfs_root=TWO_NODES, hugepage_bytes=1 << 30)
        assert node(topo, 0).hugepages_free == 1
        assert node(topo, 1).hugepages_free == 0  # no such directory: zero, not an error
        assert topo.hugepages_free == 1

    def test_unknown_node_is_none(self, two_nodes):
        assert two_nodes.node(2) is None


class TestDefaultPoolsOnTwoNodes:
    def test_one_pool_per_node(self, two_nodes):
        pools = default_pools(two_nodes)
        assert [(p.name, p.numa_node) for p in pools] == [("node0", 0), ("node1", 1)]
        for p in pools:
            assert (p.backing, p.persistence, p.latency_us, p.prefault, p.scrub) == (
                "memfd",
                "volatile",
                1,
                True,
                "zero",
            )

    def test_quarter_of_free_capped_at_8_gib(self, two_nodes):
        pools = {p.name: p for p in default_pools(two_nodes)}
        assert DEFAULT_POOL_CAP == 8 << 30
        assert pools["node0"].capacity_bytes == 8 * GiB  # 64 GiB free / 4 = 16 → cap 8
        assert pools["node1"].capacity_bytes == 2 * GiB  # 8 GiB free / 4

    def test_explicit_size_overrides(self, two_nodes):
        pools = default_pools(two_nodes, pool_bytes=1 * GiB)
        assert [p.capacity_bytes for p in pools] == [GiB, GiB]

    def test_explicit_size_rounded_down_to_pages(self, two_nodes):
        pools = default_pools(two_nodes, pool_bytes=GiB + 100)
        assert [p.capacity_bytes for p in pools] == [GiB, GiB]

    def test_explicit_size_above_cap_is_honoured(self, two_nodes):
        pools = default_pools(two_nodes, pool_bytes=16 * GiB)
        assert [p.capacity_bytes for p in pools] == [16 * GiB, 16 * GiB]

    def test_sub_page_size_makes_no_pools(self, two_nodes):
        assert default_pools(two_nodes, pool_bytes=100) == []


class TestRealHost:
    def test_discover_has_node_zero(self):
        topo = discover()
        assert 0 in topo.node_ids
        n0 = node(topo, 0)
        assert n0.mem_total_bytes > 0
        assert 0 < n0.mem_free_bytes <= n0.mem_total_bytes
        assert n0.cpus
        assert n0.distances[n0.id if len(n0.distances) > n0.id else 0] == 10
        assert topo.page_bytes >= 4096

    def test_missing_sysfs_is_one_node(self, tmp_path):
        topo = discover(sysfs_root=tmp_path / "absent")
        assert topo.node_ids == frozenset({0})
        assert node(topo, 0).mem_total_bytes > 0
        assert node(topo, 0).distances == [10]


class TestNodeRoom:
    """What a bound allocation on a node can take: free + inactive file cache − a margin."""

    def test_meminfo_keys_with_parentheses(self):
        text = "Node 0 Inactive(file):  2048 kB\nNode 0 Active(anon):  4 kB\n"
        assert parse_node_meminfo(text) == {"Inactive(file)": 2 << 20, "Active(anon)": 4 * KiB}

    def write(self, root: Path, total_kb: int, free_kb: int, inactive_kb: int) -> Path:
        (root / "node0").mkdir(parents=True)
        (root / "node0" / "meminfo").write_text(
            f"Node 0 MemTotal: {total_kb} kB\nNode 0 MemFree: {free_kb} kB\n"
            f"Node 0 Inactive(file): {inactive_kb} kB\n"
        )
        return root

    def test_small_node_keeps_32_mib(self, tmp_path):
        root = self.write(tmp_path, 1 << 20, 512 << 10, 64 << 10)  # 1 GiB node, 512 MiB free
        assert node_room(0, root) == (512 + 64 - 32) << 20

    def test_margin_is_a_64th_capped_at_1_gib(self, tmp_path):
        root = self.write(tmp_path / "a", 16 << 20, 8 << 20, 0)  # 16 GiB: margin 256 MiB
        assert node_room(0, root) == (8 << 30) - (256 << 20)
        root = self.write(tmp_path / "b", 256 << 20, 100 << 20, 0)  # 256 GiB: margin 1 GiB
        assert node_room(0, root) == (100 << 30) - (1 << 30)

    def test_never_negative_and_unknown_without_sysfs(self, tmp_path):
        root = self.write(tmp_path, 1 << 20, 1 << 10, 0)
        assert node_room(0, root) == 0
        assert node_room(3, root) is None

    def test_this_host(self):
        room = node_room(0)
        assert room is None or 0 <= room < discover().nodes[0].mem_total_bytes
