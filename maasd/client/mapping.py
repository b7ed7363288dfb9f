"""A buffer's memfd mapped in the worker: :class:`BufferMapping` (``maasd.client.Mapping``).

Made by :class:`~maasd.client.worker.Worker` (``attach``, ``put``) and by its entry
maps (:mod:`maasd.client.entry_maps`: a lookup's first mapping of an entry), which keep
it in the mapping cache (:mod:`maasd.client.entries`); it knows its worker only as
the ``on_close`` it was handed, told when its user closes it. Its owners unmap it with
:meth:`BufferMapping.unmap` where they settle the attachment with the daemon themselves.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from maasd.client.errors import ProtocolError

__all__ = ["BufferMapping", "Mapping", "check_memfd_size"]

logger = logging.getLogger("maasd.client.worker")


def check_memfd_size(fd: int, size_bytes: int) -> None:
    """Mapping past the end of the file would SIGBUS on first touch: refuse a short memfd."""
    st_size = os.fstat(fd).st_size
    if st_size < size_bytes:
        raise ProtocolError(f"memfd is {st_size} bytes, daemon said {size_bytes}")


class BufferMapping:
    """One attachment of a buffer: its memfd, mapped shared (``maasd.client.Mapping`` is
    the same class, under its first name).

    ``array`` is a ``numpy.uint8`` view of the whole buffer (no copy), writable
    unless ``writable`` is false (a committed entry: its fd is read-only); ``size``
    its length in bytes; ``numa_node`` where its pages live; ``fd`` the sealed
    memfd (owned by the mapping: closed by :meth:`close`); ``key`` the entry key
    of a ``put``. ``on_close`` is told when :meth:`close` ends the attachment (the
    worker, which sends its ``detach``).
    """

    def __init__(
        self,
        on_close: Callable[[BufferMapping], object] | None,
        buffer_id: str,
        fd: int,
        size: int,
        numa_node: int,
        *,
        writable: bool = True,
        key: str | None = None,
        populate: bool = False,
    ) -> None:
        self.buffer_id = buffer_id
        self.fd = fd
        self.size = size
        self.numa_node = numa_node
        self.writable = writable
        self.key = key
        self._on_close = on_close
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE: for a mapping about to be written in full (a put), filling the
        # page tables at once costs ~0.6 ms per 9 MiB here; a write fault per page on
        # a shared memfd, ~7 ms. Read faults map 16 pages at a time and cost no more.
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=flags, prot=prot)
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The buffer as a numpy ``uint8`` array (zero-copy; writable if :attr:`writable`)."""
        if self._array is None:
            raise ValueError(f"mapping of buffer {self.buffer_id} is closed")
        return self._array

    @property
    def mmap(self) -> mmap.mmap:
        """The underlying ``mmap`` object (a buffer for ctypes/llama.cpp)."""
        if self._mmap is None:
            raise ValueError(f"mapping of buffer {self.buffer_id} is closed")
        return self._mmap

    def unmap(self) -> bool:
        """Drop the view, unmap, close the fd — in this process only: the daemon is not told
        (the worker that owns the mapping settles the attachment: a detach, a commit, the
        connection's end). Return False if it was already closed. :meth:`close` is the
        user's way."""
        mm = self._mmap
        if mm is None:
            return False
        # Drop our array first: it holds a buffer export on the mmap, and
        # mmap.close() refuses while exports exist.
        self._array = None
        self._mmap = None
        try:
            mm.close()
        except BufferError:
            # The caller still holds a numpy view (or memoryview) of it. The
            # pages stay mapped until the last view dies; the fd can go now
            # (mmap keeps its own reference to the file).
            logger.debug("buffer %s: views still alive, unmapping deferred", self.buffer_id)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        return True

    def close(self) -> None:
        """Unmap and close the fd, then tell the daemon this attachment is over. Idempotent."""
        if self.unmap() and self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> BufferMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fd}"
        return (
            f"BufferMapping(buffer_id={self.buffer_id!r}, size={self.size}, "
            f"numa_node={self.numa_node}, {state})"
        )


#: The class's first name, kept: ``maasd.client.Mapping`` (it is not a
#: :class:`collections.abc.Mapping`; :class:`BufferMapping` says what it is).
Mapping = BufferMapping
