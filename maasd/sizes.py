"""The two rules every layer holds a size to, written once: a size is a whole number of
bytes above 0 and below 2^63 (:func:`check_size`), and it fits the capacity it is asked
of (:func:`check_fits`).

The allocator's :class:`~maasd.allocator.arith.Ledger` (one pool's bytes), the placement
policy (:mod:`maasd.core.placement`: the pools that could hold a reserve) and the ledger's
reserve transaction (:mod:`maasd.store.buffers`) each call these, so a size refused by one
is refused by all with the same error. Pure: only :mod:`maasd.bounds` and
:mod:`maasd.errors`, so the store uses it without importing the allocator.

>>> check_size(4096)
4096
>>> try:
...     check_fits(8192, 4096, "pool 'small'")
... except TooLarge as e:
...     print(e)
8192 bytes exceed the 4096-byte capacity of pool 'small'
"""

from __future__ import annotations

from maasd.bounds import MAX_BYTES
from maasd.errors import InvalidRequest, TooLarge

__all__ = ["check_fits", "check_size"]


def check_size(size: object, what: str = "size") -> int:
    """Return ``size`` if it is a positive int below 2^63 (:data:`maasd.bounds.MAX_BYTES`: an
    ``off_t``), else raise :class:`InvalidRequest` (``what`` names it in the message).

    ``bool`` is refused even though it is an ``int`` subclass: ``True`` bytes is a bug.
    A size ≤ 0 would also let the ledger's sums undercount.
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidRequest(
            f"{what} must be an integer number of bytes, got {type(size).__name__}"
        )
    if size <= 0:
        raise InvalidRequest(f"{what} must be > 0, got {size}")
    if size > MAX_BYTES:
        raise InvalidRequest(f"{what} must be below 2^63 bytes, got {size}")
    return size


def check_fits(size: int, capacity: int, where: str) -> None:
    """Raise :class:`TooLarge` if ``size`` bytes exceed ``capacity``, the whole capacity of
    ``where`` ("pool 'x'", "the pool", "every pool that meets the QoS"): too large is
    too large however empty it is (422, not a 507 that a release could cure)."""
    if size > capacity:
        raise TooLarge(f"{size} bytes exceed the {capacity}-byte capacity of {where}")
