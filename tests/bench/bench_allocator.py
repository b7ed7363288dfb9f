"""Allocator benchmark: prefault, cold and warm reserves, scrub — 4 KiB pages and hugetlb.

Run: ``python tests/bench/bench_allocator.py [--reps 5] [--sizes 64MiB,1GiB] [--no-hugetlb]``
(as root, the hugetlb rows configure the huge pages they need and give them back after;
otherwise they use what ``/proc/sys/vm/nr_hugepages`` holds, or are left out).

Not run by CI, and it asserts nothing: absolute times on shared machines drift,
so every number is printed next to a floor measured in the same run — numpy
``fill(0)`` over an already faulted-in anonymous mapping of the same size (plain
memset bandwidth).

For each backing (``memfd`` with 4 KiB pages, ``hugetlb`` with 2 MiB pages) and size:

- **prefault**: ``Region.create(prefault=True)`` (memfd, map, seal, mbind,
  ``MADV_POPULATE_WRITE``) — what a cold reserve pays for its pages;
- **reserve cold**: ``MemoryPool.reserve`` with no warm stock (that same work);
- **reserve warm (same size)**: ``MemoryPool.reserve`` of a size the stock holds exactly
  (a size asked for before: the stocked region is sealed as it is), and **warm,
  +1 page, cut**: of one page more than the size, taken from a stocked region at the
  top of that size's class (the next one up), so it is truncated by the longest tail
  there is (~1/16 of the size) before it is sealed. The stock is refilled, untimed,
  before each rep;
- **scrub**: ``zero`` (memset through the daemon's mapping, then punch), its memset
  part alone, and ``punch``; hugetlb scrubs punch in both modes (a memset could fault
  on a worker's hole), so its rows are the punch. The region is refilled, untimed,
  before each rep.

Then, end to end in process, ``Service.reserve`` (the ledger's two SQLite commits
included, no HTTP) of each size into a pool with and without a warm stock that
holds it, waiting (untimed) for the refill thread between reps.

Medians of ``--reps`` repetitions (at least 3 for 1 GiB and above).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from maasd.allocator import MemoryPool, _sys
from maasd.allocator.region import Region
from maasd.allocator.stock import size_class
from maasd.bounds import Backing, ScrubMode
from maasd.core import Service
from maasd.models import PoolSpec, ReserveSpec
from maasd.settings import Settings

PAGE = os.sysconf("SC_PAGE_SIZE")
HUGE = 2 << 20
MiB, GiB = 1 << 20, 1 << 30
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGEPAGES_LOCK = "/tmp/maasd-tests-hugepages.lock"  # the tests' lock: never undo their pages


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


def bench_prefault(size: int, backing: Backing, reps: int) -> float:
    """``Region.create(prefault=True)`` alone (the previous rep's region closed, untimed)."""
    held: list[Region] = []

    def close() -> None:
        while held:
            held.pop().close()

    try:
        return median_time(
            lambda: held.append(Region.create(size, node=0, backing=backing)), reps, setup=close
        )
    finally:
        close()


def bench_cold(size: int, backing: Backing, reps: int) -> float:
    pool = MemoryPool("cold", numa_node=0, capacity=size, backing=backing)
    held: list[Region] = []

    def release() -> None:
        while held:
            pool.release(held.pop())

    try:
        return median_time(lambda: held.append(pool.reserve(size)), reps, setup=release)
    finally:
        release()


def bench_warm(size: int, backing: Backing, reps: int, stocked: int | None = None) -> float:
    """A reserve of ``size`` from a stock holding a region of ``stocked`` bytes (default:
    ``size``; a larger size of the same class is cut down to ``size``), refilled untimed."""
    stocked = stocked or size
    pool = MemoryPool("warm", numa_node=0, capacity=stocked, backing=backing, warm_bytes=stocked)
    held: list[Region] = []

    def refill() -> None:
        while held:
            pool.release(held.pop())
        while pool.refill_step():
            pass
        assert pool.warm == stocked, "the stock did not fill"

    try:
        pool.release(pool.reserve(stocked))  # the demand the stock follows
        return median_time(lambda: held.append(pool.reserve(size)), reps, setup=refill)
    finally:
        while held:
            pool.release(held.pop())
        pool.close()


def bench_scrub(
    size: int, backing: Backing, mode: ScrubMode, reps: int, *, memset_only: bool
) -> float:
    r = Region.create(size, node=0, backing=backing)
    try:
        scrub = (
            (lambda: _sys.memset(r.address, 0, r.size)) if memset_only else (lambda: r.scrub(mode))
        )
        return median_time(scrub, reps, setup=lambda: _sys.memset(r.address, 0xA5, r.size))
    finally:
        r.close()


def bench_service(size: int, reps: int) -> tuple[float, float]:
    """``Service.reserve`` of ``size``: (cold, from the warm stock), medians."""
    pools = [
        PoolSpec(name="cold", numa_node=0, capacity_bytes=size),
        PoolSpec(name="warm", numa_node=0, capacity_bytes=size, warm_bytes=size),
    ]
    with tempfile.TemporaryDirectory() as data_dir:
        settings = Settings(
            data_dir=data_dir, admin_key="bench" * 8, pools=pools, warm_min_available_bytes=0
        )
        svc = Service(settings)
        svc.start(reaper=False)
        try:
            who = svc.auth.authenticate(svc.tenants.create("bench", 4 * size).api_key)
            warm_pool = svc.live.find("warm").pool
            held: list[str] = []

            def release(stocked: bool) -> None:
                while held:
                    svc.buffers.release(who, held.pop())
                svc.reclaimer.drain()
                while stocked and warm_pool.warm < size:
                    time.sleep(0.01)

            def reserve(pool: str) -> None:
                held.append(svc.reserves.reserve(who, ReserveSpec(size_bytes=size, pool=pool)).id)

            reserve("warm")  # the demand the stock follows
            cold = median_time(lambda: reserve("cold"), reps, setup=lambda: release(False))
            warm = median_time(lambda: reserve("warm"), reps, setup=lambda: release(True))
            release(False)
            return cold, warm
        finally:
            svc.close()


def free_hugepages() -> int:
    return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())


@contextlib.contextmanager
def hugepages(need: int) -> Iterator[str | None]:
    """``None`` while ``need`` free 2 MiB pages exist (added as root, restored after), else why not."""
    with open(HUGEPAGES_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = int(NR_HUGEPAGES.read_text())
        try:
            if free_hugepages() < need and os.geteuid() == 0:
                NR_HUGEPAGES.write_text(str(old + need - free_hugepages()))
            have = free_hugepages()
            yield (
                None if have >= need else f"{have} free huge pages, {need} needed (root adds them)"
            )
        finally:
            if int(NR_HUGEPAGES.read_text()) != old:
                NR_HUGEPAGES.write_text(str(old))


def rows_for(size: int, backing: Backing, reps: int) -> Iterator[tuple[str, float]]:
    page = PAGE if backing == "memfd" else HUGE
    yield "prefault (create)", bench_prefault(size, backing, reps)
    yield "reserve cold", bench_cold(size, backing, reps)
    yield "reserve warm (same size)", bench_warm(size, backing, reps)
    # One page above a class, from a region of the next class's top: cut by ~1/16.
    above = size_class(size, page) + page
    yield (
        "reserve warm, +1 page, cut",
        bench_warm(above, backing, reps, stocked=size_class(above, page)),
    )
    if backing == "memfd":
        yield "scrub zero: memset part", bench_scrub(size, backing, "zero", reps, memset_only=True)
        yield (
            "scrub zero (memset+punch)",
            bench_scrub(size, backing, "zero", reps, memset_only=False),
        )
    yield "scrub punch", bench_scrub(size, backing, "punch", reps, memset_only=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="64MiB,1GiB")
    ap.add_argument("--no-hugetlb", action="store_true", help="4 KiB pages only")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(
        f"# maasd allocator bench: python {sys.version.split()[0]}, numpy {np.__version__}, "
        f"{os.cpu_count()} cpus, page {PAGE} B, reps {args.reps} (median)"
    )
    if thp.exists():
        print(f"# transparent hugepages: {thp.read_text().strip()}")
    # The largest warm row holds a stocked region of the class above the size and takes it.
    need = 2 * size_class(max(sizes) + HUGE, HUGE) // HUGE + 8
    backings: list[Backing] = ["memfd"] if args.no_hugetlb else ["memfd", "hugetlb"]
    with hugepages(need if "hugetlb" in backings else 0) as why_not:
        if why_not is not None:
            print(f"# hugetlb left out: {why_not}")
            backings = ["memfd"]
        print()
        print(
            f"{'backing':<9}{'what':<28}{'size':>8}{'time ms':>10}{'s/GiB':>8}"
            f"{'floor ms':>10}{'x floor':>9}"
        )
        for size in sizes:
            reps = args.reps if size < GiB else max(3, args.reps // 2)
            floor = bench_memset(size, reps)
            print(
                f"{'-':<9}{'memset floor (numpy fill)':<28}{human(size):>8}{floor * 1e3:>10.1f}"
                f"{floor * GiB / size:>8.3f}{floor * 1e3:>10.1f}{'1.00':>9}"
            )
            for backing in backings:
                for what, t in rows_for(size, backing, reps):
                    print(
                        f"{backing:<9}{what:<28}{human(size):>8}{t * 1e3:>10.1f}"
                        f"{t * GiB / size:>8.3f}{floor * 1e3:>10.1f}{t / floor:>8.2f}x"
                    )
    print("\nx floor = time / memset floor of the same size (lower is better)\n")
    print(f"{'Service.reserve (memfd)':<28}{'size':>8}{'cold ms':>10}{'warm ms':>10}")
    for size in sizes:
        cold, warm = bench_service(size, args.reps if size < GiB else max(3, args.reps // 2))
        print(f"{'':<28}{human(size):>8}{cold * 1e3:>10.1f}{warm * 1e3:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
