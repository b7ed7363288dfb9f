"""scripts/numa-guest's choice of accelerator and its fall back from KVM to TCG.

A real guest takes minutes to boot under TCG (CI boots one for tests/multinode), so here
virtme-ng is replaced by a stand-in (``MAASD_VNG_VENV``) that runs the script's own
runner on this host, as the guest would, when asked for TCG, and hangs like a KVM guest
that never gets through its boot (PVM: docs/allocator.md, "Placement") when asked for
KVM. What is tested is the script's logic: which accelerator it asks for, that a stuck
KVM boot is stopped (its whole process group) after ``--boot-timeout``, and that the
command then runs under TCG with its output and exit status passed back.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "numa-guest"

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None
    or not glob.glob("/boot/vmlinuz-6.1.*")
    or not (os.path.exists("/bin/busybox") or shutil.which("busybox")),
    reason="the guest's packages are not installed (numa-guest would install them)",
)

FAKE_VNG = """#!/bin/sh
# virtme-ng's stand-in: records its arguments; TCG runs --exec here, KVM hangs.
echo "$*" >> "$FAKE_VNG_LOG"
case " $* " in
  *" --disable-kvm "*) ;;
  *) echo $$ > "$FAKE_VNG_LOG.kvm-pid"; exec sleep 600 ;;
esac
while [ $# -gt 0 ]; do
  if [ "$1" = --exec ]; then sh -c "$2"; exit 0; fi
  shift
done
exit 1
"""


def guest(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    venv = tmp_path / "vng"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    vng = venv / "bin" / "vng"
    vng.write_text(FAKE_VNG)
    vng.chmod(0o755)
    env = {
        **os.environ,
        "MAASD_VNG_VENV": str(venv),
        "FAKE_VNG_LOG": str(tmp_path / "vng.log"),
    }
    return subprocess.run(
        [str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "vng.log").read_text().splitlines()


def test_tcg_runs_the_command_and_passes_its_status_back(tmp_path: Path) -> None:
    r = guest(tmp_path, "--tcg", "--", "sh", "-c", "echo from-the-guest; exit 3")
    assert r.returncode == 3, r.stderr
    assert "from-the-guest" in r.stdout
    (call,) = calls(tmp_path)
    assert "--disable-kvm" in call.split()


def test_a_kvm_boot_that_never_starts_the_command_falls_back_to_tcg(tmp_path: Path) -> None:
    r = guest(
        tmp_path,
        "--kvm",
        "--boot-timeout",
        "3",
        "--kvm-opt",
        "-cpu qemu64",
        "--",
        "sh",
        "-c",
        "echo ran-under-tcg",
    )
    assert r.returncode == 0, r.stderr
    assert "ran-under-tcg" in r.stdout
    assert "booting again under TCG" in r.stderr
    kvm, tcg = calls(tmp_path)
    assert "--disable-kvm" not in kvm.split()
    assert "--qemu-opts=-cpu qemu64" in kvm
    # the KVM options are for a KVM boot only
    assert "--disable-kvm" in tcg.split()
    assert "qemu64" not in tcg
    # the hung boot was stopped, not left behind
    pid = int((tmp_path / "vng.log.kvm-pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_auto_takes_kvm_only_with_hardware_virtualization(tmp_path: Path) -> None:
    r = guest(tmp_path, "--boot-timeout", "3", "--", "true")
    assert r.returncode == 0, r.stderr
    flags = Path("/proc/cpuinfo").read_text().split()
    usable = os.access("/dev/kvm", os.R_OK | os.W_OK) and ("vmx" in flags or "svm" in flags)
    first = calls(tmp_path)[0].split()
    assert ("--disable-kvm" not in first) == usable
    if not usable and os.path.exists("/dev/kvm"):
        assert "TCG: no vmx/svm" in r.stderr


def test_an_unknown_accelerator_is_refused(tmp_path: Path) -> None:
    r = guest(tmp_path, "--accel", "hvf", "--", "true")
    assert r.returncode == 2
    assert "--accel takes auto, kvm or tcg" in r.stderr
