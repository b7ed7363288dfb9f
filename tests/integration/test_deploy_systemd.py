"""deploy/systemd: the unit verifies, its filter allows what the allocator calls, its limits
cover the daemon's caps, and the daemon works under the kernel mechanisms it turns on.

``systemd-analyze`` (Debian's ``systemd`` package) runs without systemd as PID 1: it
loads the unit file and reports unknown keys, bad values and missing executables. A
unit cannot be *started* here, so ``MemoryDenyWriteExecute=`` and ``NoNewPrivileges=``
are checked by starting a real daemon under the same kernel switches systemd uses
(``prctl(PR_SET_MDWE)``, ``prctl(PR_SET_NO_NEW_PRIVS)``) and using memory through it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from conftest import Daemon
from maasd.cli.doctor import needs
from maasd.client import Worker
from maasd.settings import Settings

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "maasd.service"
ROUTER_UNIT = REPO / "deploy" / "systemd" / "maasd-router.service"
MiB = 1 << 20

analyze = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    analyze is None, reason="systemd-analyze not installed (Debian package systemd)"
)


def unit_values(text: str) -> dict[str, list[str]]:
    """``Key`` → its values, in order (systemd keys may repeat), comments skipped."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def verify(
    tmp_path: Path, text: str, name: str = "maasd.service"
) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of ``text`` with ExecStart pointing at this venv's maasd
    (the unit's /opt/maasd does not exist here; verify checks that it is executable)."""
    maasd = Path(sys.executable).parent / "maasd"
    unit = tmp_path / name
    unit.write_text(text.replace("/opt/maasd/bin/maasd", str(maasd)))
    assert analyze is not None
    return subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120
    )


@needs_analyze
def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    r = verify(tmp_path, UNIT.read_text())
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "maasd.service" in line]
    assert r.returncode == 0, r.stdout + r.stderr
    assert not complaints, complaints


@needs_analyze
def test_the_router_unit_verifies_clean(tmp_path: Path) -> None:
    r = verify(tmp_path, ROUTER_UNIT.read_text(), "maasd-router.service")
    complaints = [x for x in (r.stdout + r.stderr).splitlines() if "maasd-router.service" in x]
    assert r.returncode == 0, r.stdout + r.stderr
    assert not complaints, complaints


def test_the_router_unit_reaches_the_daemons_socket_and_starts_its_backends() -> None:
    """docs/llama-server.md, "systemd": after maasd, in the socket's group, the daemon's
    socket path, and a command line the router accepts (no flag it sets itself)."""
    from maasd.router.backend import check_server_args

    daemon = unit_values(UNIT.read_text())
    router = unit_values(ROUTER_UNIT.read_text().replace("\\\n", " "))  # continuations
    assert "maasd.service" in router["After"][0].split()
    assert router["SupplementaryGroups"] == daemon["Group"]
    socket = next(
        e.split("=", 1)[1] for e in daemon["Environment"] if e.startswith("MAASD_SOCKET=")
    )
    (cmd,) = router["ExecStart"]
    argv = cmd.split()
    assert argv[argv.index("--socket") + 1] == socket
    assert argv[argv.index("--backends") + 1].isdigit()
    check_server_args(argv[argv.index("--") + 1 :])  # raises on a flag the router sets


@needs_analyze
def test_verify_would_see_a_mistake(tmp_path: Path) -> None:
    # The check above can fail: a misspelt key is reported (systemd only warns, rc 0).
    r = verify(tmp_path, UNIT.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    assert "Unknown key" in r.stdout + r.stderr


@cache
def syscall_group(name: str) -> frozenset[str]:
    """The system calls of a ``@group``, nested groups expanded."""
    assert analyze is not None
    out = subprocess.run(
        [analyze, "syscall-filter", name], capture_output=True, text=True, check=True
    ).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        calls |= syscall_group(item) if item.startswith("@") else {item}
    return frozenset(calls)


@needs_analyze
def test_the_syscall_filter_allows_what_the_allocator_calls() -> None:
    (spec,) = unit_values(UNIT.read_text())["SystemCallFilter"]
    assert not spec.startswith("~")  # an allow list
    allowed: set[str] = set()
    for item in spec.split():
        allowed |= syscall_group(item) if item.startswith("@") else {item}
    wanted = {
        "memfd_create",  # every region
        "fcntl",  # seals
        "ftruncate",
        "fallocate",  # punch scrub
        "mmap",
        "madvise",  # prefault (MADV_POPULATE_WRITE)
        "mbind",  # placement
        "move_pages",  # placement check, pin
        "get_mempolicy",
        "set_mempolicy",
        "sendmsg",  # SCM_RIGHTS
        "recvmsg",
    }
    assert wanted <= allowed, sorted(wanted - allowed)


def test_the_limits_cover_the_daemons_caps() -> None:
    values = unit_values(UNIT.read_text())
    need = needs(Settings())
    assert int(values["LimitNOFILE"][0]) >= need.files
    assert int(values["TasksMax"][0]) >= need.tasks
    # the comment's sum is the doctor's sum
    text = UNIT.read_text()
    assert f"= {need.files} ->" in text
    assert f"= {need.tasks} ->" in text


def test_the_unit_and_its_sandbox_switches() -> None:
    values = unit_values(UNIT.read_text())
    assert values["Type"] == ["notify"]
    assert values["LoadCredential"] == ["admin-key:/etc/maasd/admin.key"]
    assert values["RuntimeDirectory"] == ["maasd"]
    assert values["RuntimeDirectoryMode"] == ["0750"]
    assert "MAASD_SOCKET=/run/maasd/maasd.sock" in values["Environment"]
    assert set(values["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    for on in ("NoNewPrivileges", "MemoryDenyWriteExecute", "LockPersonality", "PrivateTmp"):
        assert values[on] == ["yes"], on
    assert values["ProtectSystem"] == ["strict"]


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="no systemd-sysusers")
def test_sysusers_and_tmpfiles_snippets_apply(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    sysusers = subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(REPO / "deploy/systemd/maasd.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sysusers.returncode == 0, sysusers.stderr
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    (gid,) = re.findall(r"^maasd-workers:x:(\d+):", group, re.M)
    assert re.search(rf"^maasd:x:\d+:{gid}:", passwd, re.M), passwd  # primary group
    tmpfiles = subprocess.run(
        [
            "systemd-tmpfiles",
            f"--root={root}",
            "--create",
            str(REPO / "deploy/systemd/maasd.tmpfiles"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tmpfiles.returncode == 0, tmpfiles.stderr
    assert oct((root / "etc/maasd").stat().st_mode & 0o777) == "0o700"


# What systemd does for MemoryDenyWriteExecute=yes (on kernels with PR_SET_MDWE) and
# NoNewPrivileges=yes, then exec the daemon (a Daemon ``wrapper``: its argv follows).
SANDBOXED = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_SET_MDWE, PR_GET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 38, 65, 66, 1
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    sys.exit("PR_SET_NO_NEW_PRIVS failed")
if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(f"PR_SET_MDWE failed: errno {ctypes.get_errno()}")
os.execv(sys.argv[1], sys.argv[1:])  # the daemon's command line, after this script
"""


def _mdwe_supported() -> bool:
    probe = "import ctypes,sys; sys.exit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


@pytest.mark.skipif(not _mdwe_supported(), reason="kernel without PR_SET_MDWE (Linux < 6.3)")
def test_the_daemon_works_with_no_new_privileges_and_no_write_execute(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "maasd", wrapper=[sys.executable, "-c", SANDBOXED])
    try:
        d.start()
        status = Path(f"/proc/{d.proc.pid}/status").read_text() if d.proc else ""
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), status
        _, key = d.tenant("sandboxed", 64 * MiB)
        with d.client(key) as user:
            r = user.post("/v1/reserve", json={"size_bytes": 8 * MiB, "ttl_s": 60})
            assert r.status_code == 201, r.text
            buf = r.json()
            assert (
                user.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": 0}).status_code == 200
            )
            with Worker(d.socket_path, key, renew_interval_s=0) as w:
                m = w.attach(buf["id"])
                m.array[:] = 7
                assert int(np.count_nonzero(m.array)) == 8 * MiB
                m.close()
            assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
        assert d.stop() == 0, d.log()
    finally:
        d.close()
