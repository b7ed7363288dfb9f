"""Hostile round 11: memory held after release (SPEC §2: invariant 1, with 4 and 8), held in
ways earlier rounds did not take: an fd taken out of another process with
``pidfd_getfd``, a mapping moved with ``mremap`` and split by an ``munmap`` of its
middle, a ``MAP_PRIVATE`` writable mapping of the read-only fd (and ``madvise`` on it), a
child forked after the mapping that outlives its parent, an entry promoted from the disk
tier. At each step the tenant's ``GET /v1/usage``, the admin's tenant record,
``maasctl buffers list --held`` and ``/metrics`` must agree, and a reserve beyond the
quota minus what is held must be refused.

Each test asserts what SPEC promises: a failure is a bug found.
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon
from entry_probe import MAP_FAILED
from entry_probe import libc as _libc  # mmap and munmap typed there; mremap below
from hardening import after_attack, tenant_usage
from maasd.protocol import Detach, Error, Ok, Put
from pgdb import PG_URL, fresh_pg_database
from rawentries import connect, pattern, put_committed
from sockpeer import lookup as raw_lookup
from waiting import wait_until

MiB = 1 << 20
PAGE = mmap.PAGESIZE
TESTS = Path(__file__).resolve().parent.parent

_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MADV_DONTNEED, MADV_REMOVE = 4, 9
SYS_PIDFD_GETFD = 438


def _check(result: int, what: str) -> int:
    if result < 0 or result == MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return result


def _pidfd_getfd(pid: int, fd: int) -> int:
    pidfd = os.pidfd_open(pid)
    try:
        return int(_check(_libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0), "pidfd_getfd"))
    finally:
        os.close(pidfd)


def _state(d: Daemon, tenant_id: str, key: str) -> dict[str, Any]:
    """What every surface says of the tenant: usage, the admin's record, the metric."""
    u = tenant_usage(d, key)
    t = d.admin.get(f"/v1/tenants/{tenant_id}").json()
    return {
        "used": u["used_bytes"],
        "held": u["held_bytes"],
        "buffers": u["buffers"],
        "tenant_used": t["used_bytes"],
        "tenant_held": t["held_bytes"],
        "metric": d.metric("maasd_held_bytes", tenant=tenant_id),
    }


def _expect(
    d: Daemon, tenant_id: str, key: str, held: int, buffers: int, used: int | None = None
) -> None:
    used = held if used is None else used
    s = _state(d, tenant_id, key)
    want = {
        "used": used,
        "held": held,
        "buffers": buffers,
        "tenant_used": used,
        "tenant_held": held,
        "metric": held,
    }
    assert s == want, s


def _held_pids(d: Daemon, tenant_id: str) -> dict[str, list[int]]:
    """``maasctl --json buffers list --held`` for one tenant: id -> holder pids."""
    env = {**os.environ, "MAASD_URL": d.url, "MAASD_ADMIN_KEY": d.admin_key}
    out = subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", "--json", "buffers", "list", "--held"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return {
        b["id"]: b["holder_pids"] for b in json.loads(out.stdout) if b["tenant_id"] == tenant_id
    }


def _counted_until_let_go(
    d: Daemon,
    tenant_id: str,
    key: str,
    bid: str,
    quota: int,
    size: int,
    let_go: Callable[[], object],
) -> None:
    """The released entry ``bid`` (``size`` bytes), held by this process, counts in its
    tenant's quota (held, named with this pid, a reserve past quota − size refused) until
    ``let_go()``; then nothing of it is counted."""
    _expect(d, tenant_id, key, size, 1)
    assert _held_pids(d, tenant_id) == {bid: [os.getpid()]}
    assert _reserve(d, key, quota - size + PAGE) == 409
    let_go()
    wait_until(lambda: tenant_usage(d, key)["used_bytes"] == 0, message="freed")
    _expect(d, tenant_id, key, 0, 0)


def _reserve(d: Daemon, key: str, size: int) -> int:
    """A REST reserve of ``size``: its status (released at once if it landed)."""
    with d.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": size})
        if r.status_code == 201:
            assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
        elif r.status_code == 409:
            assert r.json()["type"].endswith("quota-exceeded"), r.text
        return r.status_code


def _release(d: Daemon, key: str, buffer_id: str) -> None:
    with d.client(key) as c:
        assert c.delete(f"/v1/buffers/{buffer_id}").status_code == 204


def _spawn(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.getcwd()])}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _first_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the worker died: {proc.wait()}"
    return dict(json.loads(line))


# --- an fd taken out of another process (pidfd_getfd) ----------------------------------


_LOOKUP_AND_WAIT = """
import json, os, sys
from rawentries import connect, pattern, put_committed
from sockpeer import lookup
r = connect(type("D", (), {{"socket_path": {sock!r}}})(), {key!r})
bid = put_committed(r, "e", pattern({size}, 3))
_found, fd = lookup(r, ["e"])
print(json.dumps({{"id": bid, "fd": fd}}), flush=True)
sys.stdin.read()
"""


def test_an_fd_taken_with_pidfd_getfd_counts_after_its_worker_exits(daemon: Daemon):
    """A worker looks an entry up; another process of the same uid takes the fd out of it
    with ``pidfd_getfd`` and the worker exits. Released, the entry stays counted (quota
    minus held is all a reserve gets) until the taker closes it."""
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant("pidfd-taker", quota)
    worker = _spawn(_LOOKUP_AND_WAIT.format(sock=daemon.socket_path, key=key, size=size))
    taken = -1
    try:
        out = _first_line(worker)
        taken = _pidfd_getfd(worker.pid, out["fd"])
        assert worker.stdin is not None
        worker.stdin.close()
        assert worker.wait(30) == 0
        _expect(daemon, tenant_id, key, 0, 1, used=size)  # live: used, not held
        _release(daemon, key, out["id"])
        _expect(daemon, tenant_id, key, size, 1)
        assert _held_pids(daemon, tenant_id) == {out["id"]: [os.getpid()]}
        assert os.pread(taken, PAGE, 0) == bytes(PAGE)  # scrubbed (invariant 4)
        assert _reserve(daemon, key, quota - size + PAGE) == 409
        assert _reserve(daemon, key, quota - size) == 201
        _expect(daemon, tenant_id, key, size, 1)
    finally:
        if taken >= 0:
            os.close(taken)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="freed")
    _expect(daemon, tenant_id, key, 0, 0)
    assert _held_pids(daemon, tenant_id) == {}
    assert _reserve(daemon, key, quota) == 201
    after_attack(daemon)


# --- a mapping moved and split ----------------------------------------------------------


def test_a_mapping_moved_with_mremap_and_split_counts_until_its_last_piece_goes(
    daemon: Daemon,
):
    """The entry is mapped, the mapping moved to another address (``mremap``), split in two
    by an ``munmap`` of its middle, the fd closed and detached. Released, it reads zeros
    through both pieces and counts until the second piece is unmapped too."""
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant("mremap-keeper", quota)
    data = pattern(size, 5)
    r = connect(daemon, key)
    pieces: list[tuple[int, int]] = []
    try:
        bid = put_committed(r, "e", data)
        found, fd = raw_lookup(r, ["e"])
        addr = _check(_libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0), "mmap")
        # a place elsewhere to move it to: reserved, then replaced by the move
        where = _check(
            _libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0),
            "mmap",
        )
        moved = _check(
            _libc.mremap(addr, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, where), "mremap"
        )
        assert moved == where != addr
        hole = size // 4
        _check(_libc.munmap(moved + hole, 2 * hole), "munmap")
        pieces = [(moved, hole), (moved + 3 * hole, size - 3 * hole)]
        assert ctypes.string_at(moved, PAGE) == data[:PAGE]
        os.close(fd)
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        _release(daemon, key, bid)
        for start, length in pieces:  # invariant 4 through either piece
            assert ctypes.string_at(start, length) == bytes(length)
        _expect(daemon, tenant_id, key, size, 1)
        assert _held_pids(daemon, tenant_id) == {bid: [os.getpid()]}
        assert _reserve(daemon, key, quota - size + PAGE) == 409
        start, length = pieces.pop(0)
        _check(_libc.munmap(start, length), "munmap")
        # the other piece still holds it: still counted, still named
        assert _held_pids(daemon, tenant_id) == {bid: [os.getpid()]}
        _expect(daemon, tenant_id, key, size, 1)
        start, length = pieces.pop(0)
        _check(_libc.munmap(start, length), "munmap")
        wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="freed")
        _expect(daemon, tenant_id, key, 0, 0)
        assert _reserve(daemon, key, quota) == 201
    finally:
        for start, length in pieces:
            _libc.munmap(start, length)
        r.close()
    after_attack(daemon)


# --- MAP_PRIVATE and madvise --------------------------------------------------------------


def test_a_private_writable_mapping_changes_nothing_and_counts_until_unmapped(daemon: Daemon):
    """A ``MAP_PRIVATE`` writable mapping of the read-only fd is allowed: its writes are
    copies, the entry unchanged for every other reader (invariant 8). Released, its
    untouched pages read zeros (invariant 4), ``MADV_REMOVE`` cannot punch the sealed
    pages and ``MADV_DONTNEED`` only drops the copies: it stays counted until unmapped."""
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant("private-keeper", quota)
    data = pattern(size, 7)
    r, other = connect(daemon, key), connect(daemon, key)
    mm: mmap.mmap | None = None
    try:
        bid = put_committed(r, "e", data)
        found, fd = raw_lookup(r, ["e"])
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm[:PAGE] = b"\xee" * PAGE
        assert mm[PAGE : 2 * PAGE] == data[PAGE : 2 * PAGE]
        _found, seen = raw_lookup(other, ["e"])
        try:
            with mmap.mmap(seen, size, prot=mmap.PROT_READ) as view:
                assert view[:] == data  # invariant 8: the copy on write is the worker's own
        finally:
            os.close(seen)
        os.close(fd)
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        assert other.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        _release(daemon, key, bid)
        assert mm[PAGE:] == bytes(size - PAGE)  # invariant 4 through the private mapping
        assert mm[:PAGE] == b"\xee" * PAGE  # its own copy: its own memory
        _expect(daemon, tenant_id, key, size, 1)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert _libc.madvise(addr, size, MADV_REMOVE) != 0  # no punch of a sealed entry
        assert _libc.madvise(addr, size, MADV_DONTNEED) == 0
        assert mm[:PAGE] == bytes(PAGE)  # the copy dropped: the (scrubbed) entry again
        _counted_until_let_go(daemon, tenant_id, key, bid, quota, size, mm.close)
        mm = None
        assert _reserve(daemon, key, quota) == 201
    finally:
        if mm is not None:
            mm.close()
        r.close()
        other.close()
    after_attack(daemon)


# --- a child forked after the mapping, outliving its parent ------------------------------


_MAP_FORK_EXIT = """
import json, mmap, os, sys
from maasd.protocol import Detach, Error, Ok, Put
from rawentries import connect, pattern, put_committed
from sockpeer import lookup
r = connect(type("D", (), {{"socket_path": {sock!r}}})(), {key!r})
bid = put_committed(r, "e", pattern({size}, 9))
found, fd = lookup(r, ["e"])
mm = mmap.mmap(fd, {size}, prot=mmap.PROT_READ)
os.close(fd)
assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
child = os.fork()
if child == 0:
    r.sock.close()
    sys.stdin.read()  # until the test lets go
    assert mm[:4096] == bytes(4096), "the released entry was not scrubbed"
    os._exit(0)
print(json.dumps({{"id": bid, "child": child}}), flush=True)
os._exit(0)  # the parent goes at once; the child keeps the mapping
"""


def test_a_child_forked_after_the_mapping_holds_it_after_its_parent_exits(daemon: Daemon):
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant("late-child", quota)
    parent = _spawn(_MAP_FORK_EXIT.format(sock=daemon.socket_path, key=key, size=size))
    try:
        out = _first_line(parent)
        assert parent.wait(30) == 0
        _release(daemon, key, out["id"])
        _expect(daemon, tenant_id, key, size, 1)
        assert _held_pids(daemon, tenant_id) == {out["id"]: [out["child"]]}
        assert _reserve(daemon, key, quota - size + PAGE) == 409
        assert _reserve(daemon, key, quota - size) == 201
    finally:
        assert parent.stdin is not None
        parent.stdin.close()  # the child's stdin too: it checks the zeros and exits
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="freed")
    _expect(daemon, tenant_id, key, 0, 0)
    assert _reserve(daemon, key, quota) == 201
    after_attack(daemon)


# --- an entry promoted from the disk tier --------------------------------------------------


def test_a_disk_promoted_entry_held_after_release_counts(disk_daemon: Daemon, tmp_path: Path):
    """An entry read back from the disk tier is a fresh memfd: kept after its release, it
    counts in its tenant's quota and its pool like one committed over the socket."""
    from rawentries import demote_one, tier_pool

    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    quota = 64 * MiB
    tenant_id, key = d.tenant("promoted-keeper", quota)
    data = pattern(MiB, 13)
    r = demote_one(d, key, pool, data, fill=9)
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) == 1, timeout=20)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    r2 = connect(d, key)
    fd = -1
    try:
        found, fd = raw_lookup(r2, ["hot"])
        assert d.metric("maasd_disk_promotions_total", pool=pool) == 1
        assert os.pread(fd, MiB, 0) == data
        assert r2.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        before = tenant_usage(d, key)
        _release(d, key, found.buffer_id)
        assert os.pread(fd, PAGE, 0) == bytes(PAGE)
        u = tenant_usage(d, key)
        assert (u["held_bytes"], u["used_bytes"]) == (MiB, before["used_bytes"]), (before, u)
        assert d.metric("maasd_held_bytes", tenant=tenant_id) == MiB
        info = d.admin.get(f"/v1/pools/{pool}").json()
        assert info["held_bytes"] == MiB, info
        assert _held_pids(d, tenant_id) == {found.buffer_id: [os.getpid()]}
        os.close(fd)
        fd = -1
        wait_until(lambda: tenant_usage(d, key)["held_bytes"] == 0, message="freed")
        assert tenant_usage(d, key)["used_bytes"] == before["used_bytes"] - MiB
    finally:
        if fd >= 0:
            os.close(fd)
        r.close()
        r2.close()


# --- holders /proc/<pid>/fd does not show -------------------------------------------------


_THREAD_OWN_FDS = """
import ctypes, json, os, sys, threading
from rawentries import connect, pattern, put_committed
from sockpeer import lookup
libc = ctypes.CDLL(None, use_errno=True)
CLONE_FILES = 0x400
r = connect(type("D", (), {{"socket_path": {sock!r}}})(), {key!r})
bid = put_committed(r, "e", pattern({size}, 4))
_found, fd = lookup(r, ["e"])
ready = threading.Event()

def keeper():
    assert libc.unshare(CLONE_FILES) == 0, ctypes.get_errno()  # a fd table of its own
    ready.set()
    sys.stdin.read()  # it keeps its copy of the fd until the test lets go

t = threading.Thread(target=keeper)
t.start()
ready.wait()
os.close(fd)  # the process's (the leader's) table no longer has it
r.sock.close()
print(json.dumps({{"id": bid}}), flush=True)
t.join()
"""


def test_a_thread_with_a_fd_table_of_its_own_is_named_as_a_holder(daemon: Daemon):
    """A thread that ``unshare(CLONE_FILES)`` keeps the entry's fd in a table of its own,
    which ``/proc/<pid>/fd`` (the leader's) does not show: the entry counts all the same,
    and ``maasctl buffers list --held`` must still name the process."""
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant("thread-table", quota)
    proc = _spawn(_THREAD_OWN_FDS.format(sock=daemon.socket_path, key=key, size=size))
    try:
        out = _first_line(proc)
        _release(daemon, key, out["id"])
        _expect(daemon, tenant_id, key, size, 1)
        assert _held_pids(daemon, tenant_id) == {out["id"]: [proc.pid]}
        assert _reserve(daemon, key, quota - size + PAGE) == 409
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="freed")
    _expect(daemon, tenant_id, key, 0, 0)
    after_attack(daemon)


def test_an_fd_in_flight_in_a_socket_counts_and_goes_with_the_socket(daemon: Daemon):
    """The entry's fd sent over ``SCM_RIGHTS`` and never received: only the socket's queue
    holds it (no process's fd table, no mapping). It counts until the socket is closed;
    a cycle of sockets no process holds any more is the kernel's garbage collector's."""
    import socket

    quota, size = 8 * MiB, 2 * MiB
    tenant_id, key = daemon.tenant("in-flight", quota)
    r = connect(daemon, key)
    try:
        ids = [put_committed(r, f"e{i}", pattern(size, 20 + i)) for i in range(2)]
        # one fd in the queue of a socket pair the test keeps
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        found, fd = raw_lookup(r, ["e0"])
        socket.send_fds(a, [b"x"], [fd])
        os.close(fd)
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        # the other in a cycle: c's queue holds d and the fd, then both are closed
        c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        found, fd = raw_lookup(r, ["e1"])
        socket.send_fds(c, [b"y"], [fd, d.fileno()])
        socket.send_fds(d, [b"z"], [c.fileno()])
        os.close(fd)
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        for i in ids:
            _release(daemon, key, i)
        c.close()
        d.close()  # the cycle is unreachable: the kernel collects it, the entry goes

        def collected() -> bool:
            # the collector runs as a unix socket with fds in flight is closed: one more
            s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            socket.send_fds(s1, [b"n"], [s2.fileno()])
            s1.close()
            s2.close()
            return tenant_usage(daemon, key)["held_bytes"] == size

        wait_until(collected, timeout=30, message="the cycle collected")
        _expect(daemon, tenant_id, key, size, 1)
        assert _reserve(daemon, key, quota - size + PAGE) == 409
        assert _reserve(daemon, key, quota - size) == 201
        a.close()
        b.close()
        wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="socket closed")
        _expect(daemon, tenant_id, key, 0, 0)
    finally:
        r.close()
    after_attack(daemon)


# --- a second release of an entry already released and held ------------------------------


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_a_second_delete_of_a_held_entry_keeps_it_counted(daemon: Daemon, who: str):
    """The entry is released and held; its id is DELETEd again (by its tenant, to whom it
    is gone, or by the admin, who still lists it ``releasing``). Its memory is still
    resident: the row must stay, counted, until the holder lets go."""
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant(f"twice-{who}", quota)
    r = connect(daemon, key)
    fd = -1
    try:
        bid = put_committed(r, "e", pattern(size, 30))
        found, fd = raw_lookup(r, ["e"])
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
        _release(daemon, key, bid)
        _expect(daemon, tenant_id, key, size, 1)
        if who == "tenant":
            with daemon.client(key) as c:
                assert c.delete(f"/v1/buffers/{bid}").status_code == 404
        else:
            again = daemon.admin.delete(f"/v1/buffers/{bid}")
            assert again.status_code in (204, 404, 409), again.text
        assert daemon.admin.get(f"/v1/buffers/{bid}").json()["state"] == "releasing"
        _counted_until_let_go(
            daemon, tenant_id, key, bid, quota, size, functools.partial(os.close, fd)
        )
        fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
        r.close()
    after_attack(daemon)


# --- many held entries, their holder killed ------------------------------------------------


_KEEP_MANY = """
import json, sys
from maasd.protocol import Detach, Error, Ok, Put
from rawentries import connect, pattern, put_committed
from sockpeer import lookup
r = connect(type("D", (), {{"socket_path": {sock!r}}})(), {key!r})
ids, kept = [], []
for i in range({n}):
    bid = put_committed(r, f"e{{i}}", pattern({size}, i))
    found, fd = lookup(r, [f"e{{i}}"])
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    ids.append(bid)
    kept.append(fd)
print(json.dumps({{"ids": ids}}), flush=True)
sys.stdin.read()
"""


def test_a_quota_of_small_held_entries_comes_back_at_once_when_their_holder_is_killed(
    daemon: Daemon,
):
    """64 entries fill the quota, all released, all held by one process: every surface
    says the quota is held and nothing more is admitted; the holder is killed (64 inodes
    end at once) and every byte comes back, the quota reservable again whole."""
    n, size = 64, 128 << 10
    quota = n * size
    tenant_id, key = daemon.tenant("many-held", quota)
    proc = _spawn(_KEEP_MANY.format(sock=daemon.socket_path, key=key, size=size, n=n))
    try:
        out = _first_line(proc)
        assert len(out["ids"]) == n
        _expect(daemon, tenant_id, key, 0, n, used=quota)
        for bid in out["ids"]:
            _release(daemon, key, bid)
        _expect(daemon, tenant_id, key, quota, n)
        held = _held_pids(daemon, tenant_id)
        assert held == {bid: [proc.pid] for bid in out["ids"]}
        assert _reserve(daemon, key, PAGE) == 409
        r = connect(daemon, key)  # and no entry either
        try:
            reply, _fds = r.call(Put(key="one-more", size_bytes=PAGE))
            assert isinstance(reply, Error), reply
            assert reply.status == 409, reply
        finally:
            r.close()
        _expect(daemon, tenant_id, key, quota, n)
    finally:
        proc.kill()
        proc.wait(30)
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="all freed")
    _expect(daemon, tenant_id, key, 0, 0)
    assert _held_pids(daemon, tenant_id) == {}
    assert _reserve(daemon, key, quota) == 201
    events = daemon.admin.get("/v1/events", params={"tenant_id": tenant_id}).json()
    released = [e for e in events if e["kind"] == "release" and e["buffer_id"] in out["ids"]]
    assert len(released) == n
    after_attack(daemon)


# --- a pool's capacity minus what is held ---------------------------------------------------


def test_held_entries_count_in_their_pool_against_another_tenant(daemon: Daemon):
    """One tenant's released entries, held, fill half of a shared memfd pool: the pool's
    record and its metric say so, and another tenant gets exactly the rest (507 beyond)."""
    cap, size = 16 * MiB, 4 * MiB
    pool = daemon.pool(f"held-pool-{os.getpid()}", cap)
    tenant_id, key = daemon.tenant("pool-keeper", 64 * MiB)
    _other_id, other = daemon.tenant("pool-other", 64 * MiB)
    r = connect(daemon, key)
    fds: list[int] = []
    try:
        for i in range(2):
            bid = put_committed(r, f"e{i}", pattern(size, 40 + i), pool["id"])
            found, fd = raw_lookup(r, [f"e{i}"])
            fds.append(fd)
            assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
            _release(daemon, key, bid)
        info = daemon.admin.get(f"/v1/pools/{pool['id']}").json()
        assert (info["used_bytes"], info["held_bytes"]) == (2 * size, 2 * size), info
        assert info["free_bytes"] == cap - 2 * size, info
        assert daemon.metric("maasd_held_bytes", tenant=tenant_id, pool=pool["id"]) == 2 * size
        with daemon.client(other) as c:
            url = f"/v1/pools/{pool['id']}/reserve"
            over = c.post(url, json={"size_bytes": cap - 2 * size + PAGE})
            assert over.status_code == 507, over.text
            fits = c.post(url, json={"size_bytes": cap - 2 * size})
            assert fits.status_code == 201, fits.text
            assert c.delete(f"/v1/buffers/{fits.json()['id']}").status_code == 204
        for fd in fds:
            os.close(fd)
        fds.clear()
        wait_until(
            lambda: daemon.admin.get(f"/v1/pools/{pool['id']}").json()["used_bytes"] == 0,
            message="the pool's held bytes freed",
        )
        assert daemon.metric("maasd_held_bytes", tenant=tenant_id, pool=pool["id"]) == 0
        with daemon.client(other) as c:
            whole = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": cap})
            assert whole.status_code == 201, whole.text
            assert c.delete(f"/v1/buffers/{whole.json()['id']}").status_code == 204
    finally:
        for fd in fds:
            os.close(fd)
        r.close()
        daemon.admin.delete(f"/v1/pools/{pool['id']}", params={"drain": "true"})
    after_attack(daemon)


# --- a daemon killed while a worker keeps an entry -------------------------------------------


@pytest.mark.parametrize("state", ["live", "released"])
def test_a_kill_while_a_worker_keeps_an_entry_leaks_nothing_in_the_ledger(
    fresh_daemon: Daemon, state: str
):
    """SIGKILL while a worker keeps an entry (live, or released and held), then a restart:
    the fresh daemon never had the old memfd, so the row is released and nothing stays
    counted; the tenant gets its whole quota, and a new entry under the same key is a
    memfd of its own (the kept fd does not see it)."""
    d = fresh_daemon.start()
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = d.tenant(f"killed-{state}", quota)
    data = pattern(size, 50)
    r = connect(d, key)
    bid = put_committed(r, "e", data)
    _found, fd = raw_lookup(r, ["e"])
    try:
        if state == "released":
            _release(d, key, bid)
            _expect(d, tenant_id, key, size, 1)
        d.kill()
        r.close()
        d.start()
        _expect(d, tenant_id, key, 0, 0)
        assert d.admin.get(f"/v1/buffers/{bid}").status_code == 404
        assert _reserve(d, key, quota) == 201
        r = connect(d, key)
        new = put_committed(r, "e", pattern(size, 51))
        assert new != bid
        assert os.fstat(fd).st_ino not in _daemon_inodes(d, new)
        kept = os.pread(fd, PAGE, 0)
        assert kept == (bytes(PAGE) if state == "released" else data[:PAGE])
    finally:
        os.close(fd)
        r.close()
    after_attack(d)


def _daemon_inodes(d: Daemon, buffer_id: str) -> set[int]:
    """The inodes of the daemon's memfds named after ``buffer_id``: those it maps
    (``/proc/<daemon>/maps``; an idle committed entry parks, keeping its mapping and no fd)
    and those it holds an fd of. Never empty: the daemon holds the entry somehow."""
    assert d.proc is not None
    pid, name = d.proc.pid, f"maasd-{buffer_id[:8]}"
    inodes = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and name in fields[5]:
                inodes.add(int(fields[4]))
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if name in os.readlink(f"/proc/{pid}/fd/{fd}"):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    assert inodes, f"the daemon holds no memfd of {buffer_id}"
    return inodes


# --- an entry restored from its checkpoint at a start -----------------------------------------


def test_a_persistent_entry_restored_at_a_start_counts_when_held_after_release(
    fresh_daemon: Daemon,
):
    """A persistent entry is checkpointed, the daemon restarted (it comes back in a
    fresh memfd), then looked up, kept and released: held, it counts like any other,
    and reads zeros (SPEC §2: 1, 4)."""
    d = fresh_daemon.start()
    quota, size = 8 * MiB, 4 * MiB
    d.pool("keep", 32 * MiB, persistence="persistent")
    tenant_id, key = d.tenant("restored-keeper", quota)
    data = pattern(size, 60)
    r = connect(d, key)
    bid = put_committed(r, "e", data, "keep")
    r.close()
    with d.client(key) as c:
        assert c.post(f"/v1/buffers/{bid}/checkpoint").status_code == 200
    d.restart()
    r = connect(d, key)
    fd = -1
    try:
        found, fd = raw_lookup(r, ["e"])
        assert found.buffer_id == bid
        assert os.pread(fd, size, 0) == data
        assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
        _expect(d, tenant_id, key, 0, 1, used=size)
        _release(d, key, bid)
        assert os.pread(fd, PAGE, 0) == bytes(PAGE)
        _counted_until_let_go(d, tenant_id, key, bid, quota, size, functools.partial(os.close, fd))
        fd = -1
        assert _reserve(d, key, quota) == 201
    finally:
        if fd >= 0:
            os.close(fd)
        r.close()
    after_attack(d)


# --- what a refusal says when held entries fill the quota or the buffer cap --------------------


def test_refusals_by_held_entries_say_so(daemon: Daemon):
    """Released entries still held count in the quota and in ``max_buffers``; the tenant
    lists none of them, so the 409 must say that held entries are what fills it."""
    size = 64 << 10
    tenant_id, key = daemon.tenant("held-refusals", 2 * size)
    patched = daemon.admin.patch(f"/v1/tenants/{tenant_id}", json={"max_buffers": 2})
    assert patched.status_code == 200, patched.text
    r = connect(daemon, key)
    fds: list[int] = []
    try:
        for i in range(2):
            bid = put_committed(r, f"e{i}", pattern(size, 70 + i))
            _found, fd = raw_lookup(r, [f"e{i}"])
            fds.append(fd)
            assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
            _release(daemon, key, bid)
        _expect(daemon, tenant_id, key, 2 * size, 2)
        with daemon.client(key) as c:
            assert c.get("/v1/buffers").json() == []  # none of them is the tenant's to see
            over = c.post("/v1/reserve", json={"size_bytes": size})
            assert over.status_code == 409, over.text
            assert over.json()["type"].endswith("quota-exceeded"), over.text
            assert "2 of them (131072 bytes) are released entries still held" in over.text
        assert daemon.admin.patch(
            f"/v1/tenants/{tenant_id}", json={"quota_bytes": 64 * MiB}
        ).is_success
        reply, _fds = r.call(Put(key="n", size_bytes=PAGE))
        assert isinstance(reply, Error), reply
        assert reply.status == 409, reply
        assert (reply.type or "").endswith("buffer-count-exceeded"), reply
        assert "released entries still held" in reply.detail, reply
        for fd in fds:
            os.close(fd)
        fds.clear()
        wait_until(lambda: tenant_usage(daemon, key)["buffers"] == 0, message="freed")
        assert _reserve(daemon, key, 2 * size) == 201
    finally:
        for fd in fds:
            os.close(fd)
        r.close()
    after_attack(daemon)


# --- held on one host, asked of another (a shared PostgreSQL ledger) ---------------------------


@pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
def test_an_entry_held_on_one_host_counts_on_every_host(tmp_path: Path):
    """Two daemons on one ledger: an entry released on host A and held by A's worker counts
    in its tenant's quota on host B too — B refuses a reserve beyond the quota minus it —
    while the held breakdown (``held_bytes``, ``--held``, the metric) is A's to report:
    B, which never had the memfd, reports none of it. When the worker lets go, B gets the
    whole quota."""
    quota, size = 8 * MiB, 4 * MiB
    with fresh_pg_database() as url:
        hosts = [
            Daemon(
                tmp_path / name,
                env={"MAASD_DB_URL": url, "MAASD_NODE_NAME": name, "MAASD_HOST_TIMEOUT_S": "3"},
            )
            for name in ("held-a", "held-b")
        ]
        try:
            a, b = (d.start() for d in hosts)
            tenant_id, key = a.tenant("two-hosts", quota)
            r = connect(a, key)
            bid = put_committed(r, "e", pattern(size, 80))
            _found, fd = raw_lookup(r, ["e"])
            try:
                assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
                _release(a, key, bid)
                _expect(a, tenant_id, key, size, 1)
                assert _held_pids(a, tenant_id) == {bid: [os.getpid()]}
                on_b = tenant_usage(b, key)
                assert (on_b["used_bytes"], on_b["buffers"]) == (size, 1), on_b
                assert on_b["held_bytes"] == 0, on_b  # not B's memfd: A reports it
                assert _reserve(b, key, quota - size + PAGE) == 409
                assert _reserve(b, key, quota - size) == 201
            finally:
                os.close(fd)
                r.close()
            wait_until(lambda: tenant_usage(b, key)["used_bytes"] == 0, message="freed")
            _expect(a, tenant_id, key, 0, 0)
            assert _reserve(b, key, quota) == 201
        finally:
            for d in hosts:
                d.close()
