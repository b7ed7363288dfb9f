"""Who holds a committed entry's memfd: the pure event counter, then the kernel's events
on real memfds (``maasd.core.holders``)."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from maasd.core.holders import (
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_Q_OVERFLOW,
    Counts,
    Holders,
    holder_pids,
)
from maasd.errors import ResourceLimit
from waiting import wait_until

SIZE = 1 << 16


class Calls:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


# -- the bookkeeping --------------------------------------------------------------------------


def test_an_entry_whose_inode_went_at_its_release_is_free() -> None:
    counts = Counts()
    counts.add(7, "b", SIZE)
    assert counts.event(7, IN_DELETE_SELF) is None  # the daemon's closes ended it ...
    assert counts.event(7, IN_IGNORED) is None  # ... before anything waited for it
    assert counts.settle("b", Calls()) is True
    assert len(counts) == 0
    assert counts.held() == []


def test_only_a_released_entry_others_hold_is_released_and_held() -> None:
    """What a tenant's or pool's delete leaves alone (its row ends when they let go): not
    a live entry (watched from its commit), nor one never watched or gone."""
    counts = Counts()
    counts.add(4, "live", SIZE)
    counts.add(5, "kept", SIZE)
    assert counts.settle("kept", Calls()) is False
    assert not counts.released_held("live")
    assert counts.released_held("kept")
    assert not counts.released_held("unknown")
    counts.unwatch(5)  # after an overflow: held, no longer watched, still held
    assert counts.released_held("kept")
    counts.event(4, IN_IGNORED)
    assert not counts.released_held("live")


def test_a_held_entry_is_free_when_its_inode_goes() -> None:
    counts, done = Counts(), Calls()
    counts.add(3, "b", SIZE)
    assert counts.settle("b", done) is False
    assert counts.held() == [("b", SIZE)]
    assert counts.pending() == {3: 0}  # wd → inode (none given here)
    assert counts.event(3, IN_DELETE_SELF) is None
    assert counts.event(3, IN_IGNORED) is done
    assert counts.held() == []
    assert counts.event(3, IN_IGNORED) is None  # nothing twice


def test_entries_not_released_are_not_held() -> None:
    counts = Counts()
    counts.add(1, "a", SIZE)
    counts.add(2, "b", 2 * SIZE)
    assert counts.settle("b", Calls()) is False
    assert counts.held() == [("b", 2 * SIZE)]
    assert counts.pending() == {2: 0}


def test_after_an_overflow_a_lost_end_frees_and_a_live_watch_stays_held() -> None:
    counts, gone, kept = Counts(), Calls(), Calls()
    counts.add(1, "gone", SIZE)
    counts.add(2, "kept", SIZE)
    counts.settle("gone", gone)
    counts.settle("kept", kept)
    assert counts.event(-1, IN_Q_OVERFLOW) is None
    assert counts.overflows == 1
    assert counts.lost(1) is gone  # the kernel had removed its watch: the inode is gone
    counts.unwatch(2)  # its watch was still there: removed, no longer watched
    assert counts.held() == [("kept", SIZE)]  # counted until a restart
    assert counts.pending() == {}
    assert counts.event(2, IN_IGNORED) is None
    assert kept.n == 0


def test_an_unwatched_or_forgotten_entry_is_free() -> None:
    counts = Counts()
    assert counts.settle("never", Calls()) is True
    counts.add(4, "b", SIZE)
    assert counts.forget("b") == 4
    assert counts.forget("b") is None
    assert counts.settle("b", Calls()) is True
    assert counts.event(4, IN_IGNORED) is None  # the removed watch's last word


# -- the kernel's events on real memfds ---------------------------------------------------------


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    yield h
    h.close()


class Entry:
    """A memfd watched as a committed entry's is, with what the daemon holds of it: the
    memfd, its mapping and a read-only fd re-opened through /proc."""

    def __init__(self, holders: Holders, buffer_id: str) -> None:
        self.memfd = os.memfd_create(buffer_id, os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, SIZE)
        self.mapping = mmap.mmap(self.memfd, SIZE)
        self.ro = holders.open_read_only(buffer_id, self)  # type: ignore[arg-type]

    @property
    def fd(self) -> int:
        return self.memfd

    @property
    def size(self) -> int:
        return SIZE

    def release(self) -> None:
        """What a release closes of it in the daemon."""
        os.close(self.ro)
        self.mapping.close()
        os.close(self.memfd)


def test_the_daemons_own_fds_and_mapping_hold_nothing(holders: Holders) -> None:
    entry = Entry(holders, "b")
    entry.release()
    assert holders.settle("b", Calls()) is True
    assert holders.held() == []


def test_a_dup_a_reopen_and_a_mapping_hold_until_the_last_goes(holders: Holders) -> None:
    entry = Entry(holders, "b")
    done, freed = Calls(), threading.Event()

    def on_free() -> None:
        done()
        freed.set()

    kept = os.dup(entry.ro)  # what a lookup hands out: the same description
    reopened = os.open(f"/proc/self/fd/{kept}", os.O_RDONLY)  # a new description
    mapped = mmap.mmap(reopened, SIZE, prot=mmap.PROT_READ)
    os.close(reopened)  # the mapping keeps its description
    entry.release()
    assert holders.settle("b", on_free) is False
    assert holders.held() == [("b", SIZE)]
    assert holders.held_bytes() == SIZE
    os.close(kept)
    assert holders.settle("c", Calls()) is True  # (any settle reads what is queued)
    assert done.n == 0  # the mapping still holds it
    mapped.close()
    assert freed.wait(10), "the mapping's end freed the entry"
    assert done.n == 1
    assert holders.held_bytes() == 0


def test_a_forked_childs_inherited_fd_holds_until_the_child_lets_go(holders: Holders) -> None:
    entry = Entry(holders, "b")
    kept = os.dup(entry.ro)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps its copy of `kept` until told to stop
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(kept)  # the parent lets go; the child still has the description
    entry.release()
    done = Calls()
    assert holders.settle("b", done) is False
    os.write(w, b"x")
    os.close(w)
    os.waitpid(pid, 0)
    wait_until(lambda: done.n == 1, message="the child's exit freed the entry")


def test_a_forgotten_watch_is_removed(holders: Holders) -> None:
    entry = Entry(holders, "b")
    kept = os.dup(entry.ro)
    holders.forget("b")
    entry.release()
    assert holders.settle("b", Calls()) is True  # not watched: nothing waits for it
    os.close(kept)


def test_a_watch_the_kernel_refuses_is_a_resource_limit(holders: Holders) -> None:
    with pytest.raises(ResourceLimit, match="cannot watch"):
        holders.watch("b", 1 << 30, SIZE)  # an fd number above any limit: nothing to watch
    assert holders.settle("b", Calls()) is True  # nothing was counted


def test_held_entries_by_tenant_and_pool_and_who_holds_them(holders: Holders) -> None:
    """What usage, /metrics and ``buffers list --held`` show: the held bytes per tenant and
    pool, and the pids a /proc scan finds holding the memfd (an fd or a mapping)."""
    memfd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(memfd, SIZE)
    ro = holders.open_read_only("b", _Region(memfd), "tenant-a", "pool-p")  # type: ignore[arg-type]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a mapping only, no fd: what the scan must find in /proc/<pid>/maps
        os.close(r)
        mm = mmap.mmap(ro, SIZE, prot=mmap.PROT_READ)
        os.close(ro)
        os.write(w, b"m")
        os.close(w)
        time.sleep(30)  # killed by the test
        mm.close()
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"m"
        os.close(ro)
        os.close(memfd)
        assert holders.settle("b", Calls()) is False
        assert holders.held_bytes_by("tenant_id") == {"tenant-a": SIZE}
        assert holders.held_bytes_by("pool_id") == {"pool-p": SIZE}
        (held,) = holders.held_by()
        assert (held.buffer_id, held.tenant_id, held.pool_id, held.size_bytes) == (
            "b",
            "tenant-a",
            "pool-p",
            SIZE,
        )
        assert holder_pids([held.inode]) == {held.inode: [pid]}
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
    wait_until(lambda: holders.held_bytes() == 0, message="the child's end frees it")
    assert holder_pids([held.inode]) == {held.inode: []}


class _Region:
    def __init__(self, fd: int) -> None:
        self.fd, self.size = fd, SIZE


def test_a_thread_with_a_fd_table_of_its_own_is_found_holding() -> None:
    """``/proc/<pid>/fd`` shows the leader's fd table only: a thread that unshared its own
    (``CLONE_FILES``) and keeps the fd is found through ``/proc/<pid>/task/<tid>/fd``."""
    memfd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(memfd, SIZE)
    inode = os.fstat(memfd).st_ino
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        import ctypes

        os.close(r)
        libc = ctypes.CDLL(None, use_errno=True)
        unshared = threading.Event()

        def keeper() -> None:
            libc.unshare(0x400)  # CLONE_FILES: a copy of the table, the memfd in it
            unshared.set()
            time.sleep(30)  # killed by the test

        threading.Thread(target=keeper, daemon=True).start()
        unshared.wait()
        os.close(memfd)  # gone from the leader's table
        os.write(w, b"t")
        time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"t"
        os.close(memfd)
        assert holder_pids([inode]) == {inode: [pid]}
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)


@contextlib.contextmanager
def _inotify_queue(events: int) -> Iterator[None]:
    """New inotify instances queue at most ``events`` events (a global sysctl, as root;
    an instance keeps the size it was made with, so it is set back at once)."""
    path = "/proc/sys/fs/inotify/max_queued_events"
    before = open(path).read()  # noqa: SIM115
    try:
        with open(path, "w") as f:
            f.write(str(events))
    except OSError as e:
        pytest.skip(f"cannot set fs.inotify.max_queued_events: {e}")
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(before)


@pytest.mark.parametrize("read_by", ["the reader", "a release"])
def test_after_an_overflow_an_entry_a_process_holds_stays_watched(read_by: str) -> None:
    """The queue overflows while many released entries go at once. Those gone are freed;
    one a child process still holds stays watched (a /proc scan sees its holder), and is
    freed when the child lets go — it used to stay counted until a restart. The overflow
    is read by the reader thread, or by a release's settle (which tells the reader)."""
    with _inotify_queue(16):
        holders = Holders()
        holders.prepare()
    try:
        kept = Entry(holders, "kept")
        child = subprocess.Popen(["sleep", "60"], pass_fds=[kept.ro])  # holds its memfd
        kept.release()
        kept_free = threading.Event()
        assert holders.settle("kept", kept_free.set) is False
        many = [Entry(holders, f"e{i}") for i in range(64)]
        dups = [os.dup(e.ro) for e in many]  # the test holds them, then lets go at once
        freed = Calls()
        for i, e in enumerate(many):
            e.release()
            assert holders.settle(f"e{i}", freed) is False
        with holders._lock:  # the reader waits: the closes' events overflow its queue
            for fd in dups:
                os.close(fd)
            ready = holders._drain_locked() if read_by == "a release" else []
        for on_free in ready:
            on_free()
        wait_until(lambda: freed.n == 64, message="the entries gone are freed")
        assert holders._counts.overflows >= 1
        assert holders.held() == [("kept", SIZE)]
        assert holders._counts.watched("kept")  # not given up on: still watched
        child.kill()
        child.wait()
        assert kept_free.wait(10), "the child's exit freed the held entry"
        assert holders.held() == []
    finally:
        holders.close()


def test_a_refusal_names_the_held_entries_of_its_tenant_or_its_pool() -> None:
    """What a 409/507 adds when released entries still held fill the tenant or the pool
    (:mod:`maasd.core.room`): the tenant's for a quota or count, the pool's for capacity."""
    from maasd.core.holders import HeldAfterRelease
    from maasd.core.room import _held_after_release

    held = [
        HeldAfterRelease("a", "t1", "p1", 100),
        HeldAfterRelease("b", "t1", "p2", 50),
        HeldAfterRelease("c", "t2", "p1", 10),
    ]
    assert _held_after_release(held, "t1", pool=False).startswith("2 of them (150 bytes)")
    assert _held_after_release(held, "p1", pool=True).startswith("2 of them (110 bytes)")
    assert _held_after_release(held, "t3", pool=False) == ""
    assert _held_after_release([], "p1", pool=True) == ""
