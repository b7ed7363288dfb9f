r"""The batch of uses (the LRU order eviction follows) and lease extensions not yet in
the ledger, and the writing of them.

An attach and a lookup hit are on a worker's hot path, where a ledger commit would
cost more than the rest of it: :mod:`maasd.core.handles` and :mod:`maasd.core.entries`
remember them here, and the batch is written at once by :meth:`UseBatch.flush` (the
reaper's pass, close, the ledger coming back) or by a reserve's admitting transaction
(:mod:`maasd.core.room`, which :meth:`take`\ s it). The reaper asks it for a lease not
yet written. Its lock is a leaf of the lock order (:mod:`maasd.core.regions`).
"""

from __future__ import annotations

import threading

from maasd.store import BufferRepo

__all__ = ["UseBatch"]


class UseBatch:
    """Uses and lease extensions remembered in memory until :meth:`take` hands them on."""

    def __init__(self, store: BufferRepo) -> None:
        self._buffer_rows = store
        self._lock = threading.Lock()
        self._uses: dict[str, float] = {}
        self._leases: dict[str, float] = {}

    def touch(self, buffer_id: str, when: float, expires_at: float | None = None) -> None:
        """Remember a use of the buffer (and a lease extension to ``expires_at``); written
        to the ledger by :meth:`take`'s caller."""
        with self._lock:
            self._uses[buffer_id] = when
            if expires_at is not None and expires_at > self._leases.get(buffer_id, 0.0):
                self._leases[buffer_id] = expires_at

    def pending_uses(self) -> dict[str, float]:
        """The uses remembered and not yet taken (a copy)."""
        with self._lock:
            return dict(self._uses)

    def pending_lease(self, buffer_id: str) -> float | None:
        """A lease extension remembered for the buffer and not yet taken, if any."""
        with self._lock:
            return self._leases.get(buffer_id)

    def forget_lease(self, buffer_id: str) -> None:
        """Drop the lease extension remembered for the buffer: a renew has just written its
        lease, and the older extension, written later, would undo a shorter one."""
        with self._lock:
            self._leases.pop(buffer_id, None)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """The uses and lease extensions remembered so far, forgotten here (the caller
        writes them)."""
        with self._lock:
            uses, self._uses = self._uses, {}
            leases, self._leases = self._leases, {}
            return uses, leases

    def untake(self, uses: dict[str, float], leases: dict[str, float]) -> None:
        """Remember again uses and lease extensions taken but not written (a newer use of
        a buffer, and a later lease end, win)."""
        with self._lock:
            for buffer_id, when in uses.items():
                if self._uses.get(buffer_id, 0.0) < when:
                    self._uses[buffer_id] = when
            for buffer_id, until in leases.items():
                if self._leases.get(buffer_id, 0.0) < until:
                    self._leases[buffer_id] = until

    def flush(self) -> None:
        """Write the attach and lookup-hit times gathered since the last flush (the LRU
        order), and the leases those hits extended, to the ledger: batched, since a commit
        on a worker's hot path cost more than the rest of it. Unwritten (the ledger is
        down), they are kept, and written when it is back."""
        uses, leases = self.take()
        if uses or leases:
            try:
                self._buffer_rows.touch_many(uses, leases)
            except BaseException:
                self.untake(uses, leases)
                raise
