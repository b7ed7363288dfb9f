"""Deadlines of one fixed length, kept in start order — which is then deadline order.

The broker's timeouts (hello, send, linger) each have one length for every
connection, so an insertion-ordered map is a priority queue with O(1) start,
cancel and expiry; no heap, no lazy deletion.

    >>> d = Deadlines(5.0)
    >>> d.start("a", now=0.0); d.start("b", now=1.0)
    >>> d.next(), d.expired(now=5.5), len(d)
    (5.0, ['a'], 1)
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

T = TypeVar("T")


class Deadlines(Generic[T]):
    """Items that each expire ``timeout_s`` after they were started."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._due: collections.OrderedDict[T, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, item: object) -> bool:
        return item in self._due

    def __iter__(self) -> Iterator[T]:
        """The items, earliest deadline (first started) first."""
        return iter(self._due)

    def start(self, item: T, now: float) -> None:
        """Start (or restart) ``item``'s deadline at ``now``."""
        self._due.pop(item, None)
        self._due[item] = now + self.timeout_s

    def cancel(self, item: T) -> None:
        self._due.pop(item, None)

    def next(self) -> float | None:
        """The earliest deadline, or None."""
        for due in self._due.values():
            return due
        return None

    def expired(self, now: float) -> list[T]:
        """Remove and return the items whose deadline is ``now`` or earlier, oldest first."""
        out = []
        while self._due:
            item, due = next(iter(self._due.items()))
            if due > now:
                break
            del self._due[item]
            out.append(item)
        return out

    def drain(self) -> list[T]:
        """Remove and return every item."""
        out = list(self._due)
        self._due.clear()
        return out
