"""The shared prefix tier: a 600-token Gemma prefix restored three ways, in one run.

* local     — KVStore.restore on the host that saved it (daemon A): one socket lookup,
              the header checks, set_data from the mapping (no mapping cache);
* L2        — KVStore.restore on another host (daemon B) that does not hold it: the
              lookup misses locally, B fetches it from Redis (one round trip), checks it,
              materialises a local entry (a put: ledger, quota) and answers the lookup;
              B's entry is released between runs, so every run goes to Redis;
* recompute — evaluating the 600 tokens.

And the floor the L2 restore is held to: a local restore plus a raw redis-py GET of the
same value (the bytes that must cross the network anyway), measured in the same run.
Goals: L2 restore ≥ 20× faster than recompute; L2 restore ≤ 3× (local restore + GET).
The L2 restore and its floor run back to back, --pairs times, and the median of the
per-pair ratios is reported (the machine's load swings more than the differences).

Needs PostgreSQL (MAASD_TEST_PG_URL, or one started here with scripts/pg-test-server),
redis-server on PATH, and the dev extra's Gemma package. Nothing is asserted.

    python tests/bench/bench_l2.py [--tokens 600] [--pairs 15] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from timing import median_ms, paired

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# A script, not collected by pytest (whose pythonpath has tests/): the helpers by path.
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(REPO))


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A PostgreSQL server URL: MAASD_TEST_PG_URL, or a throw-away one of our own."""
    url = os.environ.get("MAASD_TEST_PG_URL")
    if url:
        yield url
        return
    from conftest import free_port

    port = str(free_port())
    script = str(REPO / "scripts" / "pg-test-server")
    url = subprocess.run([script, port], check=True, capture_output=True, text=True).stdout
    try:
        yield url.strip()
    finally:
        subprocess.run([script, "stop", port], check=False, capture_output=True)


@contextlib.contextmanager
def fleet(warm: str) -> Iterator[tuple[Any, Any, Any]]:
    """(daemon A, daemon B, the Redis server): one ledger database, one Redis."""
    import pgdb
    from conftest import Daemon
    from redisdb import RedisServer

    with (
        postgres() as pg_url,
        tempfile.TemporaryDirectory(prefix="maasd-bench-l2-") as tmp,
    ):
        pgdb.PG_URL = pg_url
        redis = RedisServer(Path(tmp) / "redis").start()
        daemons: list[Any] = []
        try:
            with pgdb.fresh_pg_database() as ledger:
                for name in ("bench-a", "bench-b"):
                    env = {
                        "MAASD_DB_URL": ledger,
                        "MAASD_NODE_NAME": name,
                        "MAASD_L2_URL": redis.url,
                        "MAASD_DEFAULT_WARM_BYTES": warm,
                        "MAASD_LOG_LEVEL": "warning",
                    }
                    daemons.append(Daemon(Path(tmp) / name, env=env).start())
                yield daemons[0], daemons[1], redis
                for d in daemons:
                    d.close()
        finally:
            for d in daemons:
                d.close()
            redis.stop()


def load_gemma(n_ctx: int, threads: int) -> Any:
    import llama_cpp

    from llama_model import gemma_model

    return llama_cpp.Llama(
        str(gemma_model()),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def measure(args: argparse.Namespace) -> dict[str, float]:
    from maasd.client import Client, Worker
    from maasd.l2 import codec
    from maasd.llama import KVStore

    llm = load_gemma(max(1024, args.tokens + 64), args.threads)
    rng = np.random.default_rng(0)
    tokens = [llm.token_bos()] + rng.integers(1000, 30000, args.tokens - 1).tolist()
    out: dict[str, float] = {}

    def recompute() -> None:
        llm.reset()
        llm.eval(tokens)

    out["recompute"] = median_ms(recompute, args.repeat)
    with fleet(args.warm) as (a, b, redis):
        tid, key = a.tenant("bench", 512 << 20)
        with (
            Client(a.url, key) as ca,
            Client(b.url, key) as cb,
            Worker(a.socket_path, key, cache_bytes=0) as wa,
            Worker(b.socket_path, key, cache_bytes=0) as wb,
        ):
            kva, kvb = KVStore(ca, wa, llm), KVStore(cb, wb, llm)
            saved = kva.save(0, tokens)
            assert saved is not None
            assert saved.key is not None
            saved_key: str = saved.key
            out["entry_bytes"] = saved.size_bytes
            r = redis.client()
            l2_key = codec.Keys("maasd", tid).entry(saved.key)
            deadline = time.monotonic() + 30
            while not r.exists(l2_key):
                assert time.monotonic() < deadline, "the entry never reached L2"
                time.sleep(0.01)
            out["value_bytes"] = r.strlen(l2_key)

            def local() -> None:
                assert kva.restore(0, tokens) == len(tokens)

            def raw_get() -> None:
                assert r.get(l2_key) is not None

            def from_l2() -> None:
                assert kvb.restore(0, tokens) == len(tokens)

            def floor() -> None:
                local()
                raw_get()

            def forget_on_b() -> None:  # outside the timing: B must go to L2 again
                hit = cb.lookup([saved_key])
                if hit is not None:
                    cb.release(hit.id)

            out["local"] = median_ms(local, args.repeat)
            out["get"] = median_ms(raw_get, args.repeat)
            l2_times, floors, ratios = [], [], []
            for _ in range(args.pairs):
                forget_on_b()
                t_l2, t_floor, ratio = paired(from_l2, floor, 1)
                l2_times.append(t_l2)
                floors.append(t_floor)
                ratios.append(ratio)
            forget_on_b()
            out["l2"] = statistics.median(l2_times)
            out["floor"] = statistics.median(floors)
            out["goal_floor"] = statistics.median(ratios)
            out["l2_hits"] = b.metric("maasd_l2_lookups_total", outcome="hit")
            out["fetch_ms"] = _mean_ms(b, "maasd_l2_seconds", op="fetch")
    return out


def _mean_ms(d: Any, name: str, **labels: str) -> float:
    total = d.metric(f"{name}_sum", **labels)
    count = d.metric(f"{name}_count", **labels)
    return 1e3 * total / count if count else float("nan")


def report(args: argparse.Namespace, m: dict[str, float]) -> None:
    print(
        f"Gemma 3 270M, {args.tokens} tokens, entry {m['entry_bytes'] / 2**20:.2f} MiB "
        f"(L2 value {m['value_bytes'] / 2**20:.2f} MiB), {args.threads} threads; "
        f"medians of {args.repeat} (single) and {args.pairs} (pairs); "
        f"{m['l2_hits']:.0f} L2 hits on B"
    )
    rows = [
        ("recompute: eval the whole prompt", m["recompute"]),
        ("local restore (daemon A, no mapping cache)", m["local"]),
        ("raw redis-py GET of the same value", m["get"]),
        ("floor: local restore + raw GET, back to back", m["floor"]),
        ("L2 restore through daemon B (miss → L2 → local entry)", m["l2"]),
        ("  of which B's L2 fetch (mean of maasd_l2_seconds)", m["fetch_ms"]),
    ]
    for name, ms in rows:
        print(f"  {name:<58} {ms:9.2f} ms")
    print("ratios:")
    print(f"  {'recompute / L2 restore (goal ≥ 20)':<58} {m['recompute'] / m['l2']:9.1f}×")
    print(f"  {'L2 restore / floor, paired (goal ≤ 3)':<58} {m['goal_floor']:9.2f}×")
    print(f"  {'L2 restore / local restore':<58} {m['l2'] / m['local']:9.2f}×")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--warm", default="128MiB", help="each daemon's warm stock")
    p.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    args = p.parse_args(argv)
    report(args, measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
