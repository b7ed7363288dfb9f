"""Entries: the worker socket's ``put``, ``commit``, ``abort`` and ``lookup``: committed entries are immutable.

An entry is a keyed, evictable buffer that its writer fills once; from its commit on
its bytes are immutable, enforced by the kernel, and every handle to it is read-only::

    put     the reserve of an evictable keyed buffer (Reserves.reserve, kind "entry"):
            quota, capacity, eviction and pool choice as for REST; the row ends
            ``staged``, the writer gets a writable dup of the staging region
    commit  under the buffer's lock —
              a fresh region of the pool, mapped by the daemon, sealed
              F_SEAL_FUTURE_WRITE|SHRINK|GROW|SEAL, fully populated (it takes over
              the staging region's accounting: the pool counts the entry once)
              the staged bytes copied into it (memfd: memmove, a hole faults in a
              zero page; hugetlb: pread, a hole reads as zeros and nothing faults)
              its memfd watched (maasd.core.holders), then an O_RDONLY fd of it
              opened once (every later handle is a dup of it)
              ledger: staged → live + committed_at (compare-and-set, one statement)
              the regions swapped, the key published; the staging region scrubbed
              (punched) after the answer: only its writer ever held it, and it is
              never read again (MemoryPool.retire) — even handed to the reclaimer
              only once the answer is out (maasd.core.answered), like the commit hook
    abort   a staged entry released (scrubbed); also when its writer's connection
            closes before the commit
    lookup  from memory: the index (maasd.core.regions) of this host's committed entries; a hit
            is a use (LRU) and extends the lease, batched like attach times

No worker ever held the fresh region writable, and after the seal no one can get a
writable mapping of it or ``write`` it, through any fd (a re-open of
``/proc/self/fd`` included): a writer that kept its staging mapping, forked, passed
its fd on or ``mprotect``\\ s a mapping changes only the staging region, which is
scrubbed and never read again. Only the daemon's own mapping, made before the seal,
still writes the entry: to scrub it.

A commit that cannot be honoured leaves nothing behind: the entry is released.
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from maasd.allocator import F_SEAL_FUTURE_WRITE, Region
from maasd.allocator.region import copy_region
from maasd.bounds import DEFAULT_TTL_S
from maasd.core.answered import after_answer
from maasd.core.auth import require_tenant
from maasd.core.handles import BufferHandle
from maasd.core.holders import Holders
from maasd.core.livepools import LivePool, LivePools
from maasd.core.regions import HeldRegion, Regions
from maasd.core.release import Releaser
from maasd.core.reserve import Reserves
from maasd.core.uses import UseBatch
from maasd.errors import (
    BackingError,
    MaasdError,
    NotFound,
    PoolExhausted,
    ResourceLimit,
    StateConflict,
)
from maasd.metrics import Metrics
from maasd.models import EntryAbortReason, Principal, ReserveSpec
from maasd.store import BufferRepo, BufferRow, must_last

__all__ = ["DEFAULT_ENTRY_TTL_S", "Entries", "EntryHandle"]

logger = logging.getLogger(__name__)

#: An entry's lease when its put names none (the REST reserve's default too).
DEFAULT_ENTRY_TTL_S = DEFAULT_TTL_S
#: errnos of a copy that found no memory for the fresh region (answered 507).
_NO_MEMORY = frozenset({errno.ENOMEM, errno.ENOSPC, errno.EFAULT, errno.EAGAIN})
#: errnos of the daemon at a limit of its own (open files).
_AT_LIMIT = frozenset({errno.EMFILE, errno.ENFILE})


class Settle(enum.Enum):
    """How a writer settles its staged entry (what its check and its answers say)."""

    COMMIT = "committed"
    ABORT = "aborted"


@dataclass(frozen=True)
class EntryHandle:
    """A lookup hit: ``fd`` is a new read-only descriptor the receiver closes."""

    fd: int
    buffer_id: str
    key: str
    size_bytes: int
    numa_node: int


class Entries:
    """The entry use-cases of one daemon."""

    def __init__(
        self,
        store: BufferRepo,
        regions: Regions,
        live: LivePools,
        holders: Holders,
        uses: UseBatch,
        reserves: Reserves,
        releaser: Releaser,
        metrics: Metrics,
    ) -> None:
        self._buffer_rows = store
        self._regions = regions
        self._live = live
        self._holders = holders
        self._uses = uses  # a hit is a use, written in a batch
        self._reserves = reserves
        self._releaser = releaser
        self._metrics = metrics
        self._on_commit: Callable[[str, str, str, int], None] | None = None

    def on_commit(self, hook: Callable[[str, str, str, int], None]) -> None:
        """Call ``hook(tenant_id, key, buffer_id, size)`` after each commit (the L2 tier's
        write-behind: it must not block, and what it raises is logged, never answered)."""
        self._on_commit = hook

    # -- put --------------------------------------------------------------------------------

    def put(
        self,
        who: Principal,
        key: str,
        size_bytes: int,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> BufferHandle:
        """Reserve a staged entry under ``key``; a writable handle of it for its writer.

        Raises what a REST reserve of an evictable keyed buffer raises (QuotaExceeded,
        DuplicateKey — also for a key another writer is filling —, PoolExhausted …).
        """
        tenant_id = require_tenant(who)
        spec = ReserveSpec(
            size_bytes=size_bytes,
            pool=pool,
            ttl_s=DEFAULT_ENTRY_TTL_S if ttl_s is None else ttl_s,
            key=key,
            evictable=True,
        )
        try:
            info = self._reserves.reserve(who, spec, kind="entry")
        except Exception as e:
            self._count(self._metrics.entry_puts, tenant_id, e)
            raise
        try:
            fd = self._writable_fd(info.id)
        except Exception as e:
            # Reserved, but its writer never gets it (no fd: EMFILE, or released
            # meanwhile): nobody knows its id to commit or abandon it, so it goes now —
            # a refused put leaves no row, no memfd and no usage behind.
            self._count(self._metrics.entry_puts, tenant_id, e)
            self.release_staged(tenant_id, info.id, "disconnect")
            raise
        self._metrics.entry_puts.labels(tenant=tenant_id, outcome="ok").inc()
        return BufferHandle(
            fd=fd, buffer_id=info.id, size_bytes=info.size_bytes, numa_node=info.numa_node
        )

    def _writable_fd(self, buffer_id: str) -> int:
        fd = self._regions.dup_fd(buffer_id)
        if fd is None:  # its tenant or pool was deleted meanwhile
            raise StateConflict(f"entry {buffer_id} was released before it was handed out")
        return fd

    # -- commit -----------------------------------------------------------------------------

    def commit(self, who: Principal, buffer_id: str, *, owned: bool) -> None:
        """Make a staged entry immutable and publish its key (see the module docstring).

        ``owned``: the caller's connection put this entry (the broker knows). Raises
        NotFound (unknown or foreign), StateConflict (released meanwhile, committed
        already, put by another connection), PoolExhausted / ResourceLimit (no memory
        or fds for the copy: the entry is released).
        """
        tenant_id = require_tenant(who)
        try:
            key, size = self._commit(tenant_id, buffer_id, owned)
        except Exception as e:
            self._count(self._metrics.entry_commits, tenant_id, e)
            raise
        self._metrics.entry_commits.labels(tenant=tenant_id, outcome="ok").inc()
        if key is not None:
            self.committed(tenant_id, key, buffer_id, size)

    def committed(self, tenant_id: str, key: str, buffer_id: str, size: int) -> None:
        """A writer's entry was committed (a commit, a publish): counted, and the commit
        hook run once the writer has its answer."""
        self._metrics.entry_committed_bytes.labels(tenant=tenant_id).inc(size)
        hook = self._on_commit
        if hook is not None:
            # The write-behind's queueing wakes its thread: after the writer's answer.
            after_answer(functools.partial(_run_hook, hook, tenant_id, key, buffer_id, size))

    def _commit(self, tenant_id: str, buffer_id: str, owned: bool) -> tuple[str | None, int]:
        """The commit; returns the entry's key and size."""
        self._check_own_staged(tenant_id, buffer_id, owned, Settle.COMMIT)
        failure: Exception
        with self._regions.buffer_lock(buffer_id):
            held = self._regions.held(buffer_id)
            live = None if held is None else self._live.get(held.pool_id)
            if held is None or held.live or live is None:
                raise StateConflict(f"entry {buffer_id} was released before its commit")
            try:
                fresh = _copy(held, live, buffer_id, self._holders)
            except (OSError, MaasdError) as e:
                failure = e
            else:
                durable = must_last(live.row.persistence)
                try:
                    committed = self._buffer_rows.commit(buffer_id, time.time(), durable=durable)
                except BaseException:  # the ledger cannot answer (507): the copy goes now
                    committed = None
                    raise
                finally:
                    if committed is None:
                        live.pool.release(fresh, give_back=False)
                        self._holders.forget(buffer_id)
                if committed is None:
                    raise StateConflict(f"entry {buffer_id} ended before its commit")
                staging = self._regions.commit(buffer_id, fresh)
                assert staging is not None  # held under its lock: a release waits for it
                # The copy took over its bytes; its scrub (the punch that frees it) comes
                # after the answer: saves ~0.5 ms of memset per 9 MiB commit. So does
                # handing it to the reclaimer, whose thread that wakes (no one can reach
                # the staging region any more: it is out of the index, and its writer's
                # answer does not depend on when its pages go).
                after_answer(functools.partial(live.pool.retire, staging))
                return held.key, fresh.size
        # The copy failed: nothing may stay behind (the row is still staged).
        self.release_staged(tenant_id, buffer_id, "commit_failed")
        answer = _storage_error(buffer_id, failure)
        if answer is failure:
            raise failure
        raise answer from failure

    # -- abort ------------------------------------------------------------------------------

    def abort(self, who: Principal, buffer_id: str, *, owned: bool) -> None:
        """Release a staged entry (scrubbed). One released meanwhile is fine: it is gone."""
        tenant_id = require_tenant(who)
        if self._check_own_staged(tenant_id, buffer_id, owned, Settle.ABORT) is not None:
            self.release_staged(tenant_id, buffer_id, "abort")

    def abandon(self, who: Principal, buffer_id: str) -> None:
        """The writer's connection closed: release the entry if it is still staged."""
        if who.tenant_id is not None:
            self.release_staged(who.tenant_id, buffer_id, "disconnect")

    def staged(self, buffer_id: str) -> bool:
        """Whether ``buffer_id`` is still an entry awaiting its commit here (from memory);
        False once it is committed or released (its lease ended, a DELETE)."""
        held = self._regions.held(buffer_id)
        return held is not None and not held.live

    def watch_releases(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(buffer_id)`` when an entry someone holds is released (broker)."""
        self._holders.listen(callback)

    def _check_own_staged(
        self, tenant_id: str, buffer_id: str, owned: bool, what: Settle
    ) -> HeldRegion | None:
        """The entry if it is staged and the caller's connection put it; ``None`` if the
        caller put it and it was released meanwhile (fine for an abort: it is gone).
        NotFound/StateConflict otherwise."""
        held = self._regions.held(buffer_id)
        if held is None or held.tenant_id != tenant_id:
            if owned:
                if what is Settle.ABORT:
                    return None
                raise StateConflict(f"entry {buffer_id} was released before its commit")
            raise NotFound(f"no entry {buffer_id!r}")
        if not owned:
            raise StateConflict(
                f"entry {buffer_id} can only be {what.value} by the connection that put it"
            )
        if held.live:
            raise StateConflict(f"entry {buffer_id} is committed already")
        return held

    def release_staged(self, tenant_id: str, buffer_id: str, reason: EntryAbortReason) -> None:
        """Release the entry if it is still staged (a compare-and-set in the ledger)."""
        held = self._regions.held(buffer_id)
        row: BufferRow | None = self._buffer_rows.mark_staged_releasing(
            buffer_id, tenant_id, durable=held is None or self.durable(held)
        )
        if row is None:
            return  # committed, or someone else releases it
        self._releaser.release_row(row, reason=reason, marked=True)
        self._metrics.entry_aborts.labels(tenant=tenant_id, reason=reason).inc()

    # -- lookup -----------------------------------------------------------------------------

    def lookup(
        self,
        who: Principal,
        keys: list[str],
        *,
        count_miss: bool = True,
        attached: Container[str] = (),
    ) -> EntryHandle | None:
        """The committed entry of the longest of ``keys`` (short → long), read-only; ``None``
        for a miss (a value, not an error: the edge that must answer 404 raises it).

        Answered from memory. A hit counts as an attachment of the caller — unless the
        entry is one of ``attached``, which the caller holds already — as a use and
        extends the entry's lease by its ``ttl_s``, both written in a batch later.
        ``count_miss=False``: a miss is not counted (the L2 tier is asked next, and the
        lookup's outcome is counted once that answered).
        """
        tenant_id = require_tenant(who)
        opened = self._regions.lookup(tenant_id, keys, attached)
        series = self._metrics.tenant(tenant_id)
        if opened is None:
            if count_miss:
                series.misses.inc()
            return None
        now = time.time()
        self._uses.touch(opened.buffer_id, now, now + opened.ttl_s)
        series.hits.inc()
        series.restored.inc(opened.size_bytes)
        if opened.tenant_attached is not None:
            series.attached.set(opened.tenant_attached)
        assert opened.key is not None
        return EntryHandle(
            opened.fd, opened.buffer_id, opened.key, opened.size_bytes, opened.numa_node
        )

    def durable(self, held: HeldRegion) -> bool:
        """Whether the entry's ledger writes wait for the disk: unless its pool is volatile."""
        live = self._live.get(held.pool_id)
        return live is None or must_last(live.row.persistence)

    @staticmethod
    def _count(counter: object, tenant_id: str, exc: BaseException) -> None:
        outcome = getattr(exc, "code", "error")
        counter.labels(tenant=tenant_id, outcome=outcome).inc()  # type: ignore[attr-defined]


def _run_hook(
    hook: Callable[[str, str, str, int], None], tenant_id: str, key: str, buffer_id: str, size: int
) -> None:
    """The commit hook; what it raises is logged, never answered."""
    try:
        hook(tenant_id, key, buffer_id, size)
    except Exception:
        logger.exception("the commit hook failed for entry %s", buffer_id)


def _copy(held: HeldRegion, live: LivePool, buffer_id: str, holders: Holders) -> Region:
    """The staged bytes in a fresh, frozen region of the pool, watched from now on
    (who holds its memfd: :mod:`maasd.core.holders`)."""
    staging = held.region
    fresh = live.pool.reserve(
        staging.size,
        name=f"maasd-e-{buffer_id[:8]}",
        extra_seals=F_SEAL_FUTURE_WRITE,
        accounted=False,
        prefault=True,  # every page present: the copy and a later scrub cannot fault
    )
    try:
        if live.row.prefault and not fresh.placed:  # a stocked region's was measured
            fresh.verify_node(sample=16)
        _read_all(staging, fresh)
        holders.watch(buffer_id, fresh.fd, fresh.size, held.tenant_id, held.pool_id)
    except BaseException:
        live.pool.release(fresh, give_back=False)
        raise
    return fresh


def _read_all(staging: Region, fresh: Region) -> None:
    """Copy every staged byte into the fresh region's (populated) mapping: a ``memmove``
    for memfd (saves ~1–5 ms of a 9 MiB commit against the ``pread`` it was), a ``pread``
    for hugetlb (:func:`~maasd.allocator.region.copy_region` says why)."""
    copied = copy_region(staging, fresh)
    if copied != staging.size:
        raise BackingError(f"copied {copied} of {staging.size} staged bytes", errno.EIO)


def _storage_error(buffer_id: str, exc: Exception) -> Exception:
    """What a failed copy answers: 507 when memory or fds ran out, else the error itself."""
    err = getattr(exc, "errno", None)
    detail = getattr(exc, "detail", None) or str(exc)
    if err in _NO_MEMORY:
        return PoolExhausted(f"no memory to commit entry {buffer_id} ({detail}); it was released")
    if err in _AT_LIMIT:
        return ResourceLimit(f"the daemon is out of file descriptors ({detail})")
    return exc
