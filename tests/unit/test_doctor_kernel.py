"""``maasd doctor``'s kernel check on this host, and on the settings it must refuse."""

from __future__ import annotations

import pytest

from maasd.cli import doctor_kernel
from maasd.cli.doctor import CHECKS, Settings, run_checks


def test_this_kernel_is_fine() -> None:
    c = doctor_kernel.check_kernel()
    assert c.status == "ok", c
    assert "MADV_POPULATE_READ/WRITE" in c.detail


@pytest.mark.parametrize(("value", "status"), [("0", "ok"), ("1", "ok"), ("2", "fail")])
def test_memfd_noexec(monkeypatch, tmp_path, value: str, status: str) -> None:
    sysctl = tmp_path / "memfd_noexec"
    sysctl.write_text(value + "\n")
    monkeypatch.setattr(doctor_kernel, "MEMFD_NOEXEC", sysctl)
    c = doctor_kernel.check_kernel()
    assert c.status == status, c
    assert f"vm.memfd_noexec {value}" in c.detail or "MFD_NOEXEC_SEAL" in c.detail
    if status == "fail":
        assert "vm.memfd_noexec=1" in c.fix


def test_no_sysctl_before_6_3(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(doctor_kernel, "MEMFD_NOEXEC", tmp_path / "absent")
    assert "vm.memfd_noexec absent" in doctor_kernel.check_kernel().detail


def test_it_runs_first_and_can_be_skipped(tmp_path) -> None:
    assert CHECKS[0] == "kernel"
    checks = run_checks(Settings(data_dir=str(tmp_path)), skip=frozenset(set(CHECKS) - {"kernel"}))
    assert [(c.name, c.status) for c in checks if c.status != "skip"] == [("kernel", "ok")]


@pytest.mark.parametrize(("hard", "status"), [(0, "warn"), (16384, "ok")])
def test_pipe_pages(tmp_path, hard: int, status: str) -> None:
    """A uid's pipes hold released pages the daemon cannot count: unbounded is a warning."""
    (tmp_path / "pipe-user-pages-hard").write_text(f"{hard}\n")
    (tmp_path / "pipe-user-pages-soft").write_text("16384\n")
    c = doctor_kernel.check_pipe_pages(tmp_path)
    assert c.status == status, c
    assert f"fs.pipe-user-pages-hard {hard}" in c.detail
    if status == "warn":
        assert "splice, vmsplice" in c.detail
        assert "sysctl -w fs.pipe-user-pages-hard=16384" in c.fix
    assert doctor_kernel.check_pipe_pages(tmp_path / "absent").status == "warn"
