"""The placement suite (tests/multinode): every test there needs a host (or guest) with two NUMA nodes or more.

Elsewhere each test is skipped with the reason — on one node "on node 0" is true of every
page whatever the code does. ``scripts/numa-guest --pytest tests/multinode`` runs it in a QEMU
guest with two real nodes (CI does, after the main suite).

Placement is measured here, not taken from the daemon: :func:`pages_by_node` asks the
kernel (``move_pages(2)`` with no target nodes, through libc's ``syscall``, not the
product's wrapper) where each page of *this* process's mapping of a buffer lives.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Daemon
from maasd.topology import SYSFS_NODES, discover

TOPOLOGY = discover()
NODES = sorted(TOPOLOGY.node_ids)
PAGE = mmap.PAGESIZE
HUGE = TOPOLOGY.hugepage_bytes
MiB = 1 << 20

_SYS_MOVE_PAGES = 279  # x86_64
_MADV_POPULATE_READ = 22
_MPOL_MF_MOVE_ALL = 1 << 2  # move pages mapped by other processes too (CAP_SYS_NICE)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if len(NODES) >= 2:
        return
    skip = pytest.mark.skip(
        reason=f"needs 2 NUMA nodes or more (this host has {len(NODES)}): "
        "run scripts/numa-guest --pytest tests/multinode"
    )
    here = Path(__file__).parent / "multinode"
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(skip)


def pages_by_node(addr: int, length: int, page: int = PAGE) -> dict[int, int]:
    """Pages per node of ``[addr, addr+length)`` in this process, faulted in for reading
    first (``MADV_POPULATE_READ``: a present page is only mapped, never moved); negative
    keys are errnos (``-ENOENT``: not present)."""
    if _libc.madvise(ctypes.c_void_p(addr), length, _MADV_POPULATE_READ) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")
    return _move_pages(addr, length // page, page, None, 0)


def move_behind_its_back(array: np.ndarray, node: int, page: int = PAGE) -> dict[int, int]:
    """Move every page of this process's mapping of a buffer to ``node`` — a migration the
    daemon did not ask for (as a NUMA balancer or a hot-remove would make), overriding
    the buffer's binding: ``move_pages`` with target nodes and ``MPOL_MF_MOVE_ALL`` (root:
    the daemon maps the same pages). Returns where the kernel says each page ended
    (``{node: pages}``; negative keys are errnos)."""
    return _move_pages(array.ctypes.data, array.nbytes // page, page, node, _MPOL_MF_MOVE_ALL)


def _move_pages(addr: int, count: int, page: int, node: int | None, flags: int) -> dict[int, int]:
    """``move_pages(2)`` of this process's ``count`` pages from ``addr``: where each is
    (``node`` None: a query), or moved to ``node`` with ``flags``; ``{node: pages}``,
    negative keys errnos."""
    pages = (np.arange(count, dtype=np.uint64) * np.uint64(page) + np.uint64(addr)).astype(
        np.uint64
    )
    nodes = None if node is None else np.full(count, node, dtype=np.int32)
    status = np.full(count, -errno.EINVAL - 1000, dtype=np.int32)
    rc = _libc.syscall(
        ctypes.c_long(_SYS_MOVE_PAGES),
        ctypes.c_int(0),
        ctypes.c_ulong(count),
        ctypes.c_void_p(pages.ctypes.data),
        ctypes.c_void_p(None if nodes is None else nodes.ctypes.data),
        ctypes.c_void_p(status.ctypes.data),
        ctypes.c_int(flags),
    )
    if rc < 0 or (node is None and rc != 0):
        raise OSError(ctypes.get_errno(), "move_pages")
    values, counts = np.unique(status, return_counts=True)
    return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}


def array_pages(array: np.ndarray, page: int = PAGE) -> dict[int, int]:
    """:func:`pages_by_node` of a NumPy view of a whole mapping."""
    return pages_by_node(array.ctypes.data, array.nbytes, page)


@contextlib.contextmanager
def huge_pages(per_node: dict[int, int]) -> Iterator[None]:
    """Set each node's 2 MiB ``nr_hugepages`` (root; the guest's own), restored after."""
    paths = {
        n: Path(SYSFS_NODES) / f"node{n}/hugepages/hugepages-{HUGE >> 10}kB/nr_hugepages"
        for n in per_node
    }
    old = {n: p.read_text().strip() for n, p in paths.items()}
    try:
        for n, count in per_node.items():
            paths[n].write_text(str(count))
            assert int(paths[n].read_text()) == count, f"node {n} got fewer huge pages"
        yield
    finally:
        for n, p in paths.items():
            p.write_text(old[n])


def all_on(node: int, size: int, page: int = PAGE) -> dict[int, int]:
    """What :func:`pages_by_node` says when every page of ``size`` bytes is on ``node``."""
    return {node: size // page}


@pytest.fixture(scope="module")
def numa_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A real ``maasd serve`` in the guest; its default pools are one per node (64 MiB)."""
    d = Daemon(
        tmp_path_factory.mktemp("maasd-numa"),
        env={"MAASD_DEFAULT_POOL_BYTES": str(64 * MiB)},
    )
    d.start()
    yield d
    d.close()
