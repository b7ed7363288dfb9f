"""``maasd doctor``'s kernel check: the features of the running kernel the daemon relies on.

Measured in a two-node guest on Debian 12's 6.1 kernel and on 6.18 (docs/deploy.md,
"Kernel"): the daemon needs memfd seals with ``F_SEAL_FUTURE_WRITE`` (5.1, the "memfd seals"
check), ``mbind``/``move_pages`` on shmem (the "NUMA placement" check), and uses
``MADV_POPULATE_READ``/``WRITE`` (5.14) where they exist. It passes neither ``MFD_EXEC`` nor
``MFD_NOEXEC_SEAL`` (6.3), so ``vm.memfd_noexec = 2`` (6.3+: every memfd must be created
no-exec) refuses every buffer. ``memfd_secret`` is not used (ENOSYS on Debian's 6.1).
"""

from __future__ import annotations

import platform
from pathlib import Path

from maasd.cli.doctor_check import Check
from maasd.topology import Topology

__all__ = ["check_bandwidth", "check_kernel", "check_pipe_pages"]

MEMFD_NOEXEC = Path("/proc/sys/vm/memfd_noexec")
#: The pages one user's pipes may hold at most (0: no bound), and past which its new
#: pipes get two slots (fs.pipe-user-pages-hard, -soft).
PIPE_PAGES = Path("/proc/sys/fs")
#: What "pipe pages" proposes: 64 MiB of 4 KiB pages per uid.
PIPE_PAGES_HARD = 16384


def check_kernel() -> Check:
    from maasd.allocator import populate_write_known

    name = "kernel"
    release = platform.release()
    try:
        noexec = MEMFD_NOEXEC.read_text().strip()
    except OSError:
        noexec = None  # before 6.3: no such sysctl, and no such restriction
    if noexec == "2":
        return Check(
            name,
            "fail",
            f"Linux {release}: vm.memfd_noexec = 2 refuses memfds created without "
            "MFD_NOEXEC_SEAL, which every buffer is",
            "sysctl -w vm.memfd_noexec=1 (or 0); in a container, the host's setting applies",
        )
    parts = [f"Linux {release}", f"vm.memfd_noexec {noexec if noexec is not None else 'absent'}"]
    if not populate_write_known():
        parts.append("no MADV_POPULATE_* (< 5.14)")
        return Check(
            name,
            "warn",
            "; ".join(parts)
            + ": prefault allocates through fallocate, and GET /v1/buffers/{id} counts only "
            "the pages present",
            "Linux ≥ 5.14 (Debian 12's 6.1 has them)",
        )
    parts.append("MADV_POPULATE_READ/WRITE")
    return Check(name, "ok", "; ".join(parts))


def check_bandwidth(topology: Topology) -> Check:
    """Copy bandwidth per CPU node × memory node (:mod:`maasd.probe`): a remote pair
    measured faster than the local one means the distances the kernel reports mislead."""
    from maasd.probe import probe_bandwidth

    name = "memory bandwidth"
    measured = probe_bandwidth(topology, size=16 << 20, rounds=2)
    rate = {(b.cpu_node, b.mem_node): b.gib_per_s for b in measured}
    detail = ", ".join(f"cpu {c}→mem {m} {r:.1f} GiB/s" for (c, m), r in sorted(rate.items()))
    odd = [
        f"cpu {c}→mem {m}"
        for (c, m), r in rate.items()
        if c != m and (m, m) in rate and r > 1.25 * rate[(m, m)]
    ]
    if odd:
        return Check(
            name,
            "warn",
            f"{detail}: remote faster than local for {', '.join(odd)}",
            "the nodes' distances (and pools' latency_us) may not match the hardware: "
            "check the BIOS NUMA settings (node interleaving) or a VM's declared topology",
        )
    return Check(name, "ok", detail)


def check_pipe_pages(sysctl: Path = PIPE_PAGES) -> Check:
    """Whether a worker's uid may keep unbounded memory in pipes. A page a worker moves
    into a pipe (``splice`` from its fd, ``vmsplice`` from its mapping) stays resident
    after the memfd is gone, where the daemon cannot see it, so a released buffer's or
    entry's pages can outlive their count (docs/operations.md, "Memory held after
    release"); ``fs.pipe-user-pages-hard`` is what bounds them, per uid."""
    name = "pipe pages"
    try:
        hard = int((sysctl / "pipe-user-pages-hard").read_text())
        soft = int((sysctl / "pipe-user-pages-soft").read_text())
    except (OSError, ValueError) as e:
        return Check(name, "warn", f"cannot read fs.pipe-user-pages-*: {e}")
    if hard == 0:
        return Check(
            name,
            "warn",
            f"fs.pipe-user-pages-hard 0 (no bound; soft {soft}): a worker's uid can keep a "
            "released buffer's or entry's pages resident in pipes (splice, vmsplice) past "
            "its tenant's quota, where the daemon cannot count them",
            f"sysctl -w fs.pipe-user-pages-hard={PIPE_PAGES_HARD} (and in /etc/sysctl.d: "
            f"{PIPE_PAGES_HARD * 4 // 1024} MiB of 4 KiB pages per uid; a huge page per slot "
            "from a hugetlb pool), and run each tenant's workers as a uid of their own",
        )
    return Check(
        name,
        "ok",
        f"fs.pipe-user-pages-hard {hard} (soft {soft}): a uid's pipes hold at most {hard} "
        "pages of released buffers or entries",
    )
