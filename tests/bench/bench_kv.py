"""KV prefix sharing: maasd save/restore vs Llama.save_state/load_state vs recompute.

For one ~600-token prompt, measured in one run on this machine (medians of --repeat):

* recompute  — time to first token evaluating the whole prompt (the baseline);
* maasd      — KVStore.save (put → state straight into the entry → commit) and
               KVStore.restore (one socket lookup → header check → set_data from the
               mapping → header check), with the worker's mapping cache warm and with
               it off; the time to first token via a restore + evaluating the last token;
               where the time goes (put, commit, lookup, header check);
* save_state — llama-cpp-python's Llama.save_state()/load_state() (whole context,
               through Python bytes) + evaluating the last token;
* raw        — llama_state_seq_get/set_data into a private numpy buffer (no daemon),
               and a plain bytes copy of the same size (memcpy bandwidth).

Ratios are printed, with the goals beside them; nothing is asserted (CI never runs this).
On a shared machine the load swings more than the differences measured, so the
goal ratios are *paired*: the maasd operation and its raw llama.cpp floor run
back to back, --pairs times, and the median of the per-pair ratios is reported.

    python tests/bench/bench_kv.py                      # tiny random model, own daemon
    python tests/bench/bench_kv.py --gemma              # Gemma 3 270M (pip package)
    python tests/bench/bench_kv.py --url … --socket … --key …  # an existing daemon
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from timing import median_ms, ms, paired

TESTS = Path(__file__).resolve().parents[1]
# A script, not collected by pytest (whose pythonpath has tests/): the helpers by path.
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))


@contextlib.contextmanager
def maasd_endpoint(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(url, socket, tenant key): the one given, or a daemon of our own in a temp dir."""
    if args.url and args.socket and args.key:
        yield args.url, args.socket, args.key
        return
    from conftest import Daemon  # the test suite's daemon runner

    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        env = {"MAASD_DEFAULT_WARM_BYTES": args.warm} if args.warm else None
        d = Daemon(Path(tmp) / "maasd", env=env).start()
        try:
            _tid, key = d.tenant("bench", 512 << 20)
            yield d.url, d.socket_path, key
        finally:
            d.close()


def load_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The ``Llama`` to measure and its path (Gemma, a given GGUF, or the tests' tiny model)."""
    import llama_cpp

    if args.gemma:
        from llama_model import gemma_model

        model = str(gemma_model())
    elif args.model:
        model = args.model
    else:
        from llama_model import tiny_model

        model = str(tiny_model(0))
    n_ctx = max(1024, args.tokens + 64)
    llm = llama_cpp.Llama(
        model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    return llm, model


def bench_llama(llm: Any, tokens: list[int], R: int) -> dict[str, float]:
    """Baselines without maasd: recompute, raw seq get/set, Llama.save_state/load_state."""
    from maasd.llama import LlamaSeqAdapter

    seq = LlamaSeqAdapter(llm)
    out: dict[str, float] = {}

    def recompute() -> None:  # time to first token from nothing
        llm.reset()
        llm.eval(tokens)

    out["recompute"] = median_ms(recompute, R)
    state_len = seq.state_size(0)
    out["state_len"] = state_len

    # a bytes copy of the state's size; raw seq get/set into private memory
    blob = np.random.default_rng(1).integers(0, 256, state_len, dtype=np.uint8).tobytes()
    out["copy"] = median_ms(lambda: bytearray(blob), R)
    private = np.empty(state_len, np.uint8)
    out["raw_get"] = median_ms(lambda: seq.state_get(0, private, 0, state_len), R)
    out["raw_set"] = median_ms(lambda: seq.state_set(0, private, 0, state_len), R)

    # Llama.save_state / load_state (whole context, Python bytes), then the last token
    st = llm.save_state()
    out["save_state_bytes"] = st.llama_state_size
    out["save_state"] = median_ms(llm.save_state, R)

    def load_state_ttft() -> None:
        llm.load_state(st)
        llm.n_tokens = len(tokens) - 1
        seq.seq_rm(0, len(tokens) - 1, -1)
        llm.eval(tokens[-1:])

    out["load_state"] = median_ms(lambda: llm.load_state(st), R)
    out["load_state_ttft"] = median_ms(load_state_ttft, R)
    return out


def _raw(kv: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(raw set_data, raw get_data) of sequence 0's state from/into private memory."""
    from maasd.llama import LlamaSeqAdapter

    seq = LlamaSeqAdapter(kv.model)
    size = seq.state_size(0)
    private = np.empty(size, np.uint8)
    seq.state_get(0, private, 0, size)
    return (
        lambda: seq.state_set(0, private, 0, size),
        lambda: seq.state_get(0, private, 0, size),
    )


def bench_restore_goals(kv: Any, kv_cold: Any, tokens: list[int], n: int) -> dict[str, float]:
    """restore (mapping cached, and not) / raw set_data, paired (the entry exists)."""
    raw_set, _raw_get = _raw(kv)
    return {
        "goal_restore": paired(lambda: kv.restore(0, tokens), raw_set, n)[2],
        "goal_restore_cold": paired(lambda: kv_cold.restore(0, tokens), raw_set, n)[2],
    }


def bench_save_goal(kv: Any, c: Any, tokens: list[int], n: int) -> float:
    """save / raw get_data, paired; each saved entry is released between pairs."""
    _raw_set, raw_get = _raw(kv)
    saved: list[Any] = []
    ratios = []
    for _ in range(n):
        ratios.append(paired(lambda: saved.append(kv.save(0, tokens)), raw_get, 1)[2])
        c.release(saved.pop().id)
    return statistics.median(ratios)


def bench_saves(kv: Any, c: Any, w: Any, tokens: list[int], R: int) -> dict[str, float]:
    """KVStore.save, each a fresh entry (released outside the timing), and its parts."""
    saves, puts, commits = [], [], []
    for i in range(R):
        t0 = time.perf_counter()
        entry = kv.save(0, tokens)
        saves.append(time.perf_counter() - t0)
        c.release(entry.id)
        t0 = time.perf_counter()
        m = w.put(f"bench:part:{i}", entry.size_bytes)
        t1 = time.perf_counter()
        w.commit(m)
        t2 = time.perf_counter()
        puts.append(t1 - t0)
        commits.append(t2 - t1)
        c.release(m.buffer_id)
    return {"save": ms(saves), "put": ms(puts), "commit": ms(commits)}


def bench_maasd(args: argparse.Namespace, llm: Any, tokens: list[int], R: int) -> dict[str, float]:
    """KVStore save/restore against a daemon, and where their time goes."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore, chunk_keys, parse_header, state_checksum

    out: dict[str, float] = {}
    with (
        maasd_endpoint(args) as (url, sock, key),
        Client(url, key) as c,
        Worker(sock, key) as w,
        Worker(sock, key, cache_bytes=0) as cold,
    ):
        kv = KVStore(c, w, llm)
        llm.reset()
        llm.eval(tokens)
        out |= bench_saves(kv, c, w, tokens, R)
        entry = kv.save(0, tokens)
        assert entry is not None
        out["n_restored"] = kv.restore(0, tokens)
        out["restore"] = median_ms(lambda: kv.restore(0, tokens), R)
        kv_cold = KVStore(c, cold, llm)
        out["restore_cold"] = median_ms(lambda: kv_cold.restore(0, tokens), R)
        out |= bench_restore_goals(kv, kv_cold, tokens, args.pairs)

        def maasd_ttft() -> None:
            n = kv.restore(0, tokens, max_tokens=len(tokens) - 1)
            llm.eval(tokens[n:])

        out["ttft"] = median_ms(maasd_ttft, R)

        # where a restore's time goes: the socket round trip, the header checks
        keys = [k for _, k in chunk_keys(kv.fingerprint, tokens, kv.chunk)]

        def lookup() -> None:
            hit = w.lookup(keys)
            assert hit is not None
            hit.close()

        many = max(R, 200)
        out["lookup"] = median_ms(lookup, many)
        hit = w.lookup(keys)
        assert hit is not None
        out["header"] = median_ms(lambda: parse_header(hit.array, hit.size), many)
        hdr = parse_header(hit.array, hit.size)
        state = hit.array[hdr.header_len : hdr.header_len + hdr.state_len]
        out["crc"] = median_ms(functools.partial(state_checksum, state.data), R)
        del state
        hit.close()
        c.release(entry.id)
        out["goal_save"] = bench_save_goal(kv, c, tokens, max(5, args.pairs // 2))
    return out


def report(
    model: str, n_tokens: int, threads: int, R: int, b: dict[str, float], m: dict[str, float]
) -> None:
    mib = b["state_len"] / 2**20
    print(
        f"model {Path(model).name}, {n_tokens} tokens, seq state {mib:.2f} MiB, "
        f"save_state blob {b['save_state_bytes'] / 2**20:.2f} MiB, {threads} threads, "
        f"median of {R}; restored {m['n_restored']:.0f}"
    )
    rows = [
        ("recompute: TTFT (eval whole prompt)", b["recompute"]),
        ("maasd: KVStore.save (put + get_data + header + commit)", m["save"]),
        ("  of which put (reserve, prefault)", m["put"]),
        ("  of which commit (fresh sealed region + copy)", m["commit"]),
        ("maasd: KVStore.restore, mapping cached", m["restore"]),
        ("maasd: KVStore.restore, no mapping cache", m["restore_cold"]),
        ("  of which socket lookup (cached mapping)", m["lookup"]),
        ("  of which one header check", m["header"]),
        ("  (state checksum, no longer on the restore path)", m["crc"]),
        ("maasd: TTFT (restore n-1 + eval last token)", m["ttft"]),
        ("Llama.save_state()", b["save_state"]),
        ("Llama.load_state()", b["load_state"]),
        ("Llama.load_state(): TTFT (+ eval last token)", b["load_state_ttft"]),
        ("raw llama_state_seq_get_data → numpy", b["raw_get"]),
        ("raw llama_state_seq_set_data ← numpy", b["raw_set"]),
        (f"bytes copy of {mib:.2f} MiB (memcpy baseline)", b["copy"]),
    ]
    for name, took in rows:
        print(f"  {name:<58} {took:9.3f} ms")
    ratios = [
        ("restore / raw set_data, paired (goal ≤ 1.5)", m["goal_restore"]),
        ("restore, no cache / raw set_data, paired", m["goal_restore_cold"]),
        ("save / raw get_data, paired (goal ≤ 4)", m["goal_save"]),
        ("TTFT speed-up, maasd vs recompute", b["recompute"] / m["ttft"]),
        ("restore speed-up vs recompute", b["recompute"] / m["restore"]),
        ("TTFT, maasd vs Llama.load_state", b["load_state_ttft"] / m["ttft"]),
        ("save, maasd vs Llama.save_state", b["save_state"] / m["save"]),
        ("restore, maasd vs Llama.load_state", b["load_state"] / m["restore"]),
        ("raw set_data / bytes copy", b["raw_set"] / b["copy"]),
    ]
    print("ratios:")
    for name, x in ratios:
        print(f"  {name:<46} {x:8.2f}×")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=os.environ.get("MAASD_URL"))
    p.add_argument("--socket", default=os.environ.get("MAASD_SOCKET"))
    p.add_argument("--key", default=os.environ.get("MAASD_KEY"))
    p.add_argument("--model", help="GGUF path (default: the tests' tiny random llama)")
    p.add_argument("--gemma", action="store_true", help="Gemma 3 270M from its pip package")
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pairs", type=int, default=21, help="back-to-back pairs for the goals")
    p.add_argument(
        "--warm",
        default="128MiB",
        help="the own daemon's warm stock (MAASD_DEFAULT_WARM_BYTES; '' for its default, "
        "0 for none): prefaulted regions a put and a commit take instead of faulting",
    )
    p.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    args = p.parse_args(argv)

    llm, model = load_model(args)
    rng = np.random.default_rng(0)
    n_vocab = llm.n_vocab()
    tokens = [llm.token_bos()] + rng.integers(10, min(n_vocab, 30000), args.tokens - 1).tolist()
    baseline = bench_llama(llm, tokens, args.repeat)
    maasd = bench_maasd(args, llm, tokens, args.repeat)
    report(model, len(tokens), args.threads, args.repeat, baseline, maasd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
