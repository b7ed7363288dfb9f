"""``maasd doctor`` runs its real checks; each fault is made real, then seen and explained.

Faults come from settings and fixtures, never from mocks: a socket directory of mode
0777, a ledger URL nobody listens on, a ledger behind (or ahead of) the migrations,
RLIMIT_NOFILE lowered in the child (``preexec_fn``), and a sysfs tree whose nodes
have no huge pages reserved while the config asks for a hugetlb pool.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maasd.allocator import parking
from maasd.cli.doctor import needs
from maasd.settings import Settings
from maasd.store import Store

REPO = Path(__file__).resolve().parents[2]
SYSFS_TWO_NODES = REPO / "tests" / "data" / "sysfs_two_nodes"


NEED_FILES = needs(Settings()).files
HARD_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
#: Whether this machine lets a child raise its open-files limit to what the daemon needs
#: (without CAP_SYS_RESOURCE the hard limit is the ceiling).
FILES_ENOUGH = HARD_FILES == resource.RLIM_INFINITY or HARD_FILES >= NEED_FILES


def _enough_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NEED_FILES if FILES_ENOUGH else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))


def doctor(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = _enough_files,
) -> tuple[int, dict[str, dict[str, Any]], str]:
    """Run ``maasd doctor --json``; returns (exit code, checks by name, stderr)."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MAASD_") or k == "MAASD_TEST_PG_URL"
    }
    full_env.update({"MAASD_DATA_DIR": str(tmp_path / "data"), **(env or {})})
    if "--with-llama" in args:  # the llama eval takes seconds: only where it is the point
        args = tuple(a for a in args if a != "--with-llama")
    else:
        args = (*args, "--skip", "llama-cpp-python")
    p = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "doctor", "--json", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,
    )
    assert p.stdout, p.stderr
    report = json.loads(p.stdout)
    assert report["ok"] == (p.returncode == 0), report
    return p.returncode, {c["name"]: c for c in report["checks"]}, p.stderr


def test_a_host_that_can_run_the_daemon_passes(tmp_path: Path) -> None:
    code, checks, err = doctor(tmp_path, "--with-llama")
    assert checks["memfd seals"]["status"] == "ok"
    assert "FUTURE_WRITE" in checks["memfd seals"]["detail"]
    assert checks["hugetlb memfd"]["status"] == "ok"
    assert checks["NUMA placement"]["status"] == "ok"
    assert checks["tasks"]["status"] == "ok"
    assert checks["socket directory"]["status"] == "ok"
    assert checks["ledger"]["status"] == "ok"
    assert checks["llama-cpp-python"]["status"] in ("ok", "warn", "skip")
    if FILES_ENOUGH:
        assert checks["open files"]["status"] == "ok"
        assert code == 0, (checks, err)
    else:  # this machine's hard limit is below the need: the one failure is that
        assert checks["open files"]["status"] == "fail"
        assert f"RLIMIT_NOFILE is {HARD_FILES}" in checks["open files"]["detail"]
        failed = {c["name"] for c in checks.values() if c["status"] == "fail"}
        assert "open files" in failed
        assert failed <= {"open files", "region budget"}  # no useful budget below ~970


def test_the_table_names_each_check_and_a_failure_exits_1(tmp_path: Path) -> None:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    sock_dir.chmod(0o777)
    p = subprocess.run(
        [
            *(sys.executable, "-m", "maasd.cli.daemon", "doctor"),
            *("--socket", str(sock_dir / "s"), "--skip", "llama-cpp-python"),
        ],
        # wide enough for the fix's path on one line (pytest-xdist's tmp paths are longer)
        env={**os.environ, "MAASD_DATA_DIR": str(tmp_path / "data"), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    for name in ("memfd seals", "NUMA placement", "open files", "socket directory", "ledger"):
        assert name in p.stdout
    assert f"chmod 0750 {sock_dir}" in p.stdout


def test_a_world_writable_socket_dir_fails_with_its_fix(tmp_path: Path) -> None:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    sock_dir.chmod(0o777)
    code, checks, _ = doctor(tmp_path, env={"MAASD_SOCKET": str(sock_dir / "maasd.sock")})
    c = checks["socket directory"]
    assert c["status"] == "fail"
    assert "writable by anyone" in c["detail"]
    assert c["fix"] == f"chmod 0750 {sock_dir}"
    assert code == 1


def test_a_socket_dir_its_workers_cannot_reach_fails(tmp_path: Path) -> None:
    import grp

    other = next(g for g in grp.getgrall() if g.gr_gid != os.stat(tmp_path).st_gid)
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o700)
    code, checks, _ = doctor(
        tmp_path,
        env={"MAASD_SOCKET": str(sock_dir / "maasd.sock"), "MAASD_SOCKET_GROUP": other.gr_name},
    )
    c = checks["socket directory"]
    assert c["status"] == "fail"
    assert f"workers of group {other.gr_name} cannot reach" in c["detail"]
    assert code == 1
    if os.geteuid() == 0:  # the fix the check proposes: the workers' group, g+x
        os.chown(sock_dir, -1, other.gr_gid)
        sock_dir.chmod(0o750)
    else:  # or o+x, which reaches it too
        sock_dir.chmod(0o751)
    _, checks, _ = doctor(
        tmp_path,
        env={"MAASD_SOCKET": str(sock_dir / "maasd.sock"), "MAASD_SOCKET_GROUP": other.gr_name},
    )
    assert checks["socket directory"]["status"] == "ok", checks["socket directory"]


def test_an_unreachable_ledger_fails(tmp_path: Path) -> None:
    from conftest import free_port

    url = f"postgresql+psycopg://maasd:secret@127.0.0.1:{free_port()}/maasd"
    code, checks, _ = doctor(tmp_path, env={"MAASD_DB_URL": url})
    c = checks["ledger"]
    assert c["status"] == "fail"
    assert "secret" not in c["detail"]  # the password is not shown
    assert "Connection refused" in c["detail"] or "connection" in c["detail"].lower()
    assert code == 1


def test_a_ledger_behind_the_migrations_warns_and_one_ahead_fails(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = data / "maasd.db"
    store = Store(f"sqlite:///{db}")
    store.upgrade("0001")
    store.dispose()
    code, checks, _ = doctor(tmp_path)
    c = checks["ledger"]
    assert c["status"] == "warn"
    assert "at 0001" in c["detail"]
    assert "maasd migrate" in c["fix"]

    with sqlite3.connect(db) as conn:  # as if a newer maasd had migrated it
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    code, checks, _ = doctor(tmp_path)
    assert checks["ledger"]["status"] == "fail"
    assert "does not know" in checks["ledger"]["detail"]
    assert code == 1


def test_a_lowered_open_files_limit_fails(tmp_path: Path) -> None:
    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    code, checks, _ = doctor(tmp_path, preexec=low)
    c = checks["open files"]
    assert c["status"] == "fail"
    assert "RLIMIT_NOFILE is 256" in c["detail"]
    assert "LimitNOFILE" in c["fix"]
    # 256 files cannot even hold the connections' headroom: no buffer could be reserved
    budget = checks["region budget"]
    assert budget["status"] == "fail"
    assert "would refuse to start: budget 0 regions from RLIMIT_NOFILE 256" in budget["detail"]
    assert code == 1


def test_the_region_budget_is_weighed_against_the_ledgers_tenants(tmp_path: Path) -> None:
    def files_4096() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))

    # M = 4096 (the hard limit serve raises to), 64 socket connections: 3000 regions
    # (docs/operations.md, "Limits"), unless vm.max_map_count binds first; a tenant's
    # share (a quarter) holds its cap of 700. Idle entries keep their fd here (where
    # they park, the mappings alone bind them: the next test).
    env = {
        "MAASD_SOCKET_MAX_CONNECTIONS": "64",
        "MAASD_MAX_BUFFERS_PER_TENANT": "700",
        "MAASD_ENTRY_FDS": "keep",
    }
    _, checks, _ = doctor(tmp_path, env=env, preexec=files_4096)
    c = checks["region budget"]
    assert c["status"] == "ok", c
    assert "RLIMIT_NOFILE 4096 (raised from 1024 by maasd serve)" in c["detail"]
    budget = int(c["detail"].split(" entries or buffers")[0])
    assert 0 < budget <= 3000
    assert "could need 700: one tenant at max_buffers_per_tenant" in c["detail"]

    data = tmp_path / "data"
    data.mkdir()
    store = Store(f"sqlite:///{data / 'maasd.db'}")
    store.upgrade()
    tenants = budget // 700 + 1  # together they could hold more than the budget
    for i in range(tenants):
        store.tenants.add_tenant(f"t{i}", f"team-{i}", 1 << 30, 0.0)
    store.dispose()
    _, checks, _ = doctor(tmp_path, env=env, preexec=files_4096)
    c = checks["region budget"]
    assert c["status"] == "warn", c
    assert f"could need {tenants * 700}: {tenants} tenant(s) at their caps" in c["detail"]
    assert "max_buffers_per_tenant" in c["fix"]


def test_doctor_says_what_an_idle_entry_costs_and_which_limit_binds(tmp_path: Path) -> None:
    def files_4096() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))

    _, checks, _ = doctor(tmp_path, env={"MAASD_ENTRY_FDS": "keep"}, preexec=files_4096)
    assert checks["entry cost"]["status"] == "ok"
    assert "one mapping and one open file: entry_fds" in checks["entry cost"]["detail"]
    if not parking.can_park():
        return
    _, checks, _ = doctor(tmp_path, preexec=files_4096)
    c = checks["entry cost"]
    assert c["status"] == "ok", c
    assert "one mapping and no open file" in c["detail"]
    budget = checks["region budget"]
    assert "idle entries keep no open file" in budget["detail"]
    assert "for regions, RLIMIT_NOFILE 4096 for those with an open file binds" in budget["detail"]
    regions = int(budget["detail"].split(" entries or buffers")[0])
    assert regions > 4096  # more entries than open files


def test_no_huge_pages_for_a_hugetlb_pool_fails(tmp_path: Path) -> None:
    sysfs = tmp_path / "sysfs"
    shutil.copytree(SYSFS_TWO_NODES, sysfs)
    for f in sysfs.glob("node*/hugepages/hugepages-2048kB/*_hugepages"):
        f.write_text("0\n")
    config = tmp_path / "maasd.toml"
    config.write_text(
        '[[pools]]\nname = "huge"\nnuma_node = 1\ncapacity_bytes = 1073741824\n'
        'backing = "hugetlb"\n'
    )
    code, checks, _ = doctor(
        tmp_path, "--sysfs-root", str(sysfs), env={"MAASD_CONFIG": str(config)}
    )
    c = checks["huge pages"]
    assert c["status"] == "fail"
    assert "node 1 has 0, hugetlb pools want 512" in c["detail"]
    assert "nr_hugepages" in c["fix"]
    assert code == 1


def test_the_memory_checks_use_the_allocators_own_memfds_and_regions():
    """The seal check seals as a committed entry is sealed (``maasd.allocator.add_seals``
    with ``F_SEAL_FUTURE_WRITE``), and the NUMA check places a real ``Region`` on each node
    and counts its pages with ``Region.placement``: on this host both hold."""
    from maasd.allocator import F_SEAL_FUTURE_WRITE, SEALS
    from maasd.cli.doctor_memory import check_memfd_seals, check_numa
    from maasd.topology import discover

    topology = discover()
    seals = check_memfd_seals(topology)
    assert seals.status == "ok", seals
    assert f"{SEALS | F_SEAL_FUTURE_WRITE:#x}" in seals.detail
    numa = check_numa(topology)
    assert numa.status == "ok", numa
    assert f"{len(topology.nodes)} node(s)" in numa.detail
