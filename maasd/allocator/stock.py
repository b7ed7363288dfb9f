"""A pool's warm stock: which fresh regions to keep ready, and the regions themselves.

The pure part — size classes, the record of recent demand, and the plan of
what to stock within a byte budget — touches no kernel and is tested on its own
(``tests/unit/test_stock.py``). :class:`Stock` only holds regions by class;
:class:`~maasd.allocator.pool.MemoryPool` guards it with its lock.

**Size classes.** A buffer's memfd is exactly its page-rounded size (no more),
so a stocked region is truncated down to the exact size when it is taken, and a
region serves the requests of its size *class* that are no larger than it.
Classes are geometric with 16 steps per doubling — ``m·2^e`` pages with
``16 ≤ m < 32`` — so any request of a class is less than 1/16 smaller than the
class's top: the tail truncated at take time is under 6.25 % of the request
(freeing a populated 64 MiB tail costs ~6–17 ms here). Below 32 pages a class is
an exact page count; powers of two are classes of their own.

**Exact sizes.** A region is made at the *largest size recently asked for* in
its class, not at the class's top: prefix-cache entries of one model repeat the
same few sizes, and a size asked for again is taken whole — nothing to cut
(~0.1 ms for 1 GiB). Only a first-time size smaller than a recent one of its
class pays a cut, bounded as above.

**What to stock.** The classes asked for recently: each pool remembers the
class and size of its last :data:`WINDOW` reserves, and :func:`plan` gives every
class one region per time it was asked for in that window, most asked for (then
most recent) first, round by round, while the sum stays within the budget. A
small window covers the few sizes a model's entries cluster around; a size larger
than the whole budget is never stocked.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator

from maasd.allocator.region import Region
from maasd.errors import InvalidRequest

__all__ = ["STEPS", "WINDOW", "Demand", "Stock", "plan", "size_class", "warm_budget"]

#: Size classes per doubling of the size.
STEPS = 16
#: Reserves remembered per pool to decide what to stock.
WINDOW = 64


def size_class(size: int, page: int) -> int:
    """The smallest class (bytes) that holds ``size``: ``m·2^e`` pages, ``16 ≤ m < 32``.

    ``size`` is a positive multiple of ``page`` (already rounded).

    >>> [size_class(n * 4096, 4096) // 4096 for n in (1, 31, 32, 33, 34, 64, 65)]
    [1, 31, 32, 34, 34, 64, 68]
    """
    pages = -(-size // page)
    if pages < 2 * STEPS:
        return pages * page
    shift = pages.bit_length() - STEPS.bit_length()  # keeps a mantissa in [STEPS, 2·STEPS)
    mantissa = -(-pages >> shift)  # ceil(pages / 2^shift)
    return (mantissa << shift) * page


def warm_budget(warm_bytes: object, capacity: int, page: int, prefault: bool) -> int:
    """A pool's warm budget, checked and rounded down to whole pages.

    :class:`InvalidRequest` unless it is an int from 0 to the capacity, and 0 for a
    pool without ``prefault`` (the stock is prefaulted memory, or nothing).
    """
    if isinstance(warm_bytes, bool) or not isinstance(warm_bytes, int):
        raise InvalidRequest(f"warm_bytes must be an integer, got {type(warm_bytes).__name__}")
    if not 0 <= warm_bytes <= capacity:
        raise InvalidRequest(
            f"warm_bytes must be between 0 and the capacity ({capacity}), got {warm_bytes}"
        )
    if warm_bytes and not prefault:
        raise InvalidRequest("a warm stock is prefaulted memory: it needs prefault = true")
    return warm_bytes - warm_bytes % page


def plan(recent: Iterable[int], budget: int, sizes: dict[int, int] | None = None) -> dict[int, int]:
    """How many regions of each class to keep, within ``budget`` bytes.

    ``recent`` are the classes asked for, oldest first; a region of class ``c``
    costs ``sizes[c]`` bytes (default: ``c``). Each class gets one region per time
    it appears, handed out in rounds — most asked for first, ties to the most
    recent — skipping any that no longer fits the budget.

    >>> plan([64, 16, 64, 32], budget=128)
    {64: 1, 32: 1, 16: 1}
    >>> plan([64, 16, 64, 32], budget=200)
    {64: 2, 32: 1, 16: 1}
    """
    sizes = sizes or {}
    seen = list(recent)
    counts = Counter(seen)
    last = {cls: i for i, cls in enumerate(seen)}
    order = sorted(counts, key=lambda c: (-counts[c], -last[c]))
    want: dict[int, int] = {}
    spent = 0
    for round_ in range(1, max(counts.values(), default=0) + 1):
        for cls in order:
            cost = sizes.get(cls, cls)
            if counts[cls] >= round_ and spent + cost <= budget:
                want[cls] = want.get(cls, 0) + 1
                spent += cost
    return want


class Demand:
    """The classes and sizes of a pool's last :data:`WINDOW` reserves (oldest first)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)

    def note(self, cls: int, size: int) -> None:
        self._recent.append((cls, size))

    def sizes(self) -> dict[int, int]:
        """The size to make a region of each class at: the largest asked for recently."""
        out: dict[int, int] = {}
        for cls, size in self._recent:
            out[cls] = max(out.get(cls, 0), size)
        return out

    def plan(self, budget: int) -> tuple[dict[int, int], dict[int, int]]:
        """``(regions wanted per class, the size of each)`` within ``budget``."""
        sizes = self.sizes()
        return plan((cls for cls, _ in self._recent), budget, sizes), sizes


class Stock:
    """A pool's fresh, prefaulted, not yet sealed regions by class, the demand they follow,
    and the state of the refill. Not thread-safe by itself: the pool's lock guards it."""

    def __init__(self) -> None:
        self._by_class: dict[int, list[Region]] = {}
        #: Bytes held (the sum of the regions' sizes).
        self.bytes = 0
        self.demand = Demand()
        #: Bytes of the region being made now (taken from the pool's capacity already).
        self.filling = 0
        #: Set to stop the region being made (a reserve needs its room, or memory is short).
        self.abort = False
        #: Whether the last refill failed (its failures are logged once).
        self.failed = False
        #: No more refills (the pool is deleted or the daemon closing).
        self.closed = False

    def counts(self) -> dict[int, int]:
        return {cls: len(rs) for cls, rs in self._by_class.items() if rs}

    def put(self, cls: int, region: Region) -> None:
        regions = self._by_class.setdefault(cls, [])
        regions.append(region)
        regions.sort(key=lambda r: r.size)
        self.bytes += region.size

    def take(self, cls: int, size: int = 0) -> Region | None:
        """The smallest region of class ``cls`` holding at least ``size`` bytes, or ``None``."""
        regions = self._by_class.get(cls, [])
        i = next((i for i, r in enumerate(regions) if r.size >= size), None)
        if i is None:
            return None
        region = regions.pop(i)
        self.bytes -= region.size
        return region

    def take_largest(self) -> Region | None:
        """The largest region held (to make room with the fewest regions), or ``None``."""
        held = [(rs[-1].size, cls) for cls, rs in self._by_class.items() if rs]
        if not held:
            return None
        size, cls = max(held)
        return self.take(cls, size)

    def surplus(self, want: dict[int, int]) -> Iterator[Region]:
        """Take out the regions beyond ``want``: of classes no longer asked for, or the
        smallest of a class that holds more than wanted."""
        for cls, regions in self._by_class.items():
            while len(regions) > want.get(cls, 0):
                region = regions.pop(0)
                self.bytes -= region.size
                yield region

    def take_all(self) -> list[Region]:
        regions = [r for rs in self._by_class.values() for r in rs]
        self._by_class.clear()
        self.bytes = 0
        return regions
