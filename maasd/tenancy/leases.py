"""Lease arithmetic: when a buffer's lease ends, and whether it has.

Pure functions of the clock value they are given (epoch seconds, ``float``);
callers pass ``time.time()`` so tests can pass anything.

>>> expires_at(1000.0, 60, 3600)
1060.0
>>> is_expired(1060.0, 1060.0), is_expired(1060.0, 1060.5)
(False, True)
"""

from __future__ import annotations

from maasd.errors import InvalidRequest

__all__ = ["expires_at", "is_expired", "validate_ttl"]


def validate_ttl(ttl_s: object, max_ttl_s: int) -> int:
    """Return ``ttl_s`` if it is an ``int`` in ``1 … max_ttl_s``, else raise :class:`InvalidRequest`.

    ``bool`` is rejected although it subclasses ``int``: ``true`` is not a duration.
    """
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int):
        raise InvalidRequest(
            f"ttl_s must be an integer number of seconds, got {type(ttl_s).__name__}"
        )
    if ttl_s < 1 or ttl_s > max_ttl_s:
        raise InvalidRequest(f"ttl_s must be between 1 and {max_ttl_s} seconds, got {ttl_s}")
    return ttl_s


def expires_at(now: float, ttl_s: int, max_ttl_s: int) -> float:
    """The end of a lease of ``ttl_s`` seconds starting at ``now``.

    Raises :class:`~maasd.errors.InvalidRequest` if ``ttl_s`` is not an int
    (``bool`` included) or lies outside ``1 … max_ttl_s``.
    """
    return now + validate_ttl(ttl_s, max_ttl_s)


def is_expired(expires_at: float, now: float) -> bool:
    """Whether a lease ending at ``expires_at`` is over at ``now``.

    The lease holds up to and including ``expires_at``; it is expired strictly
    after it — the same rule as :meth:`maasd.store.Store.expired`.
    """
    return now > expires_at
