"""Laws of maasd.llama.views for any layout and any damage: a state built in llama.cpp's
layout parses back to its shape; anything else is a StateError, and whatever parses
is viewed strictly inside the buffer."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import Cache, get_data
from maasd.llama.format import pack_header, state_checksum
from maasd.llama.forms import FILE_MAGIC, FILE_VERSION
from maasd.llama.views import StateError, StateView, view_state

caches = st.builds(
    Cache,
    n_cells=st.integers(1, 9),
    n_layer=st.integers(1, 4),
    n_embd_k=st.integers(1, 6),
    n_embd_v=st.integers(1, 6),
    v_trans=st.booleans(),
    ggml_type=st.sampled_from([0, 1]),
    n_stream=st.integers(1, 3),
)
states = st.lists(caches, min_size=1, max_size=3)


def inside(v: StateView, buf: Any) -> bool:
    base = np.frombuffer(buf, np.uint8)
    lo = base.__array_interface__["data"][0]
    for layer in v.layers:
        for a in (layer.k, layer.v):
            if a is None:
                continue
            start = a.__array_interface__["data"][0] - lo
            if start < 0 or start + a.nbytes > base.nbytes or not np.shares_memory(a, base):
                return False
    return True


@settings(deadline=None)
@given(states)
def test_a_built_state_parses_back_to_its_shape(cs: list[Cache]) -> None:
    data = get_data(*cs)
    v = view_state(data)
    assert [c.n_cells for c in v.caches] == [c.n_cells for c in cs]
    assert [c.n_layers for c in v.caches] == [c.n_layer for c in cs]
    for got, want in zip(v.caches, cs, strict=True):
        el = 4 if want.ggml_type == 0 else 2
        for layer in got.streams[0].layers:
            assert layer.k.shape == (want.n_cells, want.n_embd_k * el)
            assert layer.v_values().shape == (want.n_cells, want.n_embd_v)
    assert inside(v, data)


def in_form(form: str, data: bytes) -> bytes:
    """``data`` (get_data bytes) as an entry, a ggsq file, or as it is."""
    tokens = list(range(5))
    if form == "entry":
        head = pack_header("ab" * 16, tokens, len(data), state_checksum(data), 64)
        return head + data
    if form == "file":
        return struct.pack("<III", FILE_MAGIC, FILE_VERSION, 5) + bytes(4 * 5) + data[8:]
    return data


@settings(max_examples=200, deadline=None)  # a loaded machine: no per-example deadline
@given(states, st.sampled_from(["get_data", "entry", "file"]), st.data())
def test_damage_is_a_state_error_or_a_view_inside_the_buffer(
    cs: list[Cache], form: str, d: Any
) -> None:
    buf = bytearray(in_form(form, get_data(*cs)))
    assert view_state(buf).form == form
    for _ in range(d.draw(st.integers(1, 4))):
        at = d.draw(st.integers(0, len(buf) - 1))
        buf[at] = d.draw(st.integers(0, 255))
    buf = buf[: d.draw(st.integers(0, len(buf)))]
    try:
        v = view_state(buf)
    except StateError:
        return
    assert inside(v, buf)


@settings(deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_never_a_crash(raw: bytes) -> None:
    with contextlib.suppress(StateError):
        view_state(raw)
