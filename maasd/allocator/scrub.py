"""How a region's bytes are made to read zero on release (SPEC §2: every byte, everywhere).

A ``memfd`` region's ``zero`` scrub overwrites its bytes through the daemon's mapping,
skipping the holes (:func:`zero_present`), then punches the pages out to give them
back — in the call, or later on the reclaimer thread. Every other scrub punches
(``FALLOC_FL_PUNCH_HOLE``): the punch zeroes the file for every mapping, costs ~0.4 ms
per GiB and never touches a page, where a memset over a worker's hole in a ``hugetlb``
region would need a free huge page or die of SIGBUS (:mod:`maasd.allocator.region`:
nothing a worker does may fault the daemon). A punch the kernel refuses falls back to
zeroing through the mapping where that cannot fault (:func:`zero_mapped`), so the bytes
are zero whenever a scrub returns.

These functions work on a region's fd and the daemon's mapping of it (a
:class:`Scrubbed`: :class:`~maasd.allocator.region.Region` is one); the region calls
them with its lock held, once it has checked that it is open.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Protocol, get_args

from maasd.allocator import _sys
from maasd.allocator.mapped import Mapped
from maasd.bounds import ScrubMode
from maasd.errors import BackingError

logger = logging.getLogger(__name__)

SCRUB_MODES: tuple[ScrubMode, ...] = get_args(ScrubMode)

#: Data ranges of a memfd that :func:`zero_present` zeroes one by one; past this many
#: it zeroes the rest of the region in one memset.
ZERO_RANGES = 64


class Scrubbed(Mapped, Protocol):
    """What a scrub reads of a region: its mapping (:class:`Mapped`), and whether it is
    frozen (sealed against writes: a punch is refused then)."""

    @property
    def frozen(self) -> bool: ...


def scrub_region(region: Scrubbed, mode: ScrubMode, *, punch: bool) -> None:
    """Make every byte of ``region`` read zero, through every mapping of its file.

    ``memfd``: ``zero`` overwrites through the daemon's mapping (:func:`zero_present`),
    then punches the pages out to give them back (unless ``punch=False``: the caller
    gives them back later, off the request path, with :func:`punch_out`); a page a
    worker punched is faulted in fresh by the memset (shmem allocates or OOMs, it never
    signals). ``punch`` only punches. ``hugetlb``: both modes punch. After a punch the
    pages are gone from every mapping of the file, so a stale worker mapping faults in
    fresh zero pages. ``mode`` is one of :data:`SCRUB_MODES` (the caller checked).
    """
    if mode == "zero" and region.backing == "memfd":
        zero_present(region)
        if punch:
            punch_out(region, zeroed=True)
    else:
        punch_out(region, zeroed=False)


def punch_file(fd: int, length: int) -> None:
    """Punch the first ``length`` bytes of the file ``fd`` out, keeping its size (they read
    zero; their blocks go back, a discard where the filesystem passes one on). A refusal
    is a :class:`BackingError`: not every filesystem punches, and a sealed memfd refuses."""
    _sys.fallocate(fd, _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE, 0, length)


def punch_out(region: Scrubbed, *, zeroed: bool) -> None:
    """Punch the whole file (the region's lock held); if refused, zero it unless ``zeroed``.

    A frozen region (a committed entry) is never punched — the kernel refuses it, as
    expected: it is zeroed through the mapping instead, without a warning.
    """
    if region.frozen:
        if not zeroed:
            zero_mapped(region)
        return
    try:
        punch_file(region.fd, region.size)
    except BackingError as e:
        if not zeroed:
            zero_mapped(region)
        logger.warning(
            "punching %r failed (%s); its bytes were zeroed through the mapping", region, e.detail
        )


def zero_present(region: Scrubbed) -> None:
    """Zero a ``memfd`` region's bytes through the daemon's mapping, skipping its holes.

    A hole (a page never written, or punched) reads zero through every mapping already,
    and a memset over it would first fault a page in to zero it: 0.6 ms for an untouched
    MiB here against 0.01 ms for a populated one (a REST buffer of a pool without
    prefault, released unused). ``st_blocks`` (shmem: the pages allocated, swapped out
    included) answers the two common cases, none and all, with one ``fstat``; otherwise
    ``SEEK_DATA``/``SEEK_HOLE`` name the ranges that may hold bytes (a page allocated
    but never written is a hole, and reads zero). What a worker writes after this call
    is not zeroed here, as with a whole memset; the reclaimer's punch follows.
    """
    fd, addr, size = region.fd, region.address, region.size
    try:
        allocated = os.fstat(fd).st_blocks * 512
    except OSError:
        allocated = size
    if allocated == 0:
        return
    off = 0 if allocated >= size else _zero_data_ranges(fd, addr, size)
    if off < size:
        _sys.memset(addr + off, 0, size - off)


def _zero_data_ranges(fd: int, addr: int, size: int) -> int:
    """Zero the first :data:`ZERO_RANGES` data ranges of the memfd ``fd`` mapped at
    ``addr``; the offset from which the rest is still to be zeroed (``size``: none)."""
    off = 0
    try:
        for _ in range(ZERO_RANGES):
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data from ``off`` on
                    return size
                raise
            if start >= size:
                return size
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            _sys.memset(addr + start, 0, end - start)
            off = end
            if off >= size:
                return size
    except OSError as e:  # never on Linux shmem: zero the rest whole
        logger.debug("lseek(SEEK_DATA) on memfd %d failed (%s): zeroing from %d on", fd, e, off)
    return off


def zero_mapped(region: Scrubbed) -> None:
    """Zero the bytes with memset, where that cannot fault (a refused punch's fallback).

    ``memfd``: memset everything. ``hugetlb``: only the pages ``MADV_POPULATE_WRITE``
    makes present (it fails with an errno, not a signal, for a hole no huge page can
    fill — and a hole reads zero already). No worker can punch a page between the two
    calls: the kernel refused the daemon's punch, and a worker's fd may do no more.
    """
    addr, page = region.address, region.page_bytes
    if region.backing == "memfd":
        _sys.memset(addr, 0, region.size)
        return
    for off in range(0, region.size, page):
        try:
            _sys.madvise(addr + off, page, _sys.MADV_POPULATE_WRITE)
        except BackingError:
            continue
        _sys.memset(addr + off, 0, page)
