"""SPEC §5 (worker socket), §6 (client library, KVStore, MaasdCache) and §8 (`maasd worker`),
checked word for word through the real entry points.

Each test quotes the sentence of SPEC it checks. Only statements the rest of the suite
did not already exercise (or exercised only against the broker's in-memory fake) are
here: a real ``maasd serve`` (``tests/conftest.py``), the test's own socket peer
(``tests/sockpeer.py``), ``maasd.client``, ``maasd.llama`` on the tiny GGUF of
``tests/llama_model.py`` and the ``maasd worker`` CLI.
"""

from __future__ import annotations

import inspect
import os
import struct
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from conftest import Daemon, free_port
from maasd.protocol import Abort, Commit, Detach, Error, Ok, Put, Reserved
from rawentries import commit, connect, pattern, put, put_committed, write
from sockpeer import lookup, miss
from waiting import wait_until

MiB = 1 << 20
KiB = 1 << 10


def _ts(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def _refused(reply: Any, fds: list[int], status: int, type_end: str = "") -> None:
    """An error frame of ``status`` (and a ``type`` ending so), with no fd."""
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == status, reply
    assert (reply.type or "").endswith(type_end), reply


def _attached(d: Daemon, tenant_id: str) -> float:
    return d.metric("maasd_attached_handles", tenant=tenant_id)


# --- §5: the socket ----------------------------------------------------------------------


def test_put_ttl_s_is_the_entrys_lease(daemon: Daemon) -> None:
    """§5: "`put {key, size_bytes, pool?: str (id or name), ttl_s?: int}`" — and "Quota,
    pool capacity and eviction rules are those of a REST reserve": a REST reserve's
    `ttl_s` is its lease (`expires_at` = `created_at` + `ttl_s`); without it, 600."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    with daemon.client(key) as c:
        reply, fd = put(r, "ttl-7", 4 * KiB, ttl_s=7)
        os.close(fd)
        b = c.get(f"/v1/buffers/{reply.buffer_id}").json()
        assert (_ts(b["expires_at"]) - _ts(b["created_at"])).total_seconds() == pytest.approx(
            7, abs=1
        )
        commit(r, reply.buffer_id)
        b = c.get(f"/v1/buffers/{reply.buffer_id}").json()
        assert (_ts(b["expires_at"]) - _ts(b["created_at"])).total_seconds() == pytest.approx(
            7, abs=2
        )
        reply, fd = put(r, "ttl-default", 4 * KiB)
        os.close(fd)
        b = c.get(f"/v1/buffers/{reply.buffer_id}").json()
        assert (_ts(b["expires_at"]) - _ts(b["created_at"])).total_seconds() == pytest.approx(
            600, abs=1
        )
        # and the pool by name and by id, as the frame allows
        pool = daemon.admin.get("/v1/pools").json()[0]
        for ref in (pool["name"], pool["id"]):
            reply, fd = put(r, f"in-{ref}", 4 * KiB, pool=ref)
            os.close(fd)
            assert c.get(f"/v1/buffers/{reply.buffer_id}").json()["pool_id"] == pool["id"]
    r.close()


def test_abort_releases_the_entry_scrubbed(daemon: Daemon) -> None:
    """§5: "`abort {buffer_id}` … releases it (scrubbed)": the writer's own fd, still open,
    reads zeros afterwards, the row is gone and the tenant's use is back where it was."""
    tid, key = daemon.tenant()
    r = connect(daemon, key)
    with daemon.client(key) as c:
        used = c.get("/v1/usage").json()["used_bytes"]
        reply, fd = put(r, "to-abort", 64 * KiB)
        write(fd, pattern(64 * KiB, 5))
        assert os.pread(fd, 64, 0) == pattern(64 * KiB, 5)[:64]
        assert r.call(Abort(buffer_id=reply.buffer_id)) == (Ok(), [])
        assert os.pread(fd, 64 * KiB, 0) == bytes(64 * KiB)
        os.close(fd)
        assert c.get(f"/v1/buffers/{reply.buffer_id}").status_code == 404
        wait_until(lambda: c.get("/v1/usage").json()["used_bytes"] == used)
    miss(r, ["to-abort"])
    r.close()


def test_a_frame_of_exactly_64_kib_does_not_close_the_connection(daemon: Daemon) -> None:
    """§5: "the connection survives a bad frame, but a frame over 64 KiB … closes it": a
    bad frame of 64 KiB exactly is not over the limit — a 400, and the connection goes on."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    body = msgspec.msgpack.encode({"op": "lookup", "keys": ["x"], "pad": ""})
    body = msgspec.msgpack.encode(
        {"op": "lookup", "keys": ["x"], "pad": "a" * (64 * KiB - len(body) - 2)}
    )
    assert len(body) == 64 * KiB
    r.send_raw(struct.pack(">I", len(body)) + body)
    reply, fds = r.recv()
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == 400, reply
    miss(r, ["x"])  # still open
    r.close()


def test_a_lookup_fd_counts_as_an_attachment_until_detach_or_close(daemon: Daemon) -> None:
    """§5: "The fd counts as an attachment until `detach` or the connection closes"."""
    tid, key = daemon.tenant()
    w = connect(daemon, key)
    put_committed(w, "held", pattern(8 * KiB))
    base = _attached(daemon, tid)
    r = connect(daemon, key)
    found, fd = lookup(r, ["held"])
    os.close(fd)
    assert _attached(daemon, tid) == base + 1
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    assert _attached(daemon, tid) == base
    _found, fd = lookup(r, ["held"])
    os.close(fd)
    assert _attached(daemon, tid) == base + 1
    r.close()
    wait_until(lambda: _attached(daemon, tid) == base, message="closing drops the attachment")
    w.close()


def test_a_socket_lookup_hit_counts_as_a_use_for_eviction(daemon: Daemon) -> None:
    """§5: "A hit counts as a use (LRU)"; §4: evictable buffers are released "least
    recently attached first … when a reserve would otherwise fail for quota"."""
    _tid, key = daemon.tenant(quota_bytes=MiB)
    r = connect(daemon, key)
    for i in range(4):
        put_committed(r, f"e{i}", pattern(256 * KiB, i))
    # e0 is the oldest, but a lookup uses it now: e1 is the least recently used
    found, fd = lookup(r, ["e0"])
    os.close(fd)
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    reply, fd = put(r, "e4", 256 * KiB)  # over quota: one entry must go
    os.close(fd)
    assert isinstance(reply, Reserved)
    commit(r, reply.buffer_id)
    found, fd = lookup(r, ["e0"])
    os.close(fd)
    miss(r, ["e1"])
    r.close()


def test_a_put_at_the_tenants_buffer_cap_follows_the_reserve_rules(daemon: Daemon) -> None:
    """§5: "Quota, pool capacity and eviction rules are those of a REST reserve"; §4: "at
    the cap a reserve first evicts that tenant's evictable entries, then answers 409
    (`type` ends in `buffer-count-exceeded`)", and 422 for "a size larger than the
    pool's whole capacity"."""
    tid, key = daemon.tenant()
    assert daemon.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 2}).status_code == 200
    r = connect(daemon, key)
    put_committed(r, "c1", pattern(4 * KiB, 1))
    put_committed(r, "c2", pattern(4 * KiB, 2))
    reply, fd = put(r, "c3", 4 * KiB)  # evicts one of the two
    os.close(fd)
    assert r.call(Abort(buffer_id=reply.buffer_id)) == (Ok(), [])
    # a tenant at its cap with nothing evictable: 409 buffer-count-exceeded
    tid, key = daemon.tenant()
    assert daemon.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 2}).status_code == 200
    with daemon.client(key) as c:
        for _ in range(2):
            assert c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).status_code == 201
    r.close()
    r = connect(daemon, key)
    reply, fds = r.call(Put(key="c4", size_bytes=4 * KiB))
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == 409, reply
    assert (reply.type or "").endswith("buffer-count-exceeded"), reply
    reply, fds = r.call(Put(key="huge", size_bytes=1 << 40))
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == 422, reply
    r.close()


def test_after_the_connection_closes_a_buffer_lives_until_its_lease_ends(daemon: Daemon) -> None:
    """§5: "When a connection closes …, its attachments are dropped at once; buffers then
    live until their lease ends"."""
    from maasd.client import Client
    from maasd.protocol import Attach

    tid, key = daemon.tenant()
    with Client(daemon.url, key) as c:
        buf = c.reserve(size_bytes=4 * KiB, ttl_s=3)
        r = connect(daemon, key)
        reply, fds = r.call(Attach(buffer_id=buf.id))
        for fd in fds:
            os.close(fd)
        r.close()
        wait_until(lambda: _attached(daemon, tid) == 0)
        assert c.buffer(buf.id).state == "live"  # not released with the connection
        with daemon.client(key) as h:
            wait_until(
                lambda: h.get(f"/v1/buffers/{buf.id}").status_code == 404,
                timeout=20,
                message="reaped once its lease ended",
            )


def test_commit_then_a_second_commit_or_abort_is_409_and_keeps_the_entry(daemon: Daemon) -> None:
    """§5: "`commit {buffer_id}` → `ok`, which makes it immutable" — a second commit or an
    abort of a committed entry cannot undo it (a 409 error frame, the entry still found)."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    bid = put_committed(r, "once", pattern(4 * KiB, 9))
    for msg in (Commit(buffer_id=bid), Abort(buffer_id=bid)):
        reply, fds = r.call(msg)
        assert fds == []
        assert isinstance(reply, Error), reply
    assert reply.status == 409, reply
    found, fd = lookup(r, ["once"])
    assert os.pread(fd, 64, 0) == pattern(4 * KiB, 9)[:64]
    os.close(fd)
    r.close()


# --- §6: the client library ---------------------------------------------------------------


def test_client_reserve_defaults_to_a_volatile_buffer(fresh_daemon: Daemon) -> None:
    """§6: "`buf = c.reserve(size_bytes=64 << 20, pool=None, persistence="volatile", …)`":
    the library's default persistence is `volatile`, so a plain `c.reserve(size_bytes=…)`
    is a volatile buffer even where a persistent pool has more free space (and a reserve
    in a persistent pool without saying `persistence` does not silently get one)."""
    from maasd.client import Client

    d = fresh_daemon.start()
    d.pool("big-persistent", 1024 * MiB, persistence="persistent")
    _tid, key = d.tenant()
    with Client(d.url, key) as c:
        buf = c.reserve(size_bytes=64 * KiB)
        assert buf.persistence == "volatile", buf
        assert inspect.signature(c.reserve).parameters["persistence"].default == "volatile"


# --- §6: maasd.llama ------------------------------------------------------------------------


def _llm(path: Path) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        str(path), n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False
    )


def _tokens(n: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 494, n - 1).tolist()


@pytest.fixture(scope="module")
def tiny() -> Path:
    pytest.importorskip("llama_cpp")
    from llama_model import tiny_model

    return tiny_model()


@pytest.mark.llama
def test_kvstore_save_returns_a_buffer(daemon: Daemon, tiny: Path) -> None:
    """§6: "`kv.save(seq_id, tokens)` # llama_state_seq_get_data straight into a keyed,
    evictable buffer → Buffer" (`Buffer`: what `c.reserve` and `c.lookup` answer)."""
    from maasd.client import Buffer, Client, Worker
    from maasd.llama import KVStore

    _tid, key = daemon.tenant(quota_bytes=64 * MiB)
    toks = _tokens(130, 1)
    llm = _llm(tiny)
    llm.eval(toks)
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key) as w:
        saved = KVStore(c, w, llm).save(0, toks)
        assert isinstance(saved, Buffer), type(saved)
        assert saved.key
        assert saved.evictable is True


@pytest.mark.llama
def test_kvstore_save_of_a_prefix_already_saved_returns_its_buffer(
    daemon: Daemon, tiny: Path
) -> None:
    """§6: `kv.save(seq_id, tokens)` "→ Buffer" (docs/llama.md: "the second reserve gets
    409 (duplicate key); `save` then returns the existing buffer (`lookup([key])`)")."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    _tid, key = daemon.tenant(quota_bytes=64 * MiB)
    toks = _tokens(130, 2)
    a, b = _llm(tiny), _llm(tiny)
    a.eval(toks)
    b.eval(toks)
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key) as w:
        first = KVStore(c, w, a).save(0, toks)
        assert first is not None
        second = KVStore(c, w, b).save(0, toks)
        assert second is not None, "a save of a prefix already saved answered None, not a Buffer"
        assert second.id == first.id


@pytest.mark.llama
def test_kvstore_takes_pool_as_in_the_spec_and_saves_there(daemon: Daemon, tiny: Path) -> None:
    """§6: "`KVStore(client, worker, model, pool=None)`: entries go to that pool" — the
    fourth parameter, as written (`KVStore(c, w, llm, "kv")`)."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    name = f"kv-{os.getpid()}"
    daemon.pool(name, 32 * MiB)
    _tid, key = daemon.tenant(quota_bytes=64 * MiB)
    toks = _tokens(130, 3)
    llm = _llm(tiny)
    llm.eval(toks)
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key) as w:
        saved = KVStore(c, w, llm, name).save(0, toks)
        assert saved is not None
        assert c.buffer(saved.id).pool_id == c.pool(name).id


@pytest.mark.llama
def test_keys_are_the_model_fingerprint_and_a_chained_hash(daemon: Daemon, tiny: Path) -> None:
    """§6: "Keys are `"<model fingerprint>:<chained hash of token chunks>"`, so a prefix
    saved by one worker is found by any worker of the same tenant running the same
    model" — the key of a prefix extended by one more chunk starts the same way."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore
    from maasd.llama.adapter import model_fingerprint

    _tid, key = daemon.tenant(quota_bytes=64 * MiB)
    llm = _llm(tiny)
    toks = _tokens(200, 4)
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key) as w:
        kv = KVStore(c, w, llm)
        k = kv.key(toks)
        fp, _, chain = k.partition(":")
        assert fp == model_fingerprint(llm)
        assert chain
        assert chain != kv.key(toks[:64]).partition(":")[2]
        assert kv.key(toks[:128]) != k


@pytest.mark.llama
def test_maasd_cache_is_a_base_llama_cache_with_the_spec_signature() -> None:
    """§6: "`maasd.llama.MaasdCache(model, url, socket, key, *, pool=None)` implements
    llama-cpp-python's `llama_cpp.BaseLlamaCache`"."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from maasd.llama import MaasdCache

    assert issubclass(MaasdCache, llama_cpp.BaseLlamaCache)
    params = inspect.signature(MaasdCache).parameters
    assert list(params)[:4] == ["model", "url", "socket", "key"]
    assert params["pool"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["pool"].default is None


# --- §8: maasd worker -----------------------------------------------------------------------


@pytest.mark.llama
def test_worker_pool_completions_and_a_prefix_of_an_earlier_run(
    daemon: Daemon, tiny: Path, tmp_path: Path
) -> None:
    """§8: "`maasd worker --model PATH.gguf … [--pool NAME]`" serves "`/v1/completions`"
    and "a request that lands on any process restores a prefix that any other process (or
    an earlier run) computed" — entries go to `--pool`, and a second run restores them."""
    from serving import Served, worker_cmd

    name = f"wk-{os.getpid()}"
    daemon.pool(name, 64 * MiB)
    _tid, key = daemon.tenant(quota_bytes=256 * MiB)
    port = free_port()
    cmd = worker_cmd(tiny, port, "--n_ctx", "512", "--pool", name)
    cmd += ["--socket", str(daemon.socket_path), "--maasd-url", daemon.url]
    prompt = " ".join(f"w{i}" for i in range(150))
    body = {"prompt": prompt, "max_tokens": 4}

    first = Served(cmd, port, tmp_path / "w1.log", env={"MAASD_KEY": key}).start(timeout=120)
    try:
        r = httpx.post(f"{first.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] is not None
    finally:
        assert first.stop() == 0
    with daemon.client(key) as c:
        bufs = c.get("/v1/buffers").json()
        pool_id = {p["name"]: p["id"] for p in daemon.admin.get("/v1/pools").json()}[name]
    assert bufs, "the worker saved nothing"
    assert {b["pool_id"] for b in bufs} == {pool_id}, bufs

    # the second run takes its key from --key (SPEC: "[--key KEY | MAASD_KEY]")
    second = Served([*cmd, "--key", key], port, tmp_path / "w2.log", env={"MAASD_KEY": ""})
    second.start(timeout=120)
    try:
        r = httpx.post(f"{second.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        m = second.metrics()
        hits = sum(
            v
            for lab, v in m.get("maasd_worker_cache_lookups_total", [])
            if lab.get("outcome") == "hit"
        )
        restored = sum(
            v
            for lab, v in m.get("maasd_worker_prompt_tokens_total", [])
            if lab.get("source") == "restored"
        )
        assert hits >= 1, m.get("maasd_worker_cache_lookups_total")
        assert restored > 0, m.get("maasd_worker_prompt_tokens_total")
    finally:
        assert second.stop() == 0


def test_mapping_close_ends_the_attachment_on_the_daemon(daemon: Daemon) -> None:
    """§6: "`m = w.attach(buf.id)` # Mapping: .array (numpy uint8, zero-copy), .size,
    .numa_node, .close()" — against the real daemon: `.close()` ends the attachment
    (`maasd_attached_handles`), and the array is the buffer (what one writes, another
    mapping reads)."""
    from maasd.client import Client, Worker

    tid, key = daemon.tenant()
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key) as w:
        buf = c.reserve(size_bytes=5000)
        m = w.attach(buf.id)
        assert (m.size, m.numa_node, str(m.array.dtype)) == (8192, buf.numa_node, "uint8")
        assert m.array.shape == (8192,)
        assert _attached(daemon, tid) == 1
        m.array[:4] = [1, 2, 3, 4]
        other = w.attach(buf.id)
        assert other.array[:4].tolist() == [1, 2, 3, 4]
        assert _attached(daemon, tid) == 2
        m.close()
        other.close()
        wait_until(lambda: _attached(daemon, tid) == 0, message="close() detaches")
        c.release(buf.id)


@pytest.mark.llama
def test_maasd_cache_keys_are_the_model_fingerprint_and_a_chained_hash(
    daemon: Daemon, tiny: Path
) -> None:
    """§6: "`llm.set_cache(MaasdCache(llm, url, socket, key))`" … "Keys are `"<model
    fingerprint>:<chained hash of token chunks>"`" — what the cache saves is keyed so.
    A ``MaasdCache`` saves *context* states, a ``KVStore`` sequence states: the model's
    fingerprint is tagged with the kind of state (``context_fingerprint``), so that
    neither ever reads the other's (docs/llama.md, "Keys")."""
    from maasd.client import Client
    from maasd.llama import MaasdCache
    from maasd.llama.context import context_fingerprint

    _tid, key = daemon.tenant(quota_bytes=128 * MiB)
    llm = _llm(tiny)
    cache = MaasdCache(llm, daemon.url, daemon.socket_path, key)
    llm.set_cache(cache)
    try:
        llm(" ".join(f"w{i}" for i in range(120)), max_tokens=2)
    finally:
        llm.set_cache(None)
        cache.close()
    with Client(daemon.url, key) as c:
        keys = [b.key for b in c.buffers()]
    assert keys, "the cache saved nothing"
    fp = context_fingerprint(llm)
    for k in keys:
        assert k is not None
        head, sep, chain = k.partition(":")
        assert (head, sep) == (fp, ":"), k
        assert chain, k


# --- §9: beyond one host, on the socket -------------------------------------------------------


@pytest.fixture
def two_hosts_on_one_ledger(tmp_path: Path) -> Any:
    from pgdb import PG_URL, fresh_pg_database

    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        hosts = [
            Daemon(tmp_path / name, env={"MAASD_DB_URL": url, "MAASD_NODE_NAME": name})
            for name in ("spec-a", "spec-b")
        ]
        try:
            for h in hosts:
                h.start()
            yield hosts
        finally:
            for h in hosts:
                h.close()


def test_socket_puts_resolve_pool_names_locally_and_share_one_quota(
    two_hosts_on_one_ledger: list[Daemon],
) -> None:
    """§9: "tenants, keys and quotas are global, so a tenant's quota holds across hosts …;
    pools and buffers belong to their host", "a name resolves to the local host's pool" —
    through the socket's `put` too (§5: "Quota, pool capacity and eviction rules are those
    of a REST reserve")."""
    a, b = two_hosts_on_one_ledger
    _tid, key = a.tenant(quota_bytes=64 * MiB)
    pools = a.admin.get("/v1/pools").json()
    pool_of = {p["host"]: p["id"] for p in pools if p["name"] == "node0"}
    assert set(pool_of) == {"spec-a", "spec-b"}
    ra, rb = connect(a, key), connect(b, key)
    reply, fd = put(rb, "by-name", 4 * KiB, pool="node0")
    os.close(fd)
    with b.client(key) as c:
        assert c.get(f"/v1/buffers/{reply.buffer_id}").json()["pool_id"] == pool_of["spec-b"]
    reply, fds = rb.call(Put(key="foreign-pool", size_bytes=4 * KiB, pool=pool_of["spec-a"]))
    _refused(reply, fds, 404)
    # an entry of host a is not host b's: no handle of it there
    bid = put_committed(ra, "on-a", pattern(4 * KiB))
    miss(rb, ["on-a"])
    from maasd.protocol import Attach

    reply, fds = rb.call(Attach(buffer_id=bid))
    _refused(reply, fds, 404)
    # one quota across both hosts
    big, fd = put(ra, "big-on-a", 40 * MiB)
    os.close(fd)
    reply, fds = rb.call(Put(key="big-on-b", size_bytes=30 * MiB))
    _refused(reply, fds, 409)
    assert (reply.type or "").endswith("quota-exceeded"), reply
    assert ra.call(Abort(buffer_id=big.buffer_id)) == (Ok(), [])
    reply, fd = put(rb, "big-on-b", 30 * MiB)
    os.close(fd)
    ra.close()
    rb.close()


def test_a_put_entry_is_the_writers_only_until_commit(daemon: Daemon) -> None:
    """§5: "`put` … → `reserved {…}` with a writable fd … for the writer only; the entry is
    invisible to lookups until `commit`" — another connection of the same tenant gets no
    fd of it (attach 404, lookup 404, REST lookup 404), and can neither commit nor abort it."""
    from maasd.protocol import Attach

    _tid, key = daemon.tenant()
    w, other = connect(daemon, key), connect(daemon, key)
    reply, fd = put(w, "mine", 4 * KiB)
    os.close(fd)
    got, fds = other.call(Attach(buffer_id=reply.buffer_id))
    _refused(got, fds, 404)
    miss(other, ["mine"])
    with daemon.client(key) as c:
        assert c.post("/v1/buffers/lookup", json={"keys": ["mine"]}).status_code == 404
    for msg in (Commit(buffer_id=reply.buffer_id), Abort(buffer_id=reply.buffer_id)):
        got, fds = other.call(msg)
        _refused(got, fds, 409)
    commit(w, reply.buffer_id)
    found, fd = lookup(other, ["mine"])
    os.close(fd)
    assert found.buffer_id == reply.buffer_id
    w.close()
    other.close()
