"""``maasd doctor``'s memory checks: memfd seals, hugetlb memfds, reserved huge pages and
NUMA placement — each made with the allocator's own code (:mod:`maasd.allocator`), so
that what passes here is what a reserve, a put and a commit do.

* "memfd seals": a memfd made as every region's is (:func:`~maasd.allocator.new_memfd`),
  sealed as a committed entry is (:func:`~maasd.allocator.add_seals` with
  :data:`~maasd.allocator.F_SEAL_FUTURE_WRITE`); then a write must be refused.
* "hugetlb memfd": the same memfd of the host's huge page size.
* "NUMA placement": a :class:`~maasd.allocator.Region` of four pages on each node, made,
  bound and populated by :meth:`~maasd.allocator.Region.create`, and its pages counted
  by :meth:`~maasd.allocator.Region.placement` (``move_pages``), as a pin verifies them.
"""

from __future__ import annotations

import fcntl
import os

from maasd.allocator import F_SEAL_FUTURE_WRITE, SEALS, Region, add_seals, new_memfd
from maasd.cli.doctor_check import Check, why
from maasd.errors import BackingError, MaasdError
from maasd.settings import Settings
from maasd.topology import SYSFS_NODES, Topology

__all__ = ["check_hugepages", "check_hugetlb_memfd", "check_memfd_seals", "check_numa"]

_KERNEL_FIX = (
    "Linux ≥ 5.1 is needed (memfd seals with F_SEAL_FUTURE_WRITE); under a seccomp profile, "
    "allow memfd_create and fcntl (deploy/k8s/seccomp/maasd.json)"
)


def check_memfd_seals(topology: Topology) -> Check:
    name = "memfd seals"
    page = topology.page_bytes
    try:
        fd = new_memfd("maasd-doctor", page, "memfd", page)
    except BackingError as e:
        return Check(name, "fail", f"memfd_create: {why(e)}", _KERNEL_FIX)
    try:
        add_seals(fd, F_SEAL_FUTURE_WRITE)
        try:
            os.pwrite(fd, b"x", 0)
        except PermissionError:
            pass
        else:
            return Check(name, "fail", "a write went through F_SEAL_FUTURE_WRITE", _KERNEL_FIX)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except (OSError, BackingError) as e:
        return Check(name, "fail", f"F_ADD_SEALS: {why(e)}", _KERNEL_FIX)
    finally:
        os.close(fd)
    want = SEALS | F_SEAL_FUTURE_WRITE
    if seals & want != want:
        return Check(name, "fail", f"seals {seals:#x} lack some of {want:#x}", _KERNEL_FIX)
    return Check(name, "ok", f"SHRINK|GROW|FUTURE_WRITE|SEAL hold (seals {seals:#x})")


def check_hugetlb_memfd(topology: Topology) -> Check:
    name = "hugetlb memfd"
    size = topology.hugepage_bytes
    try:
        os.close(new_memfd("maasd-doctor", size, "hugetlb", size))
    except BackingError as e:
        return Check(
            name,
            "fail",
            f"memfd_create(MFD_HUGETLB): {why(e)}",
            "a kernel with CONFIG_HUGETLBFS (Linux ≥ 4.14) is needed for hugetlb pools; "
            "memfd pools work without it",
        )
    return Check(name, "ok", f"{size >> 20} MiB pages can back a memfd")


def check_hugepages(topology: Topology, settings: Settings) -> Check:
    name = "huge pages"
    size = topology.hugepage_bytes
    wanted: dict[int, int] = {}
    for p in settings.pools:
        if p.backing == "hugetlb":
            wanted[p.numa_node] = wanted.get(p.numa_node, 0) + -(-p.capacity_bytes // size)
    per_node = ", ".join(
        f"node {n.id}: {n.hugepages_free}/{n.hugepages_total} free" for n in topology.nodes
    )
    short = [
        f"node {n.id} has {n.hugepages_total}, hugetlb pools want {wanted[n.id]}"
        for n in topology.nodes
        if wanted.get(n.id, 0) > n.hugepages_total
    ]
    fix = (
        f"reserve them: echo N > {SYSFS_NODES}/nodeX/hugepages/hugepages-{size >> 10}kB/"
        "nr_hugepages (or vm.nr_hugepages in /etc/sysctl.d/, or hugepagesz=/hugepages= on "
        "the kernel command line)"
    )
    if short:
        return Check(name, "fail", f"{'; '.join(short)} ({per_node})", fix)
    if not wanted and not any(n.hugepages_total for n in topology.nodes):
        return Check(name, "warn", f"none reserved ({per_node}): hugetlb pools cannot be made", fix)
    return Check(name, "ok", f"{size >> 20} MiB pages: {per_node}")


_NUMA_FIX = (
    "mbind, move_pages and get_mempolicy must be allowed: in a container, use the "
    "seccomp profile deploy/k8s/seccomp/maasd.json (or CAP_SYS_NICE with the "
    "runtime's default profile); under systemd keep @resources in SystemCallFilter"
)


def check_numa(topology: Topology) -> Check:
    name = "NUMA placement"
    size = 4 * topology.page_bytes
    placed = []
    for node in topology.nodes:
        try:
            region = Region.create(size, node=node.id, name="maasd-doctor")
        except BackingError as e:
            return Check(name, "fail", f"node {node.id}: {why(e)}", _NUMA_FIX)
        except MaasdError as e:  # e.g. the node has no memory to spare
            return Check(name, "fail", f"node {node.id}: {e.detail}")
        try:
            where = {n for n, count in region.placement().items() if count}
        finally:
            region.close()
        if where != {node.id}:
            return Check(name, "fail", f"node {node.id}: pages landed on nodes {sorted(where)}")
        placed.append(str(node.id))
    distances = " / ".join(" ".join(map(str, n.distances)) for n in topology.nodes)
    return Check(
        name,
        "ok",
        f"{len(placed)} node(s) ({', '.join(placed)}): mbind + move_pages work; "
        f"distances {distances}",
    )
