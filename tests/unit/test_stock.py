"""The warm stock's pure part: size classes, the plan within a budget, the budget's rules,
and the default pools' budgets."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maasd.allocator.stock import STEPS, WINDOW, Demand, plan, size_class, warm_budget
from maasd.errors import ConfigError, InvalidRequest
from maasd.settings import DEFAULT_WARM_CAP, GiB, default_pools, load
from maasd.topology import Node, Topology

PAGE = 4096
MiB = 1 << 20

pages_sizes = st.sampled_from([4096, 2 << 20])
page_counts = st.integers(min_value=1, max_value=1 << 30)


class TestSizeClass:
    @given(page=pages_sizes, pages=page_counts)
    def test_holds_the_size_and_wastes_under_a_sixteenth(self, page, pages):
        size = pages * page
        cls = size_class(size, page)
        assert cls % page == 0
        assert size <= cls
        assert (cls - size) * STEPS < size  # the tail cut at take time: < 1/16 of the size

    @given(page=pages_sizes, pages=page_counts)
    def test_a_class_is_its_own_class(self, page, pages):
        cls = size_class(pages * page, page)
        assert size_class(cls, page) == cls

    @given(page=pages_sizes, a=page_counts, b=page_counts)
    def test_monotonic(self, page, a, b):
        if a <= b:
            assert size_class(a * page, page) <= size_class(b * page, page)

    @pytest.mark.parametrize("size", [64 * MiB, 1 << 30, 2 << 30, 4096, 2 << 20])
    def test_powers_of_two_cut_nothing(self, size):
        assert size_class(size, PAGE) == size

    def test_small_sizes_are_exact_and_classes_are_fine_above(self):
        assert [size_class(n * PAGE, PAGE) // PAGE for n in range(1, 33)] == list(range(1, 33))
        assert size_class(GiB + PAGE, PAGE) == GiB + GiB // 16
        assert size_class(GiB - PAGE, PAGE) == GiB

    def test_sixteen_classes_per_doubling(self):
        classes = {size_class(n * PAGE, PAGE) for n in range(1 << 14, (1 << 15) + 1)}
        assert len(classes) == STEPS + 1  # from 2^14 pages up to and including 2^15


class TestPlan:
    @given(
        recent=st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 40]), max_size=WINDOW),
        budget=st.integers(0, 100),
    )
    def test_within_budget_and_demand(self, recent, budget):
        want = plan(recent, budget)
        asked = Counter(recent)
        assert sum(cls * n for cls, n in want.items()) <= budget
        assert all(0 < n <= asked[cls] for cls, n in want.items())
        # Every class asked for that still fit the budget after the plan got one region.
        spent = sum(cls * n for cls, n in want.items())
        assert all(cls in want or cls > budget - spent for cls in asked)

    def test_most_asked_for_first_then_most_recent(self):
        assert list(plan([8, 4, 4, 2], budget=100)) == [4, 2, 8]
        assert plan([8, 4, 4, 2], budget=6) == {4: 1, 2: 1}

    def test_rounds_spread_the_budget(self):
        assert plan([4] * 10 + [2] * 10, budget=12) == {4: 2, 2: 2}

    def test_nothing_asked_nothing_planned(self):
        assert plan([], budget=1 << 40) == {}
        assert plan([1 << 30], budget=(1 << 30) - 1) == {}

    def test_a_region_costs_its_size(self):
        assert plan([64, 64, 32], budget=100, sizes={64: 30}) == {64: 2, 32: 1}
        assert plan([64, 64, 32], budget=100) == {64: 1, 32: 1}

    def test_demand_remembers_a_window_and_the_largest_size_of_each_class(self):
        d = Demand(window=3)
        for cls, size in ((1, 1), (2, 2), (2, 2), (3, 2), (3, 3)):
            d.note(cls, size)
        assert d.sizes() == {2: 2, 3: 3}
        assert d.plan(100) == ({3: 2, 2: 1}, {2: 2, 3: 3})
        assert d.plan(5) == ({3: 1, 2: 1}, {2: 2, 3: 3})


class TestBudget:
    def test_rounded_down_to_pages(self):
        assert warm_budget(3 * PAGE - 1, 16 * PAGE, PAGE, True) == 2 * PAGE
        assert warm_budget(0, 16 * PAGE, PAGE, False) == 0

    @pytest.mark.parametrize(
        ("value", "prefault", "word"),
        [
            (-1, True, "capacity"),
            (17 * PAGE, True, "capacity"),
            (True, True, "integer"),
            (1.0, True, "integer"),
            ("4096", True, "integer"),
            (PAGE, False, "prefault"),
        ],
    )
    def test_refused(self, value, prefault, word):
        with pytest.raises(InvalidRequest, match=word):
            warm_budget(value, 16 * PAGE, PAGE, prefault)


def topology(*free: int) -> Topology:
    nodes = [
        Node(id=i, cpus=[i], mem_total_bytes=2 * f, mem_free_bytes=f, distances=[10])
        for i, f in enumerate(free)
    ]
    return Topology(nodes=nodes, page_bytes=PAGE, hugepage_bytes=2 << 20, hugepages_free=0)


class TestDefaultPoolsWarm:
    def test_a_sixteenth_of_the_capacity_at_most_256_mib(self):
        pools = default_pools(topology(64 * GiB, 8 * GiB, 64 * MiB + 100))
        assert [p.capacity_bytes for p in pools] == [8 * GiB, 2 * GiB, 16 * MiB]
        assert [p.warm_bytes for p in pools] == [DEFAULT_WARM_CAP, 128 * MiB, MiB]
        assert 256 * MiB == DEFAULT_WARM_CAP

    def test_an_explicit_budget_is_capped_by_the_capacity_and_0_is_off(self):
        pools = default_pools(topology(8 * GiB), pool_bytes=GiB, warm_bytes=4 * GiB)
        assert pools[0].warm_bytes == GiB
        assert default_pools(topology(8 * GiB), warm_bytes=0)[0].warm_bytes == 0
        assert default_pools(topology(8 * GiB), warm_bytes=MiB + 1)[0].warm_bytes == MiB


class TestWarmSettings:
    def test_sizes_take_units_in_the_environment_and_the_file(self, tmp_path):
        config = tmp_path / "maasd.toml"
        config.write_text(
            'default_warm_bytes = "16MiB"\n'
            "[[pools]]\n"
            'name = "fast"\nnuma_node = 0\ncapacity_bytes = "1GiB"\nwarm_bytes = "64MiB"\n'
        )
        env = {"MAASD_CONFIG": str(config), "MAASD_WARM_MIN_AVAILABLE_BYTES": "1GiB"}
        s = load(env=env)
        assert (s.default_warm_bytes, s.warm_min_available_bytes) == (16 * MiB, GiB)
        assert s.pools[0].warm_bytes == 64 * MiB
        s = load(env={**env, "MAASD_DEFAULT_WARM_BYTES": "8MiB"})
        assert s.default_warm_bytes == 8 * MiB  # the environment wins over the file
        s = load(env={"MAASD_DEFAULT_WARM_BYTES": "0", "MAASD_WARM_MIN_AVAILABLE_BYTES": "0"})
        assert (s.default_warm_bytes, s.warm_min_available_bytes) == (0, 0)  # 0 is off

    @pytest.mark.parametrize(
        ("env", "word"),
        [
            ({"MAASD_DEFAULT_WARM_BYTES": "-1"}, "MAASD_DEFAULT_WARM_BYTES: '-1' is negative"),
            ({"MAASD_WARM_MIN_AVAILABLE_BYTES": "lots"}, "MAASD_WARM_MIN_AVAILABLE_BYTES"),
        ],
    )
    def test_bad_values_stop_the_daemon(self, env, word):
        with pytest.raises(ConfigError, match=word):
            load(env=env)
