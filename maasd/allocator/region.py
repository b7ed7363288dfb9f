"""A buffer's memory: one sealed memfd, bound to a NUMA node, mapped in the daemon.

Life of a :class:`Region`::

    memfd_create(CLOEXEC|ALLOW_SEALING[|HUGETLB])   a file of its own — never reused
    ftruncate(size)                                  page-rounded size
    mmap(MAP_SHARED) in the daemon                   for binding, scrubbing, measuring
    add seals SHRINK|GROW|SEAL [+ extra]             before anyone else can see the fd
    mbind(MPOL_BIND, node)                           sets the file's shared policy
    madvise(POPULATE_WRITE)                          when prefault: pages land on node
    ...handed out (the fd, dup'd, over SCM_RIGHTS)...
    scrub(zero|punch)                                every byte reads zero, everywhere
    close()                                          munmap + close; the kernel frees the
                                                     pages when the last worker lets go

The seals go on after the daemon's own mapping exists, so that an extra
``F_SEAL_FUTURE_WRITE`` (a committed entry) still leaves that mapping writable
for the daemon's copy and scrub, and refuses every writable mapping after it.

A region made for a pool's warm stock is created *unsealed* at the size of its
class and prefaulted in the background; :meth:`Region.seal_at` truncates it to
the buffer's exact size and seals it when a reserve takes it. An unsealed
region never leaves the daemon (:meth:`Region.dup_fd` refuses).

The region owns its file, its mapping and its seals; how its pages land on, are counted
on and move between NUMA nodes is :mod:`maasd.allocator.numa`'s, and how its bytes are
made zero on release :mod:`maasd.allocator.scrub`'s — functions that work on the
region's fd and mapping, which the region calls.

The daemon keeps its own mapping for the region's whole life: ``move_pages``
only reports pages mapped in the calling process, and scrubbing through an
existing mapping avoids a map/unmap per release.

**Nothing a worker does may fault the daemon** (docs/allocator.md). A worker may punch
holes in its buffer (the seals allow it). On hugetlb memory, a later touch of a
hole through the daemon's mapping needs a fresh huge page, and when a worker
has taken them all, the kernel answers with SIGBUS. So once a region is handed
out, the daemon never touches its pages through the mapping where a hole could
fault: hugetlb scrubs punch (both modes), its reads go through ``pread`` (a hole
reads as zeros, nothing is allocated), placement counts never populate a
hugetlb region, and every ``MADV_POPULATE_*`` failure is an errno, never a signal.
(A memfd region's hole faults in a fresh page, or OOMs: never a signal. An entry's
commit copies a memfd region through the mappings for that reason: :func:`copy_region`.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from typing import get_args

from maasd.allocator import _sys, numa, parking
from maasd.allocator.arith import round_up
from maasd.allocator.scrub import SCRUB_MODES, punch_out, scrub_region, zero_mapped
from maasd.bounds import Backing, ScrubMode
from maasd.errors import BackingError, InvalidRequest

#: The seals every region carries before its fd leaves: its size is fixed, for good.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: The seal that makes a committed entry immutable for everyone but the mapping made
#: before it (the daemon's, for scrubbing): an ``extra_seals`` of :meth:`Region.create`.
#: (Python's ``fcntl`` has no such constant.)
F_SEAL_FUTURE_WRITE = _sys.F_SEAL_FUTURE_WRITE

BACKINGS: tuple[Backing, ...] = get_args(Backing)


_open_lock = threading.Lock()
_open = 0
_open_fds = 0


def open_regions() -> int:
    """Regions of this process not yet closed: each holds one mapping.

    The daemon's budget of open files and mappings (:mod:`maasd.core.limits`)
    counts these, whoever holds them (live buffers, regions waiting to be
    reclaimed, warm stock).
    """
    return _open


def open_region_fds() -> int:
    """Regions of this process not yet closed that hold an fd: all but the parked ones
    (:meth:`Region.park`)."""
    return _open_fds


def _count_open(regions: int, fds: int) -> None:
    global _open, _open_fds
    with _open_lock:
        _open += regions
        _open_fds += fds


def _huge_flag(page_bytes: int) -> int:
    return _sys.MFD_HUGETLB | ((page_bytes.bit_length() - 1) << _sys.MFD_HUGE_SHIFT)


def check_backing(backing: object) -> Backing:
    """``backing`` if it is one of :data:`BACKINGS`, else :class:`InvalidRequest`.

    Checked where a backing comes in: a :class:`~maasd.allocator.pool.MemoryPool`'s construction,
    :meth:`Region.create` and :func:`default_page_bytes`; what they hand on is trusted."""
    if backing not in BACKINGS:
        raise InvalidRequest(f"backing must be one of {BACKINGS}, got {backing!r}")
    return backing


def page_bytes_of(backing: Backing, hugepage_bytes: int = 2 << 20) -> int:
    """The page size regions of a (checked) ``backing`` are rounded to: the base page for
    ``memfd``, ``hugepage_bytes`` for ``hugetlb``."""
    return os.sysconf("SC_PAGE_SIZE") if backing == "memfd" else hugepage_bytes


def default_page_bytes(backing: str, hugepage_bytes: int = 2 << 20) -> int:
    """The page size regions of this backing are rounded to (:func:`page_bytes_of`, checked)."""
    return page_bytes_of(check_backing(backing), hugepage_bytes)


def new_memfd(name: str, size: int, backing: Backing, page_bytes: int) -> int:
    """A new memfd of ``size`` bytes of a (checked) ``backing``, as every region's is made
    (close-on-exec, sealable, ``hugetlb`` of ``page_bytes`` pages): unsealed, unmapped,
    nothing allocated. Raises :class:`BackingError`; on failure nothing is left open.
    (``maasd doctor`` makes its test memfds here, so it tests what the daemon does.)"""
    flags = _sys.MFD_CLOEXEC | _sys.MFD_ALLOW_SEALING
    if backing == "hugetlb":
        flags |= _huge_flag(page_bytes)
    fd = _sys.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        raise BackingError(f"sizing memfd to {size} bytes: {e.strerror}", e.errno) from e
    return fd


def add_seals(fd: int, extra_seals: int = 0) -> None:
    """Seal ``fd`` as every region is sealed: :data:`SEALS`, plus ``extra_seals`` (e.g.
    :data:`F_SEAL_FUTURE_WRITE` for a committed entry). Raises :class:`BackingError`."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | extra_seals)
    except OSError as e:
        raise BackingError(f"sealing memfd ({extra_seals:#x}): {e.strerror}", e.errno) from e


def _mapped_file(name: str, size: int, backing: Backing, page_bytes: int) -> tuple[int, int]:
    """A new memfd of ``size`` bytes and the daemon's shared mapping of it: ``(fd, address)``.

    Unsealed, unbound, nothing populated; on failure nothing is left open.
    """
    fd = new_memfd(name, size, backing, page_bytes)
    try:
        return fd, _sys.mmap_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _mapped_region(
    cls: type[Region], size: int, node: int, backing: Backing, page_bytes: int, name: str
) -> Region:
    """A :class:`Region` over a new memfd of ``size`` bytes and the daemon's mapping of it."""
    fd, addr = _mapped_file(name, size, backing, page_bytes)
    try:
        return cls(fd, addr, size, node, backing, page_bytes, name)
    except BaseException:
        _sys.munmap(addr, size)
        os.close(fd)
        raise


def _set_up(region: Region, seal: bool, extra_seals: int, prefault: bool) -> None:
    """Seal, bind and (optionally) populate a region just made; closed if that fails."""
    try:
        region.sealed = False
        if seal:
            add_seals(region.fd, extra_seals)
            region.sealed = True
        _sys.mbind(region.address, region.size, region.node)
        if prefault:
            region.populate()
    except BaseException:
        region.close()  # once: its __del__ must not close the fd number again
        raise


class Region:
    """One buffer's memory. Create with :meth:`create` (``Region.create(5000, node=0)``: 8192
    bytes on node 0); thread-safe to scrub/close once."""

    __slots__ = (
        "_addr",
        "_closed",
        "_fd",
        "_ino",
        "_lock",
        "backing",
        "name",
        "node",
        "page_bytes",
        "placed",
        "released",
        "sealed",
        "size",
    )

    def __init__(
        self, fd: int, addr: int, size: int, node: int, backing: Backing, page_bytes: int, name: str
    ) -> None:
        self._fd = fd
        self._ino = os.fstat(fd).st_ino
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
        #: whether the seals are on (a stocked region gets them when it is taken)
        self.sealed = True
        #: a sample of its pages was found on its node (:meth:`verify_node`), where they stay
        self.placed = False
        _count_open(1, 1)

    @classmethod
    def create(
        cls,
        size: int,
        *,
        node: int,
        backing: Backing = "memfd",
        page_bytes: int | None = None,
        prefault: bool = True,
        name: str = "maasd-buffer",
        seal: bool = True,
        extra_seals: int = 0,
    ) -> Region:
        """Create, size, map, seal, bind and (optionally) populate a fresh region.

        ``size`` is rounded up to ``page_bytes`` (default: the base page size for
        ``memfd``, 2 MiB for ``hugetlb``). ``extra_seals`` are added to :data:`SEALS`
        (e.g. ``F_SEAL_FUTURE_WRITE``); ``seal=False`` leaves the region unsealed for
        a warm stock (:meth:`seal_at` seals it). Raises :class:`InvalidRequest` for a
        bad size or backing and :class:`BackingError` when the kernel refuses.
        """
        check_backing(backing)
        page_bytes = page_bytes_of(backing) if page_bytes is None else page_bytes
        region = _mapped_region(cls, round_up(size, page_bytes), node, backing, page_bytes, name)
        _set_up(region, seal, extra_seals, prefault)
        return region

    def populate(self, abort: Callable[[], bool] | None = None) -> bool:
        """Fault every page in now, on the bound node, so first use costs nothing
        (:func:`~maasd.allocator.numa.populate`): a refusal is a :class:`BackingError`,
        never a signal; more than a ``memfd`` region's node can spare, :class:`PoolExhausted`.
        ``abort``: go a step at a time, ask it before each; ``False`` if it said stop."""
        return numa.populate(self, abort)

    def seal_at(self, size: int, extra_seals: int = 0) -> None:
        """Truncate an unsealed (stocked) region down to ``size`` bytes, then seal it
        (:data:`SEALS` plus ``extra_seals``): the tail is unmapped and its pages freed (~6 ms
        per populated 64 MiB here), so a worker's fd covers its buffer and nothing more."""
        with self._lock:
            self._check_open()
            if self.sealed:
                raise BackingError("region is sealed already", errno=errno.EPERM)
            if round_up(size, self.page_bytes) != size or size > self.size:  # size > 0 there
                raise InvalidRequest(f"cannot cut a {self.size}-byte region to {size} bytes")
            if size < self.size:
                _sys.munmap(self._addr + size, self.size - size)
                self.size = size  # the daemon's mapping is this long now
                try:
                    os.ftruncate(self.fd, size)
                except OSError as e:
                    raise BackingError(f"cutting region: {e.strerror}", e.errno) from e
            add_seals(self.fd, extra_seals)
            self.sealed = True

    @property
    def fd(self) -> int:
        """The daemon's fd of the region's memfd; :class:`BackingError` once parked."""
        if self._fd < 0:
            raise BackingError("a parked region has no fd (re-open it)", errno=errno.EBADF)
        return self._fd

    @property
    def parked(self) -> bool:  # it let its fd go (park), keeping only its mapping
        return self._fd < 0

    def park(self) -> bool:
        """Close the daemon's fd of a frozen ``memfd`` region, keeping its mapping, which
        keeps the file (:mod:`maasd.allocator.parking`); True if it parked now. Any other
        region, or a process that cannot re-open its mappings, keeps its fd."""
        with self._lock:
            if self._closed or self._fd < 0 or self.backing != "memfd" or not parking.can_park():
                return False
            if not self.frozen:
                return False
            os.close(self._fd)
            self._fd = -1
            _count_open(0, -1)
            return True

    def reopen(self, flags: int = os.O_RDONLY) -> int:
        """A new fd of the region's memfd, a file description of its own opened with
        ``flags`` (the caller closes it): through ``/proc/self/fd``, or, once parked,
        through the mapping (:func:`~maasd.allocator.parking.open_mapped`)."""
        with self._lock:
            self._check_open()
            if self._fd >= 0:
                return os.open(f"/proc/self/fd/{self._fd}", flags | os.O_CLOEXEC)
            return parking.open_mapped(self._addr, self.size, self._ino, flags)

    def read_into(self, buf: memoryview | bytearray, offset: int = 0) -> int:
        """Copy the region's bytes from ``offset`` into ``buf``; the number copied.

        With ``pread(2)``, not through the mapping: a hole a worker punched reads as zeros,
        nothing is faulted in (checkpoints, a hugetlb entry's commit: :func:`copy_region`).
        A parked region is frozen (nothing can punch it): it is read through the mapping.
        """
        self._check_open()
        view = memoryview(buf).cast("B")[: max(0, self.size - offset)]
        if self._fd < 0:  # frozen memfd: no hole can be punched, every page reads
            view[:] = _sys.view(self._addr, self.size)[offset : offset + len(view)]
            return len(view)
        return _sys.pread_into(self._fd, view, offset)

    @property
    def frozen(self) -> bool:
        """Whether the region is sealed ``F_SEAL_FUTURE_WRITE``: immutable for everyone but
        the daemon's own mapping (a committed entry). It cannot be punched; its scrub
        zeroes it through that mapping, where every page is present."""
        self._check_open()
        if self._fd < 0:
            return True  # only a frozen region parks
        return bool(fcntl.fcntl(self._fd, fcntl.F_GET_SEALS) & _sys.F_SEAL_FUTURE_WRITE)

    def view(self) -> memoryview:
        """A writable view of the daemon's mapping (valid until :meth:`close`)."""
        self._check_open()
        return _sys.view(self._addr, self.size)

    @property
    def address(self) -> int:
        self._check_open()
        return self._addr

    def placement(self, sample: int | None = None) -> dict[int, int]:
        """Pages per NUMA node, as the kernel reports them (``move_pages``, query only):
        :func:`~maasd.allocator.numa.pages_by_node`. A full count faults a ``memfd``
        region's missing pages in for reading, never a ``hugetlb`` one's (its holes count
        as not present, ``-2``); ``sample`` asks about that many evenly spread pages."""
        return numa.pages_by_node(self, sample)

    def verify_node(self, sample: int = 64) -> None:
        """Check a sample of pages is on the region's node (:func:`~maasd.allocator.numa.verify_node`)."""
        self.placed = numa.verify_node(self, sample)

    def pin(self, node: int, known_nodes: set[int] | frozenset[int]) -> dict[int, int]:
        """Rebind to ``node``, migrate every page there and return the measured placement
        (:func:`~maasd.allocator.numa.migrate`); :class:`PlacementError` if not all moved."""
        self._check_open()
        numa.check_known(node, known_nodes)
        placed = numa.migrate(self, node)
        self.node = node
        numa.check_all_on(placed, node)
        return placed

    def scrub(self, mode: ScrubMode = "zero", *, punch: bool = True) -> None:
        """Make every byte read zero — through this mapping and any other process's
        (:func:`~maasd.allocator.scrub.scrub_region` says how, per backing and mode).

        ``memfd``'s ``zero`` memsets the pages that hold bytes, then punches them out
        (``punch=False``: the caller does, later, with :meth:`punch_hole`); every other
        scrub punches, which never touches a page. The bytes are zero whenever this returns.
        """
        if mode not in SCRUB_MODES:
            raise InvalidRequest(f"scrub must be one of {SCRUB_MODES}, got {mode!r}")
        with self._lock:
            self._check_open()
            if self._fd < 0:
                zero_mapped(self)  # frozen: zeroed through the mapping, never punched
            else:
                scrub_region(self, mode, punch=punch)

    def punch_hole(self) -> None:
        """Give the pages back to the kernel (the bytes read zero afterwards)."""
        with self._lock:
            self._check_open()
            punch_out(self, zeroed=False)

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
                if self._fd >= 0:
                    os.close(self._fd)
                _count_open(-1, -1 if self._fd >= 0 else 0)
            return True

    @property
    def closed(self) -> bool:
        return self._closed

    def dup_fd(self) -> int:
        """A new fd for the same file, for handing out (the caller closes it). Sealed only."""
        with self._lock:
            self._check_open()
            if not self.sealed:
                raise BackingError("an unsealed region never leaves the daemon", errno=errno.EPERM)
            return os.dup(self.fd)  # a parked region has none: raises

    def _check_open(self) -> None:
        if self._closed:
            raise BackingError("region is closed", errno=errno.EBADF)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "parked" if self._fd < 0 else f"fd={self._fd}"
        return f"<Region {self.size} bytes {self.backing} node={self.node} {state}>"

    def __del__(self) -> None:  # a safety net; the owner closes explicitly
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()


def copy_region(src: Region, dst: Region) -> int:
    """Copy every byte of ``src`` into ``dst`` (as long, or longer) through ``dst``'s
    mapping, which must be populated; returns the bytes copied (``src.size``, or less if
    its file ends early).

    ``memfd``: one ``memmove`` between the two mappings — ~0.8 ms for 9 MiB here, against
    1.2–6.7 ms for a ``pread`` of the same under load (the page cache's per-page copy). A
    hole a worker punched in ``src`` is read through a shmem fault, which allocates a
    zero page or, out of memory, runs the kernel's OOM handling, as the scrub's memset
    does: it never signals. ``hugetlb``: ``pread`` (:meth:`Region.read_into`), where a
    hole reads as zeros — through the mapping it would need a free huge page, or SIGBUS.
    """
    if src.backing != "memfd":
        view = dst.view()
        try:
            return src.read_into(view)
        finally:
            view.release()
    if dst.size < src.size:
        raise InvalidRequest(f"cannot copy {src.size} bytes into a {dst.size}-byte region")
    ctypes.memmove(dst.address, src.address, src.size)
    return src.size
