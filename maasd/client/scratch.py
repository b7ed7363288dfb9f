"""``Scratch``: memory of the writer's own to build an entry in, then ``publish`` it.

A memfd this process creates once and keeps mapped: each save writes into pages that
are already there (no first touch, no page-table fill), and ``Worker.publish`` sends
the memfd with one frame; the daemon reads the bytes into a sealed region of its own
(docs/client.md, "Publishing an entry"). The memfd is never the daemon's and never
counted in the tenant's quota: it is the writer's memory, like its llama.cpp context.

Example::

    scratch = Scratch()
    view = scratch.ensure(n)               # numpy uint8, writable, at least n bytes
    view[:n] = ...                         # e.g. llama_state_seq_get_data into it
    entry = worker.publish("model:prefix", scratch, n)
    scratch.close()
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os

import numpy as np
import numpy.typing as npt

__all__ = ["Scratch", "source_fd"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


class Scratch:
    """A growable memfd of this process, mapped shared and writable; not thread-safe.

    ``size`` bytes are made ready at once if given (else at the first :meth:`ensure`).
    It only grows: :meth:`ensure` of more than it holds enlarges the file and maps it
    again, filling the page tables (``MAP_POPULATE``); less reuses what is mapped.
    """

    def __init__(self, size: int = 0, *, name: str = "maasd-scratch") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.size = 0
        self._mmap: mmap.mmap | None = None
        self._array: npt.NDArray[np.uint8] | None = None
        if size:
            self.ensure(size)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The whole memfd as a writable numpy ``uint8`` array (zero-copy)."""
        if self._array is None:
            raise ValueError("the scratch memfd holds nothing yet (ensure() a size first)")
        return self._array

    @property
    def mmap(self) -> mmap.mmap:
        """The mapping (a buffer for ctypes/llama.cpp)."""
        if self._mmap is None:
            raise ValueError("the scratch memfd holds nothing yet (ensure() a size first)")
        return self._mmap

    def ensure(self, size: int) -> npt.NDArray[np.uint8]:
        """At least ``size`` bytes, mapped: the whole array (its first ``size`` bytes are
        the caller's to fill). Grows by at least a quarter, so that a state growing turn
        by turn maps again seldom."""
        if self.closed:
            raise ValueError("the scratch memfd is closed")
        if size <= 0:
            raise ValueError("size must be > 0")
        if size > self.size:
            want = max(size, self.size + self.size // 4)
            self._remap(-(-want // _PAGE) * _PAGE)
        return self.array

    def _remap(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        old = self._mmap
        self._array = None
        self._mmap = None
        if old is not None:
            _close_mapping(old)
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE  # written in full: page tables at once
        self._mmap = mmap.mmap(self.fd, size, flags=flags)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.size = size

    def close(self) -> None:
        """Unmap and close the memfd (its pages go once no one else holds it). Idempotent."""
        if self.closed:
            return
        old, self._mmap, self._array = self._mmap, None, None
        if old is not None:
            _close_mapping(old)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1
        self.size = 0

    def fileno(self) -> int:
        return self.fd

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Scratch(fd={self.fd}, size={self.size})"


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view of it is still alive: unmapped when the last one dies
        logger.debug("scratch: views still alive, unmapping deferred")


def source_fd(source: Scratch | int) -> int:
    """The fd of a publish's ``source`` (a :class:`Scratch` or an fd), checked open: an fd
    the kernel refuses to send fails the ``sendmsg`` before any byte goes, but the channel
    cannot tell that from a broken stream (it would give up the connection)."""
    if isinstance(source, Scratch):
        if source.closed:
            raise ValueError("publish: the scratch is closed")
        return source.fd
    if isinstance(source, bool) or not isinstance(source, int):
        raise TypeError(f"publish needs a Scratch or an fd, not {type(source).__name__}")
    try:
        os.fstat(source)
    except OSError as exc:
        raise ValueError(f"publish: fd {source} is not open ({exc.strerror})") from exc
    return source
