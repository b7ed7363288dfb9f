"""Pools over real regions: accounting, bad input that changes nothing, scrub on release."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import hugepages
from maasd.allocator import SEALS, MemoryPool, Region, Warmer, default_page_bytes
from maasd.allocator._sys import F_SEAL_FUTURE_WRITE
from maasd.allocator.reclaim import Reclaimer
from maasd.allocator.stock import size_class
from maasd.errors import (
    BackingError,
    InvalidRequest,
    MaasdError,
    PoolExhausted,
    TooLarge,
    Unprocessable,
)
from processes import fd_table
from waiting import wait_until

PAGE = os.sysconf("SC_PAGE_SIZE")
CAPACITY = 64 * PAGE
MiB = 1 << 20
HUGE = hugepages.HUGE


@pytest.fixture
def reclaimer() -> Iterator[Reclaimer]:
    r = Reclaimer()
    r.start()
    yield r
    r.stop()


@pytest.fixture
def pool(reclaimer: Reclaimer) -> MemoryPool:
    return MemoryPool("tiny", numa_node=0, capacity=CAPACITY, reclaimer=reclaimer)


open_fds = fd_table


def memfds_since(before: frozenset[tuple[str, str]]) -> int:
    """memfds opened since ``before`` (:func:`fd_table`) and open now: others' fds come
    and go meanwhile (a thread of an earlier test, the collector), these are the pool's."""
    return sum("/memfd:" in target for _, target in fd_table() - before)


def memfds_closed_since(before: frozenset[tuple[str, str]]) -> int:
    return sum("/memfd:" in target for _, target in before - fd_table())


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
        p = MemoryPool("h", numa_node=0, capacity=8 << 20, backing="hugetlb")
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
            MemoryPool(**args)

    def test_hugetlb_capacity_must_be_whole_huge_pages(self):
        with pytest.raises(InvalidRequest, match="multiple"):
            MemoryPool("h", numa_node=0, capacity=3 << 20, backing="hugetlb")

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
        p = MemoryPool("inline", numa_node=0, capacity=CAPACITY)
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
            p = MemoryPool(f"p-{mode}", numa_node=0, capacity=CAPACITY, scrub=mode)
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

    @pytest.mark.parametrize("with_reclaimer", [True, False])
    def test_a_retired_region_is_zero_and_freed_once_punched(self, reclaimer, with_reclaimer):
        """An entry's staging region at its commit: the copy took its accounting over, and
        its scrub (the punch) may follow the answer — never its memory's reuse."""
        p = MemoryPool("retire", numa_node=0, capacity=CAPACITY, reclaimer=reclaimer)
        if not with_reclaimer:
            p = MemoryPool("retire-inline", numa_node=0, capacity=CAPACITY)
        staging = p.reserve(8 * PAGE)
        fresh = p.reserve(8 * PAGE, accounted=False)
        worker_fd = staging.dup_fd()  # its writer's
        try:
            os.pwrite(worker_fd, b"\xa5" * staging.size, 0)
            p.retire(staging)
            assert staging.released
            assert p.used == 8 * PAGE  # counted once: by the fresh region now
            reclaimer.drain()
            assert staging.closed
            assert os.pread(worker_fd, staging.size, 0) == bytes(staging.size)
            assert os.fstat(worker_fd).st_blocks == 0  # punched: the pages are freed
            p.retire(staging)  # a second time changes nothing
            p.release(staging)
            assert p.used == 8 * PAGE
        finally:
            os.close(worker_fd)
        p.release(fresh)
        assert p.used == 0

    def test_a_frozen_region_is_retired_as_released(self, pool):
        r = pool.reserve(4 * PAGE, extra_seals=F_SEAL_FUTURE_WRITE)
        fd = r.dup_fd()
        try:
            np.frombuffer(r.view(), dtype=np.uint8)[:] = 0x5A  # the daemon's own mapping
            pool.retire(r)  # it cannot be punched: zeroed through the mapping, as release does
            assert r.released
            assert os.pread(fd, r.size, 0) == bytes(r.size)
            assert pool.used == 4 * PAGE  # not given back: a replacement took it over
        finally:
            os.close(fd)

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
        p = MemoryPool("nowhere", numa_node=63, capacity=CAPACITY)
        fds = open_fds()
        with pytest.raises(BackingError) as exc:
            p.reserve(PAGE)
        assert exc.value.errno == errno.EINVAL
        assert p.used == 0
        assert open_fds() <= fds

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
        assert open_fds() <= fds
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
        assert open_fds() <= fds

    def test_help_reclaims_what_waits_in_the_callers_thread(self, monkeypatch):
        """A reserve helps: queued regions are punched and closed by the caller until no
        more than it allows wait (here the thread is held up, as a loaded machine would)."""
        r = Reclaimer()
        r.start()
        gate, entered = threading.Event(), threading.Event()
        slow = Region.create(PAGE, node=0)
        slow.scrub("zero", punch=False)
        real = Region.punch_hole

        def punch(region: Region) -> None:
            if region is slow:
                entered.set()
                gate.wait(10)
            real(region)

        monkeypatch.setattr(Region, "punch_hole", punch)
        try:
            r.submit(slow)
            assert entered.wait(10)  # the thread is stuck on this one
            regions = [Region.create(4 * PAGE, node=0) for _ in range(6)]
            for region in regions:
                region.scrub("zero", punch=False)
                r.submit(region)
            assert r.pending_bytes == PAGE + 6 * 4 * PAGE
            assert r.help(5 * PAGE) == 5 * 4 * PAGE  # the stuck one counts too
            assert r.pending_bytes == 5 * PAGE
            assert sum(region.closed for region in regions) == 5
            assert r.help(0) == 4 * PAGE  # the stuck one is the thread's: left alone
            assert r.pending_bytes == PAGE
        finally:
            gate.set()
            r.stop()
        assert r.pending_bytes == 0
        assert all(region.closed for region in regions)

    def test_churn_keeps_pages_waiting_within_a_buffer_per_thread(self, monkeypatch):
        """4 threads reserve and release in a pool: what is taken plus what waits for the
        punch stays within the capacity plus one buffer per thread, however the
        reclaimer lags (its punches are slowed down here)."""
        r = Reclaimer()
        r.start()
        size, capacity = 16 * PAGE, 256 * PAGE
        p = MemoryPool("churn", numa_node=0, capacity=capacity, reclaimer=r, prefault=False)
        peak = 0
        stop = time.monotonic() + 2.0
        lock = threading.Lock()

        def churn() -> None:
            nonlocal peak
            while time.monotonic() < stop:
                try:
                    region = p.reserve(size)
                except PoolExhausted:
                    continue
                with lock:
                    peak = max(peak, p.used + r.pending_bytes)
                p.release(region)

        real = Region.punch_hole

        def slow_punch(region: Region) -> None:
            time.sleep(0.002)
            real(region)

        monkeypatch.setattr(Region, "punch_hole", slow_punch)
        try:
            threads = [threading.Thread(target=churn) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            r.stop()
        assert 0 < peak <= capacity + 4 * size, peak


def minor_faults() -> int:
    """Page faults of the calling thread so far (minor + major)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt


def fill_stock(pool: MemoryPool) -> None:
    """Refill in this thread until the plan is met (what the warmer thread does)."""
    while pool.refill_step():
        pass


def sealed_exactly(region: Region, size: int) -> bool:
    return os.fstat(region.fd).st_size == size == region.size and (
        fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == SEALS
    )


class TestWarmStock:
    """A pool's stock of fresh, prefaulted regions: taken by reserves without a fault."""

    @pytest.fixture
    def warm_pool(self, reclaimer: Reclaimer) -> Iterator[MemoryPool]:
        p = MemoryPool(
            "warm", numa_node=0, capacity=64 * MiB, warm_bytes=32 * MiB, reclaimer=reclaimer
        )
        yield p
        p.close()

    def test_a_stocked_size_is_reserved_without_a_fault(self, warm_pool):
        size = 4 * MiB + 3 * PAGE
        cold_before = minor_faults()
        first = warm_pool.reserve(size)  # nothing in stock yet: faulted in here
        cold = minor_faults() - cold_before
        assert cold >= first.size // PAGE
        fill_stock(warm_pool)
        assert warm_pool.warm == first.size  # the size asked for, exactly
        assert warm_pool.used == 2 * first.size  # the stock counts against the capacity

        before = minor_faults()
        second = warm_pool.reserve(size)
        warm = minor_faults() - before
        assert warm < first.size // PAGE // 16, f"{warm} faults taking from stock, {cold} cold"
        assert sealed_exactly(second, first.size)
        assert second.placement() == {0: second.size // PAGE}
        # its placement was measured when it was stocked: a reserve need not measure it
        assert second.placed
        assert not first.placed
        assert (warm_pool.warm, warm_pool.used) == (0, 2 * first.size)
        assert not np.frombuffer(second.view(), dtype=np.uint8).any()
        for r in (first, second):
            warm_pool.release(r)
        assert warm_pool.used == warm_pool.warm

    def test_a_smaller_size_of_the_class_is_cut_from_a_stocked_region(self, warm_pool):
        big, small = 4 * MiB + 3 * PAGE, 4 * MiB + PAGE  # one class: 4.25 MiB
        assert size_class(big, PAGE) == size_class(small, PAGE)
        warm_pool.release(warm_pool.reserve(big))
        fill_stock(warm_pool)
        assert warm_pool.warm == big
        before = minor_faults()
        r = warm_pool.reserve(small)
        assert minor_faults() - before < small // PAGE // 16
        assert sealed_exactly(r, small)
        assert (warm_pool.warm, warm_pool.used) == (0, small)  # the cut tail went back
        maps = Path("/proc/self/maps").read_text()
        assert f"{r.address:x}-{r.address + small:x} " in maps  # the daemon's mapping is cut too
        warm_pool.release(r)
        # A larger size than any stocked one is not taken from the stock.
        fill_stock(warm_pool)
        stocked = warm_pool.warm
        r = warm_pool.reserve(big + PAGE)
        assert warm_pool.warm == stocked
        warm_pool.release(r)

    def test_the_stock_refills_after_a_take(self, warm_pool):
        warm_pool.release(warm_pool.reserve(MiB))
        fill_stock(warm_pool)
        assert warm_pool.warm == MiB
        r = warm_pool.reserve(MiB)
        assert warm_pool.warm == 0
        fill_stock(warm_pool)
        assert warm_pool.warm == 2 * MiB  # asked for twice now: two ready
        warm_pool.release(r)

    def test_stock_follows_demand_within_the_budget(self, warm_pool):
        regions = [warm_pool.reserve(s) for s in (8 * MiB, 8 * MiB, 8 * MiB, 16 * MiB)]
        fill_stock(warm_pool)
        # 8 MiB asked for 3 times, 16 MiB once: the plan within 32 MiB is 2×8 + 1×16, but
        # only 24 MiB of the capacity are free, and the stock takes only free capacity.
        assert (warm_pool.warm, warm_pool.used) == (16 * MiB, 56 * MiB)
        for r in regions:
            warm_pool.release(r)
        fill_stock(warm_pool)
        assert warm_pool.warm == 32 * MiB == warm_pool.warm_bytes
        # Demand moves on (the window holds the last 64 reserves): the regions of sizes no
        # longer asked for are given back, one page is stocked per page asked for.
        for _ in range(64):
            warm_pool.release(warm_pool.reserve(PAGE))
        fill_stock(warm_pool)
        assert (warm_pool.warm, warm_pool.used) == (64 * PAGE, 64 * PAGE)

    def test_a_short_pool_gives_its_stock_back_before_failing(self, warm_pool):
        warm_pool.release(warm_pool.reserve(16 * MiB))
        warm_pool.release(warm_pool.reserve(16 * MiB))
        fill_stock(warm_pool)
        assert warm_pool.warm == 32 * MiB
        big = warm_pool.reserve(48 * MiB)  # fits only if the stock makes room
        assert warm_pool.used == 48 * MiB + warm_pool.warm <= warm_pool.capacity
        assert warm_pool.warm == 16 * MiB
        with pytest.raises(PoolExhausted):
            warm_pool.reserve(32 * MiB)  # would not fit even without any stock: nothing shed
        assert warm_pool.warm == 16 * MiB
        warm_pool.release(big)

    def test_a_reserve_stops_a_refill_in_flight(self, reclaimer):
        pool = MemoryPool(
            "race", numa_node=0, capacity=64 * MiB, warm_bytes=64 * MiB, reclaimer=reclaimer
        )
        try:
            pool.release(pool.reserve(64 * MiB))  # demand: one 64 MiB region
            filler = threading.Thread(target=fill_stock, args=(pool,))
            filler.start()
            while pool.used == 0 and filler.is_alive():
                time.sleep(0.001)
            r = pool.reserve(32 * MiB)  # needs the room the refill is taking
            filler.join()
            assert r.size == 32 * MiB
            assert pool.used == 32 * MiB + pool.warm <= pool.capacity
            pool.release(r)
        finally:
            pool.close()

    def test_close_gives_the_stock_back(self, reclaimer):
        fds = open_fds()
        pool = MemoryPool(
            "gone", numa_node=0, capacity=8 * MiB, warm_bytes=4 * MiB, reclaimer=reclaimer
        )
        for _ in range(3):
            pool.release(pool.reserve(MiB))
        reclaimer.drain()
        fill_stock(pool)
        assert pool.warm == 3 * MiB
        assert memfds_since(fds) == 3
        pool.close()
        assert (pool.warm, pool.used, memfds_since(fds)) == (0, 0, 0)
        assert pool.refill_step() is False  # closed: no more stock

    def test_no_budget_no_stock(self, pool):
        pool.release(pool.reserve(PAGE))
        assert pool.refill_step() is False
        assert pool.warm == 0

    @pytest.mark.parametrize(
        ("kwargs", "word"),
        [
            ({"warm_bytes": CAPACITY + PAGE}, "capacity"),
            ({"warm_bytes": -1}, "capacity"),
            ({"warm_bytes": 1.5}, "integer"),
            ({"warm_bytes": PAGE, "prefault": False}, "prefault"),
        ],
    )
    def test_bad_budget(self, kwargs, word):
        with pytest.raises(InvalidRequest, match=word):
            MemoryPool("p", numa_node=0, capacity=CAPACITY, **kwargs)

    def test_budget_is_rounded_down_to_pages(self):
        assert (
            MemoryPool("p", numa_node=0, capacity=CAPACITY, warm_bytes=PAGE + 1).warm_bytes == PAGE
        )


class TestWarmer:
    def test_the_thread_refills_and_stops(self):
        warmer = Warmer(min_available=0, interval_s=0.05)
        pool = MemoryPool("t", numa_node=0, capacity=8 * MiB, warm_bytes=4 * MiB, warmer=warmer)
        warmer.start()
        try:
            assert [t for t in threading.enumerate() if t.name == "maasd-warm"]
            pool.release(pool.reserve(2 * MiB))
            wait_until(lambda: pool.warm == 2 * MiB, message="the warmer filled the stock")
            r = pool.reserve(2 * MiB)
            wait_until(lambda: pool.warm == 4 * MiB, message="the warmer refilled it")
            pool.release(r)
        finally:
            warmer.stop()
            pool.close()
        assert not warmer.running
        assert warmer.pools() == []

    def test_a_reserves_wake_goes_through_send_wake_and_refills_once_delivered(self):
        """The daemon defers a request's wake-ups until its answer (``send_wake`` is
        ``maasd.core.answered.after_answer``): the refill a reserve causes starts only once
        the wake is delivered, and then refills as before."""
        held: list[Callable[[], object]] = []
        warmer = Warmer(min_available=0, interval_s=30.0, send_wake=held.append)
        pool = MemoryPool("t", numa_node=0, capacity=8 * MiB, warm_bytes=2 * MiB, warmer=warmer)
        warmer.start()
        try:
            time.sleep(0.2)  # the thread's first look (no demand yet): it waits now
            held.clear()
            pool.release(pool.reserve(2 * MiB))  # a demand for 2 MiB: a wake, held
            assert held
            time.sleep(0.3)
            assert pool.warm == 0  # not woken: the interval is 30 s
            for wake in held:
                wake()
            wait_until(lambda: pool.warm == 2 * MiB, message="refilled once woken")
        finally:
            warmer.stop()
            pool.close()

    def test_memory_pressure_sheds_and_stops_refilling(self, reclaimer):
        available = [1 << 40]
        warmer = Warmer(min_available=1 << 30, available=lambda: available[0])
        pool = _stocked(warmer, reclaimer)
        try:
            assert pool.warm == MiB
            available[0] = (1 << 30) - 1  # below the threshold: give it back
            assert warmer.run_once() is False
            assert (pool.warm, pool.used) == (0, 0)
            available[0] = (2 << 30) + MiB // 2  # above it, but not by twice: no refill yet
            assert warmer.run_once() is False
            assert pool.warm == 0
            available[0] = (2 << 30) + MiB
            assert warmer.run_once() is True
            assert pool.warm == MiB
        finally:
            pool.close()

    def test_no_new_stock_while_the_daemons_region_budget_says_no(self, reclaimer):
        """Every stocked region holds a file and a mapping of the daemon: the refill asks
        the region budget (maasd.core.limits) before making one."""
        room = [False]
        warmer = Warmer(min_available=0, may_grow=lambda: room[0])
        pool = _stocked(warmer, reclaimer)
        try:
            assert pool.warm == 0
            room[0] = True
            while warmer.run_once():
                pass
            assert pool.warm == MiB
        finally:
            pool.close()

    def test_shed_frees_the_stock_of_one_backing_at_once(self):
        warmer = Warmer(min_available=0)
        pool = MemoryPool("p", numa_node=0, capacity=8 * MiB, warm_bytes=4 * MiB, warmer=warmer)
        try:
            pool.release(pool.reserve(MiB))
            fill_stock(pool)
            fds = open_fds()
            assert warmer.shed(backing="hugetlb") == 0
            assert warmer.shed(backing="memfd") == MiB
            assert (pool.warm, memfds_closed_since(fds)) == (0, 1)  # closed before shed returned
        finally:
            pool.close()


@pytest.mark.hugetlb
class TestHugetlbStock:
    def test_a_reserve_the_kernel_refuses_takes_other_pools_stock(self):
        with hugepages.configured(4):
            warmer = Warmer(min_available=0)
            pages = hugepages.available()
            hoarder = MemoryPool(
                "hoarder",
                numa_node=0,
                capacity=pages * HUGE,
                backing="hugetlb",
                warm_bytes=pages * HUGE,
                warmer=warmer,
            )
            other = MemoryPool(
                "other", numa_node=0, capacity=4 * HUGE, backing="hugetlb", warmer=warmer
            )
            try:
                for _ in range(pages):
                    hoarder.release(hoarder.reserve(HUGE))
                fill_stock(hoarder)
                assert hoarder.warm == pages * HUGE
                assert hugepages.available() == 0
                r = other.reserve(HUGE)  # no huge page free: the hoarder's stock is given back
                assert (r.size, hoarder.warm) == (HUGE, 0)
                other.release(r)
            finally:
                hoarder.close()
                other.close()


def _stocked(warmer: Warmer, reclaimer: Reclaimer) -> MemoryPool:
    """An 8 MiB pool with a 4 MiB warm stock, a MiB reserved and released, and the
    warmer run until it has nothing more to do."""
    pool = MemoryPool(
        "p", numa_node=0, capacity=8 * MiB, warm_bytes=4 * MiB, reclaimer=reclaimer, warmer=warmer
    )
    pool.release(pool.reserve(MiB))
    while warmer.run_once():
        pass
    return pool
