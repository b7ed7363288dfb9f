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

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import msgspec

from maasd import allocator
from maasd.allocator import F_SEAL_FUTURE_WRITE, Region
from maasd.core.livepools import LivePool, LivePools
from maasd.core.regions import Regions
from maasd.core.release import remove_checkpoint
from maasd.core.spillfs import SpillFilesystems
from maasd.errors import BackingError, NotFound, StateConflict
from maasd.metrics import Metrics
from maasd.models import Checkpoint
from maasd.store import BufferRepo, BufferRow

__all__ = ["Checkpoints"]

logger = logging.getLogger(__name__)


class Checkpoints:
    """Writes a live persistent buffer to its spill dir; restores one at start."""

    def __init__(
        self,
        store: BufferRepo,
        regions: Regions,
        live: LivePools,
        metrics: Metrics,
        spill_fs: SpillFilesystems | None = None,
    ) -> None:
        self._buffer_rows = store
        self._spill_fs = spill_fs  # the filesystem each checkpoint went to, recorded
        self._regions = regions
        self._live = live
        self._metrics = metrics
        #: buffers with a checkpoint being written (a leaf lock: nothing taken under it)
        self._writing: set[str] = set()
        self._writing_lock = threading.Lock()

    def write(self, row: BufferRow) -> Checkpoint:
        """Write a new checkpoint file of the buffer, record it, then remove the previous one.

        Holds the buffer's lock throughout: a release waits for it to end. A checkpoint
        of a buffer whose checkpoint is being written is :class:`StateConflict` at once,
        rather than a wait for the buffer's lock: the one in progress saves the same bytes,
        and callers queued behind it would each hold a thread for nothing.
        """
        live = self._live.get(row.pool_id)
        if live is None or live.row.spill_dir is None:
            raise StateConflict(f"buffer {row.id} has no spill directory to checkpoint to")
        path = os.path.join(live.row.spill_dir, f"{row.id}.{time.time_ns():x}.ckpt")
        with self._alone(row.id), self._regions.buffer_lock(row.id):
            checksum = allocator.checkpoint(self._regions.live_region(row.id), path)
            previous = self._buffer_rows.buffer(row.id, None)
            try:
                self._buffer_rows.set_checkpoint(row.id, path, checksum, time.time())
            except NotFound:
                os.unlink(path)
                raise
            if previous is not None and previous.checkpoint_path not in (None, path):
                remove_checkpoint(previous)
        if self._spill_fs is not None:
            self._spill_fs.record([live.row.spill_dir])
        self._metrics.checkpoints.inc()
        self._metrics.checkpoint_bytes.inc(row.size_bytes)
        return Checkpoint(checksum=checksum, bytes=row.size_bytes)

    @contextlib.contextmanager
    def _alone(self, buffer_id: str) -> Iterator[None]:
        """The only checkpoint of ``buffer_id`` being written; StateConflict if another is."""
        with self._writing_lock:
            if buffer_id in self._writing:
                raise StateConflict(
                    f"a checkpoint of buffer {buffer_id} is in progress: retry once it has ended"
                )
            self._writing.add(buffer_id)
        try:
            yield
        finally:
            with self._writing_lock:
                self._writing.discard(buffer_id)

    def write_many(self, rows: list[BufferRow]) -> set[str]:
        """Checkpoint many buffers at once (shutdown), at a cost that does not grow with a
        round trip per buffer: every file written unsynced, one ``syncfs`` per spill
        dir, one ledger transaction, then the previous files removed. Returns the ids
        checkpointed; a buffer that fails keeps its previous checkpoint (logged).

        The order keeps :meth:`write`'s guarantee: the ledger names a new file only once
        it is durable; a crash before that leaves it an orphan, removed at the next start.
        """
        written: list[tuple[BufferRow, str, str]] = []
        spill_dirs: set[str] = set()
        for row in rows:
            live = self._live.get(row.pool_id)
            if live is None or live.row.spill_dir is None:
                continue
            path = os.path.join(live.row.spill_dir, f"{row.id}.{time.time_ns():x}.ckpt")
            try:
                with self._regions.buffer_lock(row.id):
                    region = self._regions.live_region(row.id)
                    checksum = allocator.checkpoint(region, path, sync=False)
            except Exception:
                logger.exception(
                    "checkpoint of buffer %s failed; it keeps its previous one", row.id
                )
                continue
            written.append((row, path, checksum))
            spill_dirs.add(live.row.spill_dir)
        for spill_dir in sorted(spill_dirs):
            allocator.sync_filesystem(spill_dir)
        if self._spill_fs is not None:
            self._spill_fs.record(spill_dirs)
        recorded = self._buffer_rows.set_checkpoints(
            [(row.id, path, checksum) for row, path, checksum in written], time.time()
        )
        for row, path, _checksum in written:
            if row.id not in recorded:  # released meanwhile
                remove_checkpoint(msgspec.structs.replace(row, checkpoint_path=path))
            elif row.checkpoint_path not in (None, path):
                remove_checkpoint(row)
            self._metrics.checkpoints.inc()
            self._metrics.checkpoint_bytes.inc(row.size_bytes)
        return recorded

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
