"""Releasing a buffer: ledger ``releasing``, memory scrubbed and freed, row deleted.

Every path that ends a buffer goes through :class:`Releaser` — a tenant's
DELETE, lease expiry, eviction, a tenant's or a pool's deletion, shutdown — so
that each one records its intent first and scrubs before it says done
(every byte reads zero, also through a stale mapping, before it answers)::

    ledger: row ``releasing`` (its key given up)
    memory: region taken out (after any checkpoint or pin of it), scrubbed, closed
    ledger: row deleted, event recorded

A committed entry's pages cannot be punched (it is sealed): when a worker still holds
its memfd open after the scrub (a kept fd, a mapping, a child's or a re-opened one),
the row stays ``releasing`` — counted in its tenant's quota and its pool's use — and
its bytes stay taken in the pool, until the kernel reports the last holder gone
(:mod:`maasd.core.holders`); then the row is deleted with its event. A tenant's or
pool's delete leaves such rows alone too: finishing them at once made the ledger forget
memory still resident, so the pool admitted (and a live tenant of a drained pool got)
that memory again. The delete raises :class:`HeldOpen` instead; the tenant or pool
stays ``deleting`` (no new reserve lands in it) and its delete ends once they are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from maasd.core.attachments import Attachments
from maasd.core.holders import Holders
from maasd.core.livepools import LivePools
from maasd.core.regions import Regions
from maasd.errors import NotFound, StateConflict
from maasd.metrics import Metrics
from maasd.models import ReleaseReason
from maasd.store import BufferRepo, BufferRow, ReserveRepo, must_last

logger = logging.getLogger(__name__)

__all__ = ["DELETE_PASSES", "HeldOpen", "Releaser", "remove_checkpoint"]

#: What ends a released buffer's row (deletes it, records its event).
Finish = Callable[[], object]

#: Passes over a deleting tenant's (draining pool's) buffers before its delete gives up
#: for now. Each pass releases every buffer it finds, and the ledger admits no new one
#: once the delete began, so a second pass is needed only when a release raced it.
DELETE_PASSES = 50
#: How long a delete gives the workers holding its released entries to let go.
HELD_GRACE_S = 0.5


class HeldOpen(StateConflict):
    """A delete could not finish: all that is left of its buffers is released entries
    that workers still hold open (counted until they let go)."""


def _held_open(what: str, held: list[BufferRow]) -> str:
    return (
        f"{what}: {len(held)} released entries ({sum(r.size_bytes for r in held)} bytes) "
        "are still held open by workers (maasctl buffers list --held names them); they "
        "count until every fd and mapping of them is closed, and the delete ends then "
        "(DELETE again, or the daemon finishes it)"
    )


def remove_checkpoint(row: BufferRow) -> None:
    """Remove the checkpoint file ``row`` names, if any (gone already is fine).

    A file that cannot be removed (a spill filesystem gone read-only, a directory put in
    its place) is logged and left: the buffer's release, or the daemon's start, goes on.
    """
    if row.checkpoint_path:
        try:
            os.unlink(row.checkpoint_path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning(
                "checkpoint file %s of buffer %s not removed: %s",
                row.checkpoint_path,
                row.id,
                e.strerror or e,
            )


class Releaser:
    """Ends buffers: their ledger rows, their memory, their checkpoint files."""

    def __init__(
        self,
        store: BufferRepo,
        reserves: ReserveRepo,
        regions: Regions,
        attachments: Attachments,
        live: LivePools,
        holders: Holders,
        metrics: Metrics,
        *,
        on_entry_end: Callable[[BufferRow, ReleaseReason], None] | None = None,
    ) -> None:
        self._buffer_rows = store
        self._reserve_rows = reserves  # a row deleted once its memory is scrubbed
        self._regions = regions
        self._attachments = attachments
        self._live = live
        self._holders = holders
        self._metrics = metrics
        #: Called with every entry's row and reason before its region is dropped (the
        #: disk tier: an eviction may be demoted, any other end erases its copy on disk).
        #: It must not raise, and reads the region under the buffer's lock if at all.
        self._on_entry_end = on_entry_end
        #: Ends of held entries' rows that the ledger refused when their last holder let
        #: go (an outage): tried again at each reaper pass (:meth:`finish_unfinished`).
        self._unfinished: list[Finish] = []
        self._unfinished_lock = threading.Lock()

    def release_row(self, row: BufferRow, *, reason: ReleaseReason, marked: bool = False) -> None:
        """Mark releasing (unless ``marked`` already), scrub and free, delete the row.

        ``reason`` is the event's kind (``release``, ``expire``, ``tenant_delete`` …).
        """
        durable = must_last(row.persistence)  # a volatile buffer's: no wait for the disk
        if not marked:
            row = self._buffer_rows.mark_releasing(row.id, None, durable=durable)
        buffer_id = row.id
        self.release_memory(
            row,
            reason=reason,
            finish=lambda: self._reserve_rows.finish_release(
                buffer_id, kind=reason, durable=durable
            ),
        )

    def release_live(self, buffer_id: str, tenant_id: str | None) -> bool:
        """Release a live volatile buffer held here (not an entry) in one ledger transaction:
        its row deleted and its memory scrubbed before the commit, its event with them
        (:meth:`ReserveRepo.release_live`). False when the ledger has no such live buffer
        (``tenant_id``'s, or any for the admin): nothing changed, and the caller takes the
        ordinary path, whose compare-and-set says what it is.

        One write transaction where :meth:`release_row` takes two (~0.2 ms of CPU and a
        turn of the writer lock less). The two are there to order a release against
        every other: a ``releasing`` row, committed before the scrub, tells a concurrent
        DELETE, the reaper or a tenant delete that it is taken. Here the transaction holds
        the row's lock (SQLite's write lock) across the scrub instead, so they wait for
        the commit and find no row; a crash before it leaves a volatile ``live`` row,
        which recovery releases. Only for a small buffer (the caller's check): its
        scrub, a memset of its present pages at most, is short enough to hold the
        writer lock for.
        """
        row = self._reserve_rows.release_live(
            buffer_id,
            tenant_id,
            lambda row: self.release_memory(row, reason="release"),
            durable=False,
        )
        return row is not None

    def release_all(
        self,
        rows: Callable[[], Iterable[BufferRow]],
        delete: Callable[[], None],
        *,
        reason: ReleaseReason,
        what: str,
        grace: float = HELD_GRACE_S,
    ) -> None:
        """Release every buffer ``rows()`` lists, then ``delete()`` their owner (a tenant or
        a pool being deleted); again while ``delete`` finds buffers left
        (:class:`StateConflict`). An owner already gone (:class:`NotFound`) is done.

        Each release is idempotent: a buffer another path is releasing is finished
        here too, and one gone meanwhile is skipped — but not a released entry that
        workers still hold open: its row stays, counted, until they let go. When only
        such rows are left, they are given ``grace`` seconds (the workers were told to
        let go), then :class:`HeldOpen`.
        """
        waited = False
        for _ in range(DELETE_PASSES):
            held = []
            for row in rows():
                if self._holders.released_held(row.id):
                    held.append(row)  # its row ends when the last holder lets go
                    continue
                with contextlib.suppress(NotFound):  # its own release finished meanwhile
                    self.release_row(row, reason=reason)
            try:
                delete()
            except NotFound:
                return
            except StateConflict:
                if held and all(self._holders.released_held(r.id) for r in rows()):
                    if waited or grace <= 0:
                        raise HeldOpen(_held_open(what, held)) from None
                    self._holders.wait_freed([r.id for r in held], grace)
                    waited = True
                    continue
                time.sleep(0.01)
                continue
            return
        raise StateConflict(
            f"{what} still holds buffers after {DELETE_PASSES} passes; "
            "its delete continues at the next DELETE or daemon start"
        )

    def release_memory(
        self, row: BufferRow, *, reason: ReleaseReason, finish: Finish | None = None
    ) -> None:
        """Scrub and free a buffer's memory and remove its checkpoint files, then
        ``finish()`` (the row's end) — later, if others still hold the memory of this
        committed entry (see :meth:`drop_region`)."""
        started = time.perf_counter()
        if self._on_entry_end is not None and row.kind == "entry":
            self._on_entry_end(row, reason)  # before the region goes: a demotion reads it
        held = self.drop_region(row, finish)
        if row.persistence == "persistent":
            # A checkpoint that finished while drop_region waited for it may have
            # recorded a newer file than the one ``row`` names: remove both.
            latest = self._buffer_rows.buffer(row.id, None)
            if latest is not None and latest.checkpoint_path != row.checkpoint_path:
                remove_checkpoint(latest)
            remove_checkpoint(row)
        self._attachments.note_released(row.id, row.tenant_id, row.kind, row.size_bytes)
        if held:  # the connections that hold it are told to let go (maasd.core.holders)
            self._holders.announce(row.id)
        self._metrics.release_total.labels(reason=reason).inc()
        self._metrics.release_seconds.observe(time.perf_counter() - started)
        if not held and finish is not None:
            finish()

    def drop_region(self, row: BufferRow, finish: Finish | None = None) -> bool:
        """Take the buffer's region out of this process, scrub it and give its bytes back.

        Waits for a checkpoint or pin of the buffer in progress. Every byte of the
        region reads zero when this returns. Nothing to do if this process holds
        no region for it. Returns True if the region is a committed entry that others
        still hold open (its pages cannot be punched): its bytes stay taken in the pool
        and ``finish`` is not called here, both are done when the last holder lets go
        (:mod:`maasd.core.holders`).
        """
        region = self._regions.take_region(row.id)
        if region is None:
            return False
        live = self._live.get(row.pool_id)
        mode = live.row.scrub if live is not None else "zero"
        started = time.perf_counter()
        if live is not None:
            live.pool.release(region, give_back=False)
        else:  # its pool is gone (deleted meanwhile): scrub it here
            region.scrub(mode)
            region.close()
        self._metrics.scrub_bytes.labels(mode=mode).inc(region.size)
        self._metrics.scrub_seconds.labels(mode=mode).inc(time.perf_counter() - started)
        give_back = live.pool.give_back if live is not None else _ignore
        size = region.size

        def freed() -> None:  # on the holders' reader thread
            give_back(size)
            if finish is not None:
                self._finish_or_later(finish)

        if self._holders.settle(row.id, freed):
            give_back(size)
            return False
        return True

    def _finish_or_later(self, finish: Finish) -> None:
        """End a held entry's row now that its memory is free; if the ledger refuses (an
        outage), at a later reaper pass — else it would stay counted until a restart."""
        try:
            with contextlib.suppress(NotFound):  # finished meanwhile (a tenant delete)
                finish()
        except Exception as e:
            logger.warning("a freed entry's row is ended at the next reaper pass: %s", e)
            with self._unfinished_lock:
                self._unfinished.append(finish)

    def finish_unfinished(self) -> int:
        """Try again the row ends the ledger refused (:meth:`_finish_or_later`); how many
        are still waiting. Raises what the ledger raises (the rest wait for the next)."""
        with self._unfinished_lock:
            todo, self._unfinished = self._unfinished, []
        try:
            while todo:
                with contextlib.suppress(NotFound):
                    todo[0]()
                todo.pop(0)
        finally:
            with self._unfinished_lock:
                self._unfinished[:0] = todo
                left = len(self._unfinished)
        return left

    def evict(self, victim: BufferRow) -> None:
        """Finish an eviction a reserve chose (its row is ``releasing`` already).

        The reserve recorded the ``evict`` event, naming itself as the cause, in
        its own transaction: deleting the row records nothing more. A committed entry
        someone still holds keeps its row (``releasing``, counted) until they let go:
        whether it did make room is :meth:`Holders.wait_freed`'s answer.
        """
        victim_id = victim.id
        durable = must_last(victim.persistence)
        self.release_memory(
            victim,
            reason="evict",
            finish=lambda: self._reserve_rows.finish_release(
                victim_id, kind="evict", record=False, durable=durable
            ),
        )
        self._metrics.evictions.inc()
        if victim.kind == "entry":
            self._metrics.entry_evictions.labels(tenant=victim.tenant_id).inc()


def _ignore(_size: int) -> None:
    """Nothing to give back: the buffer's pool is gone."""
