"""A pool: a named budget of memory with fixed QoS properties, handing out regions.

The pool is the in-process guard of capacity (the database ledger is the
authoritative one across restarts and daemons): whatever the caller does, a
pool never has more bytes in live regions than its capacity.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from maasd.allocator.arith import Ledger, check_size, round_up
from maasd.allocator.reclaim import Reclaimer, reclaim
from maasd.allocator.region import BACKINGS, SCRUB_MODES, Region
from maasd.errors import InvalidRequest

PERSISTENCES = ("volatile", "persistent")


def default_page_bytes(backing: str, hugepage_bytes: int = 2 << 20) -> int:
    """The page size regions of this backing are rounded to."""
    if backing not in BACKINGS:
        raise InvalidRequest(f"backing must be one of {BACKINGS}, got {backing!r}")
    return os.sysconf("SC_PAGE_SIZE") if backing == "memfd" else hugepage_bytes


@dataclass
class Pool:
    """Capacity accounting plus region creation for one pool. Thread-safe.

    ``reclaimer`` gives the pages of released ``zero``-scrubbed regions back in the
    background (see :meth:`release`); without one, that happens in the releasing call.

    >>> pool = Pool("node0", numa_node=0, capacity=1 << 30)   # doctest: +SKIP
    >>> region = pool.reserve(5000)                            # 8192 bytes accounted
    >>> pool.release(region)                                   # scrubbed, then returned
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
    reclaimer: Reclaimer | None = field(default=None, repr=False, compare=False)
    _ledger: Ledger = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

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
        self._ledger = Ledger(self.capacity)

    @property
    def used(self) -> int:
        return self._ledger.used

    @property
    def free(self) -> int:
        return self._ledger.free

    def rounded(self, size: int) -> int:
        """The size a request of ``size`` bytes occupies in this pool."""
        return round_up(size, self.page_bytes)

    def reserve(
        self,
        size: int,
        name: str = "maasd-buffer",
        *,
        extra_seals: int = 0,
        accounted: bool = True,
        prefault: bool | None = None,
    ) -> Region:
        """Account for and create a region of at least ``size`` bytes.

        ``extra_seals`` go on with :data:`~maasd.allocator.region.SEALS`; ``prefault``
        overrides the pool's. ``accounted=False`` makes a region that *takes over* the
        accounting of one of the same size which the caller then releases with
        ``give_back=False`` (an entry's copy at commit): no capacity is taken, so a
        full pool can still swap one region for another — the host holds both for the
        length of the swap.

        Raises :class:`TooLarge` above capacity, :class:`PoolExhausted` when full now
        (nothing changes either way), :class:`BackingError` if the kernel refuses
        (the capacity is given back).
        """
        rounded = self.rounded(size)
        if accounted:
            with self._lock:
                self._ledger.take(rounded)
        try:
            return Region.create(
                rounded,
                node=self.numa_node,
                backing=self.backing,
                page_bytes=self.page_bytes,
                prefault=self.prefault if prefault is None else prefault,
                name=name,
                extra_seals=extra_seals,
            )
        except BaseException:
            if accounted:
                with self._lock:
                    self._ledger.give(rounded)
            raise

    def adopt(self, size: int) -> None:
        """Account for a region made elsewhere (restored from a checkpoint)."""
        with self._lock:
            self._ledger.take(self.rounded(size))

    def release(self, region: Region, *, give_back: bool = True) -> None:
        """Scrub the region with this pool's mode, give its bytes back, close it.

        ``give_back=False`` keeps its bytes accounted: for a region whose accounting a
        replacement took over (``reserve(accounted=False)``).

        Every byte reads zero when this returns. With ``scrub = "zero"`` only the
        memset happens here; punching the pages out and closing the memfd is left
        to the pool's :class:`~maasd.allocator.reclaim.Reclaimer` (done here when
        the pool has none). With ``punch`` the punch *is* the scrub, so it happens here.

        Releasing an already released (closed) region changes nothing: giving its
        bytes back twice would let the pool over-commit.
        """
        with self._lock:
            if region.released or region.closed:
                return
            region.released = True
        if self.scrub == "zero":
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
            with self._lock:
                self._ledger.give(region.size)
