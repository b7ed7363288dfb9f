"""Recovery: settle the ledger with what exists after a (possibly unclean) stop.

Every change that touches memory records its intent in the ledger first
(:mod:`maasd.core.reserve`, :mod:`maasd.core.release`), so a crash at any point
leaves rows that :meth:`Recovery.recover` can settle: ``reserving``, ``staged`` and
``releasing`` rows and volatile ``live`` rows of a previous run are released (their
memory died with the process); persistent ``live`` rows are reloaded from their last
checkpoint, and held here again (:mod:`maasd.core.regions`). Run at start, and again
when a fenced host joins again (:mod:`maasd.core.reaper`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter

from maasd.allocator import Region
from maasd.core.checkpoints import Checkpoints
from maasd.core.holders import Holders
from maasd.core.limits import RegionBudget, open_files_needed
from maasd.core.livepools import LivePools
from maasd.core.regions import HeldRegion, Regions
from maasd.core.release import remove_checkpoint
from maasd.core.spillfs import SpillFilesystems
from maasd.errors import ConfigError, ResourceLimit
from maasd.store import BufferRepo, BufferRow, ReserveRepo, must_last

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)


class Recovery:
    """Settles this host's ledger rows with the regions this process holds."""

    def __init__(
        self,
        host: str,
        store: BufferRepo,
        reserves: ReserveRepo,
        regions: Regions,
        live: LivePools,
        holders: Holders,
        checkpoints: Checkpoints,
        budget: RegionBudget | None = None,
        spill_fs: SpillFilesystems | None = None,
    ) -> None:
        self._host = host
        self._buffer_rows = store
        self._reserve_rows = reserves  # a row deleted once its memory is scrubbed
        self._regions = regions
        self._live = live
        self._holders = holders
        self._checkpoints = checkpoints
        self._budget = budget
        self._spill_fs = spill_fs

    def recover(self, *, start: bool = False, release_lost: bool = False) -> dict[str, int]:
        """Settle the ledger with what exists after a (possibly unclean) stop.

        ``reserving``/``staged``/``releasing`` rows and volatile ``live`` rows lost
        their memory with the old process: released. Persistent ``live`` rows are
        reloaded from their checkpoint (checksum verified); without a usable
        checkpoint they are released too. Checkpoint files no row refers to are
        removed. Meant for :meth:`start`, before serving; buffers this process
        already holds are left alone.

        At ``start``, a spill directory whose filesystem is not the one its checkpoints
        were written to, and that holds none of them, stops the start instead, releasing
        nothing (:mod:`maasd.core.spillfs`), unless ``release_lost``.
        """
        counts: Counter[str] = Counter()
        keep: set[str] = set()
        rows = self._buffer_rows.buffers_on_host(self._host)
        todo = self._to_restore(rows)
        if start and self._spill_fs is not None:
            named: dict[str, list[str]] = {}
            for r in todo:
                if r.checkpoint_path:
                    named.setdefault(os.path.dirname(r.checkpoint_path), []).append(
                        r.checkpoint_path
                    )
            self._spill_fs.check(named, release_lost=release_lost)
        self._check_room(todo)
        for row in rows:
            outcome = self._recover_row(row)
            if outcome != "released":
                keep.add(os.path.realpath(row.checkpoint_path or ""))
            if outcome != "ours":
                counts[outcome] += 1
        counts["orphans"] += self._remove_orphans(keep)
        if start and self._spill_fs is not None:
            self._spill_fs.record(
                live.row.spill_dir for live in self._live.all() if live.row.spill_dir
            )
        found = {k: v for k, v in counts.items() if v}
        if found:
            logger.info("recovered ledger: %s", found)
        return found

    def _to_restore(self, rows: list[BufferRow]) -> list[BufferRow]:
        """The persistent buffers of ``rows`` this process is to restore."""
        return [
            r
            for r in rows
            if r.state == "live"
            and r.persistence == "persistent"
            and self._live.get(r.pool_id) is not None
            and self._regions.region(r.id) is None
        ]

    def _check_room(self, todo: list[BufferRow]) -> None:
        """Every persistent buffer to restore fits the region budget — and those that keep
        an fd (all but committed entries that park) its files budget —, or a ConfigError
        naming the limit that would hold them (nothing is released: start again with it)."""
        if self._budget is None:
            return
        budget = self._budget
        room = budget.budget - budget.held()
        if len(todo) > room:
            need = open_files_needed(budget.limits, budget.held() + len(todo))
            raise ConfigError(
                f"the ledger holds {len(todo)} persistent buffers and entries to restore, and "
                f"the region budget has room for {room} (from {budget.limits.binding}): raise "
                + (f"LimitNOFILE to at least {need}" if need else "vm.max_map_count")
                + "; nothing was released"
            )
        # A restored region holds an fd until it parks; a buffer's, for good. Restoring
        # more than the files budget holds would run into EMFILE halfway through.
        fds = sum(1 for r in todo if not self._parks(r))
        file_room = budget.file_budget - budget.held_fds()
        if fds > file_room:
            need = open_files_needed(budget.limits, budget.held_fds() + fds)
            raise ConfigError(
                f"the ledger holds {fds} persistent buffers to restore that keep an open "
                f"file, and the region budget has room for {file_room} of those (from "
                f"RLIMIT_NOFILE {budget.limits.open_files}): raise LimitNOFILE to at least "
                f"{need}; nothing was released"
            )

    def _parks(self, row: BufferRow) -> bool:
        """Whether the row's region, once restored, lets its fd go (a committed ``memfd``
        entry, where the daemon parks them: :meth:`Region.park`)."""
        live = self._live.get(row.pool_id)
        return (
            self._budget is not None
            and self._budget.limits.parks_entries
            and row.committed_at is not None
            and live is not None
            and live.row.backing == "memfd"
        )

    def _recover_row(self, row: BufferRow) -> str:
        """Settle one row: ``"ours"`` (already held), ``"restored"`` or ``"released"``."""
        live = self._live.get(row.pool_id)
        if row.state == "live" and self._regions.region(row.id) is not None:
            return "ours"  # a second pass
        if row.state == "live" and row.persistence == "persistent" and live is not None:
            region = self._checkpoints.restore(row, live)
            if region is not None:
                live.pool.adopt(region.size)
                try:
                    held = self._held(row, region)
                except ResourceLimit as e:  # no inotify watch left for a committed entry
                    logger.warning("buffer %s not restored: %s", row.id, e.detail)
                    live.pool.release(region)
                else:
                    self._regions.hold(row.id, held)
                    return "restored"
        # A volatile row's release need not wait for the disk: rolled back by a power
        # loss, the row is released again at the next start.
        self._reserve_rows.finish_release(
            row.id, kind="recover", durable=must_last(row.persistence)
        )
        remove_checkpoint(row)
        return "released"

    def _held(self, row: BufferRow, region: Region) -> HeldRegion:
        """A restored buffer as the runtime holds it; a committed entry watched (who holds
        its memfd: maasd.core.holders) and published under its key."""
        committed = row.committed_at is not None
        if committed:
            self._holders.watch(row.id, region.fd, region.size, row.tenant_id, row.pool_id)
        return HeldRegion(
            region,
            row.tenant_id,
            row.pool_id,
            row.key,
            live=True,
            committed=committed,
            ttl_s=row.lease_s,  # as its tenant last gave it, not to its (extended) end
            expires_at=row.expires_at,
        )

    def _remove_orphans(self, keep: set[str]) -> int:
        """Remove checkpoint files (and half-written ones) of spill dirs that no row names."""
        removed = 0
        for live in self._live.all():
            spill = live.row.spill_dir
            if not spill or not os.path.isdir(spill):
                continue
            try:
                entries = list(os.scandir(spill))
            except OSError as e:  # unreadable (permissions): serve all the same
                logger.warning("spill directory %s not scanned for orphans: %s", spill, e)
                continue
            for entry in entries:
                if (
                    entry.name.endswith((".ckpt", ".ckpt.tmp"))
                    and not entry.is_dir(follow_symlinks=False)
                    and os.path.realpath(entry.path) not in keep
                ):
                    try:
                        os.unlink(entry.path)
                    except OSError as e:  # a read-only spill dir: serve all the same
                        logger.warning("orphan %s not removed: %s", entry.path, e.strerror)
                        continue
                    removed += 1
        return removed
