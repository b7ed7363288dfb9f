"""Attacks on idle committed entries that keep no fd (maasd.allocator.parking).

A committed ``memfd`` entry's region closes its fd once frozen and keeps only the
daemon's mapping; a lookup re-opens the file read-only through
``/proc/self/map_files/<start>-<end>``, inode checked. Each test drives a real daemon
(``conftest.Daemon``) as a tenant or worker would, and checks what SPEC.md promises:
no tenant reaches another's bytes, every byte is zero after release, a handle of a
committed entry never becomes writable, bounds hold (a clear 507, never ``EMFILE``),
and everyone else keeps working.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from budgets import default_limits
from conftest import Daemon
from hardening import after_attack, another_tenant_works, tenant_usage
from maasd.allocator import parking
from maasd.core.limits import open_files_needed
from maasd.protocol import Attach, Attached, Commit, Detach, Error, Found, Lookup, Ok, Put, Reserved
from sockpeer import Raw
from waiting import wait_until

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

pytestmark = [
    pytest.mark.skipif(not parking.can_park(), reason="this host cannot re-open mappings"),
    pytest.mark.skipif(os.geteuid() != 0, reason="reads the daemon's /proc/PID/fd"),
]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _memfd_fds(pid: int) -> int:
    n = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:maasd-"):
                n += 1
        except OSError:
            continue
    return n


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/memfd:maasd-" in line)


def _prlimit(files: int) -> list[str]:
    return ["prlimit", f"--nofile={files}:{files}", "--"]


def test_persistent_buffers_beyond_the_files_budget_stop_the_start_and_are_kept(
    tmp_path: Path,
) -> None:
    """Persistent REST buffers (not entries: they keep their fd) restored at a start
    under an ``RLIMIT_NOFILE`` whose files budget cannot hold them.

    Parking lets the *regions* budget grow to the mappings' (vm.max_map_count), but a
    buffer still needs an fd. Must hold: the start is refused with a ConfigError naming
    LimitNOFILE and nothing is released (every buffer's bytes come back at a limit that
    holds them) — never a restore that runs into EMFILE and releases persistent buffers
    whose restore failed."""
    buffers = 1200
    d = Daemon(tmp_path / "d", env={"MAASD_TENANT_REGION_SHARE": "1"}).start()
    try:
        pool = d.pool("keep", 64 * MiB, persistence="persistent")
        _tid, key = d.tenant("keeper", GiB)
        ids: list[str] = []
        with d.client(key) as c:
            for _ in range(buffers):
                r = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": 4 * KiB})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
        assert d.stop() == 0  # every persistent buffer checkpointed
        files = open_files_needed(default_limits(4096, None, tenant_share=1.0), 100)
        assert files is not None
        assert files < buffers  # files for 100 buffers: restoring 1,200 would run out
        d.wrapper = _prlimit(files)
        with pytest.raises(RuntimeError, match="maasd exited") as e:
            d.start()
        assert "nothing was released" in str(e.value), str(e.value)[-3000:]
        assert "LimitNOFILE" in str(e.value)
        d.wrapper = []  # the limit back: every buffer comes back
        d.start()
        with d.client(key) as c:
            r = c.get("/v1/buffers")
            assert r.status_code == 200, r.text
            body = r.json()
            listed = body["buffers"] if isinstance(body, dict) else body
            live = {b["id"] for b in listed if b.get("state", "live") == "live"}
            assert live >= set(ids), f"{len(set(ids) - live)} persistent buffers were released"
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
    finally:
        d.close()


# --- helpers over the raw socket ------------------------------------------------------


def _put(r: Raw, key: str, data: bytes, pool: str | None = None) -> str:
    """Put ``data`` under ``key`` and commit it (raw frames); the entry's id."""
    reply, fds = r.call(Put(key=key, size_bytes=len(data), pool=pool))
    assert isinstance(reply, Reserved), reply
    assert len(fds) == 1
    try:
        os.pwrite(fds[0], data, 0)
    finally:
        os.close(fds[0])
    ok, fds = r.call(Commit(buffer_id=reply.buffer_id))
    assert isinstance(ok, Ok), ok
    assert fds == []
    return reply.buffer_id


def _lookup(r: Raw, keys: list[str]) -> tuple[Found | None, int | None]:
    """A lookup: the hit and its fd, or ``(None, None)`` for a 404."""
    reply, fds = r.call(Lookup(keys=keys))
    if isinstance(reply, Error):
        assert reply.status == 404, reply
        assert fds == []
        return None, None
    assert isinstance(reply, Found), reply
    assert len(fds) == 1
    return reply, fds[0]


def _peer(d: Daemon, key: str) -> Raw:
    r = Raw(d.socket_path, timeout=30)
    r.hello(key)
    return r


@pytest.fixture
def d(tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path / "d", env={"MAASD_SOCKET_MAX_PER_TENANT": "64"}).start()
    yield daemon
    daemon.close()


def _release(d: Daemon, key: str, buffer_id: str) -> None:
    with d.client(key) as c:
        r = c.delete(f"/v1/buffers/{buffer_id}")
        assert r.status_code in (204, 404), r.text


class _Race:
    """Tenant A's churn and readers and tenant B's puts, as threads that note what broke."""

    SIZE = 16 * KiB
    KEYS = tuple(f"k{i}" for i in range(4))

    def __init__(self, d: Daemon, key_a: str, key_b: str) -> None:
        self.d, self.key_a, self.key_b = d, key_a, key_b
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.hits = collections.Counter[str]()

    def pattern(self, k: str, gen: int) -> bytes:
        head = bytes([0xA0 | self.KEYS.index(k)]) + gen.to_bytes(4, "little")
        return head + b"\xaa" * (self.SIZE - 5)

    def run(self, target: Callable[[], None]) -> Callable[[], None]:
        def guarded() -> None:
            try:
                target()
            except Exception as e:
                self.errors.append(f"{target.__name__}: {e!r}")

        return guarded

    def churn(self) -> None:
        """A: put, commit and release each key, generation after generation."""
        with contextlib.closing(_peer(self.d, self.key_a)) as r:
            gen = 1
            while not self.stop.is_set():
                for k in self.KEYS:
                    _release(self.d, self.key_a, _put(r, k, self.pattern(k, gen)))
                gen += 1

    def other_tenant(self) -> None:
        """B: entries of the same size, put and released; A's keys never found."""
        with contextlib.closing(_peer(self.d, self.key_b)) as r:
            i = 0
            while not self.stop.is_set():
                buffer_id = _put(r, f"b{i}", b"\xbb" * self.SIZE)
                found, fd = _lookup(r, list(self.KEYS))
                if fd is not None:
                    os.close(fd)
                    self.errors.append(f"tenant B found A's key {found}")
                _release(self.d, self.key_b, buffer_id)
                i += 1

    def reader(self) -> None:
        """A: look its keys up; each hit read through its fd."""
        with contextlib.closing(_peer(self.d, self.key_a)) as r:
            while not self.stop.is_set():
                k = random.choice(self.KEYS)
                _found, fd = _lookup(r, [k])
                if fd is not None:
                    self.check(k, fd)

    def check(self, k: str, fd: int) -> None:
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                self.errors.append("a lookup's fd is not read-only")
            data = os.pread(fd, self.SIZE, 0)
        finally:
            os.close(fd)
        mark = 0xA0 | self.KEYS.index(k)
        if data[0] == mark and data[5:] == b"\xaa" * (self.SIZE - 5):
            self.hits["bytes"] += 1
        elif data[0] in (mark, 0) and _torn(data[5:], b"\xaa" * (self.SIZE - 5)):
            self.hits["zeros"] += 1  # released while read: its bytes, then zeros
        else:
            self.errors.append(f"key {k} read {data[:8].hex()}…")


def test_lookups_racing_release_and_re_put_never_reach_another_file(d: Daemon) -> None:
    """Tenant A puts, commits and releases entries of one size under a few keys in a
    loop; tenant B, meanwhile, puts entries of the very same size (so its new regions
    get mapped where A's were just unmapped); readers of A look up A's keys all along.

    Must hold: every hit of A is A's bytes of that key (whatever generation) or zeros
    (released while read), never B's bytes nor another key's, and its fd is read-only;
    B never finds A's keys; afterwards the daemon is healthy and holds what the ledger
    says."""
    _, key_a = d.tenant("racer-a", 256 * MiB)
    _, key_b = d.tenant("racer-b", 256 * MiB)
    race = _Race(d, key_a, key_b)
    targets = [race.churn, race.other_tenant, race.reader, race.reader, race.reader]
    threads = [threading.Thread(target=race.run(t)) for t in targets]
    for t in threads:
        t.start()
    time.sleep(20)
    race.stop.set()
    for t in threads:
        t.join(60)
    assert not race.errors, race.errors[:5]
    assert race.hits["bytes"] > 50, race.hits
    after_attack(d)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1
MAP_FAILED = ctypes.c_void_p(-1).value


def _mprotect_writable(fd: int, size: int) -> bool:
    """Map ``fd`` shared read-only, then ask for write access: whether it was granted."""
    addr = _libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    assert addr != MAP_FAILED, os.strerror(ctypes.get_errno())
    try:
        return _libc.mprotect(addr, size, PROT_READ | PROT_WRITE) == 0
    finally:
        _libc.munmap(addr, size)


def _read_only_hit(
    d: Daemon, key: str, r: Raw, name: str, want: bytes, *, release: str | None = None
) -> None:
    """Look ``name`` up: its fd is read-only, no way to write it works, and it reads
    ``want``; with ``release``, that buffer is released meanwhile and the fd reads zeros."""
    _found, fd = _lookup(r, [name])
    assert fd is not None, f"{name} not found"
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert _writes_granted(fd, len(want)) == []
        assert os.pread(fd, len(want), 0) == want
        if release is not None:
            _release(d, key, release)
            assert os.pread(fd, len(want), 0) == bytes(len(want))
    finally:
        os.close(fd)


def _writes_granted(fd: int, size: int, *, read_only: bool = True) -> list[str]:
    """Every way a worker might make an fd of a committed entry write it: the ways that
    worked (none may)."""
    got: list[str] = []
    attempts: list[tuple[str, Callable[[], object]]] = [
        ("write", lambda: os.pwrite(fd, b"X", 0)),
        ("mmap shared writable", lambda: mmap.mmap(fd, size, mmap.MAP_SHARED)),
        ("ftruncate", lambda: os.ftruncate(fd, size * 2)),
        ("punch", lambda: _punch(fd, size)),
    ]
    for what, attempt in attempts:
        try:
            attempt()
        except OSError:
            continue
        got.append(what)
    if read_only:
        with contextlib.suppress(OSError):  # F_SETFL cannot change the access mode
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_RDWR | os.O_APPEND)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            got.append("F_SETFL O_RDWR")
    if _mprotect_writable(fd, size):
        got.append("mprotect PROT_WRITE")
    return got


def _punch(fd: int, size: int) -> None:
    mode = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, ctypes.c_long(0), ctypes.c_long(size)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def test_a_lookup_fd_of_a_parked_entry_never_writes_it(d: Daemon) -> None:
    """A worker gets a lookup's fd of a parked entry (no fd of the daemon's: it was
    re-opened through /proc/self/map_files) and tries every way to write through it:
    pwrite, a writable shared mmap, ftruncate, a hole punch, F_SETFL O_RDWR, mprotect of
    a read-only shared mapping; then the same through a re-open of it O_RDWR by the
    worker (/proc/self/fd/N: a memfd's mode lets root open it so).

    Must hold: the fd is O_RDONLY; nothing of it is granted but the O_RDWR re-open, and
    that one can write nothing either (the F_SEAL_FUTURE_WRITE seal); a lookup after
    every attempt reads the committed bytes; the daemon held no memfd fd of the entry."""
    assert d.proc is not None
    _, key = d.tenant("writer", 64 * MiB)
    size = 64 * KiB
    data = bytes(range(256)) * (size // 256)
    with contextlib.closing(_peer(d, key)) as r:
        buffer_id = _put(r, "frozen", data)
        assert _maps_of(d.proc.pid, buffer_id) == 1  # its one mapping, by its name
        assert _memfd_fds_of(d.proc.pid, buffer_id) == 0, "the entry did not park"
        found, fd = _lookup(r, ["frozen"])
        assert found is not None
        assert fd is not None
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert _writes_granted(fd, size) == []
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                assert _writes_granted(rw, size, read_only=False) == []
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        found, fd = _lookup(r, ["frozen"])
        assert fd is not None
        try:
            assert os.pread(fd, size, 0) == data
        finally:
            os.close(fd)
        _release(d, key, buffer_id)
    after_attack(d)


def _maps_of(pid: int, buffer_id: str) -> int:
    """The daemon's mappings of the entry's memfd."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f"/memfd:maasd-e-{buffer_id[:8]}" in line)


def _memfd_fds_of(pid: int, buffer_id: str) -> int:
    """The daemon's fds of the buffer's memfd (its own, and kept read-only ones)."""
    n = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if f"maasd-e-{buffer_id[:8]}" in os.readlink(f"/proc/{pid}/fd/{name}"):
                n += 1
    return n


def test_a_parked_entry_held_after_release_reads_zeros_and_counts_until_let_go(
    d: Daemon,
) -> None:
    """A worker looks up a parked entry, re-opens the fd it got through /proc/self/fd
    (a description of its own, which the daemon never saw) and closes the original,
    then the tenant releases the entry, and later puts again.

    Must hold: the daemon keeps neither an fd nor its mapping of the entry after the
    release; the re-opened fd reads zeros (every byte scrubbed); the tenant's usage and
    held bytes count the entry until the worker lets go, so a put beyond its quota is
    refused 409 meanwhile; once it lets go everything comes back."""
    assert d.proc is not None
    quota, size = 1 * MiB, 512 * KiB
    _, key = d.tenant("keeper", quota)
    with contextlib.closing(_peer(d, key)) as r:
        buffer_id = _put(r, "kept", b"\x77" * size)
        assert _memfd_fds_of(d.proc.pid, buffer_id) == 0, "the entry did not park"
        _found, fd = _lookup(r, ["kept"])
        assert fd is not None
        mine = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.close(fd)
        try:
            assert os.pread(mine, 8, 0) == b"\x77" * 8
            _release(d, key, buffer_id)
            assert os.pread(mine, size, 0) == bytes(size)
            assert _maps_of(d.proc.pid, buffer_id) == 0
            assert _memfd_fds_of(d.proc.pid, buffer_id) == 0
            u = tenant_usage(d, key)
            assert (u["used_bytes"], u["held_bytes"]) == (size, size), u
            reply, fds = r.call(Put(key="more", size_bytes=size + 4 * KiB))
            for f in fds:
                os.close(f)
            assert isinstance(reply, Error), reply
            assert reply.status == 409, reply
        finally:
            os.close(mine)
        wait_until(lambda: tenant_usage(d, key)["used_bytes"] == 0, message="held entry freed")
        assert tenant_usage(d, key)["held_bytes"] == 0
        _release(d, key, _put(r, "after", b"\x01" * size))
    after_attack(d)


FILES = 2000
ENTRIES = 5000


def _flood_staged(r: Raw, prefix: str, most: int) -> tuple[list[int], Error]:
    """Put (never commit) entries until refused: the writable fds got, and the refusal."""
    held: list[int] = []
    for i in range(most):
        reply, fds = r.call(Put(key=f"{prefix}{i}", size_bytes=4 * KiB))
        if isinstance(reply, Error):
            assert fds == []
            return held, reply
        assert isinstance(reply, Reserved), reply
        held.extend(fds)
    raise AssertionError(f"{most} staged entries and never refused")


def test_parked_entries_beyond_the_files_limit_and_staged_floods_meet_their_share(
    tmp_path: Path,
) -> None:
    """A daemon under RLIMIT_NOFILE 2,000 (a files budget of a few hundred): tenant A
    commits 5,000 entries (far beyond the open files: they park); tenant B floods staged
    puts (each holds an fd) and tenant C REST buffers, until refused.

    Must hold: all of A's entries commit and are found with their bytes; B and C are
    refused with a 507 resource-limit at their share of the regions *holding an open
    file*, never EMFILE nor 500; meanwhile a fourth tenant puts, commits, looks up and
    reserves; /healthz stays 200; the daemon's fds stay under its limit and its log
    has no "Too many open files"."""
    lim = default_limits(FILES, 65530, parks_entries=True)
    share = lim.tenant_file_budget
    assert ENTRIES > FILES > 3 * share
    env = {"MAASD_MAX_BUFFERS_PER_TENANT": str(2 * ENTRIES), "MAASD_DEFAULT_POOL_BYTES": str(GiB)}
    d = Daemon(tmp_path / "d", env=env, wrapper=_prlimit(FILES)).start()
    try:
        assert d.proc is not None
        pid = d.proc.pid
        _, key_a = d.tenant("many", GiB)
        with contextlib.closing(_peer(d, key_a)) as r:
            for i in range(ENTRIES):
                _put(r, f"e{i}", i.to_bytes(4, "little") * 1024)
            assert _memfd_maps(pid) >= ENTRIES
            assert _fds(pid) < FILES - lim.headroom // 2, f"{_fds(pid)} fds"
        _, key_b = d.tenant("stager", GiB)
        r_b = _peer(d, key_b)
        staged, refusal = _flood_staged(r_b, "s", 4 * share)
        assert (refusal.status, refusal.type) == (
            507,
            "https://maasd.dev/problems/resource-limit",
        ), refusal
        assert "holding an open file" in refusal.detail, refusal.detail
        assert len(staged) == share, (len(staged), share)
        _, key_c = d.tenant("rester", GiB)
        with d.client(key_c) as c:
            made = 0
            resp = c.post("/v1/reserve", json={"size_bytes": 4 * KiB})
            while resp.status_code == 201 and made < 4 * share:
                made += 1
                resp = c.post("/v1/reserve", json={"size_bytes": 4 * KiB})
            assert resp.status_code == 507, resp.text
            assert resp.json()["type"].endswith("resource-limit"), resp.text
            assert made == share, (made, share)
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
        _, key_d = d.tenant("bystander", GiB)
        with contextlib.closing(_peer(d, key_d)) as r:
            _put(r, "mine", b"\x42" * 8 * KiB)
            _found, fd = _lookup(r, ["mine"])
            assert fd is not None
            assert os.pread(fd, 4, 0) == b"\x42" * 4
            os.close(fd)
        another_tenant_works(d)
        with contextlib.closing(_peer(d, key_a)) as r:
            for i in random.sample(range(ENTRIES), 200) + [0, ENTRIES - 1]:
                found, fd = _lookup(r, [f"e{i}"])
                assert fd is not None, f"e{i} not found"
                assert os.pread(fd, 8, 4 * KiB - 8) == i.to_bytes(4, "little") * 2
                os.close(fd)
        for f in staged:
            os.close(f)
        r_b.close()
        assert _fds(pid) < FILES
        assert "Too many open files" not in d.log()
        assert d.admin.get("/healthz").status_code == 200
    finally:
        d.close()


def test_a_checkpointed_parked_entry_comes_back_after_a_kill_with_its_bytes_parked(
    tmp_path: Path,
) -> None:
    """A parked entry of a persistent pool is checkpointed over REST (its bytes read
    through the daemon's mapping: it has no fd), then the daemon is SIGKILLed and
    started again.

    Must hold: the checkpoint answers 200; after the restart the entry is found with
    exactly its bytes, read-only, and the daemon holds its mapping and no fd of it (it
    parked again); an entry never checkpointed is gone (a miss)."""
    d = Daemon(tmp_path / "d").start()
    try:
        assert d.proc is not None
        d.pool("keep", 64 * MiB, persistence="persistent")
        _, key = d.tenant("keeper", GiB)
        data = os.urandom(96 * KiB)
        with contextlib.closing(_peer(d, key)) as r:
            kept = _put(r, "kept", data, pool="keep")
            _put(r, "lost", b"\x01" * 4 * KiB, pool="keep")
            assert _memfd_fds_of(d.proc.pid, kept) == 0, "the entry did not park"
        with d.client(key) as c:
            resp = c.post(f"/v1/buffers/{kept}/checkpoint")
            assert resp.status_code == 200, resp.text
        d.kill()
        d.start()
        assert d.proc is not None
        with contextlib.closing(_peer(d, key)) as r:
            # (a restored region's memfd is named maasd-buffer: counted, not named)
            assert _memfd_maps(d.proc.pid) == 1
            assert _memfd_fds(d.proc.pid) == 0, "the restored entry did not park"
            found, fd = _lookup(r, ["kept"])
            assert found is not None
            assert fd is not None
            try:
                assert found.buffer_id == kept
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                assert os.pread(fd, len(data) + 1, 0) == data
            finally:
                os.close(fd)
            assert _lookup(r, ["lost"]) == (None, None)
    finally:
        d.close()


def test_persistent_entries_beyond_the_open_files_come_back_parked_at_a_low_limit(
    tmp_path: Path,
) -> None:
    """1,200 entries of a persistent pool (and a few buffers) are checkpointed by a clean
    stop; the daemon starts again under an RLIMIT_NOFILE whose files budget holds 100.

    Must hold: it starts (the entries need no fd, only the few buffers do), every entry
    comes back parked — the daemon's memfd fds are the buffers' alone, its memfd
    mappings all of them — with its bytes, and a new put still works."""
    entries, buffers = 1200, 5
    d = Daemon(tmp_path / "d", env={"MAASD_TENANT_REGION_SHARE": "1"}).start()
    try:
        pool = d.pool("keep", 64 * MiB, persistence="persistent")
        _, key = d.tenant("keeper", GiB)
        with contextlib.closing(_peer(d, key)) as r:
            for i in range(entries):
                _put(r, f"p{i}", i.to_bytes(4, "little") * 1024, pool="keep")
        with d.client(key) as c:
            for _ in range(buffers):
                resp = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": 4 * KiB})
                assert resp.status_code == 201, resp.text
        assert d.stop() == 0
        files = open_files_needed(default_limits(4096, None, tenant_share=1.0), 100)
        assert files is not None
        assert files < entries
        d.wrapper = _prlimit(files)
        d.start()
        assert d.proc is not None
        assert _memfd_fds(d.proc.pid) == buffers
        assert _memfd_maps(d.proc.pid) == entries + buffers
        with contextlib.closing(_peer(d, key)) as r:
            for i in [0, entries - 1, *random.sample(range(entries), 50)]:
                _found, fd = _lookup(r, [f"p{i}"])
                assert fd is not None, f"p{i} not restored"
                try:
                    assert os.pread(fd, 4 * KiB, 0) == i.to_bytes(4, "little") * 1024
                finally:
                    os.close(fd)
            _put(r, "new", b"\x09" * 4 * KiB)
        assert "Too many open files" not in d.log()
    finally:
        d.close()


def test_a_pinned_parked_entry_is_still_found_and_scrubbed(d: Daemon) -> None:
    """A parked entry is pinned (PATCH pin: its pages migrated through the daemon's
    mapping, which an mbind could split) and its placement asked for; a worker holds a
    lookup's fd; the entry is released.

    Must hold: the pin answers 200 with every page on the node; a lookup after it still
    re-opens the entry (its mapping is one range, as map_files needs) with its bytes;
    after the release the holder reads zeros and the daemon keeps nothing of it."""
    assert d.proc is not None
    _, key = d.tenant("pinner", 64 * MiB)
    size = 256 * KiB
    data = os.urandom(size)
    with contextlib.closing(_peer(d, key)) as r:
        buffer_id = _put(r, "pinned", data)
        assert _memfd_fds_of(d.proc.pid, buffer_id) == 0, "the entry did not park"
        with d.client(key) as c:
            resp = c.patch(f"/v1/buffers/{buffer_id}/pin", json={"numa_node": 0})
            assert resp.status_code == 200, resp.text
            assert resp.json()["placement"] == {"0": size // mmap.PAGESIZE}, resp.text
            assert c.get(f"/v1/buffers/{buffer_id}").status_code == 200
        assert _maps_of(d.proc.pid, buffer_id) == 1, "the pin split the entry's mapping"
        _found, fd = _lookup(r, ["pinned"])
        assert fd is not None, "a pinned entry is no longer found"
        try:
            assert os.pread(fd, size, 0) == data
            _release(d, key, buffer_id)
            assert os.pread(fd, size, 0) == bytes(size)
        finally:
            os.close(fd)
        assert _lookup(r, ["pinned"]) == (None, None)
    after_attack(d)


def test_deleting_a_tenant_under_lookups_of_its_parked_entries(d: Daemon) -> None:
    """Readers of a tenant look its parked entries up in a loop (each fd kept a while)
    while the admin deletes the tenant; another tenant with entries of the same size
    puts and looks up throughout.

    Must hold: every read is the entry's bytes or zeros, never the other tenant's; after
    the deletion the fds still held read zeros; the other tenant's entries keep their
    bytes; the daemon is healthy and holds exactly what the ledger says."""
    tenant_id, key = d.tenant("doomed", 64 * MiB)
    _, other = d.tenant("survivor", 64 * MiB)
    size = 32 * KiB
    with contextlib.closing(_peer(d, key)) as r:
        for i in range(40):
            _put(r, f"d{i}", b"\xd0" * size)
    stop = threading.Event()
    errors: list[str] = []
    kept: list[int] = []
    survivors: list[str] = []

    def reader() -> None:
        with contextlib.suppress(OSError, AssertionError), contextlib.closing(_peer(d, key)) as r:
            while not stop.is_set():
                _found, fd = _lookup(r, [f"d{random.randrange(40)}"])
                if fd is None:
                    continue
                data = os.pread(fd, size, 0)
                if not _torn(data, b"\xd0" * size):  # its bytes, or (deleted) zeros
                    errors.append(f"read {data[:8].hex()}")
                kept.append(fd)

    def survivor() -> None:
        with contextlib.closing(_peer(d, other)) as r:
            i = 0
            while not stop.is_set():
                survivors.append(_put(r, f"s{i}", b"\x5e" * size))
                _found, fd = _lookup(r, [f"s{i}"])
                assert fd is not None
                if os.pread(fd, size, 0) != b"\x5e" * size:
                    errors.append(f"survivor's s{i} changed")
                os.close(fd)
                i += 1

    threads = [threading.Thread(target=reader) for _ in range(3)]
    threads.append(threading.Thread(target=survivor))
    for t in threads:
        t.start()
    time.sleep(3)
    assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]
    assert kept, "no lookup hit before the deletion"
    for fd in kept:
        assert os.pread(fd, size, 0) == bytes(size), "a deleted tenant's entry kept bytes"
        os.close(fd)
    with contextlib.closing(_peer(d, other)) as r:  # the survivor's entries kept theirs
        _found, first = _lookup(r, ["s0"])
        assert first is not None
        assert os.pread(first, size, 0) == b"\x5e" * size
        os.close(first)
    for buffer_id in survivors:  # (after_attack compares the ledger with buffers' fds)
        _release(d, other, buffer_id)
    after_attack(d)


def test_entry_fds_keep_holds_an_fd_per_entry_and_the_same_guarantees(tmp_path: Path) -> None:
    """``MAASD_ENTRY_FDS=keep``: idle entries keep their memfd open, as before parking.

    Must hold: each committed entry holds one daemon fd (none parks); a lookup's fd is
    read-only and cannot write; a release zeroes what a holder sees; the files share
    of staged puts is unchanged in kind (committed entries count as files here)."""
    d = Daemon(tmp_path / "d", env={"MAASD_ENTRY_FDS": "keep"}).start()
    try:
        assert d.proc is not None
        _, key = d.tenant("keeper", 64 * MiB)
        size = 16 * KiB
        with contextlib.closing(_peer(d, key)) as r:
            ids = [_put(r, f"k{i}", bytes([i]) * size) for i in range(20)]
            assert all(_memfd_fds_of(d.proc.pid, b) == 1 for b in ids), "an entry parked"
            _read_only_hit(d, key, r, "k7", b"\x07" * size, release=ids[7])
            for b in ids:
                _release(d, key, b)
        after_attack(d)
    finally:
        d.close()


@pytest.mark.parametrize("scrub", ["zero", "punch"])
def test_every_way_a_parked_entry_is_held_reads_zeros_after_release(d: Daemon, scrub: str) -> None:
    """A parked entry of a pool scrubbing by ``scrub`` is held by a worker in three ways
    — the lookup's fd, a read-only shared mapping of it, and a private (copy-on-write)
    mapping written by the worker — then released.

    Must hold: the fd and the shared mapping read zeros at once (a punch is refused for
    a frozen entry: it is zeroed through the daemon's mapping); the worker's private
    copy keeps only the page it copied (its own memory), its other pages read zeros, and
    nothing it wrote reached the entry; no later lookup finds it."""
    pool = d.pool(f"scrub-{scrub}", 16 * MiB, scrub=scrub)
    _, key = d.tenant(f"holder-{scrub}", 64 * MiB)
    size = 64 * KiB
    with contextlib.closing(_peer(d, key)) as r:
        buffer_id = _put(r, "held", b"\x3c" * size, pool=pool["id"])
        _found, fd = _lookup(r, ["held"])
        assert fd is not None
        shared = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        private = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            private[:4] = b"mine"  # copy-on-write: the worker's page, not the entry's
            _again, fd2 = _lookup(r, ["held"])
            assert fd2 is not None
            assert os.pread(fd2, 8, 0) == b"\x3c" * 8, "a private write reached the entry"
            os.close(fd2)
            _release(d, key, buffer_id)
            assert os.pread(fd, size, 0) == bytes(size)
            assert shared[:] == bytes(size)
            assert private[:4] == b"mine"
            # its copied page is its own (a copy of what it could read); the rest is the
            # entry's, zeroed
            assert private[mmap.PAGESIZE :] == bytes(size - mmap.PAGESIZE)
        finally:
            shared.close()
            private.close()
            os.close(fd)
        assert _lookup(r, ["held"]) == (None, None)
    after_attack(d)


def _parked_inodes(pid: int, name: str) -> set[int]:
    """Inodes of the daemon's memfd mappings named ``name`` that it holds no fd of."""
    with open(f"/proc/{pid}/maps") as f:
        mapped = {
            int(p[4])
            for p in (ln.split(maxsplit=5) for ln in f)
            if len(p) == 6 and p[5].startswith(f"/memfd:{name} ")
        }
    fds = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            fds.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return mapped - fds


def test_entries_committed_into_stocked_regions_park_and_are_found(tmp_path: Path) -> None:
    """Entries of a pool with a warm stock: the commit's fresh region comes from the
    stock (a ``maasd-warm`` memfd), cut to the entry's size (its tail unmapped from the
    daemon's mapping) and sealed frozen there, then parked. A lookup re-opens it
    through map_files, which names the mapping by its exact range.

    Must hold: stocked regions are committed into and park (mapped, no fd); every entry
    is found with exactly its bytes and size; a release zeroes what a holder sees."""
    d = Daemon(tmp_path / "d", env={"MAASD_WARM_MIN_AVAILABLE_BYTES": "0"}).start()
    try:
        assert d.proc is not None
        r = d.admin.post(
            "/v1/pools",
            json={
                "name": "warm",
                "numa_node": 0,
                "capacity_bytes": 64 * MiB,
                "warm_bytes": 8 * MiB,
            },
        )
        assert r.status_code == 201, r.text
        _, key = d.tenant("stocked", 64 * MiB)
        size = 33 * mmap.PAGESIZE  # of the 34-page class: cut at take time
        ids: list[str] = []
        with contextlib.closing(_peer(d, key)) as peer:
            for i in range(24):
                ids.append(_put(peer, f"x{i}", bytes([0x80 | i]) * size, pool="warm"))
                time.sleep(0.1)  # the stock refills between
            parked = _parked_inodes(d.proc.pid, "maasd-warm")
            assert parked, "no entry was committed into a stocked region and parked"
            for i in range(len(ids)):
                _found, fd = _lookup(peer, [f"x{i}"])
                assert fd is not None, f"x{i} not found"
                try:
                    assert os.fstat(fd).st_size == size
                    assert os.pread(fd, size + 1, 0) == bytes([0x80 | i]) * size
                    if os.fstat(fd).st_ino in parked:
                        parked.discard(os.fstat(fd).st_ino)
                finally:
                    os.close(fd)
            assert not parked, "a parked stocked region is no entry found"
            _found, fd = _lookup(peer, ["x0"])
            assert fd is not None
            try:
                _release(d, key, ids[0])
                assert os.pread(fd, size, 0) == bytes(size)
            finally:
                os.close(fd)
            for buffer_id in ids[1:]:
                _release(d, key, buffer_id)
        after_attack(d)
    finally:
        d.close()


#: Runs a process as root without the capabilities map_files needs (so nothing parks).
NO_MAP_FILES = ["setpriv", "--bounding-set=-sys_admin,-checkpoint_restore", "--"]


def test_a_daemon_that_cannot_re_open_its_mappings_keeps_entry_fds_and_works(
    tmp_path: Path,
) -> None:
    """The daemon runs without CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN (its entry_fds
    is the default, ``auto``): it cannot open /proc/self/map_files, so nothing may park.

    Must hold: every committed entry keeps its fd (a parked one could never be looked up
    again); lookups answer its bytes read-only; a release zeroes what a holder sees."""
    d = Daemon(tmp_path / "d", wrapper=NO_MAP_FILES).start()
    try:
        assert d.proc is not None
        _, key = d.tenant("capless", 64 * MiB)
        size = 16 * KiB
        with contextlib.closing(_peer(d, key)) as r:
            ids = [_put(r, f"c{i}", bytes([i + 1]) * size) for i in range(10)]
            assert all(_memfd_fds_of(d.proc.pid, b) == 1 for b in ids), "an entry parked"
            for i in range(10):
                want = bytes([i + 1]) * size
                _read_only_hit(d, key, r, f"c{i}", want, release=ids[3] if i == 3 else None)
            for b in ids:
                _release(d, key, b)
        after_attack(d)
    finally:
        d.close()


def _doctor_checks(tmp_path: Path, env: dict[str, str], wrapper: list[str]) -> dict[str, dict]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    full_env.update({"MAASD_DATA_DIR": str(tmp_path / "data"), **env})
    p = subprocess.run(
        [*wrapper, sys.executable, "-m", "maasd.cli.daemon", "doctor", "--json"]
        + ["--skip", "llama-cpp-python"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.stdout, p.stderr
    return {c["name"]: c for c in json.loads(p.stdout)["checks"]}


@pytest.mark.parametrize(
    ("env", "wrapper", "status", "says"),
    [
        ({}, [], "ok", "no open file"),
        ({"MAASD_ENTRY_FDS": "keep"}, [], "ok", 'entry_fds = "keep"'),
        ({}, NO_MAP_FILES, "warn", "cannot open /proc/self/map_files"),
    ],
)
def test_the_doctor_says_what_an_idle_entry_costs_the_way_the_daemon_runs(
    tmp_path: Path, env: dict[str, str], wrapper: list[str], status: str, says: str
) -> None:
    """``maasd doctor`` run as the daemon would be: parking (root, capable), ``keep``,
    and without the capabilities map_files needs.

    Must hold: the "entry cost" check says which of the two an entry costs, a warning
    with a fix where the daemon wants to park and cannot; the region budget names the
    open files only regions that keep one need where entries park."""
    checks = _doctor_checks(tmp_path, env, wrapper)
    c = checks["entry cost"]
    assert (c["status"], says in c["detail"]) == (status, True), c
    if status == "warn":
        assert "CAP_CHECKPOINT_RESTORE" in c["fix"], c
    parks = "idle entries keep no open file" in checks["region budget"]["detail"]
    assert parks == (says == "no open file"), checks["region budget"]


def test_attach_by_id_of_a_parked_entry_is_read_only_and_its_tenants_alone(d: Daemon) -> None:
    """An Attach frame naming a parked entry's id (not a lookup by key), by its tenant
    and by another tenant who learnt the id; then Detach and release.

    Must hold: its tenant gets a read-only fd of exactly its bytes (re-opened through
    map_files); the other tenant gets a 404 and no fd; after the release an Attach is a
    404 and the fd held reads zeros."""
    _, key = d.tenant("owner", 64 * MiB)
    _, thief = d.tenant("thief", 64 * MiB)
    size = 8 * KiB
    with contextlib.closing(_peer(d, key)) as r, contextlib.closing(_peer(d, thief)) as t:
        buffer_id = _put(r, "by-id", b"\x6d" * size)
        reply, fds = t.call(Attach(buffer_id=buffer_id))
        assert isinstance(reply, Error), reply
        assert (reply.status, fds) == (404, [])
        reply, fds = r.call(Attach(buffer_id=buffer_id))
        assert isinstance(reply, Attached), reply
        (fd,) = fds
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert _writes_granted(fd, size) == []
            assert os.pread(fd, size + 1, 0) == b"\x6d" * size
            ok, fds = r.call(Detach(buffer_id=buffer_id))
            assert (ok, fds) == (Ok(), [])
            _release(d, key, buffer_id)
            assert os.pread(fd, size, 0) == bytes(size)
        finally:
            os.close(fd)
        reply, fds = r.call(Attach(buffer_id=buffer_id))
        assert isinstance(reply, Error), reply
        assert (reply.status, fds) == (404, [])
    after_attack(d)


def test_lookups_racing_eviction_of_parked_entries_read_their_own_bytes(d: Daemon) -> None:
    """A pool of 1 MiB: a writer puts 64 KiB entries without end, each evicting the
    coldest (a release of a parked entry), while readers look up recent keys and keep
    each fd a moment; a second tenant's entries of the same size share the pool's host.

    Must hold: every hit reads its own key's bytes or zeros (evicted while held), never
    another entry's; the writer is never refused (eviction makes room); the daemon is
    healthy afterwards."""
    pool = d.pool("tiny", 1 * MiB)
    _, key = d.tenant("evicted", 256 * MiB)
    size = 64 * KiB
    written = [0]
    stop = threading.Event()
    errors: list[str] = []
    seen = collections.Counter[str]()

    def body(i: int) -> bytes:
        return i.to_bytes(4, "little") * (size // 4)

    def writer() -> None:
        with contextlib.closing(_peer(d, key)) as r:
            while not stop.is_set():
                _put(r, f"v{written[0]}", body(written[0]), pool=pool["id"])
                written[0] += 1

    def reader() -> None:
        with contextlib.closing(_peer(d, key)) as r:
            while not stop.is_set():
                i = max(0, written[0] - random.randrange(1, 24))
                _found, fd = _lookup(r, [f"v{i}"])
                if fd is None:
                    seen["miss"] += 1
                    continue
                try:
                    time.sleep(0.001)
                    data = os.pread(fd, size, 0)
                finally:
                    os.close(fd)
                if data == body(i):
                    seen["bytes"] += 1
                elif _torn(data, body(i)):
                    seen["zeros"] += 1
                else:
                    errors.append(f"v{i} read {data[:8].hex()}: neither its bytes nor zeros")

    def guarded(f: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                f()
            except Exception as e:
                errors.append(f"{f.__name__}: {e!r}")

        return run

    threads = [threading.Thread(target=guarded(f)) for f in (writer, reader, reader)]
    for t in threads:
        t.start()
    time.sleep(15)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]
    assert written[0] > 3 * (MiB // size), written  # it evicted, many times over
    assert seen["bytes"] > 20, seen
    _release_all(d, key)
    after_attack(d)


def _torn(got: bytes, want: bytes) -> bool:
    """Every byte of ``got`` is ``want``'s or zero: a read racing the release's memset
    (a ``pread`` is no snapshot: it may see a page half zeroed)."""
    g, w = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    return len(got) == len(want) and bool(np.all((g == w) | (g == 0)))


def _release_all(d: Daemon, key: str) -> None:
    """Release every buffer the tenant holds (after_attack compares the ledger with the
    buffers' fds, which committed entries are not)."""
    with d.client(key) as c:
        for b in c.get("/v1/buffers").json():
            _release(d, key, b["id"])


def test_at_the_whole_files_budget_parked_entries_are_still_looked_up(tmp_path: Path) -> None:
    """Under RLIMIT_NOFILE 2,000, a reader tenant commits 300 entries (parked), then
    five tenants flood staged puts until each is refused: together they hold every
    region the files budget allows an open file.

    Must hold: each flood ends in a 507 resource-limit (its share, or the daemon's
    budget), never EMFILE nor a 500; with the files budget full, the reader still looks
    up its parked entries (each a re-open: an fd from the headroom) with their bytes,
    and a new put of its is a 507 naming the budget; /healthz stays 200; once the
    floods let go, the reader puts again."""
    lim = default_limits(FILES, 65530, parks_entries=True)
    d = Daemon(tmp_path / "d", env={"MAASD_DEFAULT_POOL_BYTES": str(GiB)}, wrapper=_prlimit(FILES))
    d.start()
    floods: list[tuple[Raw, list[int]]] = []
    try:
        assert d.proc is not None
        _, reader_key = d.tenant("reader", GiB)
        reader = _peer(d, reader_key)
        for i in range(300):
            _put(reader, f"r{i}", i.to_bytes(4, "little") * 1024)
        held = 0
        for n in range(5):
            _, key = d.tenant(f"flood{n}", GiB)
            r = _peer(d, key)
            fds, refusal = _flood_staged(r, "s", 4 * lim.tenant_file_budget)
            floods.append((r, fds))
            held += len(fds)
            assert (refusal.status, refusal.type) == (
                507,
                "https://maasd.dev/problems/resource-limit",
            ), refusal
        assert held >= lim.file_budget - 4, (held, lim.file_budget)  # the stock, a few
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
        for i in [0, 299, *random.sample(range(300), 40)]:
            _found, fd = _lookup(reader, [f"r{i}"])
            assert fd is not None, f"r{i} not found at the files budget"
            try:
                assert os.pread(fd, 8, 0) == i.to_bytes(4, "little") * 2
            finally:
                os.close(fd)
        reply, fds = reader.call(Put(key="one-more", size_bytes=4 * KiB))
        assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status == 507, reply
        for r, fds in floods:
            for f in fds:
                os.close(f)
            r.close()
        floods.clear()
        wait_until(
            lambda: _put_or_refusal(reader, "after") is None, timeout=30, message="room again"
        )
        reader.close()
        assert "Too many open files" not in d.log()
        assert " 500 " not in d.log()
    finally:
        for r, fds in floods:
            for f in fds:
                os.close(f)
            r.close()
        d.close()


def _put_or_refusal(r: Raw, key: str) -> Error | None:
    """Put and commit ``key`` (None), or the refusal of the put."""
    reply, fds = r.call(Put(key=key, size_bytes=4 * KiB))
    if isinstance(reply, Error):
        assert fds == []
        return reply
    assert isinstance(reply, Reserved), reply
    os.close(fds[0])
    ok, _ = r.call(Commit(buffer_id=reply.buffer_id))
    assert isinstance(ok, Ok), ok
    return None
