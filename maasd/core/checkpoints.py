"""Persistent buffers across restarts: writing checkpoints and restoring from them.

A persistent buffer is a memfd like any other; its bytes outlive the process
in a checkpoint file in its pool's spill directory, whose SHA-256 the ledger
records. Each checkpoint gets a file of its own; the previous one is removed
only after the ledger records the new one. Renaming over the previous file
before that record would leave, after a crash between the two, a file that no
longer matches the ledger's checksum — and the buffer would be lost instead of
coming back from its last checkpoint.
"""

from __future__ import annotations

import logging
import os
import time

from maasd import allocator
from maasd.allocator import Region
from maasd.allocator._sys import F_SEAL_FUTURE_WRITE
from maasd.core.release import remove_checkpoint
from maasd.core.runtime import LivePool, Runtime
from maasd.errors import BackingError, NotFound, StateConflict
from maasd.metrics import Metrics
from maasd.models import Checkpoint
from maasd.store import BufferRow, Store

__all__ = ["Checkpoints"]

logger = logging.getLogger(__name__)


class Checkpoints:
    """Writes a live persistent buffer to its spill dir; restores one at start."""

    def __init__(self, store: Store, runtime: Runtime, metrics: Metrics) -> None:
        self._store = store
        self._runtime = runtime
        self._metrics = metrics

    def write(self, row: BufferRow) -> Checkpoint:
        """Write a new checkpoint file of the buffer, record it, then remove the previous one.

        Holds the buffer's lock throughout: a release waits for it to end.
        """
        live = self._runtime.pool(row.pool_id)
        if live is None or live.row.spill_dir is None:
            raise StateConflict(f"buffer {row.id} has no spill directory to checkpoint to")
        path = os.path.join(live.row.spill_dir, f"{row.id}.{time.time_ns():x}.ckpt")
        with self._runtime.buffer_lock(row.id):
            checksum = allocator.checkpoint(self._runtime.live_region(row.id), path)
            previous = self._store.buffer(row.id, None)
            try:
                self._store.set_checkpoint(row.id, path, checksum, time.time())
            except NotFound:
                os.unlink(path)
                raise
            if previous is not None and previous.checkpoint_path not in (None, path):
                remove_checkpoint(previous)
        self._metrics.checkpoints.inc()
        self._metrics.checkpoint_bytes.inc(row.size_bytes)
        return Checkpoint(checksum=checksum, bytes=row.size_bytes)

    @staticmethod
    def restore(row: BufferRow, live: LivePool) -> Region | None:
        """A fresh region holding the buffer's last checkpoint (checksum verified), or
        ``None`` (logged) when there is none or it is unusable.

        A committed entry comes back committed: sealed ``F_SEAL_FUTURE_WRITE`` after the
        daemon mapped it, so it is immutable again before anyone can see it.
        """
        if not row.checkpoint_path or not row.checksum:
            logger.warning("persistent buffer %s was never checkpointed; releasing it", row.id)
            return None
        try:
            return allocator.restore(
                row.checkpoint_path,
                node=row.numa_node,
                backing=live.row.backing,
                page_bytes=live.row.page_bytes,
                size=row.size_bytes,
                expected_checksum=row.checksum,
                extra_seals=F_SEAL_FUTURE_WRITE if row.committed_at is not None else 0,
            )
        except BackingError as e:
            # An expected outcome (missing or corrupt file): the detail says it all.
            logger.error("persistent buffer %s cannot be restored: %s", row.id, e.detail)  # noqa: TRY400
            return None
