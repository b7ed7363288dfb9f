"""Structured, zero-copy views of a llama.cpp sequence state: per-layer K and V.

Pure (numpy), no llama.cpp and no I/O. :func:`view_state` takes a state in any of its
forms — an entry (the ``MAASDKV`` header of :mod:`maasd.llama.format`, then the
``get_data`` bytes), the bare bytes of ``llama_state_seq_get_data``, or llama-server's
``ggsq`` slot file (:mod:`maasd.llama.forms`) — and returns a :class:`StateView`
whose K and V arrays are ``np.frombuffer`` views of the buffer passed in: nothing is
copied, so viewing a 100 MB entry through its read-only mapping costs a few page faults
(the layer headers), and a writable buffer's changes show in its views.

The memory state, as the pinned llama.cpp writes it (``llama_kv_cache::state_write``),
is one or more KV caches in a row (two for an iSWA model such as Gemma 3: the full
layers, then the sliding-window ones), each::

    u32 n_stream
    per stream:
      u32 cell_count                          (0: nothing more for this stream)
      cell_count × (i32 pos, u32 n_seq_id = 1, [12-byte cell ext], i32 seq_id)
      u32 v_trans, u32 n_layer
      n_layer × (i32 k_type, u64 k_row_bytes, cell_count × k_row_bytes)
      V, unless the model has none (MLA):
        not transposed: n_layer × (i32 v_type, u64 v_row_bytes, cell_count × v_row_bytes)
        transposed:     n_layer × (i32 v_type, u32 el_bytes, u32 n_embd_v,
                                   n_embd_v × cell_count × el_bytes)

The cell ext (M-RoPE and PLE models) and a V-less cache are not marked in the bytes:
the parse tries each layout and takes the first that accounts for every byte.

Every count is checked against the bytes that remain before anything is viewed, so a
truncated, foreign or hostile buffer raises :class:`~maasd.llama.forms.StateError`
(never an out-of-bounds view, never a long loop).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from maasd.llama.fleet import ggml_type_name
from maasd.llama.format import MAGIC, HeaderError, parse_header
from maasd.llama.forms import (
    FILE_MAGIC,
    IO_MAGIC,
    IO_PREFIX,
    StateError,
    byte_view,
    parse_file_form,
)

__all__ = [
    "CacheView",
    "LayerView",
    "StateView",
    "StreamView",
    "StateError",
    "view_entry",
    "view_file_form",
    "view_get_data",
    "view_memory",
    "view_state",
]

Form = Literal["entry", "get_data", "file"]

MAX_STREAMS = 256  # LLAMA_MAX_SEQ: a cache has at most one stream per sequence
#: Layers of one state, all its caches and streams together (each costs the parse an
#: object and two views: a bound per stream would let 8 caches × 256 streams × 4096
#: layers of 26 bytes make ~50 times their size in memory). Models have at most a few
#: hundred; a sequence's cells live in one stream.
MAX_LAYERS = 4096
MAX_CACHES = 8  # iSWA writes 2; hybrid-idx models a few more
MAX_TYPE = 64  # ggml type ids are below this (GGML_TYPE_COUNT is ~40)
CELL_EXT = 12  # llama_kv_cell_ext: x, y, tok
_NUMPY_TYPES = {0: "<f4", 1: "<f2"}  # ggml types numpy has a dtype for (f32, f16)
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class LayerView:
    """One layer of one stream: its K (``n_cells × k_row_bytes``) and V bytes, as views.

    ``v`` is ``n_cells × v_row_bytes`` when ``v_trans`` is false, and
    ``n_embd_v × (n_cells · v_el_bytes)`` when it is (llama.cpp without flash attention
    stores V transposed: one row per embedding dimension, one element per cell).
    ``v`` is ``None`` for a model without V (MLA).
    """

    index: int
    n_cells: int
    k_type: int
    k_row_bytes: int
    k: npt.NDArray[np.uint8]
    v_trans: bool
    v_type: int | None = None
    v_row_bytes: int = 0  # bytes of one cell's V (n_embd_v × v_el_bytes when transposed)
    v_el_bytes: int = 0  # transposed only
    n_embd_v: int = 0  # transposed only
    v: npt.NDArray[np.uint8] | None = None

    @property
    def k_type_name(self) -> str:
        return ggml_type_name(self.k_type)

    @property
    def v_type_name(self) -> str | None:
        return None if self.v_type is None else ggml_type_name(self.v_type)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.v is None else self.v.nbytes)

    def k_values(self) -> npt.NDArray[Any]:
        """K as numbers, ``n_cells × n_embd_k`` (f32 and f16 only; still a view)."""
        return _typed(self.k, self.k_type, "K")

    def v_values(self) -> npt.NDArray[Any]:
        """V as numbers, ``n_cells × n_embd_v`` whatever the layout (a transposed view)."""
        if self.v is None or self.v_type is None:
            raise StateError("this cache has no V (an MLA model)")
        values = _typed(self.v, self.v_type, "V")
        return values.T if self.v_trans else values


def _typed(raw: npt.NDArray[np.uint8], ggml_type: int, what: str) -> npt.NDArray[Any]:
    dtype = _NUMPY_TYPES.get(ggml_type)
    if dtype is None:
        raise StateError(f"{what} is {ggml_type_name(ggml_type)}: no numpy type (use the bytes)")
    return raw.view(dtype)


@dataclass(frozen=True)
class StreamView:
    stream: int
    n_cells: int
    positions: npt.NDArray[np.int32]  # a copy: small, and strided in the buffer
    v_trans: bool
    layers: tuple[LayerView, ...]


@dataclass(frozen=True)
class CacheView:
    """One KV cache of the memory (an iSWA model has two: full layers, then SWA ones)."""

    index: int
    streams: tuple[StreamView, ...]

    @property
    def n_cells(self) -> int:
        return sum(s.n_cells for s in self.streams)

    @property
    def n_layers(self) -> int:
        return max((len(s.layers) for s in self.streams), default=0)


@dataclass(frozen=True)
class StateView:
    """A whole state: where it came from, its tokens, and its caches' layers."""

    form: Form
    caches: tuple[CacheView, ...]
    memory_offset: int
    memory_len: int
    cell_ext: bool
    tokens: npt.NDArray[np.int32] | None = None  # entry and file forms
    fingerprint: str | None = None  # entry form
    seq_id: int | None = None  # entry and get_data forms

    @property
    def layers(self) -> list[LayerView]:
        return [layer for c in self.caches for s in c.streams for layer in s.layers]

    def summary(self) -> dict[str, Any]:
        """What the state holds, JSON-able (``maasctl entries show``)."""
        return {
            "form": self.form,
            "fingerprint": self.fingerprint,
            "n_tokens": None if self.tokens is None else len(self.tokens),
            "memory_bytes": self.memory_len,
            "cell_ext": self.cell_ext,
            "caches": [
                {
                    "index": c.index,
                    "n_stream": len(c.streams),
                    "n_cells": c.n_cells,
                    "n_layers": c.n_layers,
                    "v_trans": any(s.v_trans for s in c.streams),
                    "layers": [_layer_summary(x) for s in c.streams for x in s.layers],
                }
                for c in self.caches
            ],
        }


def _layer_summary(x: LayerView) -> dict[str, Any]:
    return {
        "layer": x.index,
        "n_cells": x.n_cells,
        "k_type": x.k_type_name,
        "k_row_bytes": x.k_row_bytes,
        "v_type": x.v_type_name,
        "v_row_bytes": x.v_row_bytes,
        "v_trans": x.v_trans,
        "bytes": x.nbytes,
    }


# --------------------------------------------------------------------------- the parse


class _Reader:
    """Bounds-checked little-endian reads from ``view[pos:end]``."""

    def __init__(self, view: memoryview, pos: int, end: int) -> None:
        self.view, self.pos, self.end = view, pos, end
        self.layers = 0  # claimed so far, against MAX_LAYERS

    def claim_layers(self, n: int, where: str) -> None:
        """Count ``n`` more layers; :class:`StateError` past :data:`MAX_LAYERS` in all."""
        if not 0 < n <= MAX_LAYERS - self.layers or n > self.left // 12:
            raise StateError(f"{where}: {n} layers ({self.layers} before; {MAX_LAYERS} at most)")
        self.layers += n

    @property
    def left(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> int:
        """Claim ``n`` bytes for ``what`` → their offset."""
        if n < 0 or n > self.left:
            raise StateError(f"truncated at byte {self.pos}: {what} needs {n} B, {self.left} left")
        off, self.pos = self.pos, self.pos + n
        return off

    def u32(self, what: str) -> int:
        return int(_U32.unpack_from(self.view, self.need(4, what))[0])

    def i32(self, what: str) -> int:
        return int(_I32.unpack_from(self.view, self.need(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack_from(self.view, self.need(8, what))[0])

    def bytes2d(self, rows: int, cols: int, what: str) -> npt.NDArray[np.uint8]:
        if cols <= 0 or rows < 0:
            raise StateError(f"{what}: {rows} × {cols} bytes")
        if rows > self.left // cols:  # before multiplying: no huge intermediate
            raise StateError(f"truncated at byte {self.pos}: {what} of {rows} × {cols} B")
        off = self.need(rows * cols, what)
        arr = np.frombuffer(self.view, dtype=np.uint8, count=rows * cols, offset=off)
        return arr.reshape(rows, cols)


def _ggml_type(r: _Reader, what: str) -> int:
    t = r.i32(f"{what} type")
    if not 0 <= t < MAX_TYPE:
        raise StateError(f"{what} type {t} is no ggml type")
    return t


def _cells(r: _Reader, n: int, ext: bool, where: str) -> npt.NDArray[np.int32]:
    """The cell records of a sequence state (``n_seq_id`` is always 1) → positions."""
    width = 3 + (CELL_EXT // 4 if ext else 0)
    raw = r.bytes2d(n, 4 * width, f"{where} cells").view("<i4")
    if n and not np.all(raw[:, 1] == 1):
        raise StateError(f"{where}: a cell with n_seq_id != 1 (not a sequence state)")
    return raw[:, 0].copy()


def _k_layers(r: _Reader, n_layer: int, n: int, where: str) -> list[tuple[int, int, Any]]:
    out = []
    for il in range(n_layer):
        t = _ggml_type(r, f"{where} layer {il} K")
        row = r.u64(f"{where} layer {il} K row size")
        out.append((t, row, r.bytes2d(n, row, f"{where} layer {il} K")))
    return out


def _layers(r: _Reader, n: int, has_v: bool, where: str) -> tuple[bool, tuple[LayerView, ...]]:
    v_trans = r.u32(f"{where} v_trans")
    n_layer = r.u32(f"{where} n_layer")
    if v_trans > 1:
        raise StateError(f"{where}: v_trans {v_trans}")
    r.claim_layers(n_layer, where)
    ks = _k_layers(r, n_layer, n, where)
    out = []
    for il, (kt, krow, k) in enumerate(ks):
        layer = LayerView(il, n, kt, int(krow), k, bool(v_trans))
        if has_v:
            layer = _with_v(r, layer, f"{where} layer {il} V")
        out.append(layer)
    return bool(v_trans), tuple(out)


def _with_v(r: _Reader, layer: LayerView, what: str) -> LayerView:
    t = _ggml_type(r, what)
    n = layer.n_cells
    if not layer.v_trans:
        row = r.u64(f"{what} row size")
        v = r.bytes2d(n, row, what)
        return dataclasses.replace(layer, v_type=t, v_row_bytes=row, v=v)
    el = r.u32(f"{what} element size")
    embd = r.u32(f"{what} n_embd")
    if el not in (1, 2, 4, 8) or embd == 0:
        raise StateError(f"{what}: element size {el}, n_embd {embd}")
    v = r.bytes2d(embd, n * el, what)
    return dataclasses.replace(
        layer, v_type=t, v_row_bytes=el * embd, v_el_bytes=el, n_embd_v=embd, v=v
    )


def _cache(r: _Reader, index: int, ext: bool, has_v: bool) -> CacheView:
    where = f"cache {index}"
    n_stream = r.u32(f"{where} n_stream")
    if not 0 < n_stream <= MAX_STREAMS:
        raise StateError(f"{where}: {n_stream} streams")
    streams = []
    for s in range(n_stream):
        at = f"{where} stream {s}"
        n = r.u32(f"{at} cell count")
        if n == 0:
            streams.append(StreamView(s, 0, np.zeros(0, np.int32), False, ()))
            continue
        pos = _cells(r, n, ext, at)
        v_trans, layers = _layers(r, n, has_v, at)
        streams.append(StreamView(s, n, pos, v_trans, layers))
    return CacheView(index, tuple(streams))


def _caches(view: memoryview, start: int, end: int, ext: bool, has_v: bool) -> list[CacheView]:
    r = _Reader(view, start, end)
    out: list[CacheView] = []
    while r.left:
        if len(out) == MAX_CACHES:
            raise StateError(f"more than {MAX_CACHES} caches")
        out.append(_cache(r, len(out), ext, has_v))
    return out


def _layouts() -> Iterator[tuple[bool, bool]]:
    yield from ((False, True), (True, True), (False, False), (True, False))


def view_memory(
    buf: Any, offset: int = 0, size: int | None = None
) -> tuple[tuple[CacheView, ...], bool]:
    """The caches of the memory state in ``buf[offset:offset + size]`` → (caches, cell_ext).

    Raises :class:`StateError` (with the first layout's reason) if no layout accounts
    for exactly those bytes.
    """
    view = byte_view(buf)
    end = len(view) if size is None else offset + size
    if not 0 <= offset < end <= len(view):
        raise StateError(f"memory state [{offset}, {end}) outside a {len(view)} B buffer")
    first: StateError | None = None
    for ext, has_v in _layouts():
        try:
            return tuple(_caches(view, offset, end, ext, has_v)), ext
        except StateError as exc:
            first = first or exc
    assert first is not None
    raise first


# --------------------------------------------------------------------------- the forms


def view_get_data(buf: Any, size: int | None = None, *, offset: int = 0) -> StateView:
    """A view of the bytes ``llama_state_seq_get_data`` returned (at ``offset``)."""
    view = byte_view(buf)
    end = len(view) if size is None else min(len(view), offset + size)
    if end - offset <= IO_PREFIX.size:
        raise StateError(f"a get_data state of {max(end - offset, 0)} bytes")
    magic, seq = IO_PREFIX.unpack_from(view, offset)
    if magic != IO_MAGIC:
        raise StateError(f"state magic {magic:#x} is not llama_state_seq_get_data's")
    mem = offset + IO_PREFIX.size
    caches, ext = view_memory(view, mem, end - mem)
    return StateView("get_data", caches, mem, end - mem, ext, seq_id=seq)


def view_entry(buf: Any, size: int | None = None) -> StateView:
    """A view of a maasd entry (``MAASDKV`` header, then the ``get_data`` bytes)."""
    try:
        hdr = parse_header(byte_view(buf), size)
    except HeaderError as exc:
        raise StateError(str(exc)) from exc
    inner = view_get_data(buf, hdr.state_len, offset=hdr.header_len)
    return StateView(
        "entry",
        inner.caches,
        inner.memory_offset,
        inner.memory_len,
        inner.cell_ext,
        tokens=hdr.tokens,
        fingerprint=hdr.fingerprint,
        seq_id=inner.seq_id,
    )


def view_file_form(buf: Any, size: int | None = None) -> StateView:
    """A view of a ``ggsq`` slot file (the first ``size`` bytes of ``buf``)."""
    view = byte_view(buf)
    form = parse_file_form(view, len(view) if size is None else size)
    caches, ext = view_memory(view, form.state_offset, form.state_len)
    return StateView("file", caches, form.state_offset, form.state_len, ext, tokens=form.tokens)


def view_state(buf: Any, size: int | None = None) -> StateView:
    """A view of a state in whichever form its first bytes say; :class:`StateError` names
    what it is not."""
    view = byte_view(buf)
    n = len(view) if size is None else min(size, len(view))
    if n >= len(MAGIC) and bytes(view[: len(MAGIC)]) == MAGIC:
        return view_entry(view, n)
    if n >= 4:
        (magic,) = _U32.unpack_from(view, 0)
        if magic == FILE_MAGIC:
            return view_file_form(view, n)
        if magic == IO_MAGIC:
            return view_get_data(view, n)
    raise StateError("not a llama state (no MAASDKV, ggsq or get_data magic)")
