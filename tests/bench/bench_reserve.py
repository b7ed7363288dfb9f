"""Reserve + release latency and throughput against a real daemon, beside the framework's floor.

Not run by CI (no assertion on timings). Run it from the project root::

    .venv/bin/python tests/bench/bench_reserve.py [--seconds 3] [--clients 1,16,64] [--size 1048576]
                                                 [--prefault on|off]

It starts a ``maasd serve`` of its own (temp data dir, SQLite, one pool
``node0`` with ``prefault`` as asked) and, as the floor, a bare litestar app
served by uvicorn in a subprocess the same way (a POST that decodes a small
msgspec body, then a DELETE of the id it answered). Each client is a thread with
its own ``httpx.Client`` doing reserve → release in a loop; the floor's clients
POST + DELETE in a loop. Both are measured in the same run on the same machine,
and the table prints the ratios (absolute times on shared machines drift): the
reserve's p50/p99 against the floor's POST, and the whole pair's p50 (``pair x``:
reserve + release against POST + DELETE). It also prints the CPU each server
process used per request (from ``/proc/PID/stat``; for maasd per reserve +
release pair), which other load on the machine disturbs much less than latency.

Goal (issue 21, not asserted): the pair's p50 within 2x the floor's at 1, 16 and 64
clients.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

# A script, not collected by pytest (whose pythonpath has tests/): conftest.Daemon by path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import Daemon, free_port

MiB = 1 << 20

#: The floor: a bare litestar POST that decodes a small msgspec body, and a DELETE of the
#: id it answered (``app``; ``profile_rest.py`` runs it in process too).
FLOOR_APP = textwrap.dedent("""
    import msgspec
    from litestar import Litestar, delete, post

    class Body(msgspec.Struct, forbid_unknown_fields=True):
        size_bytes: int

    class Reply(msgspec.Struct):
        id: str
        size_bytes: int

    @post("/floor", status_code=201)
    async def floor(data: Body) -> Reply:
        return Reply(id="0" * 32, size_bytes=data.size_bytes)

    @delete("/floor/{item_id:str}", status_code=204)
    async def floor_delete(item_id: str) -> None:
        return None

    app = Litestar([floor, floor_delete], logging_config=None, debug=False)
""")
#: ... served by uvicorn as a script of its own (its port: the first argument).
FLOOR_SERVER = FLOOR_APP + textwrap.dedent("""
    import sys, uvicorn
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_config=None,
                access_log=False, lifespan="off", server_header=False)
""")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Step = Callable[[httpx.Client, dict[str, list[float]]], None]


def drive(
    url: str, headers: dict[str, str], clients: int, seconds: float, step: Step
) -> dict[str, list[float]]:
    """Run ``step(client, samples)`` in ``clients`` threads for ``seconds``; gather samples.

    Each thread first runs one step whose samples are dropped (connection set-up)."""
    samples: dict[str, list[float]] = {}
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    stop = threading.Event()
    errors: list[str] = []

    def run() -> None:
        mine: dict[str, list[float]] = {}
        with httpx.Client(base_url=url, headers=headers, timeout=60.0) as c:
            step(c, {})  # warm-up: its samples are thrown away
            start.wait()
            while not stop.is_set():
                try:
                    step(c, mine)
                except Exception as e:  # keep going; report at the end
                    errors.append(repr(e))
        with lock:
            for k, v in mine.items():
                samples.setdefault(k, []).extend(v)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    samples["_elapsed"] = [time.perf_counter() - began]
    if errors:
        print(f"  {len(errors)} errors, e.g. {errors[0]}", file=sys.stderr)
    return samples


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


HEAD = (
    f"{'clients':>7} | {'floor p50':>9} {'p99':>8} {'req/s':>7} {'cpu/req':>7} | "
    f"{'reserve p50':>11} {'p99':>8} | {'release p50':>11} {'p99':>8} {'pairs/s':>7} "
    f"{'cpu/pair':>8} | {'p50 x':>6} {'p99 x':>6} {'cpu x':>6} | {'pair p50':>8} {'floor':>7} "
    f"{'pair x':>6}"
)


def row(
    n: int, f: dict[str, list[float]], m: dict[str, list[float]], f_cpu: float, m_cpu: float
) -> str:
    """One line of the table: the floor's and maasd's samples at ``n`` clients, and their CPU."""
    fl, rs, rl = f["floor"], m.get("reserve", []), m.get("release", [])
    f50, f99 = percentile(fl, 0.5), percentile(fl, 0.99)
    r50, r99 = percentile(rs, 0.5), percentile(rs, 0.99)
    p50, fp50 = percentile(m.get("pair", []), 0.5), percentile(f["floor_pair"], 0.5)
    return (
        f"{n:>7} | {f50 * 1e3:>7.2f}ms {f99 * 1e3:>6.2f}ms "
        f"{len(fl) / f['_elapsed'][0]:>7.0f} {f_cpu * 1e3:>5.2f}ms | "
        f"{r50 * 1e3:>9.2f}ms {r99 * 1e3:>6.2f}ms | "
        f"{percentile(rl, 0.5) * 1e3:>9.2f}ms {percentile(rl, 0.99) * 1e3:>6.2f}ms "
        f"{len(rs) / m['_elapsed'][0]:>7.0f} {m_cpu * 1e3:>6.2f}ms | "
        f"{r50 / f50:>6.1f} {r99 / f99:>6.1f} {m_cpu / f_cpu:>6.1f} | "
        f"{p50 * 1e3:>6.2f}ms {fp50 * 1e3:>5.2f}ms {p50 / fp50:>6.1f}"
    )


def steps(body: dict[str, int]) -> tuple[Step, Step]:
    """The floor's step (POST + DELETE) and maasd's (reserve + release), timed."""

    def floor_step(c: httpx.Client, out: dict[str, list[float]]) -> None:
        t = time.perf_counter()
        r = c.post("/floor", json=body)
        t1 = time.perf_counter()
        assert r.status_code == 201, r.text
        r = c.delete(f"/floor/{r.json()['id']}")
        t2 = time.perf_counter()
        assert r.status_code == 204, r.text
        out.setdefault("floor", []).append(t1 - t)
        out.setdefault("floor_pair", []).append(t2 - t)

    def maasd_step(c: httpx.Client, out: dict[str, list[float]]) -> None:
        t = time.perf_counter()
        r = c.post("/v1/pools/node0/reserve", json=body)
        t1 = time.perf_counter()
        assert r.status_code == 201, r.text
        c.delete(f"/v1/buffers/{r.json()['id']}")
        t2 = time.perf_counter()
        out.setdefault("reserve", []).append(t1 - t)
        out.setdefault("release", []).append(t2 - t1)
        out.setdefault("pair", []).append(t2 - t)

    return floor_step, maasd_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--size", type=int, default=MiB)
    ap.add_argument("--prefault", choices=("on", "off"), default="on")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="maasd-bench-"))
    config = tmp / "maasd.toml"
    config.write_text(
        f'[[pools]]\nname = "node0"\nnuma_node = 0\n'
        f"capacity_bytes = {max(levels) * 4 * args.size}\n"
        f"prefault = {'true' if args.prefault == 'on' else 'false'}\n"
    )
    d = Daemon(tmp / "maasd", env={"MAASD_LOG_LEVEL": "warning"}, config=config)
    port = free_port()
    floor_script = tmp / "floor.py"
    floor_script.write_text(FLOOR_SERVER)
    floor = subprocess.Popen(
        [sys.executable, str(floor_script), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        d.start()
        _, key = d.tenant("bench", 1 << 40)
        floor_url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.post(f"{floor_url}/floor", json={"size_bytes": 1}, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        floor_step, maasd_step = steps({"size_bytes": args.size})

        print(
            f"maasd bench: {args.size} B buffers, prefault {args.prefault}, "
            f"{args.seconds:.0f} s per level, {os.cpu_count()} CPUs, SQLite ledger"
        )
        print(HEAD)
        print("-" * len(HEAD))
        assert d.proc is not None
        for n in levels:
            c0 = cpu_s(floor.pid)
            f = drive(floor_url, {}, n, args.seconds, floor_step)
            c1 = cpu_s(d.proc.pid)
            m = drive(d.url, {"Authorization": f"Bearer {key}"}, n, args.seconds, maasd_step)
            c2 = cpu_s(d.proc.pid)
            # (the warm-up requests of each client are in the CPU too: a few per client)
            f_cpu = (cpu_s(floor.pid) - c0) / max(1, 2 * (len(f["floor"]) + n))
            m_cpu = (c2 - c1) / max(1, len(m.get("reserve", [])) + n)
            print(row(n, f, m, f_cpu, m_cpu))
        mean = d.metric("maasd_reserve_seconds_sum") / max(
            1.0, d.metric("maasd_reserve_seconds_count")
        )
        print(
            f"(daemon-side reserve time, mean over all levels: {mean * 1e3:.2f} ms; data dir {tmp})"
        )
    finally:
        floor.send_signal(signal.SIGTERM)
        floor.wait(10)
        d.close()


if __name__ == "__main__":
    main()
