"""Thin ctypes bindings for the memory syscalls Python's stdlib lacks.

Every wrapper raises :class:`maasd.errors.BackingError` carrying the errno and
the operation attempted, so a failure reads like ``mbind(MPOL_BIND, node 3) of
2097152 bytes: [EINVAL] Invalid argument``. ``mbind`` and ``move_pages`` come
from libnuma (through py-libnuma's ``LIBNUMA`` handle when it imports, else
``libnuma.so.1`` directly): libnuma exports the raw syscall wrappers on every
architecture, so no syscall numbers are hard-coded here.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno as _errno
import os

from maasd.errors import BackingError

# memfd_create(2)
MFD_CLOEXEC = 0x0001
MFD_ALLOW_SEALING = 0x0002
MFD_HUGETLB = 0x0004
MFD_HUGE_SHIFT = 26
# fcntl(2) seals Python's fcntl module lacks (Linux 5.1)
F_SEAL_FUTURE_WRITE = 0x0010
# fallocate(2)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
# mmap(2) / madvise(2)
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
# mbind(2)
MPOL_BIND = 2
MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1
MPOL_MF_MOVE_ALL = 1 << 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
PR_SET_NAME = 15


def _load_libnuma() -> ctypes.CDLL | None:
    try:
        from numa import LIBNUMA  # py-libnuma

        lib = ctypes.CDLL(LIBNUMA._name, use_errno=True)
    except Exception:  # py-libnuma missing or libnuma absent: fall back to the soname
        try:
            lib = ctypes.CDLL("libnuma.so.1", use_errno=True)
        except OSError:
            return None
    lib.mbind.restype = ctypes.c_long
    lib.mbind.argtypes = [
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.c_ulong,
        ctypes.c_uint,
    ]
    lib.numa_move_pages.restype = ctypes.c_int
    lib.numa_move_pages.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return lib


_numa = _load_libnuma()


def _fail(op: str, what: str, err: int | None = None) -> BackingError:
    """The refusal of syscall ``op`` (``what``: how it was called, for the detail)."""
    err = ctypes.get_errno() if err is None else err
    name = _errno.errorcode.get(err, str(err))
    return BackingError(f"{what}: [{name}] {os.strerror(err)}", errno=err, op=op)


def memfd_create(name: str, flags: int) -> int:
    try:
        return os.memfd_create(name, flags)
    except OSError as e:
        raise _fail("memfd_create", f"memfd_create({name!r}, flags={flags:#x})", e.errno) from e


def mmap_shared(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise _fail("mmap", f"mmap(MAP_SHARED) of {size} bytes")
    return int(addr)


def munmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        raise _fail("munmap", f"munmap of {size} bytes")


def madvise(addr: int, size: int, advice: int) -> None:
    if _libc.madvise(addr, size, advice) != 0:
        raise _fail("madvise", f"madvise({advice}) of {size} bytes")


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        raise _fail("fallocate", f"fallocate(mode={mode:#x}, offset={offset}, len={length})")


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    # The kernel reads maxnode - 1 bits (a historic off-by-one libnuma also follows).
    return mask, words * bits + 1


def mbind(addr: int, size: int, node: int, flags: int = 0) -> None:
    """Bind ``[addr, addr+size)`` to ``node`` with MPOL_BIND; ``flags`` may ask to move pages."""
    if _numa is None:
        raise BackingError("mbind: libnuma is not available on this host", errno=_errno.ENOSYS)
    mask, maxnode = _nodemask(node)
    if _numa.mbind(addr, size, MPOL_BIND, mask, maxnode, flags) != 0:
        raise _fail("mbind", f"mbind(MPOL_BIND, node {node}, flags={flags:#x}) of {size} bytes")


def move_pages_query(
    addr: int, size: int, page: int, sample: int | None = None
) -> array.array[int]:
    """Ask the kernel on which node each page of ``[addr, addr+size)`` lives.

    ``move_pages(2)`` with ``nodes=NULL`` only reports; it moves nothing. The
    answer per page is a node id, or a negative errno (``-ENOENT``: not
    present in this process's page tables). With ``sample``, only that many
    pages, spread evenly from the first to the last, are asked about.

    Plain ``array`` buffers, not numpy: the daemon would import numpy (0.2 s, and
    OpenBLAS's threads, which a process at its ``RLIMIT_NPROC`` cannot start) on its
    first placement check for three lines of arithmetic.
    """
    if _numa is None:
        raise BackingError("move_pages: libnuma is not available on this host", errno=_errno.ENOSYS)
    total = size // page
    if sample is not None and sample < total:
        step = (total - 1) / (max(sample, 1) - 1) if sample > 1 else 0.0
        index = sorted({int(i * step) for i in range(max(sample, 1))})
        pages = array.array("Q", (addr + i * page for i in index))
    else:
        pages = array.array("Q", range(addr, addr + total * page, page))
    count = len(pages)
    status = array.array("i", [-1]) * count
    if count:
        rc = _numa.numa_move_pages(
            0, count, pages.buffer_info()[0], None, status.buffer_info()[0], 0
        )
        if rc < 0:
            raise _fail("move_pages", f"move_pages(query) of {count} pages")
    return status


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """``pread(2)`` into ``view`` until it is full or the file ends; returns the bytes read."""
    done = 0
    try:
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
    except OSError as e:
        raise _fail("pread", f"pread at {offset + done}", e.errno) from e
    return done


def set_thread_name(name: str) -> None:
    """Name the calling thread for ``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/comm``
    (at most 15 bytes; best effort)."""
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def memset(addr: int, value: int, size: int) -> None:
    ctypes.memset(addr, value, size)


def view(addr: int, size: int) -> memoryview:
    """A writable memoryview over raw memory the caller keeps mapped."""
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
