"""A multi-user replay against llama-server fleets: ``maasd router`` vs. no sharing.

A shared system prompt and document (~``--system-tokens`` tokens), then ``--users``
chats of ``--turns`` turns each; every turn is sent when the user's previous one was
answered, all users at once, streamed. Each configuration gets fresh processes of the
same ``llama-server`` build (``scripts/llama-server``), model and threads:

1. ``router``  — ``maasd router`` + 2 backends (1 slot each), sharing through maasd
   (a daemon of its own);
2. ``rr``      — 2 llama-server processes, round-robin by the client, each with its own
   ``--cache-ram`` (what a fleet without sharing does);
3. ``np2``     — one llama-server with ``-np 2 --cache-ram``;

(hearth-llm, the issue's third row, is not installed here and is left out). Reported,
never asserted: TTFT mean, p50 and p95 (client side, to the first streamed event), and
generated tokens per second over the run, with the ratio of each row's mean TTFT to the
router's, measured in the same run.

::

    python tests/bench/bench_router.py                     # Gemma 3 270M, 4 users × 3 turns
    python tests/bench/bench_router.py --users 6 --turns 4 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

DOC = (
    "The Nordwind Outfitters handbook. Orders shipped abroad take between five and twelve "
    "working days. A damaged parcel is replaced at no cost once the customer sends a "
    "photograph. Gift cards cannot be exchanged for cash and expire three years after "
    "purchase. Customers may change the delivery address until the parcel leaves the "
    "warehouse. Subscriptions renew every month unless cancelled before the renewal day. "
)


def system_text(n_words: int) -> str:
    text = "You are the support assistant of Nordwind Outfitters.\n"
    while len(text.split()) < n_words:
        text += DOC
    return text


def asks(user: int, turns: int) -> list[str]:
    items = ["boots", "a tent", "a jacket", "gloves", "a backpack", "a stove"]
    base = [
        "Hello, I ordered {x} last week and it has not arrived. Where is it?",
        "Could {x} be sent to my sister's address instead?",
        "The parcel came but {x} is damaged. What should I do?",
        "Can I get a refund for {x} instead?",
    ]
    return [base[t % len(base)].format(x=items[user % len(items)]) for t in range(turns)]


def start_server(binary: str, model: str, port: int, args: list[str], log: Path) -> Any:
    argv = [binary, "-m", model, "--port", str(port), *args]
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)


def wait_http(url: str, path: str = "/health", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not come up")


async def one_turn(
    http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str, int]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text, n = 0.0, "", 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
            text += delta
            n += 1 if delta else 0
    return ttft, text, n


async def replay(urls: list[str], a: argparse.Namespace, system: str) -> dict[str, float]:
    ttfts: list[float] = []
    tokens = 0
    rr = iter(range(10**9))

    async def user(u: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        msgs = [{"role": "system", "content": system}]
        for q in asks(u, a.turns):
            msgs.append({"role": "user", "content": q})
            url = urls[next(rr) % len(urls)]
            ttft, text, n = await one_turn(http, url, msgs, a.max_tokens)
            ttfts.append(ttft)
            tokens += n
            msgs.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    # a connection per request: a kept-alive one may be closed by the server as it is reused
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(user(u, http) for u in range(a.users)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {
        "mean": statistics.mean(ttfts),
        "p50": statistics.median(ttfts),
        "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "tok_s": tokens / wall,
    }


def run_router(a: argparse.Namespace, binary: str, model: str, tmp: Path, system: str) -> Any:
    from conftest import Daemon, free_port

    d = Daemon(tmp / "maasd").start()
    try:
        _tid, key = d.tenant(f"bench-{uuid.uuid4().hex[:6]}", 2 << 30)
        port = free_port()
        env = {**os.environ, "MAASD_KEY": key}
        argv = [
            sys.executable, "-m", "maasd.cli.daemon", "router", "--port", str(port),
            "--backends", "2", "--llama-server", binary, "--model", model,
            "--socket", d.socket_path, "--maasd-url", d.url, "--log-dir", str(tmp),
            "--", "-c", str(a.ctx), "-t", str(a.threads),
        ]  # fmt: skip
        with open(tmp / "router.log", "ab") as f:
            p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, "/healthz")
            return asyncio.run(replay([url], a, system))
        finally:
            p.terminate()
            p.wait(60)
    finally:
        d.stop()


def run_plain(
    a: argparse.Namespace, binary: str, model: str, tmp: Path, system: str, *, n: int, np_: int
) -> Any:
    from conftest import free_port

    procs, urls = [], []
    for i in range(n):
        port = free_port()
        args = ["-c", str(a.ctx * np_), "-t", str(a.threads), "-np", str(np_),
                "--cache-ram", str(a.cache_ram), "-fa", "off", "--swa-full"]  # fmt: skip
        procs.append(start_server(binary, model, port, args, tmp / f"plain-{n}-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u in urls:
            wait_http(u)
        return asyncio.run(replay(urls, a, system))
    except httpx.HTTPError:
        for i in range(n):  # a server that died says why in its log
            print((tmp / f"plain-{n}-{i}.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--cache-ram", type=int, default=512, help="MiB, for the rows without maasd")
    a = ap.parse_args()
    from llama_model import gemma_model
    from router_fleet import llama_server_binary

    binary, model = llama_server_binary(), str(gemma_model())
    system = system_text(a.system_words)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as t:
        tmp = Path(t)
        rows["router + 2 backends (maasd)"] = run_router(a, binary, model, tmp, system)
        print(rows, file=sys.stderr, flush=True)
        rows["2 servers round-robin, own cache-ram"] = run_plain(
            a, binary, model, tmp, system, n=2, np_=1
        )
        rows["1 server -np 2 --cache-ram"] = run_plain(a, binary, model, tmp, system, n=1, np_=2)
    base = rows["router + 2 backends (maasd)"]["mean"]
    print(
        f"{a.users} users x {a.turns} turns, ~{a.system_words}-word shared system prompt, "
        f"max_tokens {a.max_tokens}, {a.threads} thread(s) per server"
    )
    print(
        f"{'configuration':40} {'mean':>8} {'p50':>8} {'p95':>8} {'tok/s':>7} {'mean/router':>11}"
    )
    for name, r in rows.items():
        print(
            f"{name:40} {r['mean']:8.3f} {r['p50']:8.3f} {r['p95']:8.3f} {r['tok_s']:7.1f} "
            f"{r['mean'] / base:11.2f}"
        )


if __name__ == "__main__":
    main()
