"""Measured memory per CPU node × memory node: copy bandwidth and load-to-use latency.

A pool's ``latency_us`` is what its creator declared. This measures what the host does,
for each pair: the calling thread runs on the CPU node's cpus (``sched_setaffinity``) and
touches regions bound to the memory node (``mbind``). ``maasd info --probe`` prints it,
``maasd doctor`` checks it, and the daemon runs it once in the background at start
(``python -m maasd.probe``, :mod:`maasd.core.latency`) to give pools a measured class.

**Bandwidth:** NumPy ``copyto`` between two 64 MiB regions (a memcpy at memory speed),
best of a few rounds.

**Latency:** a dependent pointer chase, ``i = m[i]``, through one random cycle over every
cache line of a buffer four times the last-level cache (so each load misses every cache,
and, on 4 KiB pages, the TLB, as a random reader of a buffer does), timed against the same
loop over a 16 KiB buffer that stays in L1. The chase is CPython (a ``memoryview`` of
int64, sixteen loads per loop turn): each step costs the interpreter ~15–35 ns, but that
cost is the same in both loops, and each load's address is the previous load's value, so
the loads cannot overlap. ``(far - near) / steps`` is the memory's load-to-use latency
less an L1 hit (~1 ns). It reads low by the part of the interpreter's work the core
overlaps with a miss (a chase over 1 MiB, inside L2, reads ~1 ns here). Rounds are short
(~5 ms, inside a time slice) and alternate near and far; the best of each is kept, so
another process's CPU time shows as fewer usable rounds, not as latency. No compiled code:
the project ships none, and machine code written at run time is what the daemon's
sandbox forbids. In a QEMU guest the distances are declared and the nodes share the
host's memory: the figures there say nothing about the host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from maasd.allocator.region import Region
from maasd.probe_answer import Bandwidth, Latency, Probe
from maasd.topology import Topology, discover

__all__ = [
    "Bandwidth",
    "Latency",
    "Probe",
    "chase_bytes",
    "load_to_use_ns",
    "probe_bandwidth",
    "probe_latency",
    "write_cycle",
]

#: Bytes copied per round (each way twice the last-level cache of most hosts).
PROBE_BYTES = 64 << 20
ROUNDS = 3
LINE = 64  # bytes of a cache line: one chase step per line
NEAR_BYTES = 16 << 10  # the L1-resident chase
STEPS = 1 << 14  # loads per round (a multiple of 16): ~5 ms of chasing memory
LAT_ROUNDS = 24
#: The last-level cache when sysfs does not say.
DEFAULT_LLC = 32 << 20
CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def _copy_rate(src: np.ndarray, dst: np.ndarray, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 2**30


def probe_bandwidth(
    topology: Topology, size: int = PROBE_BYTES, rounds: int = ROUNDS
) -> list[Bandwidth]:
    """Copy bandwidth for every (CPU node, memory node) pair with cpus and memory."""
    out: list[Bandwidth] = []
    before = os.sched_getaffinity(0)
    try:
        for mem in topology.nodes:
            regions = [Region.create(size, node=mem.id, name="maasd-probe") for _ in range(2)]
            try:
                src, dst = (np.frombuffer(r.view(), dtype=np.uint8) for r in regions)
                src[:] = 1
                for cpu in topology.nodes:
                    if not cpu.cpus:
                        continue
                    os.sched_setaffinity(0, cpu.cpus)
                    rate = _copy_rate(src, dst, rounds)
                    out.append(Bandwidth(cpu_node=cpu.id, mem_node=mem.id, gib_per_s=rate))
                del src, dst
            finally:
                for r in regions:
                    r.close()
    finally:
        os.sched_setaffinity(0, before)
    return sorted(out, key=lambda b: (b.cpu_node, b.mem_node))


# -- latency -----------------------------------------------------------------------------


def llc_bytes(caches: Path = CACHES) -> int:
    """The largest cache cpu 0 has (sysfs ``cache/index*/size``), else :data:`DEFAULT_LLC`."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=DEFAULT_LLC)


def chase_bytes(llc: int) -> int:
    """The chased buffer: four times the last-level cache, 64 MiB … 1 GiB.

    >>> chase_bytes(32 << 20) >> 20, chase_bytes(1 << 20) >> 20, chase_bytes(1 << 30) >> 20
    (128, 64, 1024)
    """
    return min(max(4 * llc, 64 << 20), 1 << 30)


def write_cycle(words: np.ndarray, rng: np.random.Generator, line_words: int = LINE // 8) -> int:
    """Write into ``words`` (int64) one random cycle through the first word of every line:
    ``words[i]`` is the index of the next line's word. Returns the cycle's start."""
    lines = len(words) // line_words
    slots = rng.permutation(lines) * line_words
    words[slots] = np.roll(slots, -1)
    return int(slots[0])


def chase(m: memoryview, i: int, steps: int) -> int:
    """``steps`` dependent loads (a multiple of 16) from index ``i``; returns where it ended."""
    for _ in range(steps >> 4):
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
        i = m[i]
    return i


def load_to_use_ns(far_s: float, near_s: float, steps: int) -> float:
    """The latency one step of the far chase adds over the near one, in ns (never < 0).

    >>> round(load_to_use_ns(far_s=0.0021, near_s=0.0005, steps=16384), 1)
    97.7
    >>> load_to_use_ns(far_s=0.0004, near_s=0.0005, steps=16384)
    0.0
    """
    if steps <= 0:
        raise ValueError("steps must be > 0")
    return max(0.0, (far_s - near_s) / steps * 1e9)


class _Chase:
    """A chased region bound to one memory node, and where its chase stands."""

    def __init__(self, size: int, node: int, rng: np.random.Generator) -> None:
        self.region = Region.create(size, node=node, name="maasd-probe")
        try:
            words = np.frombuffer(self.region.view(), dtype=np.int64)
            self.at = write_cycle(words, rng)
            del words
            self.m = self.region.view().cast("B").cast("q")
        except BaseException:
            self.region.close()
            raise

    def timed(self, steps: int) -> float:
        t0 = time.perf_counter()
        self.at = chase(self.m, self.at, steps)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.m.release()
        self.region.close()


def _pair(far: _Chase, near: _Chase, rounds: int, steps: int, deadline: float) -> tuple[float, int]:
    """The best far and near round, alternated; at least 3 rounds, then until ``deadline``."""
    far.timed(steps), near.timed(steps)  # warm: the loop, the TLB for the near one
    best_far = best_near = float("inf")
    done = 0
    while done < rounds and (done < 3 or time.monotonic() < deadline):
        best_near = min(best_near, near.timed(steps))
        best_far = min(best_far, far.timed(steps))
        done += 1
    return load_to_use_ns(best_far, best_near, steps), done


def probe_latency(
    topology: Topology,
    size: int | None = None,
    rounds: int = LAT_ROUNDS,
    steps: int = STEPS,
    deadline: float | None = None,
) -> list[Latency]:
    """Load-to-use latency for every (CPU node, memory node) pair with cpus and memory.

    ``deadline`` (``time.monotonic()``): no pair begins after it, and a pair begun stops
    after 3 rounds; pairs not reached are left out.
    """
    size = size or chase_bytes(llc_bytes())
    end = float("inf") if deadline is None else deadline
    rng = np.random.default_rng()
    out: list[Latency] = []
    before = os.sched_getaffinity(0)
    try:
        for mem in topology.nodes:
            if time.monotonic() >= end:
                break
            far = _Chase(size, mem.id, rng)
            try:
                near = _Chase(NEAR_BYTES, mem.id, rng)
                try:
                    for cpu in (c for c in topology.nodes if c.cpus):
                        if time.monotonic() >= end:
                            break
                        os.sched_setaffinity(0, cpu.cpus)
                        ns, done = _pair(far, near, rounds, steps, end)
                        out.append(
                            Latency(
                                cpu_node=cpu.id,
                                mem_node=mem.id,
                                ns=ns,
                                chase_bytes=size,
                                rounds=done,
                            )
                        )
                finally:
                    near.close()
            finally:
                far.close()
    finally:
        os.sched_setaffinity(0, before)
    return sorted(out, key=lambda b: (b.cpu_node, b.mem_node))


# -- the daemon's background probe ---------------------------------------------------------


def _orphan_dies() -> None:
    """Die with the thread that started us (PR_SET_PDEATHSIG), and at once if it is gone."""
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def run(budget_s: float) -> Probe:
    """Latency, then bandwidth, within ``budget_s`` (what is left out is not measured)."""
    deadline = time.monotonic() + budget_s
    topology = discover()
    errors: list[str] = []
    latency: list[Latency] = []
    bandwidth: list[Bandwidth] = []
    try:
        latency = probe_latency(topology, deadline=deadline)
    except Exception as e:  # a node without room for the chase: said, not raised
        errors.append(f"latency: {e}")
    if time.monotonic() < deadline:
        try:
            bandwidth = probe_bandwidth(topology)
        except Exception as e:
            errors.append(f"bandwidth: {e}")
    return Probe(latency=latency, bandwidth=bandwidth, errors=errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maasd.probe", description=__doc__)
    parser.add_argument("--budget-s", type=float, default=60.0, help="stop measuring after")
    parser.add_argument(
        "--background", action="store_true", help="nice 19; die with the parent thread"
    )
    args = parser.parse_args(argv)
    if args.background:
        _orphan_dies()
        os.nice(19)
    sys.stdout.write(msgspec.json.encode(run(args.budget_s)).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
