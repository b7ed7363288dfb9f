"""Puts in flight: rows admitted in their final state whose region this process does not
hold yet — a put's entry (``staged``), and a plain buffer admitted ``live`` at once.

A ``put`` admits its row ``staged`` (a commit), then takes a region and holds it
(:meth:`~maasd.core.regions.Regions.hold`). A release of the row in between — a
DELETE, the reaper, a tenant delete or pool drain, a fence — finds no region to
scrub (:meth:`~maasd.core.regions.Regions.take_region` answers ``None``) and ends
the row. Without a word, the put would then hold memory no row counts. So the put
registers its id before its admission, a release that finds no region for a
registered id notes it, and the put reads the note once it holds the region and
drops the region itself if one came (what a read of the row did, ~0.5 ms, before).

Every release of a row of this host's memory runs in this process (a tenant deleted
through another daemon is released here by the reaper; eviction takes only live
rows of this host), except a ``maasctl hosts forget`` of this host while it was cut
off: its fence (:meth:`PutsInFlight.forsake`) notes every put in flight.

The notes live under the regions' lock (passed in): a note and a hold are
then never interleaved, so a release either finds the region held or leaves a note
that the put reads after holding it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["PutsInFlight"]


def _ignore(_buffer_id: str) -> None:
    pass


class PutsInFlight:
    """Ids admitted and not yet held → whether a release came for them meanwhile."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock  # the regions' lock
        self._released: dict[str, bool] = {}

    @contextlib.contextmanager
    def admitting(self, buffer_id: str, put: bool = True) -> Iterator[Callable[[str], None]]:
        """Around a reserve's admission and hold: a put's (``put``) id is expected until
        the block ends (:meth:`settle`, inside it, reads what came meanwhile). It yields
        what to call with another id the reserve is admitted under instead (an admission
        undone and asked again, :mod:`maasd.core.room`), before that admission: that id
        is expected too."""
        if not put:
            yield _ignore
            return
        ids: list[str] = []

        def also(other: str) -> None:
            with self._lock:
                self._released[other] = False
            ids.append(other)

        also(buffer_id)
        try:
            yield also
        finally:
            for expected in ids:
                self.settle(expected)

    def settle(self, buffer_id: str) -> bool:
        """The put holds its region (or failed): whether a release came for it before
        (the put then drops the region itself). Forgotten here either way."""
        with self._lock:
            return self._released.pop(buffer_id, False)

    def missing_locked(self, buffer_id: str) -> None:
        """(the regions lock held) A release found no region for ``buffer_id``."""
        if buffer_id in self._released:
            self._released[buffer_id] = True

    def forsake(self) -> None:
        """Every put in flight is released (this host's rows are gone: a fence)."""
        with self._lock:
            for buffer_id in self._released:
                self._released[buffer_id] = True

    def __len__(self) -> int:
        with self._lock:
            return len(self._released)
