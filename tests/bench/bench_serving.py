"""Serving chats with a shared system prompt: ``maasd worker`` vs llama-cpp-python's server.

Two parts, in one run on this machine (CI never runs this; nothing is asserted):

* **state** — what one cache item costs, on a ~600-token Gemma context: ``MaasdCache``'s
  save (the context state straight into a maasd entry) and restore (lookup, load from
  the read-only mapping, checks) against ``Llama.save_state`` + ``LlamaRAMCache`` and
  ``LlamaRAMCache`` + ``Llama.load_state``, with llama.cpp's raw state calls into private
  memory as the floor, back to back (``--pairs`` times, medians). Also what
  ``Llama.load_state`` of the state ``MaasdCache`` answers would cost (the copy
  ``LlamaState``'s design forces, and the scores fill), had ``Llama`` called it. Then one
  chat turn alone: its time to first token from a full prefill and from a restore of the
  system prompt, and what one generated token costs.
* **serve** — a replayed multi-turn chat workload: one system prompt of ~600 tokens,
  ``--conversations`` conversations of ``--turns`` turns each (customer messages of ~40
  tokens, answers of up to ``--max-tokens``), all conversations at once, each turn sent
  when the last one was answered, each on a connection of its own. The first server
  (no cache) answers live and its answers become the transcript: the others replay it,
  so every server sees the same prompts, and a history holds what the model said (as a
  chat client sends it back). Against, each started afresh:
  ``maasd worker --processes 2`` (its own daemon), ``maasd worker --processes 1``,
  ``python -m llama_cpp.server`` with its RAM cache (``--cache_size`` sized below), and
  without a cache. Every server gets ``--interrupt_requests false --logits_all false``
  and the same model, chat format and ``--threads`` llama.cpp threads per process (so
  a worker of 2 processes uses twice the CPU of the others; ``maasd worker ×1`` is the
  row on the same CPU). Reported: TTFT (client-side, to the first streamed event) mean
  and p95, total time, and the fraction of prompt tokens restored from maasd / held in
  a process's context (from the worker's /metrics; llama-cpp-python's server has none).

::

    python tests/bench/bench_serving.py                       # both parts, Gemma 3 270M
    python tests/bench/bench_serving.py --part serve --conversations 6 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
# A script, not collected by pytest (whose pythonpath has tests/): the helpers by path.
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

MiB = 1 << 20
CHAT_FORMAT = "chatml"  # a format in which this small Gemma answers sensibly

_RULES = [
    "Greet the customer by name when the name is known, and keep a friendly tone.",
    "Never promise a delivery date that the order system has not confirmed.",
    "Refunds up to fifty euros may be granted without a supervisor's approval.",
    "Orders shipped abroad take between five and twelve working days to arrive.",
    "A damaged parcel is replaced at no cost once the customer sends a photograph.",
    "Gift cards cannot be exchanged for cash and expire three years after purchase.",
    "Customers may change the delivery address until the parcel leaves the warehouse.",
    "Subscriptions renew every month unless they are cancelled before the renewal day.",
    "Only the account holder may change the payment method or the billing address.",
    "Answer in the language of the customer, and in short sentences.",
]


SHOPS = ["Nordwind Outfitters", "Blue Fjord Supply", "Tundra & Pine", "Harbour Gear"]


def system_prompt(target_tokens: int, count: Callable[[str], int], shop: int = 0) -> str:
    """A support-desk system prompt of about ``target_tokens`` tokens (``shop``: whose)."""
    head = f"You are the support assistant of {SHOPS[shop % len(SHOPS)]}, a mail-order shop.\n"
    text, i = head, 0
    while count(text) < target_tokens:
        text += f"Rule {i + 1}: {_RULES[i % len(_RULES)]}\n"
        i += 1
    return text


def questions(n_conv: int, n_turns: int) -> list[list[str]]:
    """The customers' messages (~40 tokens each), per conversation."""
    items = ["boots", "a tent", "a jacket", "gloves", "a backpack", "a stove", "socks", "a lamp"]
    asks = [
        "Hello, my name is {n}. I ordered {x} last week, order number {o}, and it has not "
        "arrived yet although the shop said it would take three days. Where is it now?",
        "Thank you. Could I still have {x} sent to my sister's address in Uppsala instead? "
        "She will be at home all week and can sign for the parcel.",
        "The parcel came today but {x} is damaged: one side is torn open and the box was wet. "
        "What should I do now, and do I have to send it back first?",
        "Could I get a refund for {x} instead of a replacement? I would rather buy a "
        "different model in the shop downtown.",
        "One more thing: my subscription to the newsletter, does it renew automatically and "
        "how can I stop it?",
    ]
    names = ["Anna", "Bo", "Carla", "Dag", "Eva", "Finn", "Greta", "Hugo"]
    out = []
    for k in range(n_conv):
        v = {"x": items[k % len(items)], "n": names[k % len(names)], "o": 48151 + 7 * k}
        out.append([asks[t % len(asks)].format(**v) for t in range(n_turns)])
    return out


# ----------------------------------------------------------------------------- part: state


def bench_state(args: argparse.Namespace, model: str, key_env: dict[str, str]) -> None:
    import llama_cpp
    import numpy as np

    from maasd.llama import MaasdCache
    from maasd.llama.adapter import LlamaContextAdapter

    llm = llama_cpp.Llama(
        model, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
    )
    count = lambda s: len(llm.tokenize(s.encode()))  # noqa: E731
    toks = llm.tokenize(system_prompt(args.system_tokens, count).encode())
    llm.eval(toks)
    ctx = LlamaContextAdapter(llm)
    size = ctx.context_state_size()
    buf = np.empty(size, dtype=np.uint8)
    ram = llama_cpp.LlamaRAMCache(capacity_bytes=8 << 30)
    cache = MaasdCache(llm, key_env["url"], key_env["socket"], key_env["key"])
    arr = np.asarray(toks, dtype=np.int32)

    def fresh() -> None:  # an empty context, as a new process has
        llm.reset()
        ctx.forget_all()

    def maasd_save(i: int) -> None:
        # what MaasdCache[...] = <its pending state> does, under a key of its own each
        # time (a key saved already would be a 409 and no save)
        cache.store.save(arr, [64 * (i % 9 + 1)])

    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> None:
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    restored: list[Any] = []
    for i in range(args.pairs):
        timed("raw get_data", lambda: ctx.context_state_get(buf, 0, size))
        timed("RAM save", lambda: ram.__setitem__(tuple(toks), llm.save_state()))
        timed("maasd save", functools.partial(maasd_save, i))
        timed("raw set_data", lambda: ctx.context_state_set(buf, 0, size))
        timed("RAM load", lambda: llm.load_state(ram[tuple(toks)]), before=fresh)
        timed("maasd restore", lambda: restored.append(cache[toks + [toks[-1]]]), before=fresh)
        timed("load_state(restored)", lambda: llm.load_state(restored[-1]), before=fresh)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"\n## state of a {len(toks)}-token context ({size / MiB:.1f} MiB), medians of {args.pairs}"
    )
    print("| operation | ms | × raw |")
    print("|---|---:|---:|")
    for name, floor in (
        ("raw get_data", "raw get_data"),
        ("maasd save", "raw get_data"),
        ("RAM save", "raw get_data"),
        ("raw set_data", "raw set_data"),
        ("maasd restore", "raw set_data"),
        ("RAM load", "raw set_data"),
        ("load_state(restored)", "raw set_data"),
    ):
        print(f"| {name} | {med[name]:.1f} | {med[name] / med[floor]:.1f} |")
    bench_turn(args, llm, cache, toks, fresh)
    cache.close()


def bench_turn(
    args: argparse.Namespace, llm: Any, cache: Any, system: list[int], fresh: Callable[[], Any]
) -> None:
    """One chat turn alone (nothing queued before it), in this process: its time to first
    token from a full prefill and from a maasd restore of the system prompt plus the rest,
    and what each generated token costs after it (what a queued request waits for)."""
    turn = f"<|im_start|>user\n{questions(1, 1)[0][0]}<|im_end|>\n<|im_start|>assistant\n"
    prompt = system + llm.tokenize(turn.encode(), add_bos=False, special=True)
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        fresh()
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    def restored() -> None:
        cache[prompt]  # restores the system prompt's state (saved by the state part)
        llm.eval(prompt[llm.n_tokens :])

    decode = 16
    for _ in range(max(1, args.pairs // 2)):
        timed("prefill", lambda: llm.eval(prompt))
        timed("restore", restored)
        t0 = time.perf_counter()
        for _ in range(decode):  # the token's id does not change what a decode costs
            llm.eval([prompt[-1]])
        times.setdefault("decode", []).append((time.perf_counter() - t0) / decode)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n## one turn alone: {len(prompt)} prompt tokens, medians of {len(times['decode'])}")
    print("| | s |")
    print("|---|---:|")
    print(f"| time to first token, no cache: prefill {len(prompt)} tokens | {med['prefill']:.2f} |")
    print(
        f"| time to first token, maasd: restore {len(system)} + eval "
        f"{len(prompt) - len(system)} | {med['restore']:.2f} |"
    )
    print(f"| ratio | {med['prefill'] / med['restore']:.1f}× |")
    print(f"| one generated token (decode) | {med['decode']:.3f} |")
    print(f"| a {args.max_tokens}-token answer | {med['decode'] * args.max_tokens:.2f} |")


# ----------------------------------------------------------------------------- part: serve


async def converse(
    url: str, system: str, asks: list[str], answers: list[str] | None, max_tokens: int
) -> tuple[list[float], list[str]]:
    """One conversation, turn after turn → (the TTFT of each turn in seconds, the answers).

    The history holds ``answers`` when given (a replay: every server sees the same
    prompts), else what the server answered (and that is returned to be replayed).
    """
    import httpx

    messages = [{"role": "system", "content": system}]
    ttfts, said = [], []
    for t, ask in enumerate(asks):
        messages.append({"role": "user", "content": ask})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        # A connection per turn, as from many front-ends: a kept-alive connection would stay
        # with the process that accepted it for the whole conversation.
        async with httpx.AsyncClient(timeout=900.0) as http:
            t0 = time.perf_counter()
            first, text = None, []
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    if line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        text.append(delta.get("content") or "")
        ttfts.append(first if first is not None else float("nan"))
        said.append("".join(text))
        answer = said[-1] if answers is None else answers[t]
        messages.append({"role": "assistant", "content": answer})
    return ttfts, said


def agree(said: list[list[str]], recorded: list[list[str]]) -> str:
    """How many answers equal the recorded ones, of how many."""
    pairs = [(a, b) for x, y in zip(said, recorded, strict=True) for a, b in zip(x, y, strict=True)]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def run_workload(
    url: str, args: argparse.Namespace, systems: list[str], answers: list[list[str]] | None
) -> tuple[list[float], float, list[list[str]]]:
    """Every conversation at once (conversation k under ``systems[k % len(systems)]``)
    → (TTFTs, total seconds, the answers of each turn)."""
    convs = questions(args.conversations, args.turns)

    async def all_of_them() -> list[tuple[list[float], list[str]]]:
        return await asyncio.gather(
            *(
                converse(
                    url,
                    systems[i % len(systems)],
                    c,
                    None if answers is None else answers[i],
                    args.max_tokens,
                )
                for i, c in enumerate(convs)
            )
        )

    t0 = time.perf_counter()
    done = asyncio.run(all_of_them())
    total = time.perf_counter() - t0
    return [t for ttfts, _ in done for t in ttfts], total, [said for _, said in done]


def token_sources(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    got: dict[str, float] = {}
    for labels, value in metrics.get("maasd_worker_prompt_tokens_total", []):
        got[labels["source"]] = got.get(labels["source"], 0.0) + value
    return got


@contextlib.contextmanager
def server(name: str, args: argparse.Namespace, model: str, tmp: Path, maasd: Any) -> Iterator[Any]:
    from conftest import free_port
    from serving import Served, llama_server_cmd, worker_cmd

    port = free_port()
    settings = ["--n_ctx", str(args.n_ctx), "--chat_format", CHAT_FORMAT]
    env: dict[str, str] = {}
    if name.startswith("maasd worker"):
        procs = int(name.split("×")[1])
        per = args.threads
        _tid, key = maasd.tenant("serve", 8 << 30)
        env["MAASD_KEY"] = key
        cmd = worker_cmd(
            model, port, "--processes", str(procs), "--n_threads", str(per),
            "--n_threads_batch", str(per), "--socket", str(maasd.socket_path),
            "--maasd-url", maasd.url, *settings,
        )  # fmt: skip
    else:
        threads = ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
        cache = (
            ["--cache", "true", "--cache_size", str(args.ram_cache_mib * MiB)]
            if "RAM" in name
            else []
        )
        cmd = llama_server_cmd(model, port, *threads, *settings, *cache)
    s = Served(cmd, port, tmp / f"{name.split()[0]}-{port}.log", env=env).start()
    try:
        yield s
    finally:
        s.stop()


def bench_serve(args: argparse.Namespace, model: str, maasd: Any) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    count = lambda s: len(vocab.tokenize(s.encode()))  # noqa: E731
    systems = [system_prompt(args.system_tokens, count, shop) for shop in range(args.systems)]
    rows = []
    # The first server answers live; its answers are the transcript the others replay.
    names = [
        "llama_cpp.server, no cache",
        "llama_cpp.server, RAM cache",
        "maasd worker ×1",
        f"maasd worker ×{args.processes}",
    ]
    answers: list[list[str]] | None = None
    with tempfile.TemporaryDirectory(prefix="maasd-serve-") as tmp:
        for name in names:
            with server(name, args, model, Path(tmp), maasd) as s:
                ttfts, total, said = run_workload(s.url, args, systems, answers)
                sources = token_sources(s.metrics()) if name.startswith("maasd") else {}
            same = "" if answers is None else f", {agree(said, answers)} answers as recorded"
            answers = answers or said
            rows.append((name, ttfts, total, sources))
            print(
                f"  {name}: mean TTFT {statistics.mean(ttfts):.2f} s, total {total:.1f} s{same}",
                flush=True,
            )
    rows.reverse()
    print(
        f"\n## {args.conversations} conversations × {args.turns} turns, {args.systems} system "
        f"prompt(s) of {count(systems[0])} tokens, {args.max_tokens} tokens per answer, "
        f"{args.threads} thread(s) per process"
    )
    print(
        "| server | mean TTFT (s) | p95 TTFT (s) | total (s) | restored | held | × no-cache mean TTFT |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    plain = statistics.mean(rows[-1][1])
    for name, ttfts, total, src in rows:
        n = sum(src.values()) or 1.0
        restored = f"{src.get('restored', 0) / n:.0%}" if src else "–"
        held = f"{src.get('held', 0) / n:.0%}" if src else "–"
        mean = statistics.mean(ttfts)
        p95 = sorted(ttfts)[max(0, round(0.95 * len(ttfts)) - 1)]
        print(
            f"| {name} | {mean:.2f} | {p95:.2f} | {total:.1f} | {restored} | {held} | {plain / mean:.1f} |"
        )


@contextlib.contextmanager
def own_daemon(args: argparse.Namespace) -> Iterator[Any]:
    from conftest import Daemon  # the test suite's daemon runner

    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        env = {"MAASD_DEFAULT_POOL_BYTES": "6GiB", "MAASD_DEFAULT_WARM_BYTES": args.warm}
        d = Daemon(Path(tmp) / "maasd", env=env).start()
        try:
            yield d
        finally:
            d.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("state", "serve", "both"), default="both")
    p.add_argument("--model", help="GGUF path (default: Gemma 3 270M from its pip package)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp threads of every server process (default 1: on a busy 2-core machine "
        "two threads of one process wait on each other, 2-4x slower than one)",
    )
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument(
        "--systems",
        type=int,
        default=1,
        help="system prompts (shops), conversation k under shop k mod N (default 1: shared)",
    )
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=7, help="repeats of the state part")
    p.add_argument("--warm", default="256MiB", help="the daemon's warm stock per pool")
    p.add_argument(
        "--ram-cache-mib",
        type=int,
        default=128,
        help="LlamaRAMCache's --cache_size: it counts only llama states (~12-16 MiB here), "
        "not the 512 MiB scores matrix each item also holds (default 128: ~8 items, ~4.5 GiB)",
    )
    args = p.parse_args(argv)
    if args.model:
        model = args.model
    else:
        from llama_model import gemma_model

        model = str(gemma_model())
    print(json.dumps({k: v for k, v in vars(args).items()}), flush=True)
    with own_daemon(args) as d:
        if args.part in ("state", "both"):
            _tid, key = d.tenant("state", 2 << 30)
            bench_state(args, model, {"url": d.url, "socket": str(d.socket_path), "key": key})
        if args.part in ("serve", "both"):
            bench_serve(args, model, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
