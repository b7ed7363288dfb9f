"""Regions against the real kernel: seals, scrub, placement, huge pages, checkpoints, errors.

Nothing here mocks a syscall. Whatever another process could do with a buffer's
fd is tried from another process, which received the fd the way a worker does
(SCM_RIGHTS over a Unix socket) or re-opened it through ``/proc/<pid>/fd/N``.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import json
import mmap
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import hugepages
from maasd.allocator import _sys
from maasd.allocator.numa import POPULATE_CHUNK
from maasd.allocator.persist import checkpoint, file_checksum, restore
from maasd.allocator.region import SEALS, Region, copy_region
from maasd.allocator.scrub import ZERO_RANGES
from maasd.bounds import ScrubMode
from maasd.errors import BackingError, InvalidRequest, MaasdError, PlacementError, ResourceLimit
from maasd.topology import discover
from processes import fd_table

PAGE = os.sysconf("SC_PAGE_SIZE")
HUGE = 2 << 20
MiB = 1 << 20
PUNCH = _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE
F_SEAL_FUTURE_WRITE = _sys.F_SEAL_FUTURE_WRITE


open_fds = fd_table


def mapping_count() -> int:
    """memfd mappings of this process (other mappings come and go with the Python heap)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:" in line)


def as_array(region: Region) -> np.ndarray:
    return np.frombuffer(region.view(), dtype=np.uint8)


# -- another process ------------------------------------------------------------------------

# Receives the fd (SCM_RIGHTS on the socket given in argv, or /proc/<pid>/fd/N), tries
# everything the seals forbid and reports the errno of each attempt as JSON.
SEAL_CHILD = textwrap.dedent("""
    import ctypes, fcntl, json, mmap, os, socket, sys
    how, arg, page = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if how == "scm":
        sock = socket.socket(fileno=int(arg))
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        fd = fds[0]
    else:
        sock = None
        fd = os.open(arg, os.O_RDWR)
    size = os.fstat(fd).st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    out = {"pid": os.getpid(), "size": size, "seals": fcntl.fcntl(fd, fcntl.F_GET_SEALS)}
    def attempt(name, fn):
        try:
            fn()
            out[name] = 0
        except OSError as e:
            out[name] = e.errno
    def falloc(off, length):
        if libc.fallocate(fd, 0, off, length) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    attempt("grow", lambda: os.ftruncate(fd, size + page))
    attempt("shrink", lambda: os.ftruncate(fd, size - page))
    attempt("truncate0", lambda: os.ftruncate(fd, 0))
    attempt("fallocate_beyond", lambda: falloc(size, page))
    attempt("fallocate_straddling", lambda: falloc(size - page, 2 * page))
    attempt("add_seal_write", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
    attempt("add_seal_again", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW))
    m = mmap.mmap(fd, size)          # inside its bounds the buffer is an ordinary shared file
    m[:5] = b"child"
    m.close()
    out["size_after"] = os.fstat(fd).st_size
    print(json.dumps(out), flush=True)
""")


def seals_seen_by_child_over_scm(region: Region, page: int) -> dict:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = region.dup_fd()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SEAL_CHILD, "scm", str(child.fileno()), str(page)],
            pass_fds=(child.fileno(),),
            stdout=subprocess.PIPE,
            text=True,
        )
        child.close()
        socket.send_fds(parent, [b"fd"], [fd])
        out, _ = proc.communicate(timeout=30)
    finally:
        os.close(fd)
        parent.close()
    assert proc.returncode == 0, out
    return json.loads(out)


def seals_seen_by_child_via_proc(region: Region, page: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SEAL_CHILD,
            "proc",
            f"/proc/{os.getpid()}/fd/{region.fd}",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return json.loads(out)


def assert_sealed_for(report: dict, size: int) -> None:
    assert report["pid"] != os.getpid()
    assert report["size"] == size
    assert report["seals"] & SEALS == SEALS
    for op in (
        "grow",
        "shrink",
        "truncate0",
        "fallocate_beyond",
        "fallocate_straddling",
        "add_seal_write",
        "add_seal_again",
    ):
        assert report[op] == errno.EPERM, f"{op}: errno {report[op]}, expected EPERM"
    assert report["size_after"] == size


# Maps the fd it inherited, fills it with 0xA5, then answers "check" lines with what
# its still-open mapping reads.
SCRUB_CHILD = textwrap.dedent("""
    import json, mmap, sys
    import numpy as np
    fd, size = int(sys.argv[1]), int(sys.argv[2])
    m = mmap.mmap(fd, size)
    a = np.frombuffer(m, dtype=np.uint8)
    a.fill(0xA5)
    print("filled", flush=True)
    for line in sys.stdin:
        print(json.dumps({"any": bool(a.any()), "all_a5": bool((a == 0xA5).all())}), flush=True)
""")


class ChildMapping:
    """A child process holding its own MAP_SHARED mapping of a region's fd."""

    def __init__(self, region: Region) -> None:
        fd = region.dup_fd()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SCRUB_CHILD, str(fd), str(region.size)],
                pass_fds=(fd,),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        finally:
            os.close(fd)  # the child has its own copy; the mapping outlives both fds
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None
        assert stdout is not None
        self.stdin, self.stdout = stdin, stdout
        assert self.stdout.readline().strip() == "filled"

    def check(self) -> dict:
        self.stdin.write("check\n")
        self.stdin.flush()
        return json.loads(self.stdout.readline())

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=30)
        self.stdout.close()

    def __enter__(self) -> ChildMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scrub_seen_by_child(region: Region, mode: ScrubMode) -> None:
    with ChildMapping(region) as child:
        assert child.check() == {"any": True, "all_a5": True}
        assert (as_array(region) == 0xA5).all()  # the daemon's mapping shares the page
        region.scrub(mode)
        assert child.check()["any"] is False, f"{mode}: stale mapping still reads data"
        assert not as_array(region).any()
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == SEALS
        assert os.fstat(region.fd).st_size == region.size


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def region():
    r = Region.create(64 * PAGE, node=0)
    yield r
    r.close()


@pytest.fixture(scope="class")
def huge_pages():
    """A few free 2 MiB huge pages for a test class (configured when root; else skipped)."""
    with hugepages.configured(8) as pages:
        yield pages


# -- creation and bounds --------------------------------------------------------------------


class TestCreate:
    def test_rounded_sealed_bound_and_zero(self):
        r = Region.create(5000, node=0)
        try:
            assert r.size == 2 * PAGE
            assert os.fstat(r.fd).st_size == r.size
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == SEALS
            assert fcntl.fcntl(r.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert os.readlink(f"/proc/self/fd/{r.fd}").startswith("/memfd:maasd-buffer")
            assert not as_array(r).any()
        finally:
            r.close()

    def test_each_region_is_its_own_file(self):
        a, b = Region.create(PAGE, node=0), Region.create(PAGE, node=0)
        try:
            assert os.fstat(a.fd).st_ino != os.fstat(b.fd).st_ino
            as_array(a)[:] = 7
            assert not as_array(b).any()
        finally:
            a.close()
            b.close()

    def test_close_is_idempotent_and_final(self, region):
        fd = region.fd
        region.close()
        region.close()
        assert region.closed
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
        for op in (region.view, region.placement, region.dup_fd, lambda: region.scrub("zero")):
            with pytest.raises(BackingError) as exc:
                op()
            assert exc.value.errno == errno.EBADF

    def test_no_leak_over_many_regions(self):
        fds, maps = open_fds(), mapping_count()
        for _ in range(50):
            r = Region.create(3 * PAGE, node=0)
            r.scrub("punch")
            r.close()
        assert open_fds() <= fds
        assert mapping_count() == maps

    @pytest.mark.parametrize("size", [0, -1, 1.5, "4096", True, None])
    def test_bad_size(self, size):
        fds = open_fds()
        with pytest.raises(InvalidRequest):
            Region.create(size, node=0)
        assert open_fds() <= fds

    def test_unknown_backing(self):
        with pytest.raises(InvalidRequest, match="backing"):
            Region.create(PAGE, node=0, backing="ramdisk")  # type: ignore[arg-type]

    def test_unknown_scrub_mode(self, region):
        as_array(region)[:] = 1
        with pytest.raises(InvalidRequest, match="scrub"):
            region.scrub("shred")
        assert (as_array(region) == 1).all()  # nothing happened


class TestStockRegions:
    """Regions made unsealed for a warm stock, cut to size and sealed when taken."""

    def test_unsealed_region_never_leaves(self):
        r = Region.create(4 * PAGE, node=0, seal=False)
        try:
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == 0
            assert not r.sealed
            with pytest.raises(BackingError) as exc:
                r.dup_fd()
            assert exc.value.errno == errno.EPERM
        finally:
            r.close()

    def test_seal_at_cuts_the_file_and_the_mapping(self):
        r = Region.create(64 * PAGE, node=0, seal=False)
        try:
            as_array(r)[:] = 3
            maps = mapping_count()
            r.seal_at(40 * PAGE)
            assert (r.size, os.fstat(r.fd).st_size) == (40 * PAGE, 40 * PAGE)
            assert os.fstat(r.fd).st_blocks * 512 == 40 * PAGE  # the tail's pages are freed
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == SEALS
            assert mapping_count() == maps
            line = next(
                line
                for line in Path("/proc/self/maps").read_text().splitlines()
                if line.startswith(f"{r.address:x}-")
            )
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            assert end - start == 40 * PAGE  # the daemon's mapping was cut too
            assert (as_array(r) == 3).all()
            assert_sealed_for(seals_seen_by_child_over_scm(r, PAGE), 40 * PAGE)
        finally:
            r.close()

    def test_seal_at_the_full_size_only_seals(self):
        r = Region.create(4 * PAGE, node=0, seal=False)
        try:
            r.seal_at(4 * PAGE, F_SEAL_FUTURE_WRITE)
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == SEALS | F_SEAL_FUTURE_WRITE
            os.close(r.dup_fd())
        finally:
            r.close()

    @pytest.mark.parametrize("size", [0, -PAGE, PAGE + 1, 5 * PAGE])
    def test_seal_at_refuses_a_bad_size(self, size):
        r = Region.create(4 * PAGE, node=0, seal=False)
        try:
            with pytest.raises(InvalidRequest):
                r.seal_at(size)
            assert (r.size, r.sealed) == (4 * PAGE, False)
        finally:
            r.close()

    def test_seal_at_refuses_a_sealed_region(self, region):
        with pytest.raises(BackingError) as exc:
            region.seal_at(region.size)
        assert exc.value.errno == errno.EPERM

    def test_populate_can_be_cut_short(self):
        r = Region.create(40 * MiB, node=0, prefault=False, seal=False)
        try:
            assert r.populate(abort=lambda: True) is False
            assert os.fstat(r.fd).st_blocks == 0
            asked = iter([False, True])  # one step, then stop
            assert r.populate(abort=lambda: next(asked)) is False
            assert os.fstat(r.fd).st_blocks * 512 == POPULATE_CHUNK  # one step, then stop
            assert r.populate(abort=lambda: False) is True
            assert os.fstat(r.fd).st_blocks * 512 == r.size
            assert r.placement(sample=16) == {0: 16}
        finally:
            r.close()

    def test_extra_seals_keep_the_daemon_writing_and_everyone_else_out(self):
        r = Region.create(4 * PAGE, node=0, extra_seals=F_SEAL_FUTURE_WRITE)
        try:
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == SEALS | F_SEAL_FUTURE_WRITE
            as_array(r)[:] = 9  # the daemon's mapping was made before the seal
            fd = r.dup_fd()
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, r.size)
                with pytest.raises(PermissionError):
                    os.pwrite(fd, b"x", 0)
            finally:
                os.close(fd)
            r.scrub("punch")  # refused by the seal: zeroed through the mapping instead
            assert not as_array(r).any()
        finally:
            r.close()

    def test_read_into_reads_the_file(self):
        r = Region.create(3 * PAGE, node=0)
        try:
            as_array(r)[:] = np.arange(r.size, dtype=np.uint64).astype(np.uint8)
            buf = bytearray(2 * PAGE)
            assert r.read_into(buf, PAGE) == 2 * PAGE
            assert bytes(buf) == bytes(as_array(r)[PAGE:])
            assert r.read_into(buf, 2 * PAGE) == PAGE  # short at the end
            assert r.read_into(buf, r.size) == 0
        finally:
            r.close()


class TestSeals:
    def test_fd_has_shrink_grow_seal(self, region):
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == (
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )

    def test_child_over_scm_rights_cannot_resize_or_reseal(self, region):
        report = seals_seen_by_child_over_scm(region, PAGE)
        assert_sealed_for(report, region.size)
        assert bytes(region.view()[:5]) == b"child"  # and it did write inside its bounds

    def test_child_via_proc_fd_cannot_resize_or_reseal(self, region):
        report = seals_seen_by_child_via_proc(region, PAGE)
        assert_sealed_for(report, region.size)

    def test_daemon_itself_cannot_resize(self, region):
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, region.size * 2)
        with pytest.raises(BackingError) as exc:
            _sys.fallocate(region.fd, 0, region.size, PAGE)
        assert exc.value.errno == errno.EPERM

    def test_punch_still_works_when_sealed(self, region):
        arr = as_array(region)
        arr[:] = 0x5A
        _sys.fallocate(region.fd, _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE, 0, PAGE)
        assert np.count_nonzero(arr[:PAGE]) == 0  # the punched page reads zeros in the mapping
        assert np.all(arr[PAGE:] == 0x5A)  # and only that page
        assert os.fstat(region.fd).st_size == region.size  # KEEP_SIZE: the seals still hold


class TestScrub:
    @pytest.mark.parametrize("mode", ["zero", "punch"])
    def test_stale_mapping_in_child_reads_zeros(self, region, mode):
        scrub_seen_by_child(region, mode)

    @pytest.mark.parametrize("mode", ["zero", "punch"])
    def test_scrub_twice_and_reuse_by_daemon(self, region, mode):
        as_array(region)[:] = 0x5A
        region.scrub(mode)
        region.scrub(mode)
        assert not as_array(region).any()
        as_array(region)[:] = 3  # still usable until closed
        assert (as_array(region) == 3).all()

    @pytest.mark.parametrize(
        "pattern",
        ["untouched", "one_page", "few_ranges", "more_ranges_than_zeroed_alone", "all", "punched"],
    )
    def test_zero_skips_holes_and_zeroes_every_written_byte(self, pattern):
        """The memset covers what holds bytes, not the holes (which it would fault in)."""
        pages = 4 * ZERO_RANGES
        r = Region.create(pages * PAGE, node=0, prefault=False)
        fd = r.dup_fd()
        stale = mmap.mmap(fd, r.size)  # a worker's mapping, kept past the scrub
        os.close(fd)
        try:
            arr = np.frombuffer(stale, dtype=np.uint8)
            if pattern == "one_page":
                arr[5 * PAGE + 17] = 1
            elif pattern == "few_ranges":
                for p in (0, 7, 8, 9, pages - 1):
                    arr[p * PAGE : p * PAGE + 3] = 0xA5
            elif pattern == "more_ranges_than_zeroed_alone":
                for p in range(0, pages, 2):  # every other page: 2x ZERO_RANGES ranges
                    arr[p * PAGE + PAGE - 1] = 0x5A
            elif pattern in ("all", "punched"):
                arr[:] = 0x33
                if pattern == "punched":  # the worker punched some pages out again
                    _sys.fallocate(r.fd, PUNCH, 3 * PAGE, 10 * PAGE)
            written = os.fstat(r.fd).st_blocks
            r.scrub("zero", punch=False)
            if pattern != "more_ranges_than_zeroed_alone":  # (past those: one memset)
                assert os.fstat(r.fd).st_blocks == written  # no hole faulted in to be zeroed
            assert os.pread(r.fd, r.size, 0) == bytes(r.size)
            assert not arr.any()  # the stale mapping reads zeros
            assert not as_array(r).any()
            del arr
        finally:
            stale.close()
            r.close()

    def test_punch_gives_pages_back(self):
        r = Region.create(256 * PAGE, node=0)
        try:
            as_array(r)[:] = 1
            assert os.fstat(r.fd).st_blocks * 512 >= r.size
            r.scrub("punch")
            assert os.fstat(r.fd).st_blocks == 0
            r.scrub("zero")
            assert os.fstat(r.fd).st_blocks == 0  # zero also returns the pages
        finally:
            r.close()

    def test_new_region_of_same_size_is_zero(self):
        sizes = []
        for mode in ("zero", "punch"):
            r = Region.create(64 * PAGE, node=0)
            as_array(r)[:] = 0xA5
            r.scrub(mode)
            r.close()
            fresh = Region.create(64 * PAGE, node=0)
            try:
                sizes.append(fresh.size)
                assert not as_array(fresh).any()
            finally:
                fresh.close()
        assert sizes == [64 * PAGE, 64 * PAGE]


class TestPlacement:
    def test_prefaulted_region_is_on_node_zero(self):
        r = Region.create(4 * MiB, node=0, prefault=True)
        try:
            assert r.placement() == {0: 4 * MiB // PAGE}
            line = next(
                line
                for line in Path("/proc/self/numa_maps").read_text().splitlines()
                if line.startswith(f"{r.address:x} ")
            )
            assert "bind:0" in line  # the second witness
            assert f"N0={4 * MiB // PAGE}" in line
        finally:
            r.close()

    def test_not_prefaulted_is_faulted_for_the_count(self):
        r = Region.create(16 * PAGE, node=0, prefault=False)
        try:
            assert os.fstat(r.fd).st_blocks == 0
            assert r.placement() == {0: 16}
        finally:
            r.close()

    def test_pin_to_node_zero(self, region):
        as_array(region)[:] = 9
        assert region.pin(0, discover().node_ids) == {0: region.size // PAGE}
        assert region.node == 0
        assert (as_array(region) == 9).all()  # migration keeps the bytes

    def test_pin_to_missing_node(self, region):
        missing = max(discover().node_ids) + 1
        with pytest.raises(PlacementError, match=f"node {missing}"):
            region.pin(missing, discover().node_ids)
        assert region.node == 0

    @pytest.mark.parametrize("node", [True, "0", 0.0, None, -1])
    def test_pin_to_nonsense_node(self, region, node):
        with pytest.raises(PlacementError):
            region.pin(node, frozenset({0}))

    def test_pin_to_node_the_kernel_lacks(self, region):
        """The two-node fixture claims node 1; on a host without it, the kernel refuses."""
        fixture = discover(
            sysfs_root=Path(__file__).resolve().parents[1] / "data" / "sysfs_two_nodes",
            hugepage_bytes=HUGE,
        )
        if 1 in discover().node_ids:
            pytest.skip("this host really has node 1")
        with pytest.raises(PlacementError) as exc:
            region.pin(1, fixture.node_ids)
        assert isinstance(exc.value.__cause__, BackingError)
        assert exc.value.__cause__.errno in (errno.EINVAL, errno.ENODEV)
        assert region.node == 0
        assert region.placement() == {0: region.size // PAGE}


class TestErrors:
    def test_mbind_to_node_63_carries_errno_and_operation(self, region):
        with pytest.raises(BackingError) as exc:
            _sys.mbind(region.address, region.size, 63)
        assert exc.value.errno == errno.EINVAL
        assert "mbind" in exc.value.detail
        assert "node 63" in exc.value.detail
        assert "EINVAL" in exc.value.detail
        assert isinstance(exc.value, MaasdError)

    def test_pin_to_63_is_placement_error_from_a_backing_error(self, region):
        with pytest.raises(PlacementError) as exc:
            region.pin(63, frozenset({0, 63}))
        cause = exc.value.__cause__
        assert isinstance(cause, BackingError)
        assert cause.errno == errno.EINVAL
        assert "mbind" in exc.value.detail

    def test_create_on_node_63_leaks_nothing(self):
        fds, maps = open_fds(), mapping_count()
        with pytest.raises(BackingError) as exc:
            Region.create(PAGE, node=63)
        assert exc.value.errno == errno.EINVAL
        assert open_fds() <= fds
        assert mapping_count() == maps

    def test_memfd_create_bad_flags(self):
        with pytest.raises(BackingError) as exc:
            _sys.memfd_create("x", 0xFFFF)
        assert exc.value.errno == errno.EINVAL
        assert "memfd_create" in exc.value.detail

    def test_gigantic_pages_not_configured(self):
        free = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages")
        if not free.exists() or int(free.read_text()) > 0:
            pytest.skip("1 GiB huge pages are configured (or unsupported) here")
        fds, maps = open_fds(), mapping_count()
        with pytest.raises(BackingError) as exc:
            Region.create(1 << 30, node=0, backing="hugetlb", page_bytes=1 << 30)
        assert exc.value.errno in (errno.ENOMEM, errno.EINVAL)
        assert open_fds() <= fds
        assert mapping_count() == maps


@pytest.mark.hugetlb
@pytest.mark.usefixtures("huge_pages")
class TestHugetlb:
    def test_end_to_end(self):
        fds = open_fds()
        r = Region.create(3 * MiB, node=0, backing="hugetlb")
        try:
            assert (r.size, r.page_bytes, r.backing) == (4 * MiB, HUGE, "hugetlb")
            assert fcntl.fcntl(r.fd, fcntl.F_GET_SEALS) == SEALS
            assert_sealed_for(seals_seen_by_child_over_scm(r, HUGE), r.size)
            assert r.placement() == {0: 2}  # counted in 2 MiB pages
            for mode in ("zero", "punch"):
                scrub_seen_by_child(r, mode)
            assert r.pin(0, discover().node_ids) == {0: 2}
        finally:
            r.close()
        assert open_fds() <= fds

    def test_checkpoint_round_trip(self, tmp_path):
        r = Region.create(2 * MiB, node=0, backing="hugetlb")
        as_array(r)[:] = np.arange(r.size, dtype=np.uint64).astype(np.uint8)
        try:
            digest = checkpoint(r, tmp_path / "h.ckpt")
        finally:
            r.scrub("punch")
            r.close()
        back = restore(
            tmp_path / "h.ckpt", node=0, backing="hugetlb", size=2 * MiB, expected_checksum=digest
        )
        try:
            assert (as_array(back) == np.arange(back.size, dtype=np.uint64).astype(np.uint8)).all()
        finally:
            back.close()

    def test_a_write_sealed_region_is_scrubbed_without_a_punch(self):
        """F_SEAL_FUTURE_WRITE refuses the punch: the fallback zeroes present pages only."""
        r = Region.create(2 * HUGE, node=0, backing="hugetlb", extra_seals=F_SEAL_FUTURE_WRITE)
        try:
            as_array(r)[:] = 0xA5  # the daemon's own mapping predates the seal
            with pytest.raises(BackingError) as exc:
                _sys.fallocate(r.fd, PUNCH, 0, HUGE)
            assert exc.value.errno == errno.EPERM
            r.scrub("zero")
            assert not as_array(r).any()
        finally:
            r.close()


# The daemon's side of the punch-and-hog attack, in a process of its own so that a
# regression shows as a signal in its exit status instead of killing pytest. It makes a
# hugetlb region, fills it, punches its first huge page through a second fd (as a worker
# would), says "ready", waits for "go" (the hog holds every free huge page by then), then
# does everything the daemon does to a released or checkpointed region and reports.
HOG_VICTIM = textwrap.dedent("""
    import hashlib, json, os, sys
    from maasd.allocator import _sys
    from maasd.allocator.persist import checkpoint
    from maasd.allocator.region import Region, copy_region
    HUGE = 2 << 20
    r = Region.create(2 * HUGE, node=0, backing="hugetlb")
    dst = Region.create(2 * HUGE, node=0, backing="hugetlb")  # a commit's fresh region
    _sys.memset(r.address, 0xA5, r.size)
    worker = os.open(f"/proc/self/fd/{r.fd}", os.O_RDWR)
    _sys.fallocate(worker, _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE, 0, HUGE)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    out = {"placement": {str(k): v for k, v in r.placement().items()}}
    buf = bytearray(r.size)
    out["read"] = r.read_into(buf)
    out["read_sha"] = hashlib.sha256(buf).hexdigest()
    out["checkpoint_sha"] = checkpoint(r, sys.argv[1])
    out["copied"] = copy_region(r, dst)
    out["copy_sha"] = hashlib.sha256(dst.view()).hexdigest()
    r.scrub("zero")
    out["blocks_after_scrub"] = os.fstat(r.fd).st_blocks
    r.close()
    print(json.dumps(out), flush=True)
""")


@pytest.mark.hugetlb
@pytest.mark.usefixtures("huge_pages")
class TestHugetlbHoles:
    """Nothing the daemon does to a region a worker punched can fault it."""

    def test_punch_and_hog_then_everything_the_daemon_does(self, tmp_path):
        victim = subprocess.Popen(
            [sys.executable, "-c", HOG_VICTIM, str(tmp_path / "v.ckpt")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert victim.stdin is not None
        assert victim.stdout is not None
        try:
            assert victim.stdout.readline().strip() == "ready"
            with hugepages.Hog() as hog:
                assert hog.pages > 0
                assert hugepages.available() == 0
                victim.stdin.write("go\n")
                victim.stdin.flush()
                report = victim.stdout.readline()
                assert victim.wait(timeout=60) == 0, f"the region's owner died: {victim.returncode}"
        finally:
            victim.kill()
            victim.wait()
        expected = hashlib.sha256(bytes(HUGE) + b"\xa5" * HUGE).hexdigest()
        assert json.loads(report) == {
            "placement": {"-2": 1, "0": 1},  # the hole is reported, not populated
            "read": 2 * HUGE,
            "read_sha": expected,
            "checkpoint_sha": expected,
            "copied": 2 * HUGE,  # an entry's commit copies a hugetlb region with pread
            "copy_sha": expected,
            "blocks_after_scrub": 0,  # hugetlb scrubs punch, in both modes
        }
        assert file_checksum(tmp_path / "v.ckpt") == expected


class TestCopy:
    """``copy_region``: an entry's commit copies its staged bytes into a fresh region."""

    def test_a_memfd_region_is_copied_and_a_punched_hole_reads_as_zeros(self, region):
        data = np.random.default_rng(3).integers(1, 256, region.size, dtype=np.uint8)
        as_array(region)[:] = data
        worker = os.open(f"/proc/self/fd/{region.fd}", os.O_RDWR)  # as a writer would
        try:
            _sys.fallocate(worker, PUNCH, 2 * PAGE, 3 * PAGE)
        finally:
            os.close(worker)
        data[2 * PAGE : 5 * PAGE] = 0
        fresh = Region.create(region.size + PAGE, node=0)
        try:
            assert copy_region(region, fresh) == region.size
            assert (as_array(fresh)[: region.size] == data).all()
            assert not as_array(fresh)[region.size :].any()
        finally:
            fresh.close()

    def test_a_smaller_destination_is_refused_and_written_nowhere(self, region):
        as_array(region)[:] = 7
        small = Region.create(region.size - PAGE, node=0)
        try:
            with pytest.raises(InvalidRequest):
                copy_region(region, small)
            assert not as_array(small).any()
        finally:
            small.close()


class TestCheckpoint:
    @pytest.fixture
    def filled(self):
        r = Region.create(3 * MiB + 100, node=0)
        data = np.random.default_rng(7).integers(0, 256, r.size, dtype=np.uint8)
        as_array(r)[:] = data
        yield r, data
        r.close()

    def test_round_trip_byte_identical(self, filled, tmp_path):
        r, data = filled
        path = tmp_path / "buf.ckpt"
        digest = checkpoint(r, path)
        assert digest == hashlib.sha256(data.tobytes()).hexdigest() == file_checksum(path)
        assert path.stat().st_size == r.size
        assert not (tmp_path / "buf.ckpt.tmp").exists()
        back = restore(path, node=0, size=r.size, expected_checksum=digest)
        try:
            assert back.size == r.size
            assert back.fd != r.fd
            assert np.array_equal(as_array(back), data)
            assert fcntl.fcntl(back.fd, fcntl.F_GET_SEALS) == SEALS
            assert back.placement() == {0: back.size // PAGE}
        finally:
            back.close()

    def test_checkpoint_replaces_the_previous(self, filled, tmp_path):
        r, _ = filled
        path = tmp_path / "buf.ckpt"
        first = checkpoint(r, path)
        as_array(r)[0] ^= 0xFF
        second = checkpoint(r, path)
        assert first != second == file_checksum(path)

    def test_corrupted_file_is_refused_without_leaks(self, filled, tmp_path):
        r, _ = filled
        path = tmp_path / "buf.ckpt"
        digest = checkpoint(r, path)
        with open(path, "r+b") as f:
            f.seek(r.size // 2)
            b = f.read(1)
            f.seek(r.size // 2)
            f.write(bytes([b[0] ^ 0x01]))
        fds, maps = open_fds(), mapping_count()
        with pytest.raises(BackingError, match="checksum mismatch"):
            restore(path, node=0, size=r.size, expected_checksum=digest)
        assert open_fds() <= fds
        assert mapping_count() == maps

    @pytest.mark.parametrize("delta", [-PAGE, PAGE, -1])
    def test_wrong_size_is_refused(self, filled, tmp_path, delta):
        r, _ = filled
        path = tmp_path / "buf.ckpt"
        digest = checkpoint(r, path)
        fds = open_fds()
        with pytest.raises(BackingError, match="expected"):
            restore(path, node=0, size=r.size + delta, expected_checksum=digest)
        assert open_fds() <= fds

    def test_truncated_file_is_refused(self, filled, tmp_path):
        r, _ = filled
        path = tmp_path / "buf.ckpt"
        digest = checkpoint(r, path)
        os.truncate(path, r.size - PAGE)
        with pytest.raises(BackingError):
            restore(path, node=0, size=r.size, expected_checksum=digest)

    def test_missing_file(self, tmp_path):
        with pytest.raises(BackingError) as exc:
            restore(tmp_path / "nope.ckpt", node=0, size=PAGE)
        assert exc.value.errno == errno.ENOENT

    def test_a_symlink_planted_at_the_temporary_path_is_not_followed(self, filled, tmp_path):
        r, data = filled
        victim = tmp_path / "victim"
        victim.write_bytes(b"precious")
        path = tmp_path / "buf.ckpt"
        os.symlink(victim, tmp_path / "buf.ckpt.tmp")
        digest = checkpoint(r, path)
        assert victim.read_bytes() == b"precious"
        assert not (tmp_path / "buf.ckpt.tmp").exists()
        assert not path.is_symlink()
        assert digest == hashlib.sha256(data.tobytes()).hexdigest() == file_checksum(path)

    def test_a_stale_temporary_file_is_replaced(self, filled, tmp_path):
        r, data = filled
        (tmp_path / "buf.ckpt.tmp").write_bytes(b"left by a crash" * 1000)
        digest = checkpoint(r, tmp_path / "buf.ckpt")
        assert digest == hashlib.sha256(data.tobytes()).hexdigest()
        assert (tmp_path / "buf.ckpt").stat().st_size == r.size

    def test_holes_are_read_as_zeros_and_never_filled(self, tmp_path):
        r = Region.create(8 * PAGE, node=0)
        try:
            as_array(r)[:] = 0x5A
            worker = os.open(f"/proc/self/fd/{r.fd}", os.O_RDWR)
            try:
                _sys.fallocate(worker, PUNCH, 2 * PAGE, 3 * PAGE)
            finally:
                os.close(worker)
            blocks = os.fstat(r.fd).st_blocks
            expected = b"\x5a" * 2 * PAGE + bytes(3 * PAGE) + b"\x5a" * 3 * PAGE
            assert checkpoint(r, tmp_path / "h.ckpt") == hashlib.sha256(expected).hexdigest()
            assert os.fstat(r.fd).st_blocks == blocks  # read with pread: nothing allocated
        finally:
            r.close()

    def test_unwritable_directory(self, filled, tmp_path):
        """A spill directory that refuses the write is a limit the daemon is at (507, the
        detail says why), not a bug of the daemon (500)."""
        r, _ = filled
        with pytest.raises(ResourceLimit) as exc:
            checkpoint(r, tmp_path / "no" / "such" / "dir" / "buf.ckpt")
        assert "cannot take a checkpoint: No such file or directory" in exc.value.detail

    def test_a_directory_in_the_files_place_is_refused_without_leaks(self, tmp_path):
        path = tmp_path / "buf.ckpt"
        path.mkdir()
        (path / "x").write_bytes(bytes(PAGE))
        size = path.stat().st_size  # restore reads as many bytes as the "file" says
        fds, maps = open_fds(), mapping_count()
        with pytest.raises(BackingError) as exc:
            restore(path, node=0, size=size, expected_checksum="0" * 64)
        assert exc.value.errno == errno.EISDIR
        assert open_fds() <= fds
        assert mapping_count() == maps


class TestPrefault:
    """The file's pages exist (allocated, not just reserved) exactly when asked for."""

    def test_prefault_allocates_every_page_and_punch_frees_them(self):
        r = Region.create(1 * MiB, node=0, prefault=True)
        try:
            assert os.fstat(r.fd).st_blocks * 512 == r.size
            r.scrub("punch")
            assert os.fstat(r.fd).st_blocks == 0
        finally:
            r.close()

    def test_no_prefault_allocates_nothing(self):
        r = Region.create(1 * MiB, node=0, prefault=False)
        try:
            assert os.fstat(r.fd).st_blocks == 0
        finally:
            r.close()
