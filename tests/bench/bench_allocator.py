"""Allocator benchmark: scrub bandwidth and region creation, as ratios to a baseline.

Run: ``python tests/bench/bench_allocator.py [--reps 5] [--sizes 64MiB,1GiB]``

Not run by CI, and it asserts nothing: absolute times on shared machines drift,
so every number is printed next to a baseline measured in the same run.

- **scrub** ``zero`` (memset through the daemon's mapping, then punch) and
  ``punch`` (``fallocate(PUNCH_HOLE)`` only) of a fully populated region, against
  numpy ``arr.fill(0)`` over an already faulted-in anonymous mapping of the same
  size (plain memset bandwidth). The region is refilled, untimed, before each rep.
- **create** ``Region.create(prefault=True)`` (memfd, seal, mmap, mbind,
  ``MADV_POPULATE_WRITE``) then close, against anonymous ``mmap`` plus a write to
  every page, per GiB.

Medians of ``--reps`` repetitions. (OPENBLAS_* variables do not matter here:
memset is single-threaded libc/numpy, no BLAS.)
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from maasd.allocator import _sys
from maasd.allocator.region import Region

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB, GiB = 1 << 20, 1 << 30


def parse_size(text: str) -> int:
    text = text.strip()
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def human(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB and n % GiB == 0 else f"{n // MiB} MiB"


def median_time(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_memset(size: int, reps: int) -> float:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, dtype=np.uint8)
    try:
        arr.fill(1)  # fault every page in first
        return median_time(lambda: arr.fill(0), reps, setup=lambda: arr.fill(0xA5))
    finally:
        arr = np.empty(0, dtype=np.uint8)  # drop the buffer export (the lambdas' too), then unmap
        m.close()


def bench_region_memset(size: int, reps: int) -> float:
    """The write half of scrub ``zero`` alone: memset through the region's mapping."""
    r = Region.create(size, node=0, prefault=True)
    try:
        return median_time(
            lambda: _sys.memset(r.address, 0, r.size),
            reps,
            setup=lambda: _sys.memset(r.address, 0xA5, r.size),
        )
    finally:
        r.close()


def bench_scrub(size: int, mode: str, reps: int) -> float:
    r = Region.create(size, node=0, prefault=True)
    try:
        return median_time(
            lambda: r.scrub(mode), reps, setup=lambda: _sys.memset(r.address, 0xA5, r.size)
        )
    finally:
        r.close()


def bench_create(size: int, reps: int) -> float:
    def once() -> None:
        Region.create(size, node=0, prefault=True).close()

    return median_time(once, reps)


def bench_anon_touch(size: int, reps: int) -> float:
    def once() -> None:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(m, dtype=np.uint8)
        arr[::PAGE] = 1  # one write per page faults it in
        del arr
        m.close()

    return median_time(once, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="64MiB,1GiB")
    ap.add_argument("--create-size", default="1GiB", help="size for the create benchmark")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(
        f"# maasd allocator bench: python {sys.version.split()[0]}, numpy {np.__version__}, "
        f"{os.cpu_count()} cpus, page {PAGE} B, reps {args.reps} (median)"
    )
    if thp.exists():
        print(f"# transparent hugepages: {thp.read_text().strip()}")
    print()
    print(f"{'what':<28}{'size':>8}{'time ms':>11}{'GB/s':>9}{'baseline GB/s':>15}{'ratio':>8}")
    for size in sizes:
        reps = args.reps if size < GiB else max(3, args.reps // 2)
        base = bench_memset(size, reps)
        print(
            f"{'numpy fill(0) (baseline)':<28}{human(size):>8}{base * 1e3:>11.1f}"
            f"{size / base / 1e9:>9.1f}{'':>15}{'1.00':>8}"
        )
        t = bench_region_memset(size, reps)
        print(
            f"{'  zero: memset part only':<28}{human(size):>8}{t * 1e3:>11.1f}"
            f"{size / t / 1e9:>9.1f}{size / base / 1e9:>15.1f}{t / base:>7.2f}x"
        )
        for mode in ("zero", "punch"):
            t = bench_scrub(size, mode, reps)
            print(
                f"{'scrub ' + mode:<28}{human(size):>8}{t * 1e3:>11.1f}{size / t / 1e9:>9.1f}"
                f"{size / base / 1e9:>15.1f}{t / base:>7.2f}x"
            )
    size = parse_size(args.create_size)
    reps = max(3, args.reps // 2)
    base = bench_anon_touch(size, reps)
    t = bench_create(size, reps)
    per_gib = GiB / size
    print()
    print(f"{'what':<36}{'s per GiB':>10}{'GB/s':>8}{'ratio':>8}")
    print(
        f"{'anon mmap + touch (baseline)':<36}{base * per_gib:>10.3f}{size / base / 1e9:>8.2f}"
        f"{'1.00':>8}"
    )
    print(
        f"{'Region.create(prefault) + close':<36}{t * per_gib:>10.3f}{size / t / 1e9:>8.2f}"
        f"{t / base:>7.2f}x"
    )
    print("\nratio = time / baseline time (lower is better; scrub ratio 1.0 = memset speed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
