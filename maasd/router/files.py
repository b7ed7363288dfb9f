"""Slot files with no file on disk: memfds of the router, linked into a backend's slot dir.

``llama-server`` reads and writes slot files by name, under its ``--slot-save-path``.
The router gives it names that are symbolic links to ``/proc/<router pid>/fd/<n>``:

* a **restore** names a memfd holding the ``ggsq`` file form, sealed (write, grow,
  shrink) before the link exists, so nothing can change the bytes the router checked;
* a **save** names an unsealed memfd: the server's ``fopen("wb")`` truncates it and
  writes the file, which the router then reads back and copies into a maasd entry.

Opening ``/proc/<pid>/fd/<n>`` needs the same uid and PID namespace as the router.
Where that can't hold, ``copy=True`` uses real files instead (a tmpfs slot dir both
reach): a restore writes the file form there (then read-only, mode 0444: no seal can
be set on a regular file), a save lets the server create the file, which the router
reads and removes. A name never contains ``:`` (the
server's ``fs_validate_filename`` refuses it); every name starts with :data:`PREFIX`,
and :func:`sweep` removes the links a crashed router left.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["PREFIX", "LinkedFile", "sweep"]

PREFIX = "maasd-router-"
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_counter = itertools.count()


class LinkedFile:
    """One memfd of this process and its link in a slot dir. Close it when done."""

    def __init__(
        self, slot_dir: str | Path, what: str, size: int = 0, *, copy: bool = False
    ) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{what}"
        self.path = Path(slot_dir) / self.name
        self.copy = copy
        if copy:
            self.fd = -1  # a save: the server creates the file
            if size:
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                self.fd = os.open(self.path, flags, 0o644)
                os.ftruncate(self.fd, size)
            return
        self.fd = os.memfd_create(f"maasd-router-{what}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if size:
                os.ftruncate(self.fd, size)
            os.symlink(f"/proc/{os.getpid()}/fd/{self.fd}", self.path)
        except BaseException:
            os.close(self.fd)
            raise

    def map(self, size: int, *, write: bool) -> tuple[mmap.mmap, npt.NDArray[np.uint8]]:
        """The first ``size`` bytes mapped (the caller closes the mmap, views dropped)."""
        if self.fd < 0:  # a copied save: the file the server wrote
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, prot)
        return mm, np.frombuffer(mm, dtype=np.uint8, count=size)

    def seal(self) -> None:
        """No more writes, no size change: what a reader checked stays what it reads."""
        if self.copy:
            os.fchmod(self.fd, 0o444)
            return
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else os.stat(self.path).st_size

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)

    def __enter__(self) -> LinkedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep(slot_dir: str | Path) -> int:
    """Remove the router links in ``slot_dir`` whose process is gone → how many."""
    n = 0
    for p in Path(slot_dir).glob(PREFIX + "*"):
        pid = p.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
        elif pid.isdigit() and int(pid) == os.getpid() and p.is_symlink() and not p.exists():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # a dangling link of ours: its memfd is closed
                n += 1
    return n
