"""A pool's capacity and the warm stock inside it: taking, refilling, shedding.

:class:`WarmStock` is a part of :class:`~maasd.allocator.pool.MemoryPool`, made by it and
reached by no one else. It owns the pool's capacity :class:`~maasd.allocator.arith.Ledger`
and its :class:`~maasd.allocator.stock.Stock` under one lock, because the stock counts
against the capacity: a reserve that would not fit otherwise gives stocked regions back
(and stops a refill in flight), and a refill takes only capacity left free. The pool
decides what to reserve and release and asks this part for the bytes; it passes the
stock's budget (``MemoryPool.warm_bytes``) with each call that needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from maasd.allocator.arith import Ledger
from maasd.allocator.reclaim import Reclaimer, reclaim
from maasd.allocator.region import Region
from maasd.allocator.stock import Stock, size_class
from maasd.errors import BackingError, PlacementError, PoolExhausted

logger = logging.getLogger("maasd.allocator.pool")

__all__ = ["FILL_WAIT_S", "WarmStock"]

#: Longest a reserve waits for a refill in flight to give its capacity back (it stops
#: within one populate step, ~30 ms here).
FILL_WAIT_S = 10.0


class WarmStock:
    """A pool's capacity ledger and its warm stock of fresh regions (see the module
    docstring). Thread-safe: one lock, a leaf (nothing else is taken while it is held).

    ``make(size, **options)`` creates a region of the pool's node, backing and page
    (``page_bytes``);
    ``wake()`` tells the pool's warmer that the demand or the stock changed.
    """

    def __init__(
        self,
        pool: str,
        capacity: int,
        page_bytes: int,
        *,
        make: Callable[..., Region],
        reclaimer: Reclaimer | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._pool = pool
        self._page_bytes = page_bytes
        self._make = make
        self._reclaimer = reclaimer
        self._wake = wake
        self._ledger = Ledger(capacity)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._stock = Stock()

    @property
    def used(self) -> int:
        """Bytes taken: live regions plus the stock (and a refill in flight)."""
        return self._ledger.used

    @property
    def free(self) -> int:
        return self._ledger.free

    @property
    def bytes(self) -> int:
        """Bytes in the stock now."""
        return self._stock.bytes

    # -- the capacity ---------------------------------------------------------------------

    def take(self, size: int) -> None:
        """Account ``size`` bytes as used, giving stock back if that makes them fit.

        :class:`~maasd.errors.TooLarge` above the capacity, :class:`PoolExhausted` when
        they do not fit even without the stock (nothing changes either way)."""
        shed: list[Region] = []
        try:
            with self._lock:
                while True:
                    try:
                        self._ledger.take(size)
                        break
                    except PoolExhausted:
                        if size > self._ledger.free + self._stock.bytes + self._stock.filling:
                            raise  # the stock would not make room: keep it
                        region = self._stock.take_largest()
                        if region is not None:
                            self._ledger.give(region.size)
                            shed.append(region)
                            continue
                        self._stock.abort = True  # the refill in flight stops and gives back
                        if not self._room.wait_for(lambda: not self._stock.filling, FILL_WAIT_S):
                            raise
        finally:
            self.discard(shed)

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken earlier."""
        with self._lock:
            self._ledger.give(size)

    # -- the stock ------------------------------------------------------------------------

    def take_region(self, rounded: int, extra_seals: int) -> Region | None:
        """A stocked region of ``rounded``'s class, cut to ``rounded`` and sealed (its bytes
        stay taken); or ``None``. Either way the demand for the size is noted."""
        cls = size_class(rounded, self._page_bytes)
        with self._lock:
            self._stock.demand.note(cls, rounded)
            region = self._stock.take(cls, rounded)
        self._wake()
        if region is None:
            return None
        held = region.size
        try:
            region.seal_at(rounded, extra_seals)
        except BackingError as e:
            logger.warning("pool %s: a stocked region could not be cut (%s)", self._pool, e.detail)
            self.give(held)
            self.discard([region])
            return None
        self.give(held - rounded)  # the cut tail
        return region

    def refill_step(self, budget: int, room: int | None = None) -> bool:
        """One step towards the planned stock of ``budget`` bytes; ``True`` if it changed
        anything.

        Gives back the stocked regions no longer planned for, or else makes one
        missing region: from free capacity only, within the budget and within
        ``room`` (bytes the host can spare; ``None``: no limit).
        """
        with self._lock:
            if self._stock.closed or not budget:
                return False
            want, sizes = self._stock.demand.plan(budget)
            surplus = list(self._stock.surplus(want))
            for region in surplus:
                self._ledger.give(region.size)
            cls = None
            if not surplus:
                have = self._stock.counts()
                spare = min(
                    self._ledger.free,
                    budget - self._stock.bytes - self._stock.filling,
                    self._ledger.capacity if room is None else room,
                )
                cls = next(
                    (c for c, n in want.items() if have.get(c, 0) < n and sizes[c] <= spare), None
                )
                if cls is None:
                    return False
                self._ledger.take(sizes[cls])
                self._stock.filling += sizes[cls]
        if surplus:
            self.discard(surplus)
            return True
        assert cls is not None
        return self._fill(cls, sizes[cls])

    def _fill(self, cls: int, size: int) -> bool:
        """Make, bind and populate one unsealed region of ``size`` bytes into class ``cls``;
        its placement is measured here, so that a reserve that takes it need not."""
        region: Region | None = None
        done = False
        try:
            region = self._make(size, prefault=False, name="maasd-warm", seal=False)
            if region.populate(abort=lambda: self._stock.abort or self._stock.closed):
                # Off the request path: a placement sample costs a reserve 0.05–0.4 ms
                # (more on a busy host); the pages stay on the node they are bound to.
                region.verify_node(sample=16)
                done = True
        except (BackingError, PlacementError, PoolExhausted) as e:
            log = logger.debug if self._stock.failed else logger.warning
            log("pool %s: no warm region of %d bytes now (%s)", self._pool, size, e.detail)
        finally:
            with self._lock:
                self._stock.filling -= size
                keep = (
                    done and region is not None and not self._stock.closed and not self._stock.abort
                )
                if keep:
                    assert region is not None
                    self._stock.put(cls, region)
                else:
                    self._ledger.give(size)
                if not self._stock.filling:
                    self._stock.abort = False
                self._stock.failed = region is None
                self._room.notify_all()
            if not keep and region is not None:
                self.discard([region])
        return keep

    def shed(self, *, now: bool = False) -> int:
        """Give the whole stock back (memory is short); returns the bytes given.

        A refill in flight stops too. With ``now``, the regions are closed before
        this returns (their memory is free); else the reclaimer closes them.
        """
        with self._lock:
            regions = self._stock.take_all()
            for region in regions:
                self._ledger.give(region.size)
            if self._stock.filling:
                self._stock.abort = True
        self.discard(regions, now=now)
        return sum(r.size for r in regions)

    def interrupt_refill(self) -> None:
        """Stop a refill in flight (its region is given back); the stock stays."""
        with self._lock:
            self._stock.abort = bool(self._stock.filling)

    def close(self) -> None:
        """No more refills: stop the one in flight, close every stocked region now."""
        with self._lock:
            self._stock.closed = True
            self._room.wait_for(lambda: not self._stock.filling, FILL_WAIT_S)
        self.shed(now=True)

    def discard(self, regions: list[Region], *, now: bool = False) -> None:
        """Close regions no buffer ever had (no scrub needed), in the background unless ``now``."""
        for region in regions:
            if self._reclaimer is not None and not now:
                self._reclaimer.submit(region)
            else:
                reclaim(region)
