"""A pool: a named budget of memory with fixed QoS properties, handing out regions.

The pool is the in-process guard of capacity (the database ledger is the
authoritative one across restarts and daemons): whatever the caller does, a
pool never has more bytes in live regions — plus its warm stock — than its
capacity.

**Warm stock.** With ``warm_bytes > 0`` a pool keeps up to that many bytes of
fresh, prefaulted, node-bound regions ready (:mod:`maasd.allocator.stock` says
which sizes), made in the background by a :class:`~maasd.allocator.warm.Warmer`
thread. A reserve whose size class is in stock takes a region from it, cuts it
to the exact size and seals it: no page is faulted on the request path. The
stock counts against the capacity but belongs to no buffer: a reserve that would
not fit otherwise gives stocked regions back first (and stops a refill in
flight), so the stock never makes a reserve fail.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maasd.allocator.arith import Ledger, check_size, round_up
from maasd.allocator.reclaim import Reclaimer, reclaim
from maasd.allocator.region import BACKINGS, SCRUB_MODES, Region
from maasd.allocator.stock import Stock, size_class, warm_budget
from maasd.errors import BackingError, InvalidRequest, PoolExhausted

if TYPE_CHECKING:
    from maasd.allocator.warm import Warmer

logger = logging.getLogger(__name__)

PERSISTENCES = ("volatile", "persistent")
#: Longest a reserve waits for a refill in flight to give its capacity back (it stops
#: within one populate step, ~30 ms here).
FILL_WAIT_S = 10.0


def default_page_bytes(backing: str, hugepage_bytes: int = 2 << 20) -> int:
    """The page size regions of this backing are rounded to."""
    if backing not in BACKINGS:
        raise InvalidRequest(f"backing must be one of {BACKINGS}, got {backing!r}")
    return os.sysconf("SC_PAGE_SIZE") if backing == "memfd" else hugepage_bytes


@dataclass
class Pool:
    """Capacity accounting, region creation and a warm stock for one pool. Thread-safe.

    ``reclaimer`` gives the pages of released ``zero``-scrubbed regions back in the
    background (see :meth:`release`); without one, that happens in the releasing call.
    ``warmer`` refills the warm stock of ``warm_bytes`` (the pool registers itself with
    it); without one, :meth:`refill_step` is the caller's to call.
    """

    name: str
    numa_node: int
    capacity: int
    backing: str = "memfd"
    persistence: str = "volatile"
    latency_us: int = 1
    prefault: bool = True
    scrub: str = "zero"
    page_bytes: int = 0
    warm_bytes: int = 0
    reclaimer: Reclaimer | None = field(default=None, repr=False, compare=False)
    warmer: Warmer | None = field(default=None, repr=False, compare=False)
    _ledger: Ledger = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _room: threading.Condition = field(init=False, repr=False)
    _stock: Stock = field(init=False, repr=False, default_factory=Stock)

    def __post_init__(self) -> None:
        if self.backing not in BACKINGS:
            raise InvalidRequest(f"backing must be one of {BACKINGS}, got {self.backing!r}")
        if self.persistence not in PERSISTENCES:
            raise InvalidRequest(
                f"persistence must be one of {PERSISTENCES}, got {self.persistence!r}"
            )
        if self.scrub not in SCRUB_MODES:
            raise InvalidRequest(f"scrub must be one of {SCRUB_MODES}, got {self.scrub!r}")
        if not self.page_bytes:
            self.page_bytes = default_page_bytes(self.backing)
        if self.page_bytes < 0 or self.page_bytes & (self.page_bytes - 1):
            # else every reserve would fail later; refuse the pool now
            raise InvalidRequest(f"page size must be a power of two, got {self.page_bytes}")
        check_size(self.capacity)
        if self.capacity % self.page_bytes:
            raise InvalidRequest(
                f"capacity {self.capacity} is not a multiple of the {self.page_bytes}-byte page"
            )
        self.set_warm_bytes(self.warm_bytes)
        self._ledger = Ledger(self.capacity)
        self._room = threading.Condition(self._lock)
        if self.warmer is not None:
            self.warmer.add(self)

    def set_warm_bytes(self, warm_bytes: int) -> None:
        """Set the warm stock's budget (:func:`~maasd.allocator.stock.warm_budget`)."""
        self.warm_bytes = warm_budget(warm_bytes, self.capacity, self.page_bytes, self.prefault)
        if self.warmer is not None:
            self.warmer.wake()

    @property
    def used(self) -> int:
        """Bytes taken: live regions plus the warm stock (and a refill in flight)."""
        return self._ledger.used

    @property
    def free(self) -> int:
        return self._ledger.free

    @property
    def warm(self) -> int:
        """Bytes in the warm stock now."""
        return self._stock.bytes

    def rounded(self, size: int) -> int:
        """The size a request of ``size`` bytes occupies in this pool."""
        return round_up(size, self.page_bytes)

    # -- reserve ----------------------------------------------------------------------------

    def reserve(
        self,
        size: int,
        name: str = "maasd-buffer",
        *,
        extra_seals: int = 0,
        accounted: bool = True,
        prefault: bool | None = None,
    ) -> Region:
        """A sealed region of exactly ``size`` rounded to pages: from the warm stock, or new.

        ``extra_seals`` go on with :data:`~maasd.allocator.region.SEALS`; ``prefault``
        overrides the pool's for a new region (a stocked one is always populated).
        ``accounted=False`` makes a region that *takes over* the accounting of one of the
        same size, which the caller then releases with ``give_back=False`` (an entry's
        sealed copy at its commit): no capacity is taken (a stocked region's is given
        back), so a full pool can still swap one region for another — the host holds
        both for the length of the swap. Raises :class:`TooLarge` above capacity,
        :class:`PoolExhausted` when full now even without the stock (nothing changes
        either way), :class:`BackingError` if the kernel refuses (the capacity is
        given back).
        """
        rounded = self.rounded(size)
        region = self._from_stock(rounded, extra_seals)
        if region is not None:
            if not accounted:
                self._give(rounded)
            return region
        if accounted:
            self._take(rounded)
        options = {
            "prefault": self.prefault if prefault is None else prefault,
            "name": name,
            "extra_seals": extra_seals,
        }
        try:
            try:
                return self._create(rounded, **options)
            except BackingError as e:
                # Out of memory while pools hold warm stock: once it is given back, try again.
                if e.errno not in (errno.ENOMEM, errno.ENOSPC) or not self._shed_everywhere():
                    raise
            return self._create(rounded, **options)
        except BaseException:
            if accounted:
                self._give(rounded)
            raise

    def _shed_everywhere(self) -> bool:
        return self.warmer is not None and self.warmer.shed(backing=self.backing) > 0

    def _create(self, size: int, **options: Any) -> Region:
        return Region.create(
            size, node=self.numa_node, backing=self.backing, page_bytes=self.page_bytes, **options
        )

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

    def _take(self, size: int) -> None:
        """Account ``size`` bytes as used, giving warm stock back if that makes them fit."""
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
            self._discard(shed)

    def _give(self, size: int) -> None:
        with self._lock:
            self._ledger.give(size)

    def adopt(self, size: int) -> None:
        """Account for a region made elsewhere (restored from a checkpoint)."""
        self._take(self.rounded(size))

    # -- release ----------------------------------------------------------------------------

    def release(self, region: Region, *, give_back: bool = True) -> None:
        """Scrub the region with this pool's mode, give its bytes back, close it.

        ``give_back=False`` keeps its bytes accounted: for a region whose accounting a
        replacement took over (``reserve(accounted=False)``).

        Every byte reads zero when this returns. With ``scrub = "zero"`` on ``memfd``,
        only the memset happens here; the punch and the close are left to the pool's
        :class:`~maasd.allocator.reclaim.Reclaimer` (done here without one). Otherwise
        the punch *is* the scrub (``hugetlb`` punches in both modes), so it happens here.
        Releasing a released (closed) region again changes nothing.
        """
        with self._lock:
            if region.released or region.closed:
                return
            region.released = True
        if self.scrub == "zero" and region.backing == "memfd":
            region.scrub("zero", punch=False)
            if self.reclaimer is not None:
                self.reclaimer.submit(region)
            else:
                reclaim(region)
        else:
            try:
                region.scrub(self.scrub)
            finally:
                region.close()
        if give_back:
            self._give(region.size)

    # -- the warm stock ---------------------------------------------------------------------

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
        """Make, bind and populate one unsealed region of ``size`` bytes into class ``cls``."""
        region: Region | None = None
        done = False
        try:
            region = self._create(size, prefault=False, name="maasd-warm", seal=False)
            done = region.populate(abort=lambda: self._stock.abort or self._stock.closed)
        except BackingError as e:
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

    def close(self) -> None:
        """No more stock: leave the warmer, stop a refill in flight, close every stocked region.

        For a pool being deleted or a daemon closing; live regions are not touched.
        """
        if self.warmer is not None:
            self.warmer.remove(self)
        with self._lock:
            self._stock.closed = True
            self._room.wait_for(lambda: not self._stock.filling, FILL_WAIT_S)
        self.shed(now=True)

    def _discard(self, regions: list[Region], *, now: bool = False) -> None:
        """Close regions no buffer ever had (no scrub needed), in the background unless ``now``."""
        for region in regions:
            if self.reclaimer is not None and not now:
                self.reclaimer.submit(region)
            else:
                reclaim(region)
