"""An entry's put + commit against a real daemon: the worker's latencies, and the daemon's CPU.

Not run by CI (nothing asserted). From the project root::

    .venv/bin/python tests/bench/bench_entry_cpu.py [--cycles 200] [--size 9720000] [--gap 0.03]
    .venv/bin/python tests/bench/bench_entry_cpu.py --publish   # the same cycle as one publish

A daemon of its own (warm stock 128 MiB, as ``bench_kv.py``'s) and one ``Worker``:
each cycle puts an entry of ``--size`` bytes (the Gemma state of ``bench_kv.py``'s
600 tokens, with its header), fills it from numpy, commits it and releases it over
REST, ``--gap`` seconds apart (a worker's saves are spaced; the warmer refills the
stock in between). It prints the put's and the commit's p50 as the worker sees them,
and the daemon's CPU per cycle (``/proc/PID/stat``: the put, the commit, the REST
release and the warmer's refill of the two regions the cycle took), which other load
on a shared machine disturbs much less than latency. ``--publish``: each cycle fills a
``Scratch`` (the worker's own memfd, mapped once) and publishes it, one round trip, as
``KVStore.save`` does now; it prints the publish's p50. Run it against an older tree
with ``PYTHONPATH=<export of it>`` from outside the checkout to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# A script, not collected by pytest (whose pythonpath has tests/): conftest.Daemon by path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import Daemon
from maasd.client import Client, Scratch, Worker

WARM_UP = 20


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--size", type=int, default=9_720_000)
    ap.add_argument("--gap", type=float, default=0.03)
    ap.add_argument("--publish", action="store_true", help="one publish per cycle")
    args = ap.parse_args()
    env = {"MAASD_DEFAULT_WARM_BYTES": "128MiB", "MAASD_LOG_LEVEL": "warning"}
    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        d = Daemon(Path(tmp) / "maasd", env=env).start()
        assert d.proc is not None
        try:
            _tid, key = d.tenant("bench", 512 << 20)
            with Client(d.url, key) as c, Worker(d.socket_path, key) as w:
                time.sleep(1.0)  # the first stock
                puts, commits, c0 = [], [], 0.0
                scratch = Scratch(args.size)
                for i in range(WARM_UP + args.cycles):
                    if i == WARM_UP:
                        c0 = cpu_s(d.proc.pid)
                    if args.publish:
                        scratch.array[: args.size] = 7
                        t2 = time.perf_counter()
                        buffer_id = w.publish(f"bench:{i}", scratch, args.size).id
                        t3 = t1 = t0 = time.perf_counter()
                    else:
                        t0 = time.perf_counter()
                        m = w.put(f"bench:{i}", args.size)
                        t1 = time.perf_counter()
                        m.array[:] = 7
                        t2 = time.perf_counter()
                        w.commit(m)
                        t3 = time.perf_counter()
                        buffer_id = m.buffer_id
                    if i >= WARM_UP:
                        puts.append(t1 - t0)
                        commits.append(t3 - t2)
                    c.release(buffer_id)
                    time.sleep(args.gap)
                scratch.close()
                cpu = (cpu_s(d.proc.pid) - c0) / args.cycles
        finally:
            d.close()
    what = "publish" if args.publish else "commit"
    print(
        f"{args.size} B entries, {args.cycles} cycles: put p50 {statistics.median(puts) * 1e3:.2f} ms, "
        f"{what} p50 {statistics.median(commits) * 1e3:.2f} ms; daemon CPU per cycle "
        f"(put, {what}, REST release, refill) {cpu * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
