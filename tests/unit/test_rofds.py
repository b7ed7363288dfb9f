"""The read-only fds kept for the hottest committed entries (maasd.core.rofds)."""

from __future__ import annotations

import fcntl
import os
from types import SimpleNamespace
from typing import Any

from maasd.core.rofds import ReadOnlyFds


def memfd_region() -> Any:
    """What ReadOnlyFds reads of a region: its memfd (``.fd``), a real one."""
    fd = os.memfd_create("maasd-test")
    os.ftruncate(fd, 4096)
    return SimpleNamespace(fd=fd)


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
