"""Read-only fds of committed entries: re-opened per handle, kept for the hottest few.

A committed entry's handle must be a file of its own opened ``O_RDONLY`` (a ``dup``
of the daemon's fd would share its writable open file), and the daemon keeps no
such fd per entry: that doubled what an idle entry costs (two fds instead of one)
and drove a daemon that budgeted one into ``EMFILE``. A re-open through
``/proc/self/fd/N`` costs 13–20 µs here against 1–2 µs for a ``dup``, on every
lookup — so the last :data:`HOT_READ_ONLY_FDS` entries looked up keep theirs
(least recently used dropped first), and a hit on one of them costs a ``dup``.
Those fds are counted in the region budget's headroom (:mod:`maasd.core.limits`).

Not thread-safe: :class:`~maasd.core.regions.Regions` calls it under its regions lock.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

from maasd.allocator import Region

__all__ = ["HOT_READ_ONLY_FDS", "ReadOnlyFds", "open_read_only"]

#: Committed entries whose read-only fd is kept (the most recently looked up).
HOT_READ_ONLY_FDS = 32


def open_read_only(region: Region) -> int:
    """A new ``O_RDONLY`` fd of the region's memfd: a re-open (:meth:`Region.reopen`:
    through ``/proc/self/fd``, or the mapping of a parked entry), a file of its own, whose
    mode a worker cannot change: ``mmap(PROT_WRITE, MAP_SHARED)`` of it fails."""
    return region.reopen(os.O_RDONLY)


class ReadOnlyFds:
    """The read-only fds kept for the :data:`HOT_READ_ONLY_FDS` hottest entries."""

    def __init__(self, keep: int = HOT_READ_ONLY_FDS) -> None:
        self.keep = keep
        self._fds: OrderedDict[str, int] = OrderedDict()

    def handle(self, buffer_id: str, region: Region) -> int:
        """A new read-only fd of the entry (the caller closes it): a ``dup`` of the kept
        one, which is opened (and the coldest kept one closed) if there is none yet."""
        fd = self._fds.get(buffer_id)
        if fd is None:
            if self.keep <= 0:
                return open_read_only(region)
            fd = self._fds[buffer_id] = open_read_only(region)
            if len(self._fds) > self.keep:
                _, cold = self._fds.popitem(last=False)
                os.close(cold)
        else:
            self._fds.move_to_end(buffer_id)
        return os.dup(fd)

    def drop(self, buffer_id: str) -> None:
        """The entry is taken out: close its kept fd, if any."""
        fd = self._fds.pop(buffer_id, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __len__(self) -> int:
        return len(self._fds)
