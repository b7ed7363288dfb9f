"""The warm-stock half of a pool: taking a stocked region, refilling, shedding.

:class:`~maasd.allocator.pool.Pool` is a dataclass that inherits these methods; they
work on its lock, capacity ledger and :class:`~maasd.allocator.stock.Stock`, which are
declared here for the type checker only. The pool keeps the accounting of reserves and
releases; this part keeps the stock within the capacity the pool leaves free.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from maasd.allocator.arith import Ledger
from maasd.allocator.reclaim import Reclaimer, reclaim
from maasd.allocator.region import Region
from maasd.allocator.stock import Stock, size_class
from maasd.bounds import Backing
from maasd.errors import BackingError, PlacementError, PoolExhausted

if TYPE_CHECKING:
    from maasd.allocator.warm import Warmer

logger = logging.getLogger("maasd.allocator.pool")

#: Longest a reserve waits for a refill in flight to give its capacity back (it stops
#: within one populate step, ~30 ms here).
FILL_WAIT_S = 10.0


class Refilling:
    """The warm stock's methods of a pool (see the module docstring). Thread-safe."""

    name: str
    numa_node: int
    backing: Backing
    page_bytes: int
    warm_bytes: int
    reclaimer: Reclaimer | None
    warmer: Warmer | None
    _ledger: Ledger
    _lock: threading.Lock
    _room: threading.Condition
    _stock: Stock

    def _create(self, size: int, **options: Any) -> Region:
        return Region.create(
            size, node=self.numa_node, backing=self.backing, page_bytes=self.page_bytes, **options
        )

    def _give(self, size: int) -> None:
        with self._lock:
            self._ledger.give(size)

    def _from_stock(self, rounded: int, extra_seals: int) -> Region | None:
        """A stocked region of ``rounded``'s class, cut to ``rounded`` and sealed; or ``None``."""
        if not self.warm_bytes:
            return None
        cls = size_class(rounded, self.page_bytes)
        with self._lock:
            self._stock.demand.note(cls, rounded)
            region = self._stock.take(cls, rounded)
        if self.warmer is not None:
            self.warmer.wake()
        if region is None:
            return None
        held = region.size
        try:
            region.seal_at(rounded, extra_seals)
        except BackingError as e:
            logger.warning("pool %s: a stocked region could not be cut (%s)", self.name, e.detail)
            self._give(held)
            self._discard([region])
            return None
        self._give(held - rounded)  # the cut tail
        return region

    def refill_step(self, room: int | None = None) -> bool:
        """One step towards the planned stock; ``True`` if it changed anything.

        Gives back the stocked regions no longer planned for, or else makes one
        missing region: from free capacity only, within the budget and within
        ``room`` (bytes the host can spare; ``None``: no limit).
        """
        with self._lock:
            if self._stock.closed or not self.warm_bytes:
                return False
            want, sizes = self._stock.demand.plan(self.warm_bytes)
            surplus = list(self._stock.surplus(want))
            for region in surplus:
                self._ledger.give(region.size)
            cls = None
            if not surplus:
                have = self._stock.counts()
                spare = min(
                    self._ledger.free,
                    self.warm_bytes - self._stock.bytes - self._stock.filling,
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
            self._discard(surplus)
            return True
        assert cls is not None
        return self._fill(cls, sizes[cls])

    def _fill(self, cls: int, size: int) -> bool:
        """Make, bind and populate one unsealed region of ``size`` bytes into class ``cls``;
        its placement is measured here, so that a reserve that takes it need not."""
        region: Region | None = None
        done = False
        try:
            region = self._create(size, prefault=False, name="maasd-warm", seal=False)
            if region.populate(abort=lambda: self._stock.abort or self._stock.closed):
                # Off the request path: a placement sample costs a reserve 0.05–0.4 ms
                # (more on a busy host); the pages stay on the node they are bound to.
                region.verify_node(sample=16)
                done = True
        except (BackingError, PlacementError, PoolExhausted) as e:
            log = logger.debug if self._stock.failed else logger.warning
            log("pool %s: no warm region of %d bytes now (%s)", self.name, size, e.detail)
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
                self._discard([region])
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
        self._discard(regions, now=now)
        return sum(r.size for r in regions)

    def interrupt_refill(self) -> None:
        """Stop a refill in flight (its region is given back); the stock stays."""
        with self._lock:
            self._stock.abort = bool(self._stock.filling)

    def _discard(self, regions: list[Region], *, now: bool = False) -> None:
        """Close regions no buffer ever had (no scrub needed), in the background unless ``now``."""
        for region in regions:
            if self.reclaimer is not None and not now:
                self.reclaimer.submit(region)
            else:
                reclaim(region)
