"""The read-only fds kept for the hottest committed entries (maasd.core.rofds)."""

from __future__ import annotations

import fcntl
import os

import pytest

from maasd.allocator import F_SEAL_FUTURE_WRITE, Region
from maasd.core.rofds import ReadOnlyFds


def memfd_region(*, parked: bool = False) -> Region:
    """A real region of one page: frozen and parked (no fd of its own) if ``parked``."""
    if not parked:
        return Region.create(4096, node=0, prefault=False)
    region = Region.create(4096, node=0, extra_seals=F_SEAL_FUTURE_WRITE)
    if not region.park():
        pytest.skip("this process cannot re-open its mappings (maasd.allocator.parking)")
    return region


def read_only(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


def test_handles_are_new_read_only_fds_and_the_hottest_are_kept() -> None:
    ro = ReadOnlyFds(keep=2)
    regions = {name: memfd_region() for name in "abc"}
    try:
        handles = [ro.handle(name, regions[name]) for name in "aab"]
        assert len(set(handles)) == 3  # each a descriptor of its own, for the caller
        assert all(read_only(fd) for fd in handles)
        for fd in handles:
            os.close(fd)
        assert len(ro) == 2
        ro.handle("a", regions["a"])  # a is now the hottest: c pushes b out
        os.close(ro.handle("c", regions["c"]))
        assert len(ro) == 2
        assert set(ro._fds) == {"a", "c"}
        before = len(os.listdir("/proc/self/fd"))
        ro.drop("a")  # its kept fd is closed
        assert len(ro) == 1
        assert len(os.listdir("/proc/self/fd")) == before - 1
        ro.drop("unknown")  # nothing kept: nothing to close
    finally:
        for r in regions.values():
            os.close(r.fd)


def test_keeping_none_reopens_every_time() -> None:
    ro = ReadOnlyFds(keep=0)
    r = memfd_region()
    try:
        fd = ro.handle("a", r)
        assert read_only(fd)
        os.close(fd)
        assert len(ro) == 0
    finally:
        os.close(r.fd)


def test_a_parked_entry_is_re_opened_read_only_through_its_mapping() -> None:
    region = memfd_region(parked=True)
    ro = ReadOnlyFds(keep=1)
    try:
        fd = ro.handle("a", region)
        try:
            assert read_only(fd)
            assert os.fstat(fd).st_size == 4096
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & F_SEAL_FUTURE_WRITE  # the same sealed file, not a copy
        finally:
            os.close(fd)
    finally:
        ro.drop("a")
        region.close()
