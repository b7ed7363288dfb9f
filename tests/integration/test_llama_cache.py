"""``maasd.llama.MaasdCache`` on llama-cpp-python's own completion path, over a real daemon.

A tiny random-weight llama GGUF (``tests/llama_model.py``) in this process: models
A, B, C … each have their own context, as separate processes would; what one saves
another restores through the daemon. The real Gemma model across processes is in
``test_llama_cache_gemma.py``; the worker server in ``test_llama_worker.py``.

What "evaluated" means here is what llama-cpp-python evaluated: ``Llama.eval`` is
wrapped to count the tokens each call got.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

from llama_model import tiny_model  # noqa: E402
from maasd.llama import LlamaSeqAdapter, MaasdCache  # noqa: E402
from maasd.llama.context import PendingState, RestoredState  # noqa: E402

N_CTX = 512
SYSTEM = " ".join(["the cat sat on a mat"] * 16)  # ~200 tokens of the tiny vocabulary


def load(path: Path | str, **kw: Any) -> Any:
    params: dict[str, Any] = dict(n_ctx=N_CTX, n_threads=2, n_threads_batch=2, verbose=False)
    return llama_cpp.Llama(str(path), **(params | kw))


def count_evals(m: Any) -> list[int]:
    """The token counts ``m.eval`` is called with, from now on."""
    calls: list[int] = []
    original = m.eval

    def counted(tokens: Any) -> None:
        calls.append(len(tokens))
        original(tokens)

    m.eval = counted
    return calls


def text(out: dict[str, Any]) -> str:
    choice = out["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


@pytest.fixture(scope="module")
def path0() -> Path:
    return tiny_model(0)


@pytest.fixture
def tenant(daemon: Any) -> tuple[str, str]:
    return daemon.tenant("cache", 256 << 20)


@pytest.fixture
def caches(daemon: Any, tenant: tuple[str, str]) -> Iterator[Any]:
    """``cached(model, key=the tenant's)``: a model with a MaasdCache set (closed after)."""
    made: list[MaasdCache] = []

    def cached(m: Any, key: str | None = None) -> Any:
        cache = MaasdCache(m, daemon.url, daemon.socket_path, key or tenant[1])
        m.set_cache(cache)
        made.append(cache)
        return m

    yield cached
    for c in made:
        c.close()


def test_a_second_model_evaluates_only_what_the_first_did_not(
    daemon: Any, tenant: tuple[str, str], path0: Path, caches: Any
) -> None:
    a = caches(load(path0))
    a.create_completion(SYSTEM, max_tokens=6, temperature=0)
    assert a.cache.stats.lookups["miss"] == 1
    assert a.cache.stats.saves["saved"] >= 1
    committed = daemon.metric("maasd_entry_committed_bytes_total", tenant=tenant[0])
    assert committed >= a.cache.stats.saved_bytes  # (entries are page-rounded)

    prompt = SYSTEM + " and the dog ran off"
    b = caches(load(path0))
    evals = count_evals(b)
    got = b.create_completion(prompt, max_tokens=8, temperature=0)
    n_prompt = len(b.tokenize(prompt.encode()))
    restored = b.cache.stats.restored_tokens
    assert b.cache.stats.lookups["hit"] == 1
    assert restored >= len(a.tokenize(SYSTEM.encode()))
    assert evals[0] == n_prompt - restored  # the prompt's suffix, nothing more
    assert set(evals[1:]) <= {1}  # then one token per sampled token

    plain = load(path0)
    assert text(got) == text(plain.create_completion(prompt, max_tokens=8, temperature=0))
    found = daemon.metric("maasd_entry_restored_bytes_total", tenant=tenant[0])
    assert found >= b.cache.stats.restored_bytes


def test_streams_and_chats_save_and_restore_too(path0: Path, caches: Any) -> None:
    system = SYSTEM.replace("cat", "rat")
    a = caches(load(path0))
    chunks = list(a.create_completion(system, max_tokens=5, temperature=0, stream=True))
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert a.cache.stats.saves["saved"] >= 1  # saved when the stream ended

    b = caches(load(path0))
    b.create_completion(system + " on a hat", max_tokens=4, temperature=0)
    assert b.cache.stats.restored_tokens >= len(b.tokenize(system.encode()))

    messages = [{"role": "system", "content": SYSTEM.replace("cat", "bat")}]
    c = caches(load(path0))
    first = c.create_chat_completion([*messages, {"role": "user", "content": "a"}], max_tokens=4)
    d = caches(load(path0))
    evals = count_evals(d)
    second = d.create_chat_completion([*messages, {"role": "user", "content": "b"}], max_tokens=4)
    assert d.cache.stats.lookups["hit"] == 1
    assert evals[0] < 20  # the system message came from maasd
    assert first["choices"][0]["message"]["content"] is not None
    assert second["choices"][0]["message"]["content"] is not None


def test_another_tenant_finds_nothing(daemon: Any, path0: Path, caches: Any) -> None:
    prompt = SYSTEM.replace("mat", "log")
    a = caches(load(path0))
    a.create_completion(prompt, max_tokens=4, temperature=0)
    _tid, other_key = daemon.tenant("other", 64 << 20)
    b = caches(load(path0), key=other_key)
    evals = count_evals(b)
    b.create_completion(prompt, max_tokens=4, temperature=0)
    assert b.cache.stats.lookups["miss"] == 1
    assert evals[0] == len(b.tokenize(prompt.encode()))
    c = caches(load(path0))  # the first tenant's own: a hit
    c.create_completion(prompt, max_tokens=4, temperature=0)
    assert c.cache.stats.lookups["hit"] == 1


def test_save_state_is_the_models_own_outside_a_completion(path0: Path, caches: Any) -> None:
    a = caches(load(path0))
    toks = a.tokenize(SYSTEM.encode())
    a.eval(toks)
    state = a.save_state()  # called by this test, not by a completion: a true state
    assert not isinstance(state, PendingState)
    assert state.llama_state_size > 0
    assert len(state.llama_state) == state.llama_state_size
    # given to the cache by hand, its bytes are shared (one copy)
    a.cache[toks] = state
    assert a.cache.stats.saves["saved"] == 1
    b = caches(load(path0))
    assert b.cache[toks + [5, 6]].n_tokens == len(toks)
    assert b.n_tokens == len(toks)


def test_the_restored_state_is_a_true_state(path0: Path, caches: Any) -> None:
    prompt = SYSTEM.replace("sat", "lay")
    a = caches(load(path0))
    a.create_completion(prompt, max_tokens=4, temperature=0)
    toks = a.tokenize(prompt.encode())
    b = caches(load(path0))
    state = b.cache[toks]
    assert isinstance(state, RestoredState)
    assert state.n_tokens == b.n_tokens
    assert state.input_ids.shape == b.input_ids.shape
    assert state.scores.shape == (1, b.n_vocab())  # one row, no logits matrix
    # Llama finds nothing longer in it than what the model now holds: no load_state
    assert llama_cpp.Llama.longest_token_prefix(state.input_ids.tolist(), toks) == b.n_tokens
    # and another model loads it like any state: the same next-token logits
    c = load(path0)
    c.load_state(state)
    b.eval(toks[b.n_tokens :] or toks[-1:])
    c.eval(toks[c.n_tokens :] or toks[-1:])
    np.testing.assert_array_equal(
        LlamaSeqAdapter(b).last_logits(), LlamaSeqAdapter(c).last_logits()
    )


def test_a_model_with_logits_all_is_refused(daemon: Any, path0: Path, tenant: Any) -> None:
    m = load(path0, logits_all=True)
    with pytest.raises(ValueError, match="logits_all"):
        MaasdCache(m, daemon.url, daemon.socket_path, tenant[1])
    assert "save_state" not in m.__dict__


def test_close_gives_the_model_its_save_state_back(daemon: Any, path0: Path, tenant: Any) -> None:
    m = load(path0)
    cache = MaasdCache(m, daemon.url, daemon.socket_path, tenant[1])
    assert "save_state" in m.__dict__
    cache.close()
    assert "save_state" not in m.__dict__


def test_a_garbage_entry_is_a_miss_and_the_completion_goes_on(
    daemon: Any, path0: Path, caches: Any, tenant: tuple[str, str]
) -> None:
    from maasd.client import Worker

    prompt = SYSTEM.replace("on", "under")
    a = caches(load(path0))
    toks = np.asarray(a.tokenize(prompt.encode()), dtype=np.int32)
    key = a.cache.store.key_at(toks, 128)
    with Worker(daemon.socket_path, tenant[1]) as w, w.entry(key, 1 << 16) as m:
        m.array[:] = 7  # not a maasd KV entry
    evals = count_evals(a)
    got = a.create_completion(prompt, max_tokens=4, temperature=0)
    assert a.cache.stats.lookups["refused"] == 1
    assert evals[0] == len(toks)
    assert text(got) == text(load(path0).create_completion(prompt, max_tokens=4, temperature=0))


def test_without_a_daemon_it_is_a_miss_and_it_reconnects(fresh_daemon: Any, path0: Path) -> None:
    d = fresh_daemon.start()
    _tid, key = d.tenant("cache-down", 64 << 20)
    seen: list[bool] = []

    class Observer:
        def looked_up(self, *_a: Any) -> None: ...
        def saved(self, *_a: Any) -> None: ...
        def restored(self, *_a: Any) -> None: ...
        def sharing(self, up: bool) -> None:
            seen.append(up)

    m = load(path0)
    cache = MaasdCache(m, d.url, d.socket_path, key, observer=Observer())
    m.set_cache(cache)
    prompt = SYSTEM.replace("a mat", "the mat")
    with contextlib.closing(cache):
        m.create_completion(prompt, max_tokens=3, temperature=0)
        assert seen == [True]
        d.stop()
        m.reset()
        m.create_completion(prompt, max_tokens=3, temperature=0)  # lookup fails: a miss
        assert seen == [True, False]
        assert cache.stats.lookups["error"] + cache.stats.lookups["down"] == 1
        d.start()
        deadline = time.monotonic() + 30
        while seen[-1] is False and time.monotonic() < deadline:
            time.sleep(0.2)  # the link tries again after its back-off (0.5 s, then 1 s)
            m.reset()
            m.create_completion(prompt, max_tokens=3, temperature=0)
        assert seen == [True, False, True]
        assert cache.stats.lookups["miss"] == 2  # the daemon restarted: its entries are gone
    assert "save_state" not in m.__dict__
