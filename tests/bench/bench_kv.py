"""KV prefix sharing: maasd save/restore vs Llama.save_state/load_state vs recompute.

For one ~600-token prompt, measured in one run on this machine (medians of --repeat):

* recompute  — time to first token evaluating the whole prompt (the baseline);
* maasd      — KVStore.save (state straight into a maasd buffer) and the time to
               first token via KVStore.restore + evaluating the last token;
* save_state — llama-cpp-python's Llama.save_state()/load_state() (whole context,
               through Python bytes) + evaluating the last token;
* raw        — llama_state_seq_get/set_data into a private numpy buffer (no daemon),
               and a plain bytes copy of the same size (memcpy bandwidth).

Ratios are printed; nothing is asserted (CI never runs this).

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

TESTS = Path(__file__).resolve().parents[1]
# A script, not collected by pytest (whose pythonpath has tests/): the helpers by path.
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def maasd_endpoint(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(url, socket, tenant key): the one given, or a daemon of our own in a temp dir."""
    if args.url and args.socket and args.key:
        yield args.url, args.socket, args.key
        return
    from conftest import Daemon  # the test suite's daemon runner

    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        d = Daemon(Path(tmp) / "maasd").start()
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


def bench_maasd(args: argparse.Namespace, llm: Any, tokens: list[int], R: int) -> dict[str, float]:
    """KVStore save/restore against a daemon, and where a restore's time goes."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore, chunk_keys, state_checksum

    out: dict[str, float] = {}
    with maasd_endpoint(args) as (url, sock, key), Client(url, key) as c, Worker(sock, key) as w:
        kv = KVStore(c, w, llm)
        llm.reset()
        llm.eval(tokens)

        def save() -> None:
            buf = kv.save(0, tokens)
            c.release(buf.id)  # measure a fresh reserve + write every time

        out["save"] = median_ms(save, R)
        buf = kv.save(0, tokens)
        out["n_restored"] = kv.restore(0, tokens)
        out["restore"] = median_ms(lambda: kv.restore(0, tokens), R)

        def maasd_ttft() -> None:
            n = kv.restore(0, tokens, max_tokens=len(tokens) - 1)
            llm.eval(tokens[n:])

        out["ttft"] = median_ms(maasd_ttft, R)

        # where a restore's time goes: the daemon round trips and the checksum
        keys = [k for _, k in chunk_keys(kv.fingerprint, tokens, kv.chunk)]
        out["lookup"] = median_ms(lambda: c.lookup(keys), R)

        def attach_close() -> None:
            w.attach(buf.id).close()

        out["attach"] = median_ms(attach_close, R)
        out["renew"] = median_ms(lambda: w.renew(buf.id, 600), R)
        with w.attach(buf.id) as m:
            out["crc"] = median_ms(functools.partial(state_checksum, m.array.data), R)
        c.release(buf.id)
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
        ("maasd: KVStore.save (reserve + write + header)", m["save"]),
        ("maasd: KVStore.restore (lookup + attach + verify + set)", m["restore"]),
        ("  of which REST lookup", m["lookup"]),
        ("  of which socket attach + close (detach)", m["attach"]),
        ("  of which socket renew (on a hit)", m["renew"]),
        ("  of which the state checksum (XXH3)", m["crc"]),
        ("maasd: TTFT (restore n-1 + eval last token)", m["ttft"]),
        ("Llama.save_state()", b["save_state"]),
        ("Llama.load_state()", b["load_state"]),
        ("Llama.load_state(): TTFT (+ eval last token)", b["load_state_ttft"]),
        ("raw llama_state_seq_get_data → numpy", b["raw_get"]),
        ("raw llama_state_seq_set_data ← numpy", b["raw_set"]),
        (f"bytes copy of {mib:.2f} MiB (memcpy baseline)", b["copy"]),
    ]
    for name, ms in rows:
        print(f"  {name:<58} {ms:9.2f} ms")
    ratios = [
        ("TTFT speed-up, maasd vs recompute", b["recompute"] / m["ttft"]),
        ("TTFT, maasd vs Llama.load_state", b["load_state_ttft"] / m["ttft"]),
        ("save, maasd vs Llama.save_state", b["save_state"] / m["save"]),
        ("restore, maasd vs Llama.load_state", b["load_state"] / m["restore"]),
        ("maasd restore / raw set_data (overhead)", m["restore"] / b["raw_set"]),
        ("maasd save / raw get_data (overhead)", m["save"] / b["raw_get"]),
        ("raw set_data / bytes copy", b["raw_set"] / b["copy"]),
    ]
    print("ratios:")
    for name, x in ratios:
        print(f"  {name:<42} {x:8.2f}×")


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
