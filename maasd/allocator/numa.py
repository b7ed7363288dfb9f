"""A region's pages on their NUMA node: populating them there, counting where they are
(``move_pages``), and moving them (``mbind``).

A ``memfd`` region's pages are bound (``MPOL_BIND``) and never land on another node,
so a populate first asks whether the node can hold them (:func:`check_node_room`).
Where they are, the kernel's answer decides, never the syscall's success (SPEC §2:
placement is verified with ``move_pages``). ``move_pages`` sees only pages mapped in the
calling process, which is why the daemon keeps its own mapping of every region
(:mod:`maasd.allocator.region`); a count never populates a ``hugetlb`` region, where a
hole would take a huge page from everyone else, or fail when a worker took them all.

These functions work on a region's mapping (a :class:`Placed`:
:class:`~maasd.allocator.region.Region` is one, whose ``address`` refuses a closed
region), which the region's own methods call.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from maasd.allocator import _sys
from maasd.allocator.mapped import Mapped
from maasd.errors import BackingError, PlacementError, PoolExhausted
from maasd.topology import node_room

logger = logging.getLogger(__name__)

#: Bytes populated per step when a populate may be cut short (the warm stock's refills).
POPULATE_CHUNK = 16 << 20
#: What ``madvise`` answers for an advice the kernel does not know (``MADV_POPULATE_*``
#: before Linux 5.14).
_UNKNOWN_ADVICE = (errno.EINVAL, errno.ENOSYS)
#: Rounds of ``mbind(MPOL_MF_MOVE_ALL)`` a pin makes while pages stay behind.
MIGRATE_ROUNDS = 11  # backoff 2, 4 … 1024 ms between them: ~2 s at most, for a busy writer


class Placed(Mapped, Protocol):
    """What this module reads of a region: its mapping (:class:`Mapped`) and its node."""

    @property
    def node(self) -> int: ...
    def placement(self, sample: int | None = None) -> dict[int, int]: ...


def check_node_room(node: int, size: int) -> None:
    """Refuse (507) a ``memfd`` region its node cannot hold now (:func:`~maasd.topology.node_room`).

    Its pages are bound (``MPOL_BIND``): they never land on another node, and populating
    past the node's free memory makes the kernel OOM-kill a process — the daemon, in a
    two-node guest. Huge pages need no such check: a node without enough of them makes
    the populate fail with an errno.
    """
    room = node_room(node)
    if room is not None and size > room:
        raise PoolExhausted(
            f"NUMA node {node} has {room} bytes to spare, fewer than the {size} bytes asked "
            f"(its pages are never placed on another node)"
        )


def populate(region: Placed, abort: Callable[[], bool] | None = None) -> bool:
    """Fault every page of ``region`` in now (on the node it is bound to).

    ``MADV_POPULATE_WRITE`` through the bound mapping allocates the pages *and*
    the daemon's page-table entries (``fallocate`` alone is twice as fast, but
    then the release-time memset faults every page in: 0.4 instead of 0.015 ms
    per MiB here). A refusal is a :class:`BackingError` (huge pages: ``ENOMEM``, or
    ``EFAULT`` if too few on the node), never a signal; more than a ``memfd`` region's
    node can spare, :class:`PoolExhausted` (:func:`check_node_room`). ``abort``: go
    :data:`POPULATE_CHUNK` bytes at a time, ask it before each; ``False`` if it said stop.
    """
    addr, size = region.address, region.size
    if region.backing == "memfd":
        check_node_room(region.node, size)
    step = size if abort is None else max(POPULATE_CHUNK, region.page_bytes)
    for off in range(0, size, step):
        if abort is not None and abort():
            return False
        length = min(step, size - off)
        try:
            _sys.madvise(addr + off, length, _sys.MADV_POPULATE_WRITE)
        except BackingError as e:
            if e.errno not in _UNKNOWN_ADVICE:
                raise
            # Kernels before 5.14 lack MADV_POPULATE_*: allocate through the file instead.
            _sys.fallocate(region.fd, 0, off, length)
    return True


def populate_write_known() -> bool:
    """Whether this kernel knows ``MADV_POPULATE_WRITE`` (5.14+), the advice :func:`populate`
    faults a region in with (without it, a populate allocates through the file), asked of
    one page of a fresh memfd."""
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.memfd_create("maasd-populate-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, page)
        addr = _sys.mmap_shared(fd, page)
        try:
            _sys.madvise(addr, page, _sys.MADV_POPULATE_WRITE)
        except BackingError as e:
            if e.errno in _UNKNOWN_ADVICE:
                return False
            raise
        finally:
            _sys.munmap(addr, page)
    finally:
        os.close(fd)
    return True


def pages_by_node(region: Placed, sample: int | None = None) -> dict[int, int]:
    """Pages per NUMA node, as the kernel reports them (``move_pages``, query only).

    For a full count of a ``memfd`` region, missing pages are first faulted in for
    reading (``MADV_POPULATE_READ``: a shmem read fault can always allocate or OOM, and a
    failure comes back as an errno, which is logged, not raised). A ``hugetlb`` region is
    never populated here, so its holes count as not present (``-2``). ``sample`` asks
    about that many evenly spread pages only, without populating: a constant-cost check
    (a full count costs ~0.12 s per GiB here). Negative keys are errnos.
    """
    addr, size = region.address, region.size
    if sample is None and region.backing == "memfd":
        try:
            _sys.madvise(addr, size, _sys.MADV_POPULATE_READ)
        except BackingError as e:
            if e.errno not in _UNKNOWN_ADVICE:
                logger.warning("placement of %r counts the pages present: %s", region, e.detail)
    status = _sys.move_pages_query(addr, size, region.page_bytes, sample)
    return _count_by_node(status)


def verify_node(region: Placed, sample: int) -> bool:
    """Check (by ``sample`` pages) that the region's pages are on its node; whether every
    page asked about was present. Raises :class:`PlacementError` naming where the strays
    are. Pages not present (never faulted, e.g. without prefault) are not strays."""
    placed = region.placement(sample=sample)
    stray = {n: c for n, c in placed.items() if n >= 0 and n != region.node}
    if stray:
        raise PlacementError(f"pages of a region bound to node {region.node} are on {stray}")
    return all(n >= 0 for n in placed)


def check_all_on(placed: dict[int, int], node: int) -> None:
    """After a pin to ``node``: :class:`PlacementError` if the kernel could not move every
    page (the measurement, not the syscall, decides)."""
    stray = {n: c for n, c in placed.items() if n != node}
    if stray:
        raise PlacementError(f"after pinning to node {node}, pages remain elsewhere: {stray}")


def check_known(node: object, known_nodes: set[int] | frozenset[int]) -> None:
    """:class:`PlacementError` unless ``node`` is one of this host's ``known_nodes``."""
    if isinstance(node, bool) or not isinstance(node, int) or node not in known_nodes:
        raise PlacementError(
            f"NUMA node {node!r} does not exist on this host (nodes: {sorted(known_nodes)})"
        )


def migrate(region: Placed, node: int) -> dict[int, int]:
    """Rebind ``region`` to ``node`` and move its pages there; returns the measured placement
    (``region.placement()``), which the caller checks.

    The kernel skips a page it cannot move now (one a worker is faulting or writing
    through its own mapping: the migration finds it referenced and gives up on it after
    its own retries) and still reports success, so the pages are counted after each
    round and the ones left behind are moved again, up to :data:`MIGRATE_ROUNDS` rounds
    (measured in the two-node guest: a worker writing to every page of 16 MiB left 5
    pages behind after one round).
    """
    placed: dict[int, int] = {}
    for attempt in range(MIGRATE_ROUNDS):
        if attempt:
            time.sleep(0.001 * 2**attempt)  # let the writer's fault finish
        try:
            _sys.mbind(region.address, region.size, node, _sys.MPOL_MF_MOVE | _sys.MPOL_MF_MOVE_ALL)
        except BackingError as e:
            raise PlacementError(f"could not move pages to node {node}: {e.detail}") from e
        placed = region.placement()
        if all(n == node for n in placed):
            break
    return placed


def _count_by_node(status: Iterable[int]) -> dict[int, int]:
    """Pages per node from ``move_pages`` status; negative keys are errnos (-2: not present)."""
    return dict(sorted(Counter(status).items()))
