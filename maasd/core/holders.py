"""Who still holds a committed entry's memory, as the kernel tells it (inotify).

A committed entry is sealed ``F_SEAL_FUTURE_WRITE``, so its pages cannot be punched:
a release zeroes them through the daemon's mapping, but they stay resident — charged
to the daemon's memory cgroup — as long as any process keeps an open file description
of the memfd (an fd, or a mapping, which keeps its description referenced). A worker
holds one by keeping a looked-up fd (a dup of the daemon's read-only description),
passing it to a child or another process, or re-opening it through
``/proc/<pid>/fd/N`` (a new description).

So each committed entry's memfd inode is watched with inotify (from its commit, before
the daemon opens its read-only description). The kernel drops the watch — and queues
``IN_IGNORED`` for it — when the inode is freed, that is when the last description of
it is gone, whoever held it: the one fact that settles the question. At the release
the daemon closes everything *it* holds of the entry (the read-only fd, the memfd and
its mapping: a frozen region is closed in the release, not on the reclaimer thread),
so the inode goes at once unless someone else holds it::

    commit     watch(buffer_id, memfd)          (507 resource-limit if refused)
    release    the daemon's fds and mapping closed, then settle(buffer_id, on_free):
                 IN_IGNORED queued → True: the caller finishes the release now
                 else              → False: the row stays ``releasing`` (counted in
                                     its tenant's quota and its pool), and
                                     ``on_free()`` runs on the reader thread when
                                     the kernel reports the inode gone

A released entry that stays held is announced (:meth:`Holders.announce`: the broker
pushes ``released`` to the connections holding it, whose clients let go), and a
reserve that evicted it waits briefly for it (:meth:`Holders.wait_freed`,
:mod:`maasd.core.room`). What is held is reported per tenant and pool (``held_bytes``)
and, for an operator, with the pids that hold it (:func:`holder_pids`, a /proc scan).

A close that ends a description queues its event before the call returns, so a
release sees the result of its own closes. Counting opens against closes
(``IN_OPEN``/``IN_CLOSE_*``) would not do: the kernel merges an event into an identical
one still unread, so two opens (or closes) in a row can be reported once.

One inotify instance and one reader thread per daemon, both made at the first watch;
the watch mask asks for no event a worker could flood (``IN_DELETE_SELF``, which an
unlinked memfd reports only as it goes), so the queue holds one event or two per entry
freed. If it overflows anyway (``IN_Q_OVERFLOW``, ``fs.inotify.max_queued_events``
inode ends between two reads), the reader thread looks for the released entries' ends
that were lost: a scan of ``/proc`` (:func:`holder_pids`, outside the lock) finds
which of their inodes a process still holds — alive, so their watches stand, and their
ends will be reported as any other. For the others, the watch is removed: refused
(``EINVAL``) means the kernel removed it — the inode is gone, the entry is freed;
accepted means a holder the scan could not see (an fd in flight in a socket) still had
it, and it is no longer watched: it stays ``releasing``, counted, until the daemon
restarts (the safe side). Watches of entries not yet released cannot have lost anything
(the daemon still holds them).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from maasd.allocator import Region
from maasd.errors import ResourceLimit

__all__ = ["Counts", "HeldAfterRelease", "Holders", "holder_pids"]

logger = logging.getLogger(__name__)

IN_DELETE_SELF = 0x0400
IN_MOVE_SELF = 0x0800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
#: Events a memfd never reports but as it goes: the kernel's IN_IGNORED, always sent
#: when the inode is freed, is what counts.
_WATCH_MASK = IN_DELETE_SELF | IN_MOVE_SELF
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (the name that follows)
_READ_BYTES = 64 * 1024
#: What the reader's wake pipe says: stop, or recount after an overflow another thread read.
_STOP, _RECOUNT = b"x", b"r"

OnFree = Callable[[], None]


@dataclass(slots=True)
class _Watch:
    buffer_id: str
    size: int
    tenant_id: str = ""
    pool_id: str = ""
    inode: int = 0
    #: set once the entry is released while held: what to run when it is free
    on_free: OnFree | None = None


class HeldAfterRelease(NamedTuple):
    """A released entry whose memory some process still holds (resident, zeroed)."""

    buffer_id: str
    tenant_id: str
    pool_id: str
    size_bytes: int
    #: the memfd's inode number (what /proc/<pid>/fd and /proc/<pid>/maps show of it)
    inode: int = 0


def holder_pids(inodes: Iterable[int], proc: str = "/proc") -> dict[int, list[int]]:
    """Which processes hold each memfd ``inodes`` names — an fd of it or a mapping — as
    ``/proc`` shows them to this process (all of them to root; the daemon excluded).
    A scan of every process: for an operator's question, never on a request path."""
    wanted = {i for i in inodes if i}
    found: dict[int, set[int]] = {i: set() for i in wanted}
    me = os.getpid()
    for name in os.listdir(proc) if wanted else ():
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        for ino in _fd_inodes(f"{proc}/{name}"):
            if ino in found:
                found[ino].add(pid)
        with contextlib.suppress(OSError), open(f"{proc}/{name}/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/memfd:"):
                    ino = int(parts[4])
                    if ino in found:
                        found[ino].add(pid)
    return {i: sorted(p) for i, p in found.items()}


def _fd_inodes(process: str) -> set[int]:
    """The inodes of the memfds a process's fds name — in every fd table of it: a thread
    that ``unshare(CLONE_FILES)`` has one of its own, which ``/proc/<pid>/fd`` (the
    leader's) does not show, ``/proc/<pid>/task/<tid>/fd`` does."""
    try:
        tables = [f"{process}/task/{tid}/fd" for tid in os.listdir(f"{process}/task")]
    except OSError:
        tables = [f"{process}/fd"]  # gone, or not ours to read: tried as it was
    inodes: set[int] = set()
    for table in tables:
        try:
            fds = os.listdir(table)
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"{table}/{fd}").startswith("/memfd:"):
                    inodes.add(os.stat(f"{table}/{fd}").st_ino)
    return inodes


class Counts:
    """Pure: the watched entries, which of them are released and held, from the kernel's
    events. Methods that free an entry return its callback; the caller runs it outside
    its lock."""

    def __init__(self) -> None:
        self._by_wd: dict[int, _Watch] = {}
        self._by_id: dict[str, int] = {}
        #: held entries no longer watched (after an overflow): held until a restart
        self._untracked: dict[str, _Watch] = {}
        self.overflows = 0

    def add(
        self,
        wd: int,
        buffer_id: str,
        size: int,
        tenant_id: str = "",
        pool_id: str = "",
        inode: int = 0,
    ) -> None:
        """A new watch of ``buffer_id``'s memfd."""
        self._by_wd[wd] = _Watch(buffer_id, size, tenant_id, pool_id, inode)
        self._by_id[buffer_id] = wd

    def watched(self, buffer_id: str) -> bool:
        return buffer_id in self._by_id

    def holding(self, buffer_id: str) -> bool:
        """Whether ``buffer_id``'s memory may still be resident: watched (its inode not
        reported gone) or held and no longer watched (after an overflow)."""
        return buffer_id in self._by_id or buffer_id in self._untracked

    def released_held(self, buffer_id: str) -> bool:
        """Whether ``buffer_id`` was released and others still hold its memory."""
        wd = self._by_id.get(buffer_id)
        if wd is not None:
            return self._by_wd[wd].on_free is not None
        return buffer_id in self._untracked

    def forget(self, buffer_id: str) -> int | None:
        """Stop watching ``buffer_id`` (a commit undone); its wd to remove, if any."""
        wd = self._by_id.pop(buffer_id, None)
        if wd is not None:
            del self._by_wd[wd]
        return wd

    def event(self, wd: int, mask: int) -> OnFree | None:
        """Take one event; the callback of a held entry that just became free, if any."""
        if mask & IN_Q_OVERFLOW:
            self.overflows += 1
            return None
        if not mask & IN_IGNORED or wd not in self._by_wd:
            return None  # IN_DELETE_SELF (its IN_IGNORED follows), or a watch forgotten
        watch = self._by_wd.pop(wd)  # the inode is gone: no one holds anything of it
        self._by_id.pop(watch.buffer_id, None)
        return watch.on_free

    def settle(self, buffer_id: str, on_free: OnFree) -> bool:
        """The daemon released ``buffer_id`` and closed what it held of it. True: its
        inode is gone (or it was never watched); the caller runs ``on_free`` itself.
        False: others hold it; ``on_free`` is kept for when they let go."""
        wd = self._by_id.get(buffer_id)
        if wd is None:
            return True
        self._by_wd[wd].on_free = on_free
        return False

    def lost(self, wd: int) -> OnFree | None:
        """A held entry's watch was found removed by the kernel (its IN_IGNORED lost in an
        overflow): it is free."""
        return self.event(wd, IN_IGNORED)

    def unwatch(self, wd: int) -> None:
        """A held entry's watch was removed by the daemon to learn whether it was gone, and
        it was not: it stays held, uncounted here, until the daemon restarts."""
        watch = self._by_wd.pop(wd)
        self._by_id.pop(watch.buffer_id, None)
        self._untracked[watch.buffer_id] = watch

    def pending(self) -> dict[int, int]:
        """The wds of released entries others still hold, and their inodes."""
        return {wd: w.inode for wd, w in self._by_wd.items() if w.on_free is not None}

    def held(self) -> list[tuple[str, int]]:
        """``(buffer_id, size)`` of every released entry others still hold."""
        return [(w.buffer_id, w.size) for w in self._held_watches()]

    def held_by(self) -> list[HeldAfterRelease]:
        """Every released entry others still hold, with its tenant and pool."""
        return [
            HeldAfterRelease(w.buffer_id, w.tenant_id, w.pool_id, w.size, w.inode)
            for w in self._held_watches()
        ]

    def _held_watches(self) -> list[_Watch]:
        held = [w for w in self._by_wd.values() if w.on_free is not None]
        return held + list(self._untracked.values())

    def __len__(self) -> int:
        return len(self._by_wd)


class _Inotify:
    """The few inotify calls, through libc (the stdlib has none)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add.restype = ctypes.c_int
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        self._rm.restype = ctypes.c_int
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd

    def add(self, target_fd: int) -> int:
        """Watch the inode ``target_fd`` names (``/proc/self/fd/N`` follows to it)."""
        wd = int(self._add(self.fd, f"/proc/self/fd/{target_fd}".encode(), _WATCH_MASK))
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch: {os.strerror(err)}")
        return wd

    def remove(self, wd: int) -> bool:
        """Remove a watch: False if the kernel had removed it already (its inode is gone)."""
        return int(self._rm(self.fd, wd)) == 0

    def read(self) -> Iterable[tuple[int, int]]:
        """Every event queued now, as ``(wd, mask)``; nothing if none."""
        while True:
            try:
                data = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                yield wd, mask

    def close(self) -> None:
        os.close(self.fd)


class Holders:
    """The daemon's watches of committed entries and their reader (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a leaf lock: callbacks run outside it
        #: notified whenever the kernel's events were read (an entry may have gone)
        self._read = threading.Condition(self._lock)
        #: told the id of every released entry (the broker: the connections holding it)
        self._listeners: list[Callable[[str], None]] = []
        self._counts = Counts()
        self._inotify: _Inotify | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._closed = False
        self._recount_due = False  # an overflow was read: the reader recounts

    def watch(
        self, buffer_id: str, fd: int, size: int, tenant_id: str = "", pool_id: str = ""
    ) -> None:
        """Watch the memfd ``fd`` of the entry ``buffer_id`` (from its commit on).

        :class:`ResourceLimit` when the kernel refuses (no inotify instance or watch
        left): the caller does not commit the entry.
        """
        with self._lock:
            try:
                inotify = self._start()
                wd = inotify.add(fd)
            except OSError as e:
                limit = "fs.inotify.max_user_watches" if e.errno == errno.ENOSPC else "inotify"
                raise ResourceLimit(
                    f"the daemon cannot watch another committed entry ({limit}: {e.strerror})"
                ) from e
            self._counts.add(wd, buffer_id, size, tenant_id, pool_id, os.fstat(fd).st_ino)

    def prepare(self) -> None:
        """Make the inotify instance and its reader now, at the daemon's start: another
        process of the daemon's uid cannot use ``fs.inotify.max_user_instances`` up before
        the first commit then. Refused, it is logged; each commit tries again."""
        with self._lock:
            try:
                self._start()
            except OSError as e:
                logger.warning("no inotify instance for committed entries yet: %s", e)

    def open_read_only(
        self, buffer_id: str, region: Region, tenant_id: str = "", pool_id: str = ""
    ) -> int:
        """An ``O_RDONLY`` fd of a committed entry's memfd (a re-open through
        ``/proc/self/fd``), watched from before it is opened (:meth:`watch`)."""
        self.watch(buffer_id, region.fd, region.size, tenant_id, pool_id)
        try:
            return os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.forget(buffer_id)
            raise

    def forget(self, buffer_id: str) -> None:
        """Stop watching an entry whose commit was undone (nothing waits for it)."""
        with self._lock:
            wd = self._counts.forget(buffer_id)
            if wd is not None and self._inotify is not None:
                self._inotify.remove(wd)

    def settle(self, buffer_id: str, on_free: OnFree) -> bool:
        """The daemon has closed all it held of a released entry (its read-only fd, its
        memfd and mapping): True if no one else holds it (the caller runs ``on_free``
        itself), False if ``on_free`` runs later, on the reader thread, when the last
        holder lets go."""
        with self._lock:
            if not self._counts.watched(buffer_id):
                return True
            ready = self._drain_locked()
            free = self._counts.settle(buffer_id, on_free)
        _run(ready)
        return free

    def wait_freed(self, buffer_ids: Iterable[str], timeout: float) -> set[str]:
        """Wait up to ``timeout`` seconds for released entries to be freed; the ids of
        those still held then. Reads the queued events first: the daemon's own closes
        queued theirs before they returned."""
        deadline = time.monotonic() + timeout
        ready: list[OnFree] = []
        with self._lock:
            ready = self._drain_locked()
            while True:
                left = {b for b in buffer_ids if self._counts.holding(b)}
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    break
                self._read.wait(remaining)
        _run(ready)
        return left

    def listen(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(buffer_id)`` for every committed entry released from now on
        (from the releasing thread; it must not block)."""
        with self._lock:
            self._listeners.append(listener)

    def announce(self, buffer_id: str) -> None:
        """A committed entry was released: tell the listeners (who hold it, let go)."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(buffer_id)
            except Exception:
                logger.exception("telling the holders of %s that it was released failed", buffer_id)

    def released_held(self, buffer_id: str) -> bool:
        """Whether ``buffer_id`` was released and others still hold its memory (its row
        ends by itself when they let go)."""
        with self._lock:
            return self._counts.released_held(buffer_id)

    def held(self) -> list[tuple[str, int]]:
        """``(buffer_id, size)`` of every released entry others still hold."""
        with self._lock:
            return self._counts.held()

    def held_by(self) -> list[HeldAfterRelease]:
        """Every released entry others still hold, with its tenant, pool and size."""
        with self._lock:
            return self._counts.held_by()

    def held_bytes_by(self, what: Literal["tenant_id", "pool_id"]) -> dict[str, int]:
        """Bytes of released entries others still hold, per tenant or per pool."""
        totals: dict[str, int] = {}
        for h in self.held_by():
            key = h.tenant_id if what == "tenant_id" else h.pool_id
            totals[key] = totals.get(key, 0) + h.size_bytes
        return totals

    def held_bytes(self) -> int:
        """Bytes of released entries others still hold (resident, zeroed, counted)."""
        return sum(size for _id, size in self.held())

    def close(self) -> None:
        """Stop the reader and close the inotify fd (held entries stay ``releasing``:
        the next start releases their rows)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if self._wake_w >= 0:
                os.write(self._wake_w, _STOP)
        if thread is not None:
            thread.join()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
            self._thread = None

    # -- internals --------------------------------------------------------------------------

    def _start(self) -> _Inotify:
        """(lock held) The inotify instance, and its reader, made at the first watch."""
        if self._inotify is not None:
            return self._inotify
        if self._closed:
            raise OSError(errno.EBADF, "the daemon is closing")
        inotify = _Inotify()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._inotify = inotify
        self._thread = threading.Thread(target=self._read_loop, name="maasd-holders", daemon=True)
        self._thread.start()
        return inotify

    def _drain_locked(self) -> list[OnFree]:
        """(lock held) Take every queued event; the callbacks of entries now free."""
        ready: list[OnFree] = []
        inotify = self._inotify
        if inotify is None:
            return ready
        overflowed = False
        for wd, mask in inotify.read():
            overflowed = overflowed or bool(mask & IN_Q_OVERFLOW)
            on_free = self._counts.event(wd, mask)
            if on_free is not None:
                ready.append(on_free)
        if overflowed and not self._recount_due:
            self._recount_due = True
            if threading.current_thread() is not self._thread and self._wake_w >= 0:
                os.write(self._wake_w, _RECOUNT)  # read by settle(): tell the reader
        self._read.notify_all()
        return ready

    def _recount(self, pending: dict[int, int]) -> None:
        """After an overflow, on the reader thread: which released entries' ends were lost
        (``pending``: their wds and inodes when the overflow was read; module docstring)."""
        alive = holder_pids(pending.values())  # a /proc scan: not under the lock
        ready: list[OnFree] = []
        kept = unseen = 0
        with self._lock:
            inotify = self._inotify
            still = self._counts.pending()
            for wd, inode in pending.items():
                if inotify is None or wd not in still:
                    continue  # its end was read meanwhile
                if alive.get(inode):
                    kept += 1  # a process holds it: its watch stands
                elif inotify.remove(wd):  # held, by no one the scan saw: now unwatched
                    self._counts.unwatch(wd)
                    unseen += 1
                elif (on_free := self._counts.lost(wd)) is not None:
                    ready.append(on_free)
            self._read.notify_all()
        _run(ready)
        logger.warning(
            "the kernel's inotify queue overflowed (fs.inotify.max_queued_events): "
            "%d released entries freed, %d still held and watched, %d held where /proc "
            "does not show it (counted until a restart)",
            len(ready),
            kept,
            unseen,
        )

    def _read_loop(self) -> None:
        with self._lock:
            inotify, wake = self._inotify, self._wake_r
        assert inotify is not None
        poller = select.poll()
        poller.register(inotify.fd, select.POLLIN)
        poller.register(wake, select.POLLIN)
        while True:
            fds = {fd for fd, _ in poller.poll()}
            if wake in fds and _STOP in os.read(wake, 64):
                return
            with self._lock:
                ready = self._drain_locked()
                pending = self._counts.pending() if self._recount_due else None
                self._recount_due = False
            _run(ready)
            if pending is not None:
                self._recount(pending)


def _run(callbacks: list[OnFree]) -> None:
    for on_free in callbacks:
        try:
            on_free()
        except Exception:
            logger.exception("finishing the release of a held entry failed")
