"""A committed entry's region without an fd of its own (maasd.allocator.parking): real
memfds, real mappings, the kernel's ``/proc/self/map_files``."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from maasd.allocator import F_SEAL_FUTURE_WRITE, Region, parking
from maasd.allocator.region import open_region_fds, open_regions
from maasd.errors import BackingError

pytestmark = pytest.mark.skipif(
    not parking.can_park(), reason="this process cannot re-open its mappings' files"
)


def frozen(size: int = 3 * 4096) -> Region:
    region = Region.create(size, node=0, extra_seals=F_SEAL_FUTURE_WRITE)
    region.view()[:] = b"\x5a" * region.size  # the daemon's mapping: writable before and after
    return region


def test_a_parked_region_holds_its_mapping_and_no_fd() -> None:
    region = frozen()
    regions, fds = open_regions(), open_region_fds()
    fd_number = region.fd
    assert region.park()
    assert region.parked
    assert not region.park()
    with pytest.raises(OSError, match="Bad file descriptor"):  # closed
        os.fstat(fd_number)
    assert (open_regions(), open_region_fds()) == (regions, fds - 1)
    with pytest.raises(BackingError) as e:
        _ = region.fd
    assert e.value.errno == errno.EBADF
    assert region.frozen
    assert bytes(region.view()[:4]) == b"\x5a" * 4  # the mapping kept the file
    region.close()
    assert (open_regions(), open_region_fds()) == (regions - 1, fds - 1)


def test_a_re_open_is_the_same_sealed_file_read_only() -> None:
    region = frozen()
    ino = os.fstat(region.fd).st_ino
    assert region.park()
    fd = region.reopen(os.O_RDONLY)
    try:
        st = os.fstat(fd)
        assert (st.st_ino, st.st_size) == (ino, region.size)
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
        assert os.pread(fd, 4, 0) == b"\x5a" * 4
        with pytest.raises(PermissionError):  # a worker's handle cannot map it writable
            mmap.mmap(fd, region.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        rw = region.reopen(os.O_RDWR)  # even a writable re-open cannot write: the seal
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"x", 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
        region.close()


def test_a_parked_region_is_read_and_scrubbed_through_its_mapping() -> None:
    region = frozen()
    assert region.park()
    buf = bytearray(region.size)
    assert region.read_into(buf, 4096) == region.size - 4096
    assert bytes(buf[: region.size - 4096]) == b"\x5a" * (region.size - 4096)
    holder = region.reopen(os.O_RDONLY)  # a worker still holding it
    try:
        region.scrub("punch")  # any mode: a frozen region is zeroed, never punched
        assert os.pread(holder, region.size, 0) == bytes(region.size)
    finally:
        os.close(holder)
        region.close()


def test_only_frozen_memfd_regions_park() -> None:
    plain = Region.create(4096, node=0)
    unsealed = Region.create(4096, node=0, seal=False)
    try:
        assert not plain.park()
        assert not unsealed.park()
        assert plain.fd >= 0
        assert unsealed.fd >= 0
    finally:
        plain.close()
        unsealed.close()


def test_a_closed_region_cannot_be_re_opened() -> None:
    region = frozen()
    assert region.park()
    region.close()
    with pytest.raises(BackingError):
        region.reopen()
    assert not region.park()


def test_a_mapping_is_re_opened_only_as_the_file_it_was() -> None:
    region = frozen()
    try:
        ino = os.fstat(region.fd).st_ino
        with pytest.raises(BackingError, match="not the region's file"):
            parking.open_mapped(region.address, region.size, ino + 1)
        with pytest.raises(BackingError):  # a range that is no mapping
            parking.open_mapped(region.address, region.size - 4096, ino)
        os.close(parking.open_mapped(region.address, region.size, ino))
    finally:
        region.close()


def test_the_daemons_ambient_capability_is_not_handed_to_its_children() -> None:
    """Under an ambient CAP_CHECKPOINT_RESTORE (as the unit grants it), a process that
    clears its ambient set keeps the capability and starts children without it."""
    if shutil.which("capsh") is None:
        pytest.skip("no capsh (libcap2-bin) to start a process with an ambient capability")
    script = (
        "import subprocess, sys\n"
        "from maasd.allocator import parking\n"
        "def amb(text):\n"
        "    return next(l.split()[1] for l in text.splitlines() if l.startswith('CapAmb'))\n"
        "before = amb(open('/proc/self/status').read())\n"
        "assert parking.keep_capabilities_to_self()\n"
        "child = subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True)\n"
        "print(before, amb(child.stdout), parking.can_park())\n"
    )
    out = subprocess.run(
        [
            "capsh",
            "--inh=cap_checkpoint_restore",
            "--addamb=cap_checkpoint_restore",
            "--",
            "-c",
            f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert int(out[0], 16) != 0, out  # the process had it, ambient
    assert int(out[1], 16) == 0, out  # its child has none
    assert out[2] == "True"  # and it still re-opens its mappings
