"""Persistence primitives: a region's bytes to a file and back, checksummed.

Persistent pools are memfds like the others (a named tmpfs file cannot be
sealed); their bytes survive a restart through these checkpoint files.
A checkpoint is written to ``PATH.tmp`` (created exclusively, never through a
symlink), fsync'd, renamed to ``PATH`` and the directory fsync'd, so a file
under its final name is always whole. The daemon
gives every checkpoint a file name of its own and removes the previous file only
once the ledger records the new one's checksum (:mod:`maasd.core.checkpoints`):
renaming over the previous file would leave, after a crash before that record,
a file whose checksum the ledger does not know.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
from pathlib import Path

from maasd.allocator.region import Region
from maasd.bounds import Backing
from maasd.errors import BackingError, MaasdError, ResourceLimit

CHUNK = 8 << 20
#: A checkpoint's temporary file: created new, never through a symlink.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

#: errnos of a spill filesystem with no room left (answered 507, like any daemon limit).
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def checkpoint(region: Region, path: str | os.PathLike[str], *, sync: bool = True) -> str:
    """Write the region's bytes to ``path`` durably; return their SHA-256 (hex).

    The bytes are read with ``pread`` from the region's fd, never through the
    daemon's mapping: a worker may have punched holes in its buffer, which read as
    zeros this way and cost nothing, where a touch through the mapping of a
    ``hugetlb`` hole could fault the daemon (no worker action may: docs/allocator.md). The temporary file is
    created with ``O_EXCL | O_NOFOLLOW`` after removing any stale one (a crash's
    leftover, or a planted symlink, which is removed and never followed).

    ``sync=False`` leaves out the two fsyncs (file and directory): for many checkpoints
    at once, made durable together by one :func:`sync_filesystem` — which must happen
    before anything (the ledger) relies on them.

    A checkpoint that fails leaves no file behind. Raises :class:`ResourceLimit` (507)
    when the spill filesystem is full or refuses the write (read-only, I/O error).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, _CREATE, 0o600)
    except OSError as e:
        raise _checkpoint_error(path, e) from e
    try:
        digest = _write_all(region, fd, path, sync=sync)
    except BaseException as e:
        # A failed checkpoint leaves no file behind: a partial one would keep a full
        # spill directory full, for every buffer of the pool, after its buffer is gone.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _checkpoint_error(path, e) from e
        raise
    try:
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _checkpoint_error(path, e) from e
    if sync:
        try:
            _fsync_dir(path.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise _checkpoint_error(path, e) from e
    return digest


def _write_all(region: Region, fd: int, path: Path, *, sync: bool) -> str:
    """Write the region's bytes to ``fd`` (then close it); their SHA-256 (hex)."""
    digest = hashlib.sha256()
    chunk = bytearray(min(CHUNK, region.size))
    try:
        off = 0
        while off < region.size:
            n = region.read_into(chunk, off)
            if not n:
                raise BackingError(f"checkpoint to {path}: short read of the region at {off}")
            data = memoryview(chunk)[:n]
            digest.update(data)
            while data:
                data = data[os.write(fd, data) :]
            off += n
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _checkpoint_error(path: Path, e: OSError) -> MaasdError:
    """A spill filesystem that is full, or that refuses writes (gone read-only after an
    I/O error, a failing disk), is a limit the daemon is at (507, the detail says which),
    not a bug (500): the buffer keeps its previous checkpoint, and a retry may succeed
    once the operator has repaired the spill directory."""
    if e.errno in _FULL:
        return ResourceLimit(
            f"the spill directory {path.parent} has no room for a checkpoint: "
            f"{e.strerror}; free space there or give the pool a larger spill_dir"
        )
    return ResourceLimit(
        f"the spill directory {path.parent} cannot take a checkpoint: {e.strerror or e}; "
        "the buffer keeps its previous checkpoint"
    )


def sync_filesystem(path: str | os.PathLike[str]) -> None:
    """``syncfs(2)`` of the filesystem holding ``path``: everything written there (files,
    renames) is durable when this returns. One call instead of two fsyncs per file."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise BackingError(f"syncfs of {path}: {os.strerror(err)}", err)
    finally:
        os.close(fd)


def file_checksum(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def restore(
    path: str | os.PathLike[str],
    *,
    node: int,
    backing: Backing = "memfd",
    page_bytes: int | None = None,
    size: int | None = None,
    expected_checksum: str | None = None,
    extra_seals: int = 0,
) -> Region:
    """Load a checkpoint into a fresh sealed region; verify the checksum when given.

    ``extra_seals`` go on with the region's seals (``F_SEAL_FUTURE_WRITE`` for a
    committed entry: the daemon's own mapping, made before them, stays writable).

    Raises :class:`BackingError` when the file is missing, unreadable, not ``size``
    bytes long, or its checksum does not match (the region is closed, nothing leaks).
    """
    path = Path(path)
    try:
        file_size = path.stat().st_size
    except OSError as e:
        raise BackingError(f"restore from {path}: {e.strerror}", e.errno) from e
    size = file_size if size is None else size
    if file_size != size:
        raise BackingError(f"restore from {path}: file holds {file_size} bytes, expected {size}")
    region = Region.create(
        size,
        node=node,
        backing=backing,
        page_bytes=page_bytes,
        prefault=True,
        extra_seals=extra_seals,
    )
    try:
        _read_and_verify(path, region, file_size, expected_checksum)
    except BaseException as e:
        region.scrub("punch")
        region.close()
        if isinstance(e, OSError):  # not a readable file (a directory, an I/O error)
            raise BackingError(f"restore from {path}: {e.strerror or e}", e.errno) from e
        raise
    return region


def _read_and_verify(
    path: Path, region: Region, file_size: int, expected_checksum: str | None
) -> None:
    """Read ``file_size`` bytes of ``path`` into ``region``; check the sha256 if one is given."""
    digest = hashlib.sha256()
    view = region.view()
    try:
        with open(path, "rb", buffering=0) as f:
            off = 0
            while off < file_size:
                n = f.readinto(view[off : min(off + CHUNK, file_size)])
                if not n:
                    raise BackingError(f"restore from {path}: short read at {off}")
                digest.update(view[off : off + n])
                off += n
    finally:
        view.release()
    if expected_checksum is not None and digest.hexdigest() != expected_checksum:
        raise BackingError(
            f"restore from {path}: checksum mismatch "
            f"(file {digest.hexdigest()[:16]}…, ledger {expected_checksum[:16]}…)"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
