"""Measured memory bandwidth per CPU node × memory node (``maasd info --probe``).

A pool's ``latency_us`` is what its creator declared. This measures what the host does:
for each pair, the calling thread runs on the CPU node's cpus (``sched_setaffinity``) and
copies between two regions bound to the memory node (NumPy ``copyto``: a memcpy at memory
speed), best of a few rounds. A remote pair shows as a lower figure than a local one.

What it does not measure: load-to-use latency. A dependent pointer chase over a buffer
larger than the last-level cache needs compiled code (each load's address comes from the
previous one; NumPy and ctypes cost more per step than the load itself), and the project
keeps no compiled extension of its own: the bandwidth ratio is the figure given. In a QEMU
guest the distances are declared and the nodes share the host's memory: the figures there
say nothing about the host.
"""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np

from maasd.allocator.region import Region
from maasd.topology import Topology

__all__ = ["Bandwidth", "probe_bandwidth"]

#: Bytes copied per round (each way twice the last-level cache of most hosts).
PROBE_BYTES = 64 << 20
ROUNDS = 3


class Bandwidth(msgspec.Struct, frozen=True, kw_only=True):
    cpu_node: int
    mem_node: int
    gib_per_s: float


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
