"""An idle committed entry without an open file: its memfd reached through the mapping.

A committed entry's region is sealed ``F_SEAL_FUTURE_WRITE``: no one may write it again
but through the daemon's mapping made before the seal, which the scrub at release needs.
That mapping keeps the file alive by itself (a VMA holds a reference to the file it
maps), so the daemon's fd of an idle entry is redundant — and it is the costlier of the
two: ``RLIMIT_NOFILE`` is a unit limit the daemon cannot raise without
``CAP_SYS_RESOURCE``, while ``vm.max_map_count`` is one sysctl, and a host with
100,000 entries needs one or the other per entry. So once committed, an entry's region
*parks*: it closes its fd and keeps only its mapping (:meth:`Region.park
<maasd.allocator.region.Region.park>`). An idle entry then costs no fd and one mapping.

When an fd is needed again (a lookup's read-only handle, an inotify watch), the file is
re-opened through ``/proc/self/map_files/<start>-<end>``, the kernel's link from a
mapping to the file it maps: a new open file description of the same inode, with the
mode asked for (:func:`open_mapped`). Its inode is checked against the region's own, so
a re-open can never reach another file, whatever happened to the address range.

The kernel allows ``map_files`` only to a process with ``CAP_CHECKPOINT_RESTORE`` (or
``CAP_SYS_ADMIN``) in the initial user namespace. Without it (:func:`can_park` says,
once per process, by trying) nothing parks and an idle entry keeps its fd, as before:
one fd and one mapping. ``maasd doctor`` reports which of the two a host gets.

The unit grants that capability as an *ambient* one (deploy/systemd), which every program
the daemon starts would inherit (the latency probe, a llama worker): at start the daemon
clears its ambient set (:func:`keep_capabilities_to_self`), keeping the capability in its
own effective set only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading

from maasd.allocator import _sys
from maasd.errors import BackingError

__all__ = ["can_park", "keep_capabilities_to_self", "map_files_path", "open_mapped"]

_probe_lock = threading.Lock()
_probed: bool | None = None


def map_files_path(address: int, size: int) -> str:
    """The ``/proc/self/map_files`` link of the mapping ``[address, address + size)``."""
    return f"/proc/self/map_files/{address:x}-{address + size:x}"


def open_mapped(address: int, size: int, inode: int, flags: int = os.O_RDONLY) -> int:
    """A new fd (``flags``, close-on-exec) of the file mapped at ``[address, address +
    size)``, which must be inode ``inode``; :class:`BackingError` otherwise. The caller
    keeps the mapping from being unmapped meanwhile (the region's lock)."""
    try:
        fd = os.open(map_files_path(address, size), flags | os.O_CLOEXEC)
    except OSError as e:
        raise BackingError(f"re-opening a mapped region: {e.strerror}", e.errno) from e
    try:
        ino = os.fstat(fd).st_ino
    except OSError as e:
        os.close(fd)
        raise BackingError(f"re-opening a mapped region: {e.strerror}", e.errno) from e
    if ino != inode:
        os.close(fd)
        raise BackingError(f"the mapping at {address:#x} is not the region's file any more")
    return fd


def can_park() -> bool:
    """Whether this process may re-open its mappings' files (``map_files``): tried once,
    on a one-page memfd of its own; the answer is kept for the process's life."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _try_map_files()
        return _probed


def _try_map_files() -> bool:
    try:
        fd = _sys.memfd_create("maasd-probe", _sys.MFD_CLOEXEC)
    except (OSError, BackingError):
        return False
    try:
        size = os.sysconf("SC_PAGE_SIZE")
        os.ftruncate(fd, size)
        addr = _sys.mmap_shared(fd, size)
        try:
            with contextlib.suppress(BackingError):
                os.close(open_mapped(addr, size, os.fstat(fd).st_ino))
                return True
            return False
        finally:
            _sys.munmap(addr, size)
    except (OSError, BackingError):
        return False
    finally:
        os.close(fd)


#: prctl(2): the ambient capability set, and clearing all of it.
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def keep_capabilities_to_self() -> bool:
    """Clear this process's ambient capabilities, so that no program it starts inherits
    them; its own permitted and effective sets are unchanged. False where the kernel
    refuses (before 4.3: no ambient set, so nothing to clear)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) == 0
