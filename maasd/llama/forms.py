"""The heads of the two forms a llama.cpp sequence state travels in (pure: numpy, no I/O).

* **get_data form** — what ``llama_state_seq_get_data`` returns: the u32 ``IO_MAGIC``
  (``0xaf143cd8``), the i32 source sequence id, then the memory state. An entry
  (:mod:`maasd.llama.format`) holds it after its ``MAASDKV`` header.
* **File form** (``ggsq``) — what ``llama-server``'s ``/slots/{id}?action=save|restore``
  reads and writes (``llama_state_seq_save_file``): the u32 magic ``0x67677371``, the
  u32 version (3 in the pinned build), the u32 token count, the tokens, then the same
  memory state. The server writes its tokens as a packed record (``-1``, record version
  1, the u32 count and the tokens, a u32 media count, zero padding to 4 bytes); a plain
  token list is accepted on restore.

What follows either head — the memory state itself, per-layer K and V — is
:mod:`maasd.llama.views`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from maasd.llama.fleet import FILE_VERSION

__all__ = [
    "FILE_HEAD",
    "FILE_MAGIC",
    "FILE_VERSION",
    "IO_MAGIC",
    "IO_PREFIX",
    "FileForm",
    "StateError",
    "byte_view",
    "parse_file_form",
]

FILE_MAGIC = 0x67677371  # LLAMA_FILE_MAGIC_GGSQ
IO_MAGIC = 0xAF143CD8  # the first u32 of llama_state_seq_get_data
FILE_HEAD = struct.Struct("<III")
IO_PREFIX = struct.Struct("<Ii")
_PACKED_MARK = -1  # LLAMA_TOKEN_NULL: a packed server_tokens record follows
_PACKED_VERSION = 1


class StateError(ValueError):
    """A state that must not reach llama.cpp, or cannot be read (why is in the message)."""


def byte_view(buf: Any) -> memoryview:
    """``buf`` (bytes, bytearray, memoryview, mmap, a contiguous numpy array) as a flat
    memoryview of bytes, over the same memory (no copy)."""
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:  # a non-contiguous array, or a memoryview of another shape
        raise StateError(f"not a contiguous buffer of bytes: {exc}") from None


@dataclass(frozen=True)
class FileForm:
    """A parsed ``ggsq`` file: its tokens and where its memory state lies."""

    tokens: npt.NDArray[np.int32]
    state_offset: int
    state_len: int


def _unpack_tokens(raw: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """The tokens of a server's token record (packed or plain)."""
    if len(raw) == 0 or raw[0] != _PACKED_MARK:
        return raw
    if len(raw) < 4 or int(raw[1]) != _PACKED_VERSION:
        raise StateError("unknown packed token record")
    n = int(raw[2])
    if n < 0 or 3 + n + 1 > len(raw):
        raise StateError("packed token count exceeds the record")
    if int(raw[3 + n]) != 0:
        raise StateError("the slot holds media chunks (not shareable)")
    if np.any(raw[4 + n :]):  # numpy: the trailer can be as long as the record
        raise StateError("trailing data in the packed token record")
    return raw[3 : 3 + n]


def parse_file_form(buf: bytes | memoryview | npt.NDArray[np.uint8], size: int) -> FileForm:
    """Parse the ``ggsq`` bytes a server saved (the first ``size`` of ``buf``)."""
    view = byte_view(buf)
    size = min(size, len(view))
    if size < FILE_HEAD.size:
        raise StateError(f"slot file of {size} bytes")
    magic, version, count = FILE_HEAD.unpack_from(view, 0)
    if magic != FILE_MAGIC or version != FILE_VERSION:
        raise StateError(f"slot file magic {magic:#x} version {version}, want ggsq v{FILE_VERSION}")
    offset = FILE_HEAD.size + 4 * count
    if offset >= size:
        raise StateError(f"slot file of {size} bytes cannot hold {count} token words and a state")
    raw = np.frombuffer(view, dtype="<i4", count=count, offset=FILE_HEAD.size)
    return FileForm(_unpack_tokens(raw).copy(), offset, size - offset)
