"""Huge pages for the tests that need them, and a process that takes every free one.

Import as ``import hugepages`` (``tests/`` is on pytest's ``pythonpath``).

:func:`configured` makes sure at least N free 2 MiB huge pages exist for a block:
as root it raises ``/proc/sys/vm/nr_hugepages`` and restores the old count
afterwards; otherwise (or when the kernel cannot find the memory) it skips the
test and says why. The count is global to the host, so the block holds an
exclusive ``flock`` on a lock file for its whole length: two test runs on one
machine never restore each other's pages away.

:class:`Hog` is the attacker no worker action may harm the daemon against: a child
process that maps every free huge page (``MAP_ANONYMOUS | MAP_HUGETLB``) and touches
each one, until it is closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

HUGE = 2 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
LOCK = Path("/tmp/maasd-tests-hugepages.lock")


def meminfo(field: str) -> int:
    """A ``/proc/meminfo`` field as the number it shows (kB, or a page count)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def available() -> int:
    """Huge pages free and not reserved by any mapping: what a new mapping can take."""
    return meminfo("HugePages_Free") - meminfo("HugePages_Rsvd")


@contextlib.contextmanager
def configured(need: int) -> Iterator[int]:
    """At least ``need`` free 2 MiB huge pages for the block (see the module docstring)."""
    if meminfo("Hugepagesize") != HUGE // 1024:
        pytest.skip(f"default huge page size is {meminfo('Hugepagesize')} kB, not 2048 kB")
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            old = int(NR_HUGEPAGES.read_text())
        except OSError as e:
            pytest.skip(f"cannot read {NR_HUGEPAGES}: {e}")
        if available() >= need:
            yield need  # already there: nothing to configure or restore
            return
        if os.geteuid() != 0:
            pytest.skip(f"huge pages: only {available()} free and not root to add {need}")
        try:
            try:
                NR_HUGEPAGES.write_text(str(old + need))
            except OSError as e:
                pytest.skip(f"cannot configure huge pages via {NR_HUGEPAGES}: {e}")
            if available() < need:
                pytest.skip(
                    f"asked for {need} huge pages, the kernel gave {available()} "
                    "(memory too fragmented?)"
                )
            yield need
        finally:
            NR_HUGEPAGES.write_text(str(old))


# Maps every huge page it can (anonymous, MAP_HUGETLB), touches each, prints how many,
# and holds them until its stdin closes.
HOG = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    PROT_RW, MAP_PRIVATE, MAP_ANONYMOUS, MAP_HUGETLB = 3, 0x02, 0x20, 0x40000
    HUGE = 2 << 20
    held = 0
    while True:  # one page per mapping: each is reserved at mmap, then faulted in
        addr = libc.mmap(None, HUGE, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(addr, 1, 1)
        held += 1
    print(held, flush=True)
    sys.stdin.read()
""")


class Hog:
    """A child process holding every huge page it could take (``pages``) until closed."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.pages = int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Hog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
