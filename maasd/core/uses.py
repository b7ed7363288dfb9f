r"""The batch of uses (the LRU order eviction follows) and lease extensions not yet in
the ledger, and the writing of them.

An attach and a lookup hit are on a worker's hot path, where a ledger commit would
cost more than the rest of it: :mod:`maasd.core.handles` and :mod:`maasd.core.entries`
remember them here, and the batch is written at once by :meth:`UseBatch.flush` (the
reaper's pass, close, the ledger coming back) or by a reserve's admitting transaction
(:mod:`maasd.core.room`, which :meth:`take`\ s it). The reaper asks it for a lease not
yet written. Its lock is a leaf of the lock order (:mod:`maasd.core.regions`).

A lease extension is kept with the time of the hit that made it (an
:class:`~maasd.store.Extension`): taken, it may be written after a renew that came
after the hit — and the ledger writes it only over a lease no renew set since that hit,
so a renew to a shorter lease holds (:meth:`maasd.store.BufferRepo.touch_many`).
"""

from __future__ import annotations

import threading

from maasd.store import BufferRepo, Extension

__all__ = ["UseBatch"]


class UseBatch:
    """Uses and lease extensions remembered in memory until :meth:`take` hands them on."""

    def __init__(self, store: BufferRepo) -> None:
        self._buffer_rows = store
        self._lock = threading.Lock()
        self._uses: dict[str, float] = {}
        self._leases: dict[str, Extension] = {}

    def touch(self, buffer_id: str, when: float, expires_at: float | None = None) -> None:
        """Remember a use of the buffer at ``when`` (and a lookup hit's lease extension to
        ``expires_at``); written to the ledger by :meth:`take`'s caller."""
        with self._lock:
            self._uses[buffer_id] = when
            if expires_at is not None:
                _keep_latest(self._leases, buffer_id, Extension(expires_at, when))

    def pending_uses(self) -> dict[str, float]:
        """The uses remembered and not yet taken (a copy)."""
        with self._lock:
            return dict(self._uses)

    def pending_lease(self, buffer_id: str) -> float | None:
        """A lease extension remembered for the buffer and not yet taken, if any."""
        with self._lock:
            pending = self._leases.get(buffer_id)
            return None if pending is None else pending.expires_at

    def forget_lease(self, buffer_id: str) -> None:
        """Drop the lease extension remembered for the buffer: a renew has just written its
        lease (one taken already is refused by the ledger: its hit was before the renew)."""
        with self._lock:
            self._leases.pop(buffer_id, None)

    def take(self) -> tuple[dict[str, float], dict[str, Extension]]:
        """The uses and lease extensions remembered so far, forgotten here (the caller
        writes them)."""
        with self._lock:
            uses, self._uses = self._uses, {}
            leases, self._leases = self._leases, {}
            return uses, leases

    def untake(self, uses: dict[str, float], leases: dict[str, Extension]) -> None:
        """Remember again uses and lease extensions taken but not written (a newer use of
        a buffer, and a later hit's extension, win)."""
        with self._lock:
            for buffer_id, when in uses.items():
                if self._uses.get(buffer_id, 0.0) < when:
                    self._uses[buffer_id] = when
            for buffer_id, extension in leases.items():
                _keep_latest(self._leases, buffer_id, extension)

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


def _keep_latest(leases: dict[str, Extension], buffer_id: str, extension: Extension) -> None:
    """Keep the buffer's extension of the latest hit (of two as late, the later lease end).

    Every hit extends the lease by its length from the hit on, so a later hit's end is the
    later one — unless a renew to a shorter lease came between the two, and then the
    earlier hit's longer end is one the ledger refuses (its hit was before the renew): the
    later hit's must not be dropped for it."""
    kept = leases.get(buffer_id)
    if kept is None or (kept.hit_at, kept.expires_at) < (extension.hit_at, extension.expires_at):
        leases[buffer_id] = extension
