"""A pool's memory (:class:`MemoryPool`): a named budget with fixed QoS properties,
handing out regions. (The client's :class:`maasd.client.Pool` is a pool's REST view.)

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
import threading
from dataclasses import dataclass, field
from typing import Any, get_args

from maasd.allocator.arith import check_size, round_up
from maasd.allocator.reclaim import Reclaimer, reclaim
from maasd.allocator.refill import WarmStock
from maasd.allocator.region import Region, check_backing, page_bytes_of
from maasd.allocator.scrub import SCRUB_MODES
from maasd.allocator.stock import warm_budget
from maasd.allocator.warm import Warmer
from maasd.bounds import Backing, Persistence, ScrubMode
from maasd.errors import BackingError, InvalidRequest, PoolExhausted

logger = logging.getLogger(__name__)

PERSISTENCES: tuple[Persistence, ...] = get_args(Persistence)


@dataclass
class MemoryPool:
    """One pool's memory: capacity accounting, region creation and a warm stock. Thread-safe.

    ``reclaimer`` gives the pages of released ``zero``-scrubbed regions back in the
    background (see :meth:`release`); without one, that happens in the releasing call.
    ``warmer`` refills the warm stock of ``warm_bytes`` (the pool registers itself with
    it); without one, :meth:`refill_step` is the caller's to call. The capacity and the
    stock inside it are the pool's :class:`~maasd.allocator.refill.WarmStock`.
    """

    name: str
    numa_node: int
    capacity: int
    backing: Backing = "memfd"
    persistence: Persistence = "volatile"
    latency_us: int = 1
    prefault: bool = True
    scrub: ScrubMode = "zero"
    page_bytes: int = 0
    warm_bytes: int = 0
    reclaimer: Reclaimer | None = field(default=None, repr=False, compare=False)
    warmer: Warmer | None = field(default=None, repr=False, compare=False)
    _warm: WarmStock = field(init=False, repr=False)
    #: Guards only the ``released`` mark of the regions this pool hands out.
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        check_backing(self.backing)
        if self.persistence not in PERSISTENCES:
            raise InvalidRequest(
                f"persistence must be one of {PERSISTENCES}, got {self.persistence!r}"
            )
        if self.scrub not in SCRUB_MODES:
            raise InvalidRequest(f"scrub must be one of {SCRUB_MODES}, got {self.scrub!r}")
        if not self.page_bytes:
            self.page_bytes = page_bytes_of(self.backing)
        if self.page_bytes < 0 or self.page_bytes & (self.page_bytes - 1):
            # else every reserve would fail later; refuse the pool now
            raise InvalidRequest(f"page size must be a power of two, got {self.page_bytes}")
        check_size(self.capacity)
        if self.capacity % self.page_bytes:
            raise InvalidRequest(
                f"capacity {self.capacity} is not a multiple of the {self.page_bytes}-byte page"
            )
        self.set_warm_bytes(self.warm_bytes)
        self._warm = WarmStock(
            self.name,
            self.capacity,
            self.page_bytes,
            make=self._create,
            reclaimer=self.reclaimer,
            wake=self.warmer.wake if self.warmer is not None else lambda: None,
        )
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
        return self._warm.used

    @property
    def free(self) -> int:
        return self._warm.free

    @property
    def warm(self) -> int:
        """Bytes in the warm stock now."""
        return self._warm.bytes

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
        :class:`PoolExhausted` when full now even without the stock, or when its NUMA
        node cannot spare the pages (nothing changes either way), :class:`BackingError` if the kernel refuses (the capacity is
        given back).
        """
        rounded = self.rounded(size)
        if self.reclaimer is not None and self.reclaimer.pending_bytes > rounded:
            self.reclaimer.help(rounded)  # released pages waiting stay bounded (reclaim.py)
        region = self._warm.take_region(rounded, extra_seals) if self.warm_bytes else None
        if region is not None:
            if not accounted:
                self._warm.give(rounded)
            return region
        if accounted:
            self._warm.take(rounded)
        options = {
            "prefault": self.prefault if prefault is None else prefault,
            "name": name,
            "extra_seals": extra_seals,
        }
        try:
            try:
                return self._create(rounded, **options)
            except BackingError as e:
                # Out of memory while pools hold warm stock: once it is given back, try again
                # (huge pages: EFAULT at populate when the node has too few of its own).
                if not self._out_of_memory(e) or not self._shed_everywhere():
                    raise
            except PoolExhausted:  # the node cannot spare the pages (Region.populate): the same
                if not self._shed_everywhere():
                    raise
            return self._create(rounded, **options)
        except BaseException:
            if accounted:
                self._warm.give(rounded)
            raise

    def _create(self, size: int, **options: Any) -> Region:
        return Region.create(
            size, node=self.numa_node, backing=self.backing, page_bytes=self.page_bytes, **options
        )

    def _out_of_memory(self, e: BackingError) -> bool:
        if e.errno in (errno.ENOMEM, errno.ENOSPC):
            return True
        return self.backing == "hugetlb" and e.errno == errno.EFAULT

    def _shed_everywhere(self) -> bool:
        return self.warmer is not None and self.warmer.shed(backing=self.backing) > 0

    def adopt(self, size: int) -> None:
        """Account for a region made elsewhere (restored from a checkpoint)."""
        self._warm.take(self.rounded(size))

    # -- release ----------------------------------------------------------------------------

    def release(self, region: Region, *, give_back: bool = True) -> None:
        """Scrub the region with this pool's mode, give its bytes back, close it.

        ``give_back=False`` keeps its bytes accounted: for a region whose accounting a
        replacement took over (``reserve(accounted=False)``).

        Every byte reads zero when this returns. With ``scrub = "zero"`` on ``memfd``,
        only the memset happens here; the punch and the close are left to the pool's
        :class:`~maasd.allocator.reclaim.Reclaimer` (done here without one) — but a
        frozen region (a committed entry), which cannot be punched, is closed here. Otherwise
        the punch *is* the scrub (``hugetlb`` punches in both modes), so it happens here.
        Releasing a released (closed) region again changes nothing.
        """
        with self._lock:
            if region.released or region.closed:
                return
            region.released = True
        if self.scrub == "zero" and region.backing == "memfd":
            frozen = region.frozen
            region.scrub("zero", punch=False)
            if frozen:
                # Nothing to punch (the kernel refuses it): closed now, so that the
                # memory goes at once unless a worker still holds it (maasd.core.holders).
                region.close()
            elif self.reclaimer is not None:
                self.reclaimer.submit(region)
            else:
                reclaim(region)
        else:
            try:
                region.scrub(self.scrub)
            finally:
                region.close()
        if give_back:
            self._warm.give(region.size)

    def retire(self, region: Region) -> None:
        """Release a region that a replacement took over (its accounting: ``reserve(
        accounted=False)``) and that no one reads again — an entry's staging region at
        its commit — with its scrub after the caller's answer where a reclaimer runs.

        Its bytes must be zero before its memory is freed or reused, not before the
        answer: the reclaimer's punch zeroes every page for every mapping and frees it
        in one step (:meth:`Region.punch_hole`; a refused punch zeroes instead), and a
        memfd is never reused. That takes the memset of :meth:`release` (~0.5 ms for
        9 MiB here) off a commit's answer. Without a reclaimer the punch happens here;
        a frozen region (which cannot be punched) is released as :meth:`release` does.
        """
        if region.released or region.closed:
            return
        if region.frozen:
            self.release(region, give_back=False)
            return
        with self._lock:
            if region.released or region.closed:
                return
            region.released = True
        if self.reclaimer is not None:
            self.reclaimer.submit(region)  # reclaimed here if it is not running
        else:
            reclaim(region)

    def give_back(self, size: int) -> None:
        """Give back the bytes of a region released with ``give_back=False`` whose
        memory others held until now (a committed entry: maasd.core.holders)."""
        self._warm.give(size)

    def close(self) -> None:
        """No more stock: leave the warmer, stop a refill in flight, close every stocked region.

        For a pool being deleted or a daemon closing; live regions are not touched.
        """
        if self.warmer is not None:
            self.warmer.remove(self)
        self._warm.close()

    # -- the warm stock, for the warmer -----------------------------------------------------

    def refill_step(self, room: int | None = None) -> bool:
        """One step towards the planned stock; ``True`` if it changed anything
        (:meth:`WarmStock.refill_step <maasd.allocator.refill.WarmStock.refill_step>`)."""
        return self._warm.refill_step(self.warm_bytes, room)

    def shed(self, *, now: bool = False) -> int:
        """Give the whole stock back (memory is short); returns the bytes given.

        A refill in flight stops too. With ``now``, the regions are closed before
        this returns (their memory is free); else the reclaimer closes them.
        """
        return self._warm.shed(now=now)

    def interrupt_refill(self) -> None:
        """Stop a refill in flight (its region is given back); the stock stays."""
        self._warm.interrupt_refill()
