"""Pure arithmetic of the allocator: page rounding, size validation, ledgers.

Nothing here touches the kernel, so it is tested exhaustively on its own
(``tests/unit/test_arith.py``, ``tests/property/test_pool_machine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from maasd.bounds import MAX_BYTES
from maasd.errors import InvalidRequest, PoolExhausted
from maasd.sizes import check_fits, check_size

__all__ = ["Ledger", "check_size", "round_up"]


def round_up(size: int, page: int) -> int:
    """Round ``size`` up to a whole number of ``page``-byte pages (``page`` a power of two).

    >>> round_up(1, 4096), round_up(4096, 4096), round_up(4097, 4096)
    (4096, 4096, 8192)
    """
    if page <= 0 or page & (page - 1):
        raise InvalidRequest(f"page size must be a power of two, got {page}")
    rounded = (check_size(size) + page - 1) & ~(page - 1)
    if rounded > MAX_BYTES:  # e.g. 2^63 - 1 rounds to 2^63: no off_t holds it
        raise InvalidRequest(f"size {size} rounded up to {page}-byte pages reaches 2^63 bytes")
    return rounded


@dataclass
class Ledger:
    """Capacity accounting of one pool: ``used + free == capacity`` always.

    Not thread-safe by itself; :class:`maasd.allocator.pool.MemoryPool` holds a lock
    around it.
    """

    capacity: int
    used: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def take(self, size: int) -> None:
        """Account ``size`` bytes as used, or raise without changing anything."""
        check_fits(size, self.capacity, "the pool")
        if size > self.free:
            raise PoolExhausted(f"{size} bytes requested, {self.free} of {self.capacity} free")
        self.used += size

    def give(self, size: int) -> None:
        """Return ``size`` bytes taken earlier."""
        if size < 0 or size > self.used:
            raise AssertionError(f"ledger underflow: giving back {size} of {self.used} used")
        self.used -= size
