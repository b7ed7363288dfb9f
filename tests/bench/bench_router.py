"""A multi-user replay against llama-server fleets: ``maasd router`` vs. no sharing.

A shared system prompt and document (~``--system-tokens`` tokens), then ``--users``
chats of ``--turns`` turns each; every turn is sent when the user's previous one was
answered, all users at once, streamed. Each configuration gets fresh processes of the
same ``llama-server`` build (``scripts/llama-server``), model and threads:

1. ``router`` — ``maasd router`` + 2 backends (``--router-slots`` slots each, one
   unified KV cache per backend), sharing through maasd (a daemon of its own);
2. ``rr``     — 2 llama-server processes, round-robin by the client, each with its own
   ``--cache-ram`` (what a fleet without sharing does);
3. ``hearth`` — hearth-llm 0.1.1 (the peer: snapshots of slot 0 as files) in front of one
   llama-server ``-np 1``; it runs from a venv of its own (``--hearth``, by default
   ``~/.cache/maasd/hearth/bin/hearth``: ``python3 -m venv ~/.cache/maasd/hearth &&
   ~/.cache/maasd/hearth/bin/pip install hearth-llm==0.1.1``), never maasd's;
4. ``np2``    — one llama-server with ``-np 2 --cache-ram``.

Every server runs the same build (``scripts/llama-server``), model, threads and
``-fa off --swa-full``. ``--warm`` first sends one earlier user's turn to every front
(each server of the round-robin): each has seen the shared system prompt once. Reported,
never asserted: TTFT mean, p50 and p95 (client side, to the first streamed event), the
mean by turn, generated tokens per second over the run and the prompt tokens the servers
evaluated (their own ``timings``: what the machine's load does not change), with the
ratio of each row's mean TTFT to the router's, measured in the same run; for the router,
where its time went (its own /metrics), for hearth-llm its ``/hearth/stats``.

::

    python tests/bench/bench_router.py                     # Gemma 3 270M, 4 users × 3 turns
    python tests/bench/bench_router.py --rows router --router-slots 1   # one row alone
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
) -> tuple[float, str, int, int]:
    """→ TTFT, the answer, its tokens, and the prompt tokens the server evaluated (its
    last event's ``timings``)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text, n, evaluated = 0.0, "", 0, 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            event = json.loads(line[6:])
            evaluated = int(event.get("timings", {}).get("prompt_n", evaluated))
            if not event.get("choices"):
                continue
            delta = event["choices"][0].get("delta", {}).get("content") or ""
            text += delta
            n += 1 if delta else 0
    return ttft, text, n, evaluated


async def warm_up(http: httpx.AsyncClient, urls: list[str], system: str, max_tokens: int) -> None:
    """An earlier user, one turn on every front (every server of a round-robin): each has
    seen the shared system prompt once, as in a fleet that has served for a while."""
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello, when are you open?"},
    ]
    for url in urls:
        await one_turn(http, url, msgs, max_tokens)
        for _ in range(600):  # a router publishes after the answer: until it is idle
            r = await http.get(url + "/healthz")
            if r.status_code != 200 or not any(b["busy"] for b in r.json().get("backends", [])):
                break
            await asyncio.sleep(0.1)


async def replay(urls: list[str], a: argparse.Namespace, system: str) -> dict[str, Any]:
    ttfts: list[float] = []
    by_turn: dict[int, list[float]] = {}
    tokens = evaluated = 0
    rr = iter(range(10**9))

    async def user(u: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, evaluated
        msgs = [{"role": "system", "content": system}]
        for turn, q in enumerate(asks(u, a.turns)):
            msgs.append({"role": "user", "content": q})
            url = urls[next(rr) % len(urls)]
            ttft, text, n, ev = await one_turn(http, url, msgs, a.max_tokens)
            ttfts.append(ttft)
            evaluated += ev
            by_turn.setdefault(turn, []).append(ttft)
            tokens += n
            msgs.append({"role": "assistant", "content": text})

    # a connection per request: a kept-alive one may be closed by the server as it is reused
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        if a.warm:
            await warm_up(http, urls, system, a.max_tokens)
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, http) for u in range(a.users)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {
        "mean": statistics.mean(ttfts),
        "p50": statistics.median(ttfts),
        "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "tok_s": tokens / wall,
        "evaluated": evaluated,
        "turn_means": [round(statistics.mean(by_turn[t]), 3) for t in sorted(by_turn)],
    }


ROUTER_METRICS = (
    "maasd_router_ttft_seconds",
    "maasd_router_restore_seconds",
    "maasd_router_save_seconds",
    "maasd_router_tokenize_seconds",
    "maasd_router_slot_wait_seconds",
    "maasd_router_lead_wait_seconds",
    "maasd_router_prompt_tokens",
    "maasd_router_entries",
    "maasd_router_requests",
    "maasd_router_errors",
)


def router_breakdown(url: str) -> dict[str, float]:
    """Where the router's time went: its own /metrics, summed over backends."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name not in ROUTER_METRICS:
            continue
        for smp in fam.samples:
            if smp.name.endswith(("_bucket", "_created")):
                continue
            label = ",".join(
                f"{k}={v}" for k, v in sorted(smp.labels.items()) if k not in ("backend", "url")
            )
            name = smp.name + (f"{{{label}}}" if label else "")
            out[name] = out.get(name, 0.0) + smp.value
    return out


def run_router(a: argparse.Namespace, binary: str, model: str, tmp: Path, system: str) -> Any:
    from conftest import Daemon, free_port

    d = Daemon(tmp / "maasd").start()
    try:
        _tid, key = d.tenant(f"bench-{uuid.uuid4().hex[:6]}", 2 << 30)
        port = free_port()
        env = {**os.environ, "MAASD_KEY": key}
        argv = [
            sys.executable, "-m", "maasd.cli.daemon", "router", "--port", str(port),
            "--backends", "2", "--slots", str(a.router_slots),
            "--llama-server", binary, "--model", model,
            "--socket", d.socket_path, "--maasd-url", d.url, "--log-dir", str(tmp),
            *a.router_arg,
            "--", "-c", str(a.ctx * a.router_slots), "-t", str(a.threads),
        ]  # fmt: skip
        with open(tmp / "router.log", "ab") as f:
            p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url, "/healthz")
            row = asyncio.run(replay([url], a, system))
            row["breakdown"] = router_breakdown(url)
            return row
        finally:
            p.terminate()
            p.wait(60)
    finally:
        d.stop()


def plain_args(a: argparse.Namespace, np_: int) -> list[str]:
    return ["-c", str(a.ctx * np_), "-t", str(a.threads), "-np", str(np_),
            "-fa", "off", "--swa-full"]  # fmt: skip


def run_plain(
    a: argparse.Namespace, binary: str, model: str, tmp: Path, system: str, *, n: int, np_: int
) -> Any:
    from conftest import free_port

    procs, urls = [], []
    for i in range(n):
        port = free_port()
        args = [*plain_args(a, np_), "--cache-ram", str(a.cache_ram)]
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


def run_hearth(a: argparse.Namespace, binary: str, model: str, tmp: Path, system: str) -> Any:
    """hearth-llm in front of one llama-server, attached (``--upstream``): the server runs
    ``-np 1`` with ``--slot-save-path`` = hearth's ``--cache-dir``, as hearth requires."""
    from conftest import free_port

    cache = tmp / "hearth-cache"
    cache.mkdir()
    sport, hport = free_port(), free_port()
    args = [*plain_args(a, 1), "--slot-save-path", f"{cache}/"]
    server = start_server(binary, model, sport, args, tmp / "hearth-server.log")
    hearth: subprocess.Popen[bytes] | None = None
    try:
        wait_http(f"http://127.0.0.1:{sport}")
        argv = [a.hearth, "serve", "--upstream", f"http://127.0.0.1:{sport}",
                "--port", str(hport), "--cache-dir", str(cache)]  # fmt: skip
        with open(tmp / "hearth.log", "ab") as f:
            hearth = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{hport}"
        wait_http(url, "/hearth/stats", timeout=60)
        row = asyncio.run(replay([url], a, system))
        row["breakdown"] = httpx.get(url + "/hearth/stats").json()
        return row
    finally:
        for p in (hearth, server):
            if p is not None:
                p.terminate()
                p.wait(60)


ROWS = {
    "router": "maasd router + 2 backends",
    "rr": "2 servers round-robin, own cache-ram",
    "hearth": "hearth-llm + 1 server",
    "np2": "1 server -np 2 --cache-ram",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--cache-ram", type=int, default=512, help="MiB, for the rows without maasd")
    ap.add_argument("--router-slots", type=int, default=4, help="slots per router backend")
    ap.add_argument(
        "--warm", action="store_true", help="one earlier user's turn on every front first"
    )
    ap.add_argument(
        "--router-arg", action="append", default=[], help="one more router option (repeatable)"
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {','.join(ROWS)}")
    ap.add_argument("--keep", default=None, help="keep every process's log under this dir")
    ap.add_argument(
        "--hearth", default=str(Path.home() / ".cache/maasd/hearth/bin/hearth"),
        help="the hearth-llm 0.1.1 executable (a venv of its own)",
    )  # fmt: skip
    a = ap.parse_args()
    from llama_model import gemma_model
    from router_fleet import llama_server_binary

    binary, model = llama_server_binary(), str(gemma_model())
    system = system_text(a.system_words)
    wanted = [r for r in a.rows.split(",") if r]
    if "hearth" in wanted and not os.access(a.hearth, os.X_OK):
        print(f"no hearth-llm at {a.hearth} (see --help): its row is left out", file=sys.stderr)
        wanted.remove("hearth")
    runs = {
        "router": lambda tmp: run_router(a, binary, model, tmp, system),
        "rr": lambda tmp: run_plain(a, binary, model, tmp, system, n=2, np_=1),
        "hearth": lambda tmp: run_hearth(a, binary, model, tmp, system),
        "np2": lambda tmp: run_plain(a, binary, model, tmp, system, n=1, np_=2),
    }
    rows: dict[str, Any] = {}
    for name in wanted:
        if a.keep:  # the logs of every process of the row, kept
            rows[name] = runs[name](Path(tempfile.mkdtemp(prefix=f"{name}-", dir=a.keep)))
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-router-{name}-") as t:
            rows[name] = runs[name](Path(t))
        print(name, rows[name], file=sys.stderr, flush=True)
    base = rows["router"]["mean"] if "router" in rows else None
    print(
        f"{a.users} users x {a.turns} turns, ~{a.system_words}-word shared system prompt, "
        f"max_tokens {a.max_tokens}, {a.threads} thread(s) per server, "
        f"{'warm (one earlier turn per front), ' if a.warm else 'cold, '}"
        f"router: {a.router_slots} slot(s) per backend {' '.join(a.router_arg)}"
    )
    print("| configuration | mean | p50 | p95 | tok/s | mean / router | prompt tokens evaluated |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = f"{r['mean'] / base:.2f}" if base else "-"
        print(
            f"| {ROWS[name]} | {r['mean']:.3f} | {r['p50']:.3f} | {r['p95']:.3f} "
            f"| {r['tok_s']:.1f} | {ratio} | {r['evaluated']} |"
        )
    print("\nmean TTFT by turn:", {ROWS[n]: r["turn_means"] for n, r in rows.items()})
    for name, r in rows.items():
        if "breakdown" in r:
            print(f"\n{ROWS[name]}:")
            for k, v in sorted(r["breakdown"].items()):
                print(f"  {k} {v:g}" if isinstance(v, float | int) else f"  {k} {v}")


if __name__ == "__main__":
    main()
