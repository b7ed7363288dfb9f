"""``maasd doctor``'s limits: open files and tasks at the daemon's caps, and the region
budget ``maasd serve`` would derive — each from the daemon's own budget
(:mod:`maasd.core.limits`: :func:`~maasd.core.limits.settings_limits`,
:func:`~maasd.core.limits.open_files_needed`, :func:`~maasd.core.limits.maps_needed`), the
tenants' caps as the ledger holds them (:mod:`maasd.cli.doctor_ledger`) and the pools'
pages as the daemon rounds them (:meth:`maasd.topology.Topology.page_bytes_of`); the
tasks from the daemon's thread pools (``REST_THREADS``, anyio's default pool as anyio
sizes it, ``socket_slow_workers``) and its own threads, summed by the daemon's own
:func:`~maasd.core.limits.tasks_needed`; the regions a budget must hold for the tenants'
caps by its :func:`~maasd.core.limits.regions_wanted`.
deploy/systemd/maasd.service sizes ``LimitNOFILE`` and ``TasksMax`` from :func:`needs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import resource
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from maasd.cli.doctor_check import Check
from maasd.errors import ConfigError
from maasd.settings import Settings
from maasd.topology import Topology

if TYPE_CHECKING:
    from maasd.core.limits import ProcessLimits

__all__ = [
    "Needs",
    "anyio_threads",
    "check_entry_fds",
    "check_limits",
    "check_region_budget",
    "check_regions",
    "needs",
    "region_need",
    "regions_wanted",
]


@functools.cache
def anyio_threads() -> int:
    """The threads of anyio's default pool, asked of anyio as the daemon's event loop asks
    it: the daemon leaves that pool at anyio's default (its health checks run there, as
    does any ``to_thread`` call without a limiter of its own; the REST service calls have
    theirs, ``REST_THREADS``). Starts a throw-away event loop: not for a caller in one."""
    import anyio
    import anyio.to_thread

    async def ask() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    return anyio.run(ask)


class Needs(msgspec.Struct, frozen=True):
    files: int
    tasks: int
    files_sum: str
    tasks_sum: str
    #: The regions the files are sized for, and the vm.max_map_count they need.
    regions: int = 0
    maps: int = 0


def regions_wanted(settings: Settings, tenant_caps: list[int | None] | None = None) -> int:
    """Regions a budget must hold for every tenant to reach its cap (``None``: the
    default, ``max_buffers_per_tenant``; no tenants known: one at the default), by the
    daemon's rule (:func:`maasd.core.limits.regions_wanted`)."""
    from maasd.core import limits

    caps = limits.tenant_caps(settings.max_buffers_per_tenant, tenant_caps)
    return limits.regions_wanted(caps, settings.tenant_region_share)


def needs(settings: Settings, *, regions: int | None = None, postgres: bool = False) -> Needs:
    """Open files, tasks and mappings a daemon with ``settings`` needs for a budget of
    ``regions`` (default: :func:`regions_wanted` with no tenants known), computed by the
    daemon's own budget (:mod:`maasd.core.limits`; deploy/systemd/maasd.service sizes
    ``LimitNOFILE`` and ``TasksMax`` from the same sum)."""
    from maasd.core.limits import (
        BASE_TASKS,
        HOT_READ_ONLY_FDS,
        OWN_FILES,
        REST_THREADS,
        maps_needed,
        open_files_needed,
        settings_limits,
        tasks_needed,
    )

    want = regions_wanted(settings) if regions is None else regions
    files = open_files_needed(settings_limits(settings, 0, None, postgres=postgres), want)
    assert files is not None  # no mapping limit given: the files alone bind
    at = settings_limits(settings, files, None, postgres=postgres)
    slow = settings.socket_slow_workers
    pool = anyio_threads()
    tasks = tasks_needed(settings, pool)
    return Needs(
        files=files,
        tasks=tasks,
        files_sum=f"{want} regions + {at.headroom} kept (the larger of a quarter of the "
        f"limit and {at.reserved}: the ledger {at.ledger_files}, REST {at.rest_connections}, "
        f"2 × {at.socket_connections} socket connections, 2 × {at.threads} threads' "
        f"transient files, {OWN_FILES + HOT_READ_ONLY_FDS} of the daemon's own)",
        tasks_sum=f"{REST_THREADS} service + {pool} pool + {slow} socket slow-op "
        f"threads + {BASE_TASKS}",
        regions=want,
        maps=maps_needed(want),
    )


def _pids_max() -> int | None:
    """This process's cgroup (v2) pids.max, None when unlimited or unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                text = (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "pids.max").read_text()
                return None if text.strip() == "max" else int(text)
    return None


def check_limits(settings: Settings) -> list[Check]:
    need = needs(settings)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out = []
    if soft != resource.RLIM_INFINITY and soft < need.files:
        out.append(
            Check(
                "open files",
                "fail",
                f"RLIMIT_NOFILE is {soft} (hard {hard}); for a tenant at its default cap "
                f"the daemon holds {need.files} = {need.files_sum}",
                f"raise it to ≥ {need.files}: LimitNOFILE= in the unit (deploy/systemd), "
                "--ulimit nofile= for a container, or ulimit -n",
            )
        )
    else:
        out.append(Check("open files", "ok", f"RLIMIT_NOFILE {soft} ≥ {need.files}"))
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    pids = _pids_max()
    limits = {
        k: v
        for k, v in (("RLIMIT_NPROC", nproc), ("cgroup pids.max", pids))
        if v is not None and v != resource.RLIM_INFINITY
    }
    low = {k: v for k, v in limits.items() if v < need.tasks}
    if low:
        what = ", ".join(f"{k} is {v}" for k, v in low.items())
        out.append(
            Check(
                "tasks",
                "fail",
                f"{what}; at its caps the daemon runs {need.tasks} = {need.tasks_sum}",
                f"raise it to ≥ {need.tasks}: TasksMax= in the unit, the pod's pids limit, "
                "or ulimit -u",
            )
        )
    else:
        shown = ", ".join(f"{k} {v}" for k, v in limits.items()) or "unlimited"
        out.append(Check("tasks", "ok", f"{shown} ≥ {need.tasks}"))
    return out


def region_need(
    max_per_tenant: int, tenant_caps: list[int | None] | None, pool_regions: int
) -> tuple[int, str]:
    """Regions the configured tenants and pools could hold at once, and how that was counted.

    Each tenant may hold its cap (``None``: the daemon's ``max_buffers_per_tenant``); with
    no tenants known (no ledger yet) one tenant at the default cap. The pools can hold no
    more regions than their pages (a region is at least one page).
    """
    from maasd.core.limits import tenant_caps as caps_of

    tenants = sum(caps_of(max_per_tenant, tenant_caps))
    if tenant_caps:
        why = f"{len(tenant_caps)} tenant(s) at their caps: {tenants}"
    else:
        why = f"one tenant at max_buffers_per_tenant: {tenants}"
    if pool_regions < tenants:
        return pool_regions, f"the pools' pages: {pool_regions} ({why})"
    return tenants, why


def check_region_budget(
    limits: ProcessLimits,
    max_per_tenant: int,
    tenant_caps: list[int | None] | None,
    pool_regions: int,
    *,
    soft_now: int | None = None,
) -> Check:
    """The region budget ``maasd serve`` would derive (docs/operations.md, "ProcessLimits"; the
    daemon's own :mod:`maasd.core.limits`) against what the configured tenants and pools
    could hold. ``limits.open_files`` is the limit the daemon will run with; ``soft_now``,
    when lower, the soft limit it raises."""
    from maasd.core.limits import (
        MIN_USEFUL_REGIONS,
        maps_needed,
        open_files_needed,
        regions_wanted,
    )
    from maasd.core.limits import tenant_caps as caps_of

    name = "region budget"
    budget = limits.region_budget
    maps = "unknown" if limits.max_map_count is None else str(limits.max_map_count)
    raised = (
        f" (raised from {soft_now} by maasd serve)"
        if soft_now is not None and soft_now < limits.open_files
        else ""
    )
    basis = (
        f"RLIMIT_NOFILE {limits.open_files}{raised}, vm.max_map_count {maps}, "
        f"{limits.headroom} files kept for the ledger, connections and threads"
    )
    files = min(limits.file_budget, budget)
    if limits.parks_entries:
        basis += (
            f"; idle entries keep no open file: {files} of the regions may hold one "
            "(buffers, entries being written)"
        )
    if min(budget, files) < MIN_USEFUL_REGIONS:
        budget = min(budget, files)
        need = open_files_needed(limits)
        return Check(
            name,
            "fail",
            f"maasd serve would refuse to start: budget {budget} regions from {basis}",
            f"raise the hard open-files limit to ≥ {need} (LimitNOFILE= in the unit, "
            "--ulimit nofile= for a container), or lower socket_max_connections"
            if need is not None
            else f"raise vm.max_map_count to ≥ {maps_needed(MIN_USEFUL_REGIONS)}",
        )
    want, why = region_need(max_per_tenant, tenant_caps, pool_regions)
    share = limits.tenant_budget
    caps = caps_of(max_per_tenant, tenant_caps)
    wanted = regions_wanted(caps, limits.tenant_share, pool_regions)
    detail = (
        f"{budget} entries or buffers in all, {share} per tenant "
        f"(tenant_region_share {limits.tenant_share:g}), from {basis} ({limits.binding} "
        f"binds); could need {want}: {why}"
    )
    if wanted > budget:
        if limits.parks_entries:  # entries need mappings only; buffers keep files
            maps_need = maps_needed(wanted)
            fix = f"for {wanted} entries: vm.max_map_count ≥ {maps_need} (sysctl -w vm.max_map_count={maps_need})"
        else:
            need = open_files_needed(dataclasses.replace(limits, max_map_count=None), wanted)
            fix = f"for {wanted} regions: LimitNOFILE ≥ {need}{_maps_fix(limits, wanted)}"
        return Check(
            name,
            "warn",
            f"below what could be asked for: {detail}; a tenant at its cap needs "
            f"{regions_wanted([max(caps)], limits.tenant_share, pool_regions)} in all",
            f"{fix}, or lower the tenants' max_buffers / max_buffers_per_tenant, or raise "
            "tenant_region_share",
        )
    return _above_file_share(limits, caps, files, detail) or Check(name, "ok", detail)


def _above_file_share(
    limits: ProcessLimits, caps: list[int], files: int, detail: str
) -> Check | None:
    """Where idle entries park, buffers (and entries being written) still keep an open
    file: a warning when a tenant's cap is above its share of those (the daemon refuses
    them there, below the cap), else None."""
    from maasd.core.limits import open_files_needed

    file_share = limits.tenant_file_budget
    if not limits.parks_entries or max(caps) <= file_share:
        return None
    need = open_files_needed(
        dataclasses.replace(limits, max_map_count=None),
        math.ceil(max(caps) / limits.tenant_share),
    )
    return Check(
        "region budget",
        "warn",
        f"{detail}; but a tenant's buffers and entries being written (each keeps an "
        f"open file) stop at {file_share}, its share of the {files} that may hold one, "
        f"below its cap of {max(caps)} (idle entries park past it)",
        f"for a tenant at its cap in buffers: LimitNOFILE ≥ {need}, or lower the tenants' "
        "max_buffers / max_buffers_per_tenant, or raise tenant_region_share",
    )


#: Where the kernel says how many inotify watches one user may hold (one per entry).
INOTIFY_WATCHES = "/proc/sys/fs/inotify/max_user_watches"


def check_entry_fds(settings: Settings, regions: int) -> Check:
    """What an idle committed entry costs this host's daemon (:mod:`maasd.allocator.parking`),
    and whether ``fs.inotify.max_user_watches`` holds ``regions`` entries (each committed
    entry is watched: :mod:`maasd.core.holders`)."""
    from maasd.core.limits import parks_entries

    try:
        watches: int | None = int(Path(INOTIFY_WATCHES).read_text())
    except (OSError, ValueError):
        watches = None
    if watches is not None and watches < regions:
        return Check(
            "entry cost",
            "warn",
            f"fs.inotify.max_user_watches is {watches}: the daemon watches each committed "
            f"entry, and its budget holds {regions}; commits past it answer 507",
            f"sysctl -w fs.inotify.max_user_watches={regions + 8192} (and in /etc/sysctl.d)",
        )
    watched = "" if watches is None else f"; fs.inotify.max_user_watches {watches}"
    if parks_entries(settings):
        return Check(
            "entry cost",
            "ok",
            "an idle entry holds one mapping and no open file (re-opened through "
            f"/proc/self/map_files: CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN){watched}",
        )
    why = (
        'entry_fds = "keep"'
        if settings.entry_fds == "keep"
        else "this process cannot open /proc/self/map_files (no CAP_CHECKPOINT_RESTORE)"
    )
    return Check(
        "entry cost",
        "ok" if settings.entry_fds == "keep" else "warn",
        f"an idle entry holds one mapping and one open file: {why}{watched}",
        ""
        if settings.entry_fds == "keep"
        else "grant the daemon CAP_CHECKPOINT_RESTORE (AmbientCapabilities= in the unit, "
        "--cap-add for a container) to hold entries by mappings alone",
    )


def _maps_fix(limits: ProcessLimits, regions: int) -> str:
    """`` and vm.max_map_count ≥ N (…)`` when the host's is below what ``regions`` need."""
    from maasd.core.limits import maps_needed

    need = maps_needed(regions)
    if limits.max_map_count is not None and limits.max_map_count >= need:
        return ""
    return f" and vm.max_map_count ≥ {need} (sysctl -w vm.max_map_count={need})"


def _pool_regions(settings: Settings, topology: Topology) -> int:
    from maasd.settings import default_pools

    pools = settings.pools or default_pools(
        topology, settings.default_pool_bytes, settings.default_warm_bytes
    )
    return sum(p.capacity_bytes // topology.page_bytes_of(p.backing) for p in pools)


def check_regions(
    settings: Settings,
    topology: Topology,
    *,
    open_files: int | None = None,
    max_map_count: int | None = None,
) -> list[Check]:
    """The region budget under this host's limits, or under ``open_files`` (a
    ``LimitNOFILE``) and ``max_map_count`` given instead (``--nofile``, ``--max-map-count``),
    and what an entry costs here (:func:`check_entry_fds`)."""
    from maasd.cli.doctor_ledger import ledger_tenant_caps
    from maasd.core.limits import max_map_count as read_max_map_count
    from maasd.core.limits import settings_limits
    from maasd.store.engine import normalize_url

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        url = normalize_url(settings.database_url)
    except ConfigError as e:
        return [Check("region budget", "fail", e.detail, "fix MAASD_DB_URL / --db")]
    if open_files is None:
        open_files = soft if hard == resource.RLIM_INFINITY else hard
    else:
        soft = open_files
    limits = settings_limits(
        settings,
        open_files,
        read_max_map_count() if max_map_count is None else max_map_count,
        postgres=url.get_backend_name() == "postgresql",
    )
    return [
        check_region_budget(
            limits,
            settings.max_buffers_per_tenant,
            ledger_tenant_caps(url),
            _pool_regions(settings, topology),
            soft_now=soft,
        ),
        check_entry_fds(settings, limits.region_budget),
    ]
