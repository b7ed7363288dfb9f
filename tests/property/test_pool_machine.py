"""A Hypothesis state machine over a real :class:`MemoryPool` of 64 base pages.

Random sequences of reserve / release / double release / bad requests / warm
stock refills and sheds must keep ``used + free == capacity`` and ``used ==``
live regions plus the warm stock, never over-commit, keep the stock within its
budget, never fail a reserve that the live regions alone leave room for (the
stock gives way), and give back exactly what was reserved. Every region handed
out is exactly its rounded size and sealed. Regions are real (tiny) memfds, so
the scrub on release is checked too, through a worker-style mapping of a dup'd fd.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from maasd.allocator import SEALS, MemoryPool, Region
from maasd.allocator.reclaim import Reclaimer
from maasd.errors import InvalidRequest, PoolExhausted, TooLarge
from processes import fd_table
from strategies import bad_sizes, request_sizes

PAGE = os.sysconf("SC_PAGE_SIZE")
PAGES = 64


class PoolMachine(RuleBasedStateMachine):
    regions = Bundle("regions")

    def __init__(self) -> None:
        super().__init__()
        self.pool: MemoryPool | None = None
        self.live: dict[int, int] = {}  # id(region) -> size reserved for it
        self.live_regions: dict[int, Region] = {}
        self.released: list[Region] = []

    @property
    def made_pool(self) -> MemoryPool:
        """The pool; the rules that reach it run only after ``make_pool``."""
        assert self.pool is not None
        return self.pool

    @rule(
        scrub=st.sampled_from(["zero", "punch"]),
        prefault=st.booleans(),
        warm_pages=st.sampled_from([0, 8, 32, PAGES]),
    )
    @precondition(lambda self: self.pool is None)
    def make_pool(self, scrub, prefault, warm_pages):
        reclaimer = Reclaimer()
        reclaimer.start()
        self.pool = MemoryPool(
            "machine",
            numa_node=0,
            capacity=PAGES * PAGE,
            scrub=scrub,
            prefault=prefault or warm_pages > 0,  # a warm stock is prefaulted memory
            warm_bytes=warm_pages * PAGE,
            reclaimer=reclaimer,
        )

    @rule(steps=st.integers(1, 4))
    @precondition(lambda self: self.pool is not None)
    def refill(self, steps):
        for _ in range(steps):
            self.made_pool.refill_step()

    @rule()
    @precondition(lambda self: self.pool is not None)
    def shed(self):
        self.made_pool.shed()
        assert self.made_pool.warm == 0

    @rule(target=regions, size=request_sizes(PAGE, PAGES))
    @precondition(lambda self: self.pool is not None)
    def reserve(self, size):
        rounded = -(-size // PAGE) * PAGE
        live = sum(self.live.values())
        try:
            region = self.made_pool.reserve(size)
        except TooLarge:
            assert rounded > self.made_pool.capacity
            assert self.made_pool.used == live + self.made_pool.warm
            return multiple()
        except PoolExhausted:
            assert rounded <= self.made_pool.capacity
            assert rounded > self.made_pool.capacity - live  # the stock never stood in the way
            assert self.made_pool.used == live + self.made_pool.warm
            return multiple()
        assert rounded <= self.made_pool.capacity - live  # it did fit: no over-commit
        assert region.size == rounded == os.fstat(region.fd).st_size
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == SEALS
        assert self.made_pool.used == live + rounded + self.made_pool.warm
        self.live[id(region)] = rounded
        self.live_regions[id(region)] = region
        return region

    @rule(region=consumes(regions), fill=st.integers(1, 255))
    def release(self, region, fill):
        assert not region.closed
        fd = region.dup_fd()  # a worker's stale handle
        m = mmap.mmap(fd, region.size)
        try:
            a = np.frombuffer(m, dtype=np.uint8)
            a.fill(fill)
            before = self.made_pool.used - self.made_pool.warm
            self.made_pool.release(region)
            assert self.made_pool.used - self.made_pool.warm == before - self.live.pop(id(region))
            del self.live_regions[id(region)]
            assert not a.any()  # scrubbed under the worker
            del a
        finally:
            m.close()
            os.close(fd)
        self.released.append(region)

    @rule(data=st.data())
    @precondition(lambda self: self.released)
    def release_again(self, data):
        region = data.draw(st.sampled_from(self.released))
        before = self.made_pool.used
        self.made_pool.release(region)
        assert self.made_pool.used == before

    @rule(size=bad_sizes)
    @precondition(lambda self: self.pool is not None)
    def bad_request(self, size):
        before = self.made_pool.used
        try:
            self.made_pool.reserve(size)
        except InvalidRequest:
            pass
        else:
            raise AssertionError(f"reserve({size!r}) was accepted")
        assert self.made_pool.used == before

    @invariant()
    def ledger_balances(self):
        if self.pool is None:
            return
        assert self.pool.used + self.pool.free == self.pool.capacity
        assert 0 <= self.pool.used <= self.pool.capacity
        assert self.pool.used == sum(self.live.values()) + self.pool.warm
        assert self.pool.warm <= self.pool.warm_bytes

    def teardown(self):
        # Regions not released by a rule are live: release them so no fd outlives the example.
        if self.pool is not None:
            for region in self.live_regions.values():
                self.pool.release(region)
            self.pool.close()  # gives the warm stock back
            assert self.pool.used == 0
            assert self.pool.reclaimer is not None
            # "zero" pools close their memfds in the background, after the release: stopping
            # the pool's reclaimer finishes that and ends its thread.
            self.pool.reclaimer.stop()


PoolMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_no_fd_leak_across_the_machine():
    """Run the machine once more and check every memfd it made was closed."""
    before = fd_table()
    run_state_machine_as_test(
        PoolMachine, settings=settings(max_examples=10, stateful_step_count=20, deadline=None)
    )
    # Not a count: an fd an earlier test left to the collector may close meanwhile.
    assert fd_table() <= before
