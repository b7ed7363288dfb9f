"""The two forms of one llama.cpp sequence state, and the fingerprint that says who may share it.

Pure (numpy; xxhash on the first checksum), no llama.cpp and no I/O.

* **Entry form** — what maasd stores, the form :class:`~maasd.llama.KVStore` writes: the
  ``MAASDKV`` header of :mod:`maasd.llama.format` (fingerprint, tokens, state length
  and checksum), then the bytes ``llama_state_seq_get_data`` returns: an 8-byte prefix
  (``0xaf143cd8``, the source sequence id), then the memory state.
* **File form** (``ggsq``) — what ``llama-server``'s ``/slots/{id}?action=save|restore``
  reads and writes (``llama_state_seq_save_file``): the u32 magic ``0x67677371``, the
  u32 version (3 in the pinned build), the u32 token count, the tokens, then the same
  memory state. The server writes its tokens as a packed record (``-1``, record version
  1, the u32 count and the tokens, a u32 media count, zero padding to 4 bytes); a plain
  token list is accepted on restore, which is what :func:`write_file_form` writes.

Entries are stored in the entry form, whoever computed them, so a prefix saved by a
``maasd worker`` (llama-cpp-python) restores into ``llama-server`` and the reverse
whenever their fingerprints are equal. Converting costs one copy of the state (about
1 ms for a 6.6 MB Gemma state, docs/llama-server.md), which buys something a
zero-copy restore cannot: the router checks the checksum of exactly the bytes the server
will read, in memory nobody else can change.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from maasd.llama.fleet import FILE_VERSION, fleet_fingerprint, ggml_type_name
from maasd.llama.format import (
    Header,
    HeaderError,
    as_tokens,
    header_len_for,
    pack_header,
    parse_header,
    state_checksum,
)

__all__ = [
    "FILE_MAGIC",
    "FILE_VERSION",
    "IO_MAGIC",
    "FileForm",
    "StateError",
    "entry_size",
    "file_size",
    "fleet_fingerprint",
    "ggml_type_name",
    "parse_file_form",
    "validate_entry",
    "write_entry_form",
    "write_file_form",
]

FILE_MAGIC = 0x67677371  # LLAMA_FILE_MAGIC_GGSQ
IO_MAGIC = 0xAF143CD8  # the first u32 of llama_state_seq_get_data
_FILE_HEAD = struct.Struct("<III")
_IO_PREFIX = struct.Struct("<Ii")
_PACKED_MARK = -1  # LLAMA_TOKEN_NULL: a packed server_tokens record follows
_PACKED_VERSION = 1


class StateError(ValueError):
    """A state that must not reach llama.cpp (why is in the message)."""


# --------------------------------------------------------------------------- file form


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
    if any(raw[4 + n :]):
        raise StateError("trailing data in the packed token record")
    return raw[3 : 3 + n]


def parse_file_form(buf: bytes | memoryview | npt.NDArray[np.uint8], size: int) -> FileForm:
    """Parse the ``ggsq`` bytes a server saved (the first ``size`` of ``buf``)."""
    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf).cast("B")
    size = min(size, len(view))
    if size < _FILE_HEAD.size:
        raise StateError(f"slot file of {size} bytes")
    magic, version, count = _FILE_HEAD.unpack_from(view, 0)
    if magic != FILE_MAGIC or version != FILE_VERSION:
        raise StateError(f"slot file magic {magic:#x} version {version}, want ggsq v{FILE_VERSION}")
    offset = _FILE_HEAD.size + 4 * count
    if offset >= size:
        raise StateError(f"slot file of {size} bytes cannot hold {count} token words and a state")
    raw = np.frombuffer(view, dtype="<i4", count=count, offset=_FILE_HEAD.size)
    return FileForm(_unpack_tokens(raw).copy(), offset, size - offset)


def file_size(n_tokens: int, memory_len: int) -> int:
    """Bytes of the file form of ``n_tokens`` tokens and ``memory_len`` bytes of memory state."""
    return _FILE_HEAD.size + 4 * n_tokens + memory_len


def write_file_form(
    dst: npt.NDArray[np.uint8], entry: npt.NDArray[np.uint8], header: Header
) -> int:
    """Write the file form of a validated entry into ``dst`` → bytes written.

    The memory state is the entry's state less its 8-byte ``get_data`` prefix.
    """
    toks = header.tokens
    memory = entry[header.header_len + _IO_PREFIX.size : header.header_len + header.state_len]
    n = file_size(len(toks), len(memory))
    if dst.size < n:
        raise ValueError(f"{dst.size} B cannot hold a {n} B slot file")
    dst[: _FILE_HEAD.size] = np.frombuffer(
        _FILE_HEAD.pack(FILE_MAGIC, FILE_VERSION, len(toks)), dtype=np.uint8
    )
    off = _FILE_HEAD.size
    dst[off : off + 4 * len(toks)] = as_tokens(toks).view(np.uint8)
    dst[off + 4 * len(toks) : n] = memory
    return n


# --------------------------------------------------------------------------- entry form


def entry_size(n_tokens: int, memory_len: int) -> int:
    """Bytes of the entry form of ``n_tokens`` tokens and ``memory_len`` bytes of memory."""
    return header_len_for(n_tokens) + _IO_PREFIX.size + memory_len


def write_entry_form(
    dst: npt.NDArray[np.uint8],
    fingerprint: str,
    chunk: int,
    form: FileForm,
    src: npt.NDArray[np.uint8],
    n_tokens: int | None = None,
) -> int:
    """Write the entry form of the slot file ``src`` (parsed as ``form``) into ``dst``.

    ``n_tokens`` keeps only that many of the file's tokens in the header (the state
    still holds them all: a restore trims). The magic is written last. → bytes written.
    """
    toks = form.tokens if n_tokens is None else form.tokens[:n_tokens]
    hlen = header_len_for(len(toks))
    state_len = _IO_PREFIX.size + form.state_len
    if dst.size < hlen + state_len:
        raise ValueError(f"{dst.size} B cannot hold a {hlen + state_len} B entry")
    state = dst[hlen : hlen + state_len]
    state[: _IO_PREFIX.size] = np.frombuffer(_IO_PREFIX.pack(IO_MAGIC, 0), dtype=np.uint8)
    state[_IO_PREFIX.size :] = src[form.state_offset : form.state_offset + form.state_len]
    crc = state_checksum(state.data)
    head = pack_header(fingerprint, toks, state_len, crc, chunk)
    m = 8  # the magic goes last: a reader sees the entry whole or not at all
    dst[m : len(head)] = np.frombuffer(head, dtype=np.uint8, offset=m)
    dst[:m] = np.frombuffer(head, dtype=np.uint8, count=m)
    return hlen + state_len


def validate_entry(
    buf: npt.NDArray[np.uint8], size: int, fingerprint: str, tokens: Any, matched: int
) -> Header:
    """Everything llama.cpp will not check, checked before a state goes near a server.

    The header (magic, version, header checksum, bounds), the fingerprint, that the
    stored tokens start with the ``matched`` tokens of the prompt the key was computed
    from, the ``get_data`` prefix, and the checksum of the whole state. Raises
    :class:`StateError` (a miss: the caller drops the entry).
    """
    try:
        hdr = parse_header(buf, size)
    except HeaderError as exc:
        raise StateError(str(exc)) from exc
    if hdr.fingerprint != fingerprint:
        raise StateError(f"saved with another fingerprint ({hdr.fingerprint})")
    arr = as_tokens(tokens)
    if hdr.n_tokens < matched or not np.array_equal(hdr.tokens[:matched], arr[:matched]):
        raise StateError("its tokens do not match its key")
    state = buf[hdr.header_len : hdr.header_len + hdr.state_len]
    if hdr.state_len <= _IO_PREFIX.size:
        raise StateError("empty state")
    magic, _seq = _IO_PREFIX.unpack_from(state.data, 0)
    if magic != IO_MAGIC:
        raise StateError(f"state magic {magic:#x} is not llama_state_seq_get_data's")
    if state_checksum(state.data) != hdr.state_crc:
        raise StateError("state checksum mismatch")
    return hdr
