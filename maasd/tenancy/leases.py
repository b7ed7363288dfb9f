"""Lease arithmetic: when a buffer's lease ends.

Pure functions of the clock value they are given (epoch seconds, ``float``);
callers pass ``time.time()`` so tests can pass anything. A lease holds up to and
including its end; the store's reaper query releases it strictly after.

The shape of ``ttl_s`` (an integer, 1 … 2^31) is checked where a request is
decoded (:data:`maasd.bounds.TtlS`); the daemon's own limit, ``max_ttl_s``, is
the rule checked here.

>>> expires_at(1000.0, 60, 3600)
1060.0
"""

from __future__ import annotations

from maasd.errors import InvalidRequest

__all__ = ["expires_at", "validate_ttl"]


def validate_ttl(ttl_s: int, max_ttl_s: int) -> int:
    """Return ``ttl_s`` if it lies in ``1 … max_ttl_s``, else raise :class:`InvalidRequest`."""
    if not 1 <= ttl_s <= max_ttl_s:
        raise InvalidRequest(f"ttl_s must be between 1 and {max_ttl_s} seconds, got {ttl_s}")
    return ttl_s


def expires_at(now: float, ttl_s: int, max_ttl_s: int) -> float:
    """The end of a lease of ``ttl_s`` seconds starting at ``now``.

    Raises :class:`~maasd.errors.InvalidRequest` if ``ttl_s`` lies outside
    ``1 … max_ttl_s``.
    """
    return now + validate_ttl(ttl_s, max_ttl_s)
