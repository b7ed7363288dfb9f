"""Pools over real regions: accounting, bad input that changes nothing, scrub on release."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from maasd.allocator import Pool, Region, default_page_bytes
from maasd.allocator.reclaim import Reclaimer
from maasd.errors import (
    BackingError,
    InvalidRequest,
    MaasdError,
    PoolExhausted,
    TooLarge,
    Unprocessable,
)

PAGE = os.sysconf("SC_PAGE_SIZE")
CAPACITY = 64 * PAGE


@pytest.fixture
def reclaimer() -> Iterator[Reclaimer]:
    r = Reclaimer()
    r.start()
    yield r
    r.stop()


@pytest.fixture
def pool(reclaimer: Reclaimer) -> Pool:
    return Pool("tiny", numa_node=0, capacity=CAPACITY, reclaimer=reclaimer)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class TestConstruction:
    def test_defaults(self, pool):
        assert (pool.backing, pool.persistence, pool.scrub, pool.prefault) == (
            "memfd",
            "volatile",
            "zero",
            True,
        )
        assert pool.page_bytes == PAGE == default_page_bytes("memfd")
        assert (pool.used, pool.free) == (0, CAPACITY)

    def test_hugetlb_pool_page(self):
        p = Pool("h", numa_node=0, capacity=8 << 20, backing="hugetlb")
        assert p.page_bytes == 2 << 20
        assert p.rounded(1) == 2 << 20

    @pytest.mark.parametrize(
        ("kwargs", "word"),
        [
            ({"backing": "ramdisk"}, "backing"),
            ({"persistence": "forever"}, "persistence"),
            ({"scrub": "shred"}, "scrub"),
            ({"capacity": 0}, "size"),
            ({"capacity": -PAGE}, "size"),
            ({"capacity": float(CAPACITY)}, "integer"),
            ({"capacity": PAGE + 1}, "multiple"),
            ({"capacity": 6 << 20, "backing": "hugetlb", "page_bytes": 3 << 20}, "power of two"),
        ],
    )
    def test_bad_pool(self, kwargs, word):
        args = {"name": "p", "numa_node": 0, "capacity": CAPACITY, **kwargs}
        with pytest.raises(InvalidRequest, match=word):
            Pool(**args)

    def test_hugetlb_capacity_must_be_whole_huge_pages(self):
        with pytest.raises(InvalidRequest, match="multiple"):
            Pool("h", numa_node=0, capacity=3 << 20, backing="hugetlb")

    def test_unknown_backing_for_page_size(self):
        with pytest.raises(InvalidRequest, match="backing"):
            default_page_bytes("tape")


class TestAccounting:
    def test_reserve_rounds_and_release_returns_exactly(self, pool):
        r = pool.reserve(5000)
        assert r.size == 2 * PAGE
        assert (pool.used, pool.free) == (2 * PAGE, CAPACITY - 2 * PAGE)
        pool.release(r)
        assert (pool.used, pool.free) == (0, CAPACITY)
        assert pool.reclaimer is not None
        pool.reclaimer.drain()  # "zero" pools punch and close in the background, after the answer
        assert r.closed

    def test_without_a_reclaimer_release_closes_at_once(self):
        p = Pool("inline", numa_node=0, capacity=CAPACITY)
        r = p.reserve(PAGE)
        p.release(r)
        assert r.closed
        assert p.used == 0

    def test_fill_to_capacity_then_exhausted(self, pool):
        regions = [pool.reserve(PAGE) for _ in range(64)]
        assert pool.free == 0
        with pytest.raises(PoolExhausted):
            pool.reserve(1)
        assert pool.used == CAPACITY
        pool.release(regions.pop())
        last = pool.reserve(PAGE)
        for r in [*regions, last]:
            pool.release(r)
        assert pool.used == 0

    def test_double_release_gives_back_once(self, pool):
        a, b = pool.reserve(PAGE), pool.reserve(PAGE)
        pool.release(a)
        pool.release(a)
        assert pool.used == PAGE  # b is still live: its bytes stay counted
        pool.release(b)
        assert pool.used == 0

    def test_release_scrubs_what_a_stale_mapping_sees(self):
        for mode in ("zero", "punch"):
            p = Pool(f"p-{mode}", numa_node=0, capacity=CAPACITY, scrub=mode)
            r = p.reserve(8 * PAGE)
            worker_fd = r.dup_fd()  # what a worker would hold
            m = mmap.mmap(worker_fd, r.size)
            try:
                a = np.frombuffer(m, dtype=np.uint8)
                a.fill(0xA5)
                p.release(r)
                assert not a.any(), mode
                assert p.used == 0
                del a
            finally:
                m.close()
                os.close(worker_fd)

    def test_reserve_is_placed_on_the_node(self, pool):
        r = pool.reserve(16 * PAGE)
        try:
            assert r.node == 0
            assert r.placement() == {0: 16}
        finally:
            pool.release(r)

    def test_adopt(self, pool):
        pool.adopt(3 * PAGE - 1)
        assert pool.used == 3 * PAGE
        with pytest.raises(TooLarge):
            pool.adopt(CAPACITY + 1)
        with pytest.raises(PoolExhausted):
            pool.adopt(CAPACITY)
        assert pool.used == 3 * PAGE

    def test_backing_failure_gives_capacity_back(self):
        p = Pool("nowhere", numa_node=63, capacity=CAPACITY)
        fds = open_fds()
        with pytest.raises(BackingError) as exc:
            p.reserve(PAGE)
        assert exc.value.errno == errno.EINVAL
        assert p.used == 0
        assert open_fds() == fds

    def test_concurrent_reserves_never_overcommit(self, pool):
        got, errors, lock = [], [], threading.Lock()
        barrier = threading.Barrier(8)

        def worker():
            barrier.wait()
            for _ in range(16):
                try:
                    r = pool.reserve(PAGE)
                except PoolExhausted as e:
                    with lock:
                        errors.append(e)
                else:
                    with lock:
                        got.append(r)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 64
        assert len(errors) == 8 * 16 - 64
        assert pool.used == CAPACITY == sum(r.size for r in got)
        releasers = [threading.Thread(target=pool.release, args=(r,)) for r in got]
        for t in releasers:
            t.start()
        for t in releasers:
            t.join()
        assert pool.used == 0


class TestBadInput:
    @pytest.mark.parametrize(
        "size",
        [0, -1, -PAGE, 1.0, 4096.0, float("nan"), "4096", b"1", True, False, None, [PAGE], 1 << 63],
    )
    def test_invalid_size_changes_nothing(self, pool, size):
        live = pool.reserve(PAGE)
        fds = open_fds()
        with pytest.raises(InvalidRequest):
            pool.reserve(size)
        assert pool.used == PAGE
        assert open_fds() == fds
        pool.release(live)

    @pytest.mark.parametrize("size", [CAPACITY + 1, 2 * CAPACITY, (1 << 62)])
    def test_larger_than_pool_is_too_large(self, pool, size):
        with pytest.raises(TooLarge) as exc:
            pool.reserve(size)
        assert isinstance(exc.value, Unprocessable)
        assert pool.used == 0

    def test_size_rounding_past_2_63(self, pool):
        with pytest.raises(InvalidRequest):
            pool.reserve((1 << 63) - 1)
        assert pool.used == 0

    def test_fits_in_principle_but_not_now(self, pool):
        live = pool.reserve(CAPACITY - PAGE)
        with pytest.raises(PoolExhausted) as exc:
            pool.reserve(2 * PAGE)
        assert not isinstance(exc.value, Unprocessable)
        assert "free" in exc.value.detail
        assert pool.used == CAPACITY - PAGE
        pool.release(live)

    def test_all_are_maasd_errors(self):
        for cls in (InvalidRequest, TooLarge, PoolExhausted, BackingError):
            assert issubclass(cls, MaasdError)


class TestReclaimer:
    def test_stop_reclaims_everything_submitted_then_ends_the_thread(self):
        def threads() -> int:
            return sum(t.name == "maasd-reclaim" and t.is_alive() for t in threading.enumerate())

        before = threads()
        r = Reclaimer()
        r.start()
        r.start()  # idempotent
        assert threads() == before + 1
        regions = [Region.create(PAGE, node=0) for _ in range(8)]
        for region in regions:
            region.scrub("zero", punch=False)
            r.submit(region)
        r.stop()
        assert all(region.closed for region in regions)
        assert not r.running
        assert threads() == before
        r.stop()  # idempotent

    def test_a_region_submitted_while_not_running_is_reclaimed_at_once(self):
        r = Reclaimer()
        fds = open_fds()
        region = Region.create(PAGE, node=0)
        region.scrub("zero", punch=False)
        r.submit(region)
        assert region.closed
        assert open_fds() == fds
