"""The pools' measured latency class: the daemon's probe of its nodes, once, at start.

``maasd serve`` runs :mod:`maasd.probe` (``python -m maasd.probe --background``: a child
at nice 19, so the chase holds no GIL of the daemon's and its memory is given back at its
exit) in a thread of its own after the pools are provisioned; the child is killed past
``latency_probe_timeout_s``. Until it answers every pool's ``measured_latency_us`` is
``null``, and a reserve with ``latency_source = "measured"`` finds no pool (422
qos-unmet, "no node measured yet"). A node the probe could not measure (no room for the
chase, the budget spent) stays ``null``. ``latency_probe = false`` turns it off; it is
off by default for a :class:`~maasd.core.Service` embedded elsewhere (tests), on under
``maasd serve`` (docs/allocator.md, "Latency classes").

:func:`node_classes` (pure) turns the probe's pairs into each memory node's class: the
latency from the nearest CPU node (the node's own cpus; a memory-only node's nearest by
the kernel's distance), with every CPU node's figures beside it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec

from maasd.models import Measured, MeasuredFrom, PoolInfo, rfc3339
from maasd.probe_answer import Probe
from maasd.topology import Topology

__all__ = ["Measurements", "node_classes", "run_probe"]

logger = logging.getLogger(__name__)

#: What runs the probe: ``(timeout_s) -> Probe`` (a child process by default).
Runner = Callable[[float], Probe]


def run_probe(timeout_s: float) -> Probe:
    """``python -m maasd.probe --background`` with a budget inside ``timeout_s``; killed past it."""
    budget = max(1.0, timeout_s * 0.8)  # what it measures, less its start (imports)
    out = subprocess.run(
        [sys.executable, "-m", "maasd.probe", "--background", "--budget-s", f"{budget:g}"],
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    if out.returncode != 0:
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"the probe exited with {out.returncode}: {' '.join(tail)}")
    return msgspec.json.decode(out.stdout, type=Probe)


def _nearest_cpu_node(topology: Topology, mem: int, measured: set[int]) -> int | None:
    """The CPU node nearest ``mem`` among ``measured`` (the node itself first; ties: id)."""
    node = topology.node(mem)
    if node is None or not measured:
        return None
    ids = [n.id for n in topology.nodes]

    def distance(cpu: int) -> tuple[int, int]:
        if cpu == mem:
            return (-1, cpu)
        at = ids.index(cpu)
        return (node.distances[at] if at < len(node.distances) else 1 << 30, cpu)

    return min(measured, key=distance)


def node_classes(topology: Topology, probe: Probe, at: float) -> dict[int, Measured]:
    """Each memory node's measured class (µs) and its figures per CPU node, from ``probe``.

    A node with no latency measured from any CPU node is left out.
    """
    latency = {(x.cpu_node, x.mem_node): x.ns / 1000 for x in probe.latency}
    rate = {(x.cpu_node, x.mem_node): x.gib_per_s for x in probe.bandwidth}
    out: dict[int, Measured] = {}
    for mem in topology.nodes:
        cpus = {c for c, m in latency if m == mem.id}
        nearest = _nearest_cpu_node(topology, mem.id, cpus)
        if nearest is None:
            continue
        by_cpu = [
            MeasuredFrom(
                cpu_node=c,
                latency_us=None if (c, mem.id) not in latency else round(latency[c, mem.id], 4),
                gib_per_s=None if (c, mem.id) not in rate else round(rate[c, mem.id], 3),
            )
            for c in sorted(cpus | {c for c, m in rate if m == mem.id})
        ]
        out[mem.id] = Measured(
            latency_us=round(latency[(nearest, mem.id)], 4),
            cpu_node=nearest,
            gib_per_s=None if (nearest, mem.id) not in rate else round(rate[nearest, mem.id], 3),
            by_cpu_node=by_cpu,
            measured_at=rfc3339(at),
        )
    return out


class Measurements:
    """The nodes' measured classes, as the background probe left them (thread-safe)."""

    def __init__(self, enabled: bool, timeout_s: float, runner: Runner = run_probe) -> None:
        self.enabled = enabled
        self._timeout_s = timeout_s
        self._runner = runner
        self._lock = threading.Lock()
        self._classes: dict[int, Measured] = {}
        self._thread: threading.Thread | None = None
        #: ``off``, ``pending`` (not started), ``running``, ``done`` or ``failed: …``.
        self.state = "pending" if enabled else "off"

    def start(self, topology: Topology) -> None:
        """Measure in the background, once per daemon (later calls do nothing)."""
        if not self.enabled or self._thread is not None:
            return
        self.state = "running"
        self._thread = threading.Thread(
            target=self._measure, args=(topology,), name="maasd-latency-probe", daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the probe to end; whether it has (tests, ``maasd info``)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state not in ("pending", "running")

    def _measure(self, topology: Topology) -> None:
        started = time.monotonic()
        try:
            probe = self._runner(self._timeout_s)
        except Exception as e:  # the timeout too: a daemon without classes, said once
            self.state = f"failed: {e}"
            logger.warning("latency probe: no measured classes: %s", e)
            return
        classes = node_classes(topology, probe, time.time())
        with self._lock:
            self._classes = classes
        self.state = "done"
        for error in probe.errors:
            logger.warning("latency probe: %s", error)
        logger.info(
            "latency probe: %s in %.1f s",
            ", ".join(f"node {n} {m.latency_us * 1000:.0f} ns" for n, m in classes.items())
            or "no node measured",
            time.monotonic() - started,
        )

    def classes(self) -> dict[int, float]:
        """The measured latency class of each measured node, in µs (for placement)."""
        with self._lock:
            return {node: m.latency_us for node, m in self._classes.items()}

    def of_node(self, node: int) -> Measured | None:
        with self._lock:
            return self._classes.get(node)

    def annotate(self, infos: list[PoolInfo], host: str) -> list[PoolInfo]:
        """``infos`` with this host's pools' measured class beside their declared one."""
        out = []
        for info in infos:
            m = self.of_node(info.numa_node) if info.host == host else None
            if m is not None:
                info = msgspec.structs.replace(info, measured_latency_us=m.latency_us, measured=m)
            out.append(info)
        return out
