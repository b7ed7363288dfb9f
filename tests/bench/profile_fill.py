"""Where one committed entry's fill goes: the daemon's CPU, the client's, and the machine.

    .venv/bin/python tests/bench/profile_fill.py [--entries 300] [--workers 1,4]
    scripts/numa-guest -- .venv/bin/python tests/bench/profile_fill.py --entries 100

``bench_scale.py`` fills its daemon with committed 4 KiB entries (``Worker.entry``:
a socket ``put``, 8 bytes written, a ``commit``). This starts the same daemon (its
``start_daemon``: SQLite ledger, a persistent pool) and, for ``--entries`` entries,
times each ``put`` and each ``commit`` apart, and the whole fill with each
``--workers`` count, and reads the daemon's CPU time (``/proc/<pid>/stat``) and the
client's (``time.process_time``) over it: CPU per entry against the wall time per
entry says whether the fill is CPU-bound and on which side. For scale it also times
the machine itself, each on its own: a pure-Python loop (the interpreter's speed), a
socket round trip through the daemon that touches no ledger (a ``lookup`` that
misses), ``memfd_create`` + ``ftruncate`` + ``mmap`` + a write + ``munmap`` +
``close`` of 4 KiB (what an entry asks of the kernel, at least twice: its staging
region and its sealed copy), and an ``fsync`` of a file in the data dir (the
ledger's durable write). Run it on the host and in the QEMU guest
(``scripts/numa-guest``): the ratios of the two say what the guest's emulation costs
each part. Nothing is asserted; CI never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_scale import SIZE, TTL_S, fill_keys, start_daemon
from timing import median_ms

from maasd.client import Worker
from maasd.protocol import Lookup
from sockpeer import Raw


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def python_loop() -> None:
    total = 0
    for i in range(100_000):
        total += i & 7


def region_cycle() -> None:
    fd = os.memfd_create("profile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SIZE)
        with mmap.mmap(fd, SIZE) as m:
            m[:8] = b"\1" * 8
    finally:
        os.close(fd)


def machine(raw: Raw, data: Path) -> None:
    """The machine's own costs, each a median of its own repeats."""
    probe = data / "fsync-probe"
    with open(probe, "wb") as f:

        def sync() -> None:
            f.write(b"x" * 512)
            f.flush()
            os.fsync(f.fileno())

        fsync = median_ms(sync, 50)
    probe.unlink()
    print(
        f"machine: 100k-step Python loop {median_ms(python_loop, 20):.2f} ms; "
        f"lookup miss round trip {median_ms(lambda: raw.call(Lookup(keys=['none'])), 200):.3f} ms; "
        f"4 KiB memfd + mmap cycle {median_ms(region_cycle, 200):.3f} ms; "
        f"fsync in the data dir {fsync:.3f} ms",
        flush=True,
    )


def split(w: Worker, prefix: str, n: int) -> tuple[list[float], list[float]]:
    """Times of ``n`` puts and of their commits, apart."""
    put, commit = [], []
    for i in range(n):
        t0 = time.perf_counter()
        m = w.put(f"{prefix}{i}", SIZE, pool="scale")
        t1 = time.perf_counter()
        m.array[:8] = 1
        t2 = time.perf_counter()
        w.commit(m)
        t3 = time.perf_counter()
        put.append(t1 - t0)
        commit.append(t3 - t2)
    return put, commit


def fill(socket_path: str, key: str, prefix: str, n: int, workers: int) -> float:
    """``n`` entries by ``workers`` connections at once (bench_scale's fill); seconds."""
    return fill_keys(socket_path, key, [f"{prefix}{i}" for i in range(n)], workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=300, help="entries per measurement")
    ap.add_argument("--workers", default="1,4", help="fill connections, each count in turn")
    args = ap.parse_args()
    n, counts = args.entries, [int(s) for s in args.workers.split(",")]
    top = n * (1 + len(counts)) + 64
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="maasd-fill-")))
        run = start_daemon(tmp / "d", top, [], stack)
        assert run.d.proc is not None
        pid = run.d.proc.pid
        raw = Raw(run.d.socket_path, timeout=600)
        stack.callback(raw.close)
        raw.hello(run.key)
        print(f"{os.cpu_count()} CPUs; {SIZE} B entries; {n} per measurement", flush=True)
        machine(raw, tmp / "d")
        with Worker(run.d.socket_path, run.key, renew_interval_s=0, ttl_s=TTL_S) as w:
            split(w, "warm", 20)
            d0, c0 = cpu_s(pid), time.process_time()
            put, commit = split(w, "s", n)
            d1, c1 = cpu_s(pid), time.process_time()
        print(
            f"one connection: put p50 {statistics.median(put) * 1e3:.2f} ms, commit p50 "
            f"{statistics.median(commit) * 1e3:.2f} ms; per entry: daemon CPU "
            f"{(d1 - d0) / n * 1e3:.2f} ms, client CPU {(c1 - c0) / n * 1e3:.2f} ms",
            flush=True,
        )
        for workers in counts:
            d0, c0 = cpu_s(pid), time.process_time()
            took = fill(run.d.socket_path, run.key, f"f{workers}-", n, workers)
            d1, c1 = cpu_s(pid), time.process_time()
            print(
                f"fill by {workers} connections: {took / n * 1e3:.2f} ms an entry (wall); "
                f"per entry: daemon CPU {(d1 - d0) / n * 1e3:.2f} ms, client CPU "
                f"{(c1 - c0) / n * 1e3:.2f} ms",
                flush=True,
            )
        # a checkpoint per persistent entry: longer than close() waits under emulation
        run.d.stop(timeout=3600)


if __name__ == "__main__":
    main()
