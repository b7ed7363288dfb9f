"""One pool's disk directory: entry files encrypted with a key of their own, held in memory.

Each entry is one file ``<random id>.ent``: a 12-byte nonce, then the entry's bytes
encrypted with AES-256-GCM under a key drawn for that entry alone, then the 16-byte tag.
The key lives only in this process (:class:`Sealed`); the additional data binds the file
to its tenant, key, size and name, so a file renamed or swapped for another fails its tag.

    seal      the bytes encrypted into memory (in the caller's thread: no plaintext copy
              is ever made, and the ciphertext is what waits for the writer)
    write     to ``.<id>.tmp``, fsync, rename to ``<id>.ent``, fsync the directory — a crash
              leaves a temporary file (removed at start) or a whole one, never a torn
              ``.ent``; and since the keys die with the process, nothing on disk is ever
              restorable after a restart anyway
    read_into the file read, decrypted straight into the caller's buffer (a fresh memfd's
              mapping), the tag checked: a changed byte, a short or missing file is
              :class:`Unreadable` (the caller drops the entry and scrubs the buffer)
    erase     the key forgotten by the caller (the bytes are unreadable from then on,
              whatever the disk keeps), the file's blocks punched (a discard where the
              filesystem passes it on), then unlinked
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from maasd.allocator import punch_file
from maasd.errors import BackingError

__all__ = ["SUFFIX", "DiskDir", "Sealed", "Unreadable"]

logger = logging.getLogger(__name__)

SUFFIX = ".ent"
NONCE = 12
TAG = 16
#: What decrypting into the caller's buffer needs beyond the bytes (cryptography's
#: update_into asks for a block of room; the tail goes through a small scratch buffer).
_TAIL = 4096


class _Failures:
    """A warning at most every :data:`LOG_EVERY_S` seconds, with how many it stood for."""

    LOG_EVERY_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said_at = -self.LOG_EVERY_S
        self._since = 0

    def say(self, what: str) -> None:
        with self._lock:
            self._since += 1
            now = time.monotonic()
            if now - self._said_at < self.LOG_EVERY_S:
                return
            count, self._since, self._said_at = self._since, 0, now
        logger.warning("%s; %d such in the last minute", what, count)


_ERASE_FAILURES = _Failures()


class Unreadable(Exception):
    """The file is gone, short, or its tag does not verify: the entry is lost."""


@dataclass(frozen=True)
class Sealed:
    """One entry on disk: its file's name, its size and its key (memory only)."""

    name: str
    size: int
    key: bytes
    aad: bytes


def _aad(tenant_id: str, key: str, size: int, name: str) -> bytes:
    return f"maasd-disk-v1\0{tenant_id}\0{key}\0{size}\0{name}".encode()


def _open_own(path: str, flags: int) -> int:
    """An entry file opened as only a regular file of the tier may be: not through a
    symlink (an erase would punch its target, wherever it is), never waiting (a named
    pipe's ``open`` waits for a peer for ever) → the fd; ``OSError`` for anything else."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


class DiskDir:
    """The entry files of one pool's disk tier."""

    def __init__(self, path: str) -> None:
        self.path = path

    def open(self) -> int:
        """Make the directory (0700) and empty it: files of an earlier run cannot be read
        (their keys died with it). Returns how many files were removed."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", self.path)
        removed = 0
        for name in os.listdir(self.path):
            if name.endswith(SUFFIX) or (name.startswith(".") and name.endswith(SUFFIX + ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, name))
                removed += 1
        return removed

    @staticmethod
    def seal(tenant_id: str, key: str, data: memoryview) -> tuple[Sealed, bytes]:
        """The entry's key and file name, and its file's bytes (nonce, ciphertext, tag)."""
        name = secrets.token_hex(16) + SUFFIX
        aad = _aad(tenant_id, key, len(data), name)
        entry_key = AESGCM.generate_key(bit_length=256)
        nonce = secrets.token_bytes(NONCE)
        body = AESGCM(entry_key).encrypt(nonce, data, aad)
        return Sealed(name, len(data), entry_key, aad), nonce + body

    def write(self, sealed: Sealed, blob: bytes) -> None:
        """Write the file whole or not at all (``OSError`` on a full or failing disk; the
        temporary file is gone then)."""
        final = os.path.join(self.path, sealed.name)
        tmp = os.path.join(self.path, "." + sealed.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
        dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def read_into(self, sealed: Sealed, out: memoryview) -> int:
        """Decrypt the entry into ``out[:size]`` and verify it; the bytes read from disk.

        Raises :class:`Unreadable` if the file is missing, short or fails its tag — ``out``
        may then hold unverified bytes, which the caller scrubs.
        """
        size = sealed.size
        try:
            fd = _open_own(os.path.join(self.path, sealed.name), os.O_RDONLY)
            with open(fd, "rb", buffering=0) as f:
                blob = bytearray(NONCE + size + TAG + 1)
                got = f.readinto(blob)
        except OSError as e:
            raise Unreadable(f"entry file {sealed.name}: {e.strerror or e}") from e
        if got != NONCE + size + TAG:
            raise Unreadable(f"entry file {sealed.name}: {got} bytes, not {NONCE + size + TAG}")
        view = memoryview(blob)
        nonce, body, tag = view[:NONCE], view[NONCE : NONCE + size], view[NONCE + size : got]
        dec = Cipher(algorithms.AES(sealed.key), modes.GCM(bytes(nonce), bytes(tag))).decryptor()
        dec.authenticate_additional_data(sealed.aad)
        head = max(0, size - _TAIL)
        if head:
            dec.update_into(body[:head], out[: head + _TAIL])  # room: the tail's own bytes
        scratch = bytearray(_TAIL + 32)
        n = dec.update_into(body[head:], scratch)
        out[head : head + n] = scratch[:n]
        try:
            dec.finalize()
        except InvalidTag as e:
            raise Unreadable(f"entry file {sealed.name}: its tag does not verify") from e
        return got

    def erase(self, sealed: Sealed) -> None:
        """Punch the file's blocks (a discard, where passed on) and unlink it; gone is fine.
        The caller has forgotten ``sealed`` (its key): that is the erasure, so a disk that
        refuses (read-only, gone, failing) is logged, never raised — a release, a delete
        or a lookup that erases must not fail for the disk (SPEC §12)."""
        path = os.path.join(self.path, sealed.name)
        try:
            fd = _open_own(path, os.O_WRONLY)
        except OSError:
            fd = -1  # gone, or no file of ours any more (a link, a pipe): unlink only
        if fd >= 0:
            try:
                with contextlib.suppress(BackingError):  # not every filesystem punches
                    punch_file(fd, sealed.size + 64)
            finally:
                os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # the key is gone: what stays on disk cannot be read
            _ERASE_FAILURES.say(f"disk tier {self.path}: a file not removed ({e})")

    def files(self) -> list[str]:
        """The entry and temporary files in the directory now (tests, checks)."""
        try:
            return sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
