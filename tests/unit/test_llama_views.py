"""maasd.llama.views on synthetic states in llama.cpp's exact layout (tests/kvstate.py):
every layout it may meet, zero-copy, and refusals of what is not a state."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvstate import Cache, get_data, memory
from maasd.llama.format import header_len_for, pack_header, state_checksum
from maasd.llama.forms import FILE_MAGIC, FILE_VERSION
from maasd.llama.views import (
    StateError,
    view_entry,
    view_file_form,
    view_get_data,
    view_memory,
    view_state,
)

pytest.importorskip("xxhash")

FP = "ab" * 16


def entry(data: bytes, tokens: list[int]) -> bytearray:
    head = pack_header(FP, tokens, len(data), state_checksum(data), 64)
    out = bytearray(header_len_for(len(tokens)) + len(data))
    out[: len(head)] = head
    out[len(head) :] = data
    return out


def ggsq(mem: bytes, tokens: list[int]) -> bytearray:
    words = [-1, 1, len(tokens), *tokens, 0]
    head = struct.pack("<III", FILE_MAGIC, FILE_VERSION, len(words))
    return bytearray(head + np.asarray(words, "<i4").tobytes() + mem)


@pytest.mark.parametrize("v_trans", [True, False])
def test_layers_types_cells_and_rows(v_trans: bool) -> None:
    c = Cache(n_cells=5, n_layer=3, n_embd_k=8, n_embd_v=6, v_trans=v_trans)
    v = view_get_data(get_data(c, seq_id=3))
    assert v.form == "get_data"
    assert v.seq_id == 3
    assert not v.cell_ext
    assert [(x.index, x.n_cells, x.k_type_name, x.k_row_bytes) for x in v.layers] == [
        (i, 5, "f16", 16) for i in range(3)
    ]
    for x in v.layers:
        assert x.k.shape == (5, 16)
        assert x.v_trans is v_trans
        assert x.v_type_name == "f16"
        assert x.v_row_bytes == 12
        assert x.v is not None
        assert x.v.shape == ((6, 10) if v_trans else (5, 12))
        assert x.k_values().shape == (5, 8)
        assert x.v_values().shape == (5, 6)  # cells × embd, whatever the layout
    assert v.caches[0].streams[0].positions.tolist() == [0, 1, 2, 3, 4]


def test_the_views_are_the_bytes_themselves() -> None:
    mem = memory(Cache(n_cells=4, n_layer=2, n_embd_k=4, n_embd_v=4, ggml_type=0))
    buf = bytearray(get_data(Cache(n_cells=4, n_layer=2, n_embd_k=4, n_embd_v=4, ggml_type=0)))
    assert bytes(buf[8:]) == mem
    v = view_state(buf)
    layer = v.layers[1]
    base = np.frombuffer(buf, np.uint8)
    assert np.shares_memory(layer.k, base)
    assert layer.v is not None
    assert np.shares_memory(layer.v, base)
    # Writing through the buffer shows in the views: nothing was copied.
    k_at = layer.k.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    struct.pack_into("<f", buf, k_at, 1.5)
    assert layer.k_values()[0, 0] == 1.5
    v_at = layer.v.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    struct.pack_into("<f", buf, v_at + 4, -2.0)  # transposed: dimension 0, cell 1
    assert layer.v_values()[1, 0] == -2.0


def test_an_iswa_state_is_two_caches_and_ext_and_mla_layouts_parse() -> None:
    full, swa = Cache(n_cells=6, n_layer=1), Cache(n_cells=6, n_layer=5)
    v = view_get_data(get_data(full, swa))
    assert [(c.index, c.n_cells, c.n_layers) for c in v.caches] == [(0, 6, 1), (1, 6, 5)]
    assert len(v.layers) == 6
    ext = view_get_data(get_data(Cache(cell_ext=True)))
    assert ext.cell_ext
    assert ext.layers[0].k.shape == (4, 16)
    mla = view_get_data(get_data(Cache(has_v=False, v_trans=False)))
    assert all(x.v is None and x.v_type is None for x in mla.layers)
    with pytest.raises(StateError, match="no V"):
        mla.layers[0].v_values()
    multi = view_get_data(get_data(Cache(n_stream=3)))
    assert [s.n_cells for s in multi.caches[0].streams] == [4, 0, 0]


def test_three_forms_one_memory() -> None:
    c = Cache(n_cells=4)
    data = get_data(c)
    e = view_state(entry(data, [7, 8, 9, 10]))
    f = view_state(ggsq(data[8:], [7, 8, 9, 10]))
    g = view_state(data)
    assert (e.form, f.form, g.form) == ("entry", "file", "get_data")
    assert e.fingerprint == FP
    assert e.tokens is not None
    assert e.tokens.tolist() == [7, 8, 9, 10]
    assert f.tokens is not None
    assert f.tokens.tolist() == [7, 8, 9, 10]
    assert e.memory_len == f.memory_len == g.memory_len == len(data) - 8
    for a, b in zip(e.layers, f.layers, strict=True):
        assert np.array_equal(a.k, b.k)
        assert a.v is not None
        assert b.v is not None
        assert np.array_equal(a.v, b.v)
    s = e.summary()
    assert s["n_tokens"] == 4
    assert s["caches"][0]["layers"][0]["bytes"] == e.layers[0].nbytes == 4 * 16 * 2


def test_not_a_state_and_bad_heads_are_refused() -> None:
    data = get_data(Cache())
    for bad in (b"", b"hello world, no state here", bytes(64)):
        with pytest.raises(StateError, match="not a llama state"):
            view_state(bad)
    with pytest.raises(StateError, match="magic"):
        view_get_data(b"\0\0\0\0" + data[4:])
    f = ggsq(data[8:], [1])
    struct.pack_into("<I", f, 4, FILE_VERSION + 1)
    with pytest.raises(StateError, match="version"):
        view_file_form(f)
    e = entry(data, [1, 2])
    e[70] ^= 1  # a token: the header checksum
    with pytest.raises(StateError, match="checksum"):
        view_entry(e)


@pytest.mark.parametrize(
    ("patch", "why"),
    [
        ((0, "<I", 1 << 30), "streams"),  # n_stream
        ((4, "<I", 0xFFFFFFFF), "truncated"),  # cell count
        ((4, "<I", 5), "n_seq_id|truncated"),
        ((8 + 4 * 12 + 4, "<I", 1 << 31), "layers"),  # n_layer
        ((8 + 4 * 12, "<I", 7), "v_trans"),
        ((8 + 4 * 12 + 8, "<i", 999), "no ggml type"),  # layer 0 K type
        ((8 + 4 * 12 + 12, "<Q", 1 << 62), "truncated"),  # layer 0 K row size
        ((8 + 4 * 12 + 12, "<Q", 0), "0 bytes"),
        ((12, "<I", 0), "n_seq_id"),  # cell 0
    ],
)
def test_absurd_counts_are_a_clear_error(patch: tuple[int, str, int], why: str) -> None:
    mem = bytearray(memory(Cache(n_cells=4, n_layer=2)))
    off, fmt, val = patch
    struct.pack_into(fmt, mem, off, val)
    with pytest.raises(StateError, match=why):
        view_memory(mem)


def test_every_truncation_is_refused() -> None:
    first = Cache(n_cells=3, n_layer=2, n_embd_k=4, n_embd_v=4)
    data = get_data(first, Cache(n_cells=3))
    assert view_get_data(data).memory_len == len(data) - 8
    # Cut between its caches, an iSWA state is a whole one-cache state, and cut after
    # its first K layers a whole V-less (MLA) one: only an entry's checksum (or the
    # model) can tell. Every other cut is refused.
    whole = {len(get_data(first)), len(get_data(Cache(**{**first.__dict__, "has_v": False})))}
    parsed = set()
    for n in range(len(data)):
        try:
            v = view_get_data(data[:n])
        except StateError:
            continue
        parsed.add(n)
        assert len(v.caches) == 1
    assert parsed == whole
    with pytest.raises(StateError, match="outside"):
        view_memory(data, 8, len(data))  # a size past the end
