"""What the allocator's free functions read of a region (:class:`Mapped`).

:mod:`maasd.allocator.scrub` and :mod:`maasd.allocator.numa` work on a region's file and
the daemon's mapping of it without importing :class:`~maasd.allocator.region.Region`
(which calls them): each names what it reads as a protocol over this one.
"""

from __future__ import annotations

from typing import Protocol

from maasd.bounds import Backing

__all__ = ["Mapped"]


class Mapped(Protocol):
    """A region's file, the daemon's mapping of it, and its pages."""

    @property
    def fd(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def backing(self) -> Backing: ...
    @property
    def page_bytes(self) -> int: ...
