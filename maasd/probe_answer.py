"""What ``python -m maasd.probe`` answers (JSON on its stdout): the shapes alone.

Apart from :mod:`maasd.probe` so that the daemon, which only decodes the answer
(:mod:`maasd.core.latency`), does not import numpy, which the measuring child needs.
"""

from __future__ import annotations

import msgspec

__all__ = ["Bandwidth", "Latency", "Probe"]


class Bandwidth(msgspec.Struct, frozen=True, kw_only=True):
    cpu_node: int
    mem_node: int
    gib_per_s: float


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    cpu_node: int
    mem_node: int
    #: Load-to-use latency of the memory node's memory from the CPU node's cpus, less an L1 hit.
    ns: float
    #: The chased buffer's size (four times the last-level cache).
    chase_bytes: int
    #: Rounds measured (fewer than asked when the budget ran out).
    rounds: int


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """``python -m maasd.probe``'s answer: every pair measured within the budget."""

    latency: list[Latency]
    bandwidth: list[Bandwidth]
    errors: list[str] = msgspec.field(default_factory=list)
