"""``maasd router`` beyond one host: two daemons, one PostgreSQL ledger, one real Redis.

Router A runs on host ``router-a``'s daemon, router B on host ``router-b``'s; each starts
its own llama-server (the ``scripts/llama-server`` build, the real Gemma 3 270M). A
prefix router A computed and published is written behind to Redis by A's daemon; B's
lookup misses locally, B's daemon fetches it from L2, and B's backend restores it:
it evaluates only the suffix, and its greedy output equals A's cold run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.llama

pytest.importorskip("xxhash")

from conftest import Daemon  # noqa: E402
from l2hosts import in_l2, l2_key, two_hosts  # noqa: E402
from llama_model import GERMANY, SWEDEN  # noqa: E402
from maasd.llama.format import chunk_keys  # noqa: E402
from redisdb import RedisServer  # noqa: E402
from router_fleet import CHUNK, RouterProc, text_of, tokens_of  # noqa: E402
from waiting import wait_until  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, l2_ledger_url: str, redis_server: RedisServer
) -> Iterator[tuple[Daemon, Daemon]]:
    # a loaded 2-core machine: Redis answers a 7 MB value slower than 0.1 s
    env = {"MAASD_L2_TIMEOUT_S": "2"}
    with two_hosts(
        tmp_path_factory, ("router-a", "router-b"), l2_ledger_url, redis_server, env
    ) as p:
        yield p


@pytest.fixture
def start(llama_server: str, gemma_gguf: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[RouterProc] = []

    def make(host: Daemon, key: str, **kw: Any) -> RouterProc:
        r = RouterProc(
            llama_server,
            gemma_gguf,
            tmp_path / "logs",
            key=key,
            socket_path=host.socket_path,
            maasd_url=host.url,
            chunk=CHUNK,
            **kw,
        ).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@dataclass
class Published:
    """A prompt a router on one host answered cold and published, written behind to L2."""

    tenant_id: str
    key: str
    prompt: str
    cold: Any  # the cold answer
    toks: list[int]
    n: int  # the tokens of its entry's key
    entry_key: str


def published_in_l2(host: Daemon, redis_server: RedisServer, start: Any, prompt: str) -> Published:
    tid, key = host.tenant(f"router-l2-{uuid.uuid4().hex[:6]}", 256 * MiB)
    a = start(host, key, backends=1)
    cold = a.complete(prompt)
    assert cold.headers["x-maasd-restored"] == "0"
    a.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    toks = tokens_of(a, prompt)
    n = len(toks) - len(toks) % CHUNK
    entry_key = chunk_keys(a.health()["fingerprint"], toks[:n], CHUNK)[-1][1]
    wait_until(
        lambda: in_l2(redis_server, tid, entry_key),
        timeout=60,
        message="the entry written behind to Redis",
    )
    return Published(tid, key, prompt, cold, toks, n, entry_key)


def test_a_prefix_router_a_computed_on_host_a_is_restored_by_router_b_on_host_b(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer, start: Any
) -> None:
    a_host, b_host = hosts
    prompt = "Two hosts.\n" + GERMANY
    p = published_in_l2(a_host, redis_server, start, prompt)
    key, toks, n, cold = p.key, p.toks, p.n, p.cold
    hits = b_host.metric("maasd_l2_lookups_total", outcome="hit")

    b = start(b_host, key, backends=1)  # another host's daemon: only L2 holds the prefix
    warm = b.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) == n
    assert text_of(warm) == text_of(cold)
    assert b_host.metric("maasd_l2_lookups_total", outcome="hit") == hits + 1
    # B's backend evaluated only the suffix (the server's own timings, counted by B)
    evaluated = b.metric("maasd_router_prompt_tokens", kind="evaluated")
    assert 0 < evaluated <= len(toks) - n + 1
    assert b.metric("maasd_router_prompt_tokens", kind="restored") == n
    assert b.metric("maasd_router_entries", op="lookup", outcome="hit") == 1


def corrupt_in_l2(redis_server: RedisServer, tenant_id: str, key: str) -> None:
    """Flip a byte of the K/V state of the entry ``key`` in Redis, and make the L2 value's
    own checksum anew — as a bit flip before it was written, or anyone who can write to
    Redis, would (docs/scale-out.md, "Security"): the daemon's check passes it."""
    from maasd.l2 import codec

    r = redis_server.client()
    name = l2_key(tenant_id, key)
    value = bytearray(r.get(name))
    ttl = r.pttl(name)
    data = codec.decode(bytes(value), tenant_id, key, len(value))
    assert len(data) > 4096
    value[-1000] ^= 0x40  # the entry's last bytes: its state's V of the last layer
    codec.encode_into(value, tenant_id, key)
    r.set(name, bytes(value), px=ttl)


def test_a_corrupted_entry_in_l2_passes_the_daemon_and_is_refused_by_the_router(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer, start: Any
) -> None:
    a_host, b_host = hosts
    p = published_in_l2(a_host, redis_server, start, "Corrupted in L2.\n" + GERMANY)
    corrupt_in_l2(redis_server, p.tenant_id, p.entry_key)
    key, prompt, cold = p.key, p.prompt, p.cold
    hits = b_host.metric("maasd_l2_lookups_total", outcome="hit")

    b = start(b_host, key, backends=1)
    warm = b.complete(prompt)
    assert b_host.metric("maasd_l2_lookups_total", outcome="hit") == hits + 1  # the daemon's
    assert warm.headers["x-maasd-restored"] == "0"  # … but the router's check refused it
    assert b.metric("maasd_router_entries", op="lookup", outcome="refused") == 1
    assert text_of(warm) == text_of(cold)  # the corrupted state never reached the server


def test_every_backend_restarted_the_prefixes_survive_in_maasd(
    hosts: tuple[Daemon, Daemon], start: Any
) -> None:
    """Both backends of a router SIGKILLed at once: restarted empty, each prefix it had
    published comes back from maasd (restored, the same greedy output), on either one."""
    import os
    import signal

    host = hosts[0]
    _tid, key = host.tenant(f"router-restart-{uuid.uuid4().hex[:6]}", 256 * MiB)
    r = start(host, key, backends=2)
    prompts = ["Restart all.\n" + GERMANY, "Both again.\n" + SWEDEN]
    colds = [text_of(r.complete(p)) for p in prompts]
    r.wait_metric("maasd_router_entries", 2, op="publish", outcome="ok")
    r.wait_idle()
    before = [b["pid"] for b in r.health()["backends"]]
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        bs = r.health()["backends"]
        if all(b["alive"] and b["restarts"] == 1 for b in bs):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"not restarted: {r.health()}\n{r.log()}")
    assert all(b["pid"] not in before for b in bs)
    for p, cold in zip(prompts, colds, strict=True):
        warm = r.complete(p)
        assert int(warm.headers["x-maasd-restored"]) > 0, r.log()
        assert text_of(warm) == cold
    assert r.metric("maasd_router_backend_restarts") == 2
