"""A buffer's memory: one sealed memfd, bound to a NUMA node, mapped in the daemon.

Life of a :class:`Region`::

    memfd_create(CLOEXEC|ALLOW_SEALING[|HUGETLB])   a file of its own — never reused
    ftruncate(size)                                  page-rounded size
    add seals SHRINK|GROW|SEAL                       before anyone else can see the fd
    mmap(MAP_SHARED) in the daemon                   for binding, scrubbing, measuring
    mbind(MPOL_BIND, node)                           sets the file's shared policy
    madvise(POPULATE_WRITE)                          when prefault: pages land on node
    ...handed out (the fd, dup'd, over SCM_RIGHTS)...
    scrub(zero|punch)                                every byte reads zero, everywhere
    close()                                          munmap + close; the kernel frees the
                                                     pages when the last worker lets go

The daemon keeps its own mapping for the region's whole life: ``move_pages``
only reports pages mapped in the calling process, and scrubbing through an
existing mapping avoids a map/unmap per release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading

import numpy as np

from maasd.allocator import _sys
from maasd.allocator.arith import round_up
from maasd.errors import BackingError, InvalidRequest, PlacementError

logger = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

BACKINGS = ("memfd", "hugetlb")
SCRUB_MODES = ("zero", "punch")


_open_lock = threading.Lock()
_open = 0


def open_regions() -> int:
    """Regions of this process not yet closed: each holds one fd and one mapping.

    The daemon's budget of open files and mappings (:mod:`maasd.core.limits`)
    counts these, whoever holds them (live buffers, regions waiting to be
    reclaimed, warm stock).
    """
    return _open


def _count_open(delta: int) -> None:
    global _open
    with _open_lock:
        _open += delta


def _huge_flag(page_bytes: int) -> int:
    return _sys.MFD_HUGETLB | ((page_bytes.bit_length() - 1) << _sys.MFD_HUGE_SHIFT)


class Region:
    """One buffer's memory. Create with :meth:`create`; thread-safe to scrub/close once.

    >>> r = Region.create(5000, node=0)          # doctest: +SKIP
    >>> r.size, r.placement()                     # doctest: +SKIP
    (8192, {0: 2})
    """

    __slots__ = (
        "_addr",
        "_closed",
        "_lock",
        "backing",
        "fd",
        "name",
        "node",
        "page_bytes",
        "released",
        "size",
    )

    def __init__(
        self, fd: int, addr: int, size: int, node: int, backing: str, page_bytes: int, name: str
    ) -> None:
        self.fd = fd
        self._addr = addr
        self.size = size
        self.node = node
        self.backing = backing
        self.page_bytes = page_bytes
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        #: set by the owning pool once its bytes are given back (exactly once)
        self.released = False
        _count_open(1)

    @classmethod
    def create(
        cls,
        size: int,
        *,
        node: int,
        backing: str = "memfd",
        page_bytes: int | None = None,
        prefault: bool = True,
        name: str = "maasd-buffer",
    ) -> Region:
        """Create, size, seal, map, bind and (optionally) populate a fresh region.

        ``size`` is rounded up to ``page_bytes`` (default: the base page size for
        ``memfd``, 2 MiB for ``hugetlb``). Raises :class:`InvalidRequest` for a bad
        size or backing and :class:`BackingError` when the kernel refuses.
        """
        if backing not in BACKINGS:
            raise InvalidRequest(f"backing must be one of {BACKINGS}, got {backing!r}")
        if page_bytes is None:
            page_bytes = os.sysconf("SC_PAGE_SIZE") if backing == "memfd" else 2 << 20
        size = round_up(size, page_bytes)
        flags = _sys.MFD_CLOEXEC | _sys.MFD_ALLOW_SEALING
        if backing == "hugetlb":
            flags |= _huge_flag(page_bytes)
        fd = _sys.memfd_create(name, flags)
        addr = 0
        try:
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            except OSError as e:
                raise BackingError(
                    f"sizing/sealing memfd to {size} bytes: {e.strerror}", e.errno
                ) from e
            addr = _sys.mmap_shared(fd, size)
            _sys.mbind(addr, size, node)
            region = cls(fd, addr, size, node, backing, page_bytes, name)
            if prefault:
                region.populate()
        except BaseException:
            if addr:
                _sys.munmap(addr, size)
            os.close(fd)
            raise
        return region

    # -- memory ---------------------------------------------------------------------------

    def populate(self) -> None:
        """Fault every page in now (on the bound node), so first use costs nothing.

        ``MADV_POPULATE_WRITE`` through the bound mapping allocates the pages *and*
        the daemon's page-table entries. ``fallocate`` alone allocates them about
        twice as fast, but then the release-time memset has to fault every page in
        (0.4 ms instead of 0.015 ms per MiB here), so the pair costs the same and a
        large release gets slow (measured on the 2-core test machine).
        """
        try:
            _sys.madvise(self._addr, self.size, _sys.MADV_POPULATE_WRITE)
        except BackingError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            # Kernels before 5.14 lack MADV_POPULATE_*: allocate through the file instead.
            _sys.fallocate(self.fd, 0, 0, self.size)

    def view(self) -> memoryview:
        """A writable view of the daemon's mapping (valid until :meth:`close`)."""
        self._check_open()
        return _sys.view(self._addr, self.size)

    @property
    def address(self) -> int:
        self._check_open()
        return self._addr

    def placement(self, sample: int | None = None) -> dict[int, int]:
        """Pages per NUMA node, as the kernel reports them (``move_pages``, query only).

        Pages not yet faulted in are faulted in for reading first
        (``MADV_POPULATE_READ``), so the answer covers every page of the region.
        ``sample`` asks about that many evenly spread pages only: a constant-cost
        check (a full count costs ~0.12 s per GiB here).
        """
        self._check_open()
        if sample is None:
            try:
                _sys.madvise(self._addr, self.size, _sys.MADV_POPULATE_READ)
            except BackingError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
        status = _sys.move_pages_query(self._addr, self.size, self.page_bytes, sample)
        return _count_by_node(status)

    def verify_node(self, sample: int = 64) -> None:
        """Check (by a sample of pages) that the region's pages are on its node.

        Raises :class:`PlacementError` naming where the strays are. Pages not
        present (never faulted, e.g. without prefault) are not strays.
        """
        placed = self.placement(sample=sample)
        stray = {n: c for n, c in placed.items() if n >= 0 and n != self.node}
        if stray:
            raise PlacementError(f"pages of a region bound to node {self.node} are on {stray}")

    def pin(self, node: int, known_nodes: set[int] | frozenset[int]) -> dict[int, int]:
        """Rebind to ``node``, migrate every page there, and return the measured placement.

        Raises :class:`PlacementError` for a node not in ``known_nodes``, or when the
        kernel could not move every page (the measurement, not the syscall, decides).
        """
        self._check_open()
        if isinstance(node, bool) or not isinstance(node, int) or node not in known_nodes:
            raise PlacementError(
                f"NUMA node {node!r} does not exist on this host (nodes: {sorted(known_nodes)})"
            )
        try:
            _sys.mbind(self._addr, self.size, node, _sys.MPOL_MF_MOVE | _sys.MPOL_MF_MOVE_ALL)
        except BackingError as e:
            raise PlacementError(f"could not move pages to node {node}: {e.detail}") from e
        self.node = node
        placed = self.placement()
        stray = {n: c for n, c in placed.items() if n != node}
        if stray:
            raise PlacementError(f"after pinning to node {node}, pages remain elsewhere: {stray}")
        return placed

    def scrub(self, mode: str = "zero", *, punch: bool = True) -> None:
        """Make every byte read zero — through this mapping and any other process's.

        ``zero`` overwrites through the daemon's mapping (memset, not a Python loop),
        then punches the pages out to give them back (unless ``punch=False``: the
        caller gives them back later, off the request path, with :meth:`punch_hole`);
        ``punch`` only punches. After a punch the pages are gone from every mapping
        of the file, so a stale worker mapping faults in fresh zero pages.

        The bytes are zero whenever this returns: a punch the kernel refuses falls
        back to memset (and a refused give-back after a memset is only logged).
        """
        if mode not in SCRUB_MODES:
            raise InvalidRequest(f"scrub must be one of {SCRUB_MODES}, got {mode!r}")
        with self._lock:
            self._check_open()
            if mode == "zero":
                _sys.memset(self._addr, 0, self.size)
                if punch:
                    self._punch(zeroed=True)
            else:
                self._punch(zeroed=False)

    def punch_hole(self) -> None:
        """Give the pages back to the kernel (the bytes read zero afterwards)."""
        with self._lock:
            self._check_open()
            self._punch(zeroed=False)

    def _punch(self, *, zeroed: bool) -> None:
        try:
            _sys.fallocate(
                self.fd, _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE, 0, self.size
            )
        except BackingError as e:
            if not zeroed:
                _sys.memset(self._addr, 0, self.size)
            logger.warning(
                "punching %r failed (%s); its bytes were zeroed with memset", self, e.detail
            )

    def close(self) -> bool:
        """Unmap and close the daemon's fd. Idempotent. Does not scrub: call :meth:`scrub` first.

        Returns True for the one call that actually closed the region, so an owner
        can give its accounting back exactly once.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            try:
                _sys.munmap(self._addr, self.size)
            finally:
                os.close(self.fd)
                _count_open(-1)
            return True

    @property
    def closed(self) -> bool:
        return self._closed

    def dup_fd(self) -> int:
        """A new fd for the same file, for handing out (the caller closes it)."""
        with self._lock:
            self._check_open()
            return os.dup(self.fd)

    def _check_open(self) -> None:
        if self._closed:
            raise BackingError("region is closed", errno=errno.EBADF)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self.fd}"
        return f"<Region {self.size} bytes {self.backing} node={self.node} {state}>"

    def __del__(self) -> None:  # a safety net; the owner closes explicitly
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()


def _count_by_node(status: np.ndarray) -> dict[int, int]:
    """Pages per node from ``move_pages`` status; negative keys are errnos (-2: not present)."""
    values, counts = np.unique(status, return_counts=True)
    return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}
