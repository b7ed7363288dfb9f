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
from maasd.llama.forms import (
    FILE_HEAD,
    FILE_MAGIC,
    IO_MAGIC,
    IO_PREFIX,
    FileForm,
    StateError,
    parse_file_form,
)
from maasd.llama.views import StateView, view_file_form, view_get_data

__all__ = [
    "FILE_MAGIC",
    "FILE_VERSION",
    "IO_MAGIC",
    "FileForm",
    "Settings",
    "StateError",
    "check_file_form",
    "entry_size",
    "file_checksum",
    "file_size",
    "fleet_fingerprint",
    "ggml_type_name",
    "parse_file_form",
    "validate_entry",
    "write_entry_form",
    "write_file_form",
]


def file_size(n_tokens: int, memory_len: int) -> int:
    """Bytes of the file form of ``n_tokens`` tokens and ``memory_len`` bytes of memory state."""
    return FILE_HEAD.size + 4 * n_tokens + memory_len


def write_file_form(
    dst: npt.NDArray[np.uint8], entry: npt.NDArray[np.uint8], header: Header
) -> int:
    """Write the file form of a validated entry into ``dst`` → bytes written.

    The memory state is the entry's state less its 8-byte ``get_data`` prefix.
    """
    toks = header.tokens
    memory = entry[header.header_len + IO_PREFIX.size : header.header_len + header.state_len]
    n = file_size(len(toks), len(memory))
    if dst.size < n:
        raise ValueError(f"{dst.size} B cannot hold a {n} B slot file")
    dst[: FILE_HEAD.size] = np.frombuffer(
        FILE_HEAD.pack(FILE_MAGIC, FILE_VERSION, len(toks)), dtype=np.uint8
    )
    off = FILE_HEAD.size
    dst[off : off + 4 * len(toks)] = as_tokens(toks).view(np.uint8)
    dst[off + 4 * len(toks) : n] = memory
    return n


def file_checksum(buf: npt.NDArray[np.uint8], n_tokens: int, prefix: bytes) -> int:
    """The state checksum an entry's header keeps (:func:`~maasd.llama.format.state_checksum`)
    of a file form :func:`write_file_form` wrote: over the entry's 8-byte ``get_data``
    prefix, then the file's memory state — so a restore checks the very bytes it hands
    the server, in one pass and with no copy."""
    import xxhash

    h = xxhash.xxh3_64(prefix)
    h.update(buf[FILE_HEAD.size + 4 * n_tokens :].data)
    return int(h.intdigest()) & 0xFFFFFFFF


# --------------------------------------------------------------------------- entry form


def entry_size(n_tokens: int, memory_len: int) -> int:
    """Bytes of the entry form of ``n_tokens`` tokens and ``memory_len`` bytes of memory."""
    return header_len_for(n_tokens) + IO_PREFIX.size + memory_len


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
    state_len = IO_PREFIX.size + form.state_len
    if dst.size < hlen + state_len:
        raise ValueError(f"{dst.size} B cannot hold a {hlen + state_len} B entry")
    state = dst[hlen : hlen + state_len]
    state[: IO_PREFIX.size] = np.frombuffer(IO_PREFIX.pack(IO_MAGIC, 0), dtype=np.uint8)
    state[IO_PREFIX.size :] = src[form.state_offset : form.state_offset + form.state_len]
    crc = state_checksum(state.data)
    head = pack_header(fingerprint, toks, state_len, crc, chunk)
    m = 8  # the magic goes last: a reader sees the entry whole or not at all
    dst[m : len(head)] = np.frombuffer(head, dtype=np.uint8, offset=m)
    dst[:m] = np.frombuffer(head, dtype=np.uint8, count=m)
    return hlen + state_len


@dataclass(frozen=True)
class Settings:
    """The cache settings a sequence state shows: K and V types, V layout, KV streams.

    What a backend really runs, read from a state it saved (:mod:`maasd.router.identity`),
    and what every state the router restores or publishes must show too: a state of
    other settings under the fleet's fingerprint (a worker that claimed it, a backend
    restarted otherwise) is refused, whatever its key says.
    """

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False  # V not transposed
    n_stream: int = 1

    @classmethod
    def of(cls, view: StateView) -> Settings:
        """The settings ``view`` shows; :class:`StateError` if its layers disagree."""
        seen = set()
        for c in view.caches:
            for s in c.streams:
                for x in s.layers:
                    v = "none" if x.v_type is None else ggml_type_name(x.v_type)
                    seen.add(cls(ggml_type_name(x.k_type), v, not x.v_trans, len(c.streams)))
        if len(seen) != 1:
            raise StateError(f"a state of {len(seen)} kinds of layers: {sorted(map(str, seen))}")
        return seen.pop()

    def check(self, view: StateView) -> None:
        """:class:`StateError` unless ``view`` was saved with these settings."""
        got = Settings.of(view)
        if got.type_v == "none":  # a model without V (MLA): nothing to compare
            got = Settings(got.type_k, self.type_v, got.flash_attn, got.n_stream)
        if got != self:
            raise StateError(f"a state of {got.describe()}, not {self.describe()}")

    def describe(self) -> str:
        fa = "flash attention (V rows)" if self.flash_attn else "no flash attention (V transposed)"
        return f"K {self.type_k}, V {self.type_v}, {fa}, {self.n_stream} KV stream(s)"


def validate_entry(
    buf: npt.NDArray[np.uint8],
    size: int,
    fingerprint: str,
    tokens: Any,
    matched: int,
    settings: Settings | None = None,
) -> Header:
    """Everything llama.cpp will not check, checked before a state goes near a server.

    The header (magic, version, header checksum, bounds), the fingerprint, that the
    stored tokens start with the ``matched`` tokens of the prompt the key was computed
    from, the ``get_data`` prefix, the checksum of the whole state, and that the state
    parses into whole per-layer K/V caches holding those tokens. Raises
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
    if hdr.state_len <= IO_PREFIX.size:
        raise StateError("empty state")
    magic, _seq = IO_PREFIX.unpack_from(state.data, 0)
    if magic != IO_MAGIC:
        raise StateError(f"state magic {magic:#x} is not llama_state_seq_get_data's")
    if state_checksum(state.data) != hdr.state_crc:
        raise StateError("state checksum mismatch")
    _check_layout(view_get_data(state), hdr.n_tokens, settings)
    return hdr


def _check_layout(view: StateView, n_tokens: int, settings: Settings | None = None) -> None:
    """The memory state parses into whole caches (:mod:`maasd.llama.views`: llama.cpp
    aborts on some malformed states) and holds at least the tokens its head names."""
    cells = max((c.n_cells for c in view.caches), default=0)
    if cells < n_tokens:
        raise StateError(f"the state holds {cells} cells for {n_tokens} tokens")
    if settings is not None:
        settings.check(view)


def check_file_form(
    buf: npt.NDArray[np.uint8], size: int, settings: Settings | None = None
) -> FileForm:
    """:func:`parse_file_form`, and its memory state checked like an entry's."""
    form = parse_file_form(buf, size)
    _check_layout(view_file_form(buf, size), len(form.tokens), settings)
    return form
