"""What the host's memory looks like: NUMA nodes, cpus, memory, distances, huge pages.

Read from sysfs (``/sys/devices/system/node``), which is what libnuma reads
too; py-libnuma answers for the distance matrix when it loads, and sysfs'
``distance`` files otherwise. ``sysfs_root`` is a parameter so tests can feed
a fabricated two-node tree.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

SYSFS_NODES = "/sys/devices/system/node"


class Node(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    cpus: list[int]
    mem_total_bytes: int
    mem_free_bytes: int
    distances: list[int]
    hugepages_total: int = 0
    hugepages_free: int = 0


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[Node]
    page_bytes: int
    hugepage_bytes: int
    hugepages_free: int

    @property
    def node_ids(self) -> frozenset[int]:
        return frozenset(n.id for n in self.nodes)

    def node(self, node_id: int) -> Node | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def page_bytes_of(self, backing: str) -> int:
        """The page a pool of ``backing`` is made of on this host (its capacity is whole
        pages of it): the huge page for ``hugetlb``, else the base page."""
        return self.hugepage_bytes if backing == "hugetlb" else self.page_bytes


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist such as ``0-3,8,10-11``.

    >>> parse_cpulist("0-3,8,10-11\\n")
    [0, 1, 2, 3, 8, 10, 11]
    """
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


_MEMINFO = re.compile(r"Node\s+\d+\s+([\w()]+):\s+(\d+)(?:\s+kB)?")


def parse_node_meminfo(text: str) -> dict[str, int]:
    """Parse a node's ``meminfo``: values in bytes (kB fields converted), counts as-is."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _MEMINFO.match(line.strip())
        if m:
            key, val = m.group(1), int(m.group(2))
            out[key] = val * 1024 if line.rstrip().endswith("kB") else val
    return out


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text()
    except OSError:
        return default


def _default_hugepage_bytes() -> int:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith("Hugepagesize:"):
            return int(line.split()[1]) * 1024
    return 2 << 20


def discover(
    sysfs_root: str | os.PathLike[str] = SYSFS_NODES, *, hugepage_bytes: int | None = None
) -> Topology:
    """Read the host's NUMA topology. A host without NUMA sysfs is one node 0."""
    root = Path(sysfs_root)
    hp_bytes = hugepage_bytes or _default_hugepage_bytes()
    hp_dir = f"hugepages-{hp_bytes // 1024}kB"
    ids = sorted(int(p.name[4:]) for p in root.glob("node[0-9]*")) if root.is_dir() else []
    nodes: list[Node] = []
    for nid in ids:
        d = root / f"node{nid}"
        mem = parse_node_meminfo(_read(d / "meminfo"))
        distances = [int(x) for x in _read(d / "distance").split()] or [10]
        nodes.append(
            Node(
                id=nid,
                cpus=parse_cpulist(_read(d / "cpulist")),
                mem_total_bytes=mem.get("MemTotal", 0),
                mem_free_bytes=mem.get("MemFree", 0),
                distances=distances,
                hugepages_total=int(_read(d / "hugepages" / hp_dir / "nr_hugepages", "0") or 0),
                hugepages_free=int(_read(d / "hugepages" / hp_dir / "free_hugepages", "0") or 0),
            )
        )
    if not nodes:  # no NUMA in this kernel: the whole machine is node 0
        meminfo = {
            k.rstrip(":"): int(v) * 1024
            for k, v, *_ in (line.split() for line in _read(Path("/proc/meminfo")).splitlines())
            if k in ("MemTotal:", "MemFree:")
        }
        nodes.append(
            Node(
                id=0,
                cpus=list(range(os.cpu_count() or 1)),
                mem_total_bytes=meminfo.get("MemTotal", 0),
                mem_free_bytes=meminfo.get("MemFree", 0),
                distances=[10],
            )
        )
    return Topology(
        nodes=nodes,
        page_bytes=os.sysconf("SC_PAGE_SIZE"),
        hugepage_bytes=hp_bytes,
        hugepages_free=sum(n.hugepages_free for n in nodes),
    )


def node_room(node: int, sysfs_root: str | os.PathLike[str] = SYSFS_NODES) -> int | None:
    """Bytes a strict (``MPOL_BIND``) allocation on ``node`` can take now without the OOM
    killer: free plus inactive page cache, less a margin the kernel keeps for itself
    (1/64 of the node, between 32 MiB and 1 GiB, above its watermarks).

    ``None`` when the node's ``meminfo`` cannot be read (no NUMA sysfs): nothing is known.
    Under ``MPOL_BIND`` a page never comes from another node, so a populate past this
    does not fall back: the kernel reclaims, then OOM-kills (often the daemon itself).
    """
    mem = parse_node_meminfo(_read(Path(sysfs_root) / f"node{node}" / "meminfo"))
    if "MemFree" not in mem:
        return None
    margin = min(max(32 << 20, mem.get("MemTotal", 0) // 64), 1 << 30)
    return max(0, mem["MemFree"] + mem.get("Inactive(file)", 0) - margin)


def libnuma_view() -> dict[str, object] | None:
    """What libnuma itself reports (py-libnuma), as a cross-check for ``maasd info``."""
    try:
        from numa import info
    except Exception:
        return None
    if not info.numa_available():
        return {"available": False}
    return {
        "available": True,
        "max_node": info.get_max_node(),
        "configured_nodes": info.get_num_configured_nodes(),
        "distances": info.numa_hardware_info()["numa_node_distance"],
    }
