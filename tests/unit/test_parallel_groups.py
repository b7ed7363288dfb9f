"""Which modules share a pytest-xdist worker (tests/parallel.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import hugepages
from parallel import _group_of


def _module(name: str, **names: object) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(names)
    return module


@pytest.mark.parametrize(
    ("module", "seen", "group"),
    [
        (_module("test_plain"), set(), "test_plain"),
        (_module("test_plain"), {"postgres", "daemon"}, "test_plain"),
        (_module("test_marked"), {"hugetlb"}, "hugepages"),
        (_module("test_hog", Hog=hugepages.Hog), set(), "hugepages"),
        (_module("test_helpers", hugepages=hugepages), set(), "hugepages"),
        (_module("test_model"), {"llama"}, "llama"),
        (_module("test_fleet"), {"routers", "daemon"}, "llama"),
        (_module("test_both", Hog=hugepages.Hog), {"llama"}, "hugepages"),
    ],
)
def test_a_module_runs_in_its_own_group_unless_it_shares_a_host_resource(
    module: types.ModuleType, seen: set[str], group: str
) -> None:
    assert _group_of(module, seen) == group


PLAIN = """
import os


def _ran(name):
    with open(os.path.join(os.environ["RAN_DIR"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))

"""


def test_under_xdist_a_modules_tests_and_a_groups_modules_share_one_worker(
    tmp_path: Path,
) -> None:
    """The whole chain, as scripts/test runs it: the plugin's markers reach pytest-xdist's
    scheduler (they do not if its hook runs after xdist's, or under pytest 9.2)."""
    ran = tmp_path / "ran"
    ran.mkdir()
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ("parallel",)\n')
    for name in ("a", "b", "c"):
        body = PLAIN + "".join(f"def test_{i}():\n    _ran('{name}{i}')\n\n" for i in range(6))
        (suite / f"test_{name}.py").write_text(body)
    for name in ("h1", "h2"):  # two modules that share the huge pages
        body = "import pytest\npytestmark = pytest.mark.hugetlb\n" + PLAIN
        body += "".join(f"def test_{i}():\n    _ran('{name}{i}')\n\n" for i in range(3))
        (suite / f"test_{name}.py").write_text(body)
    tests_dir = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "RAN_DIR": str(ran),
        "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadgroup", "-o", "markers=hugetlb", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    worker = {p.name: p.read_text() for p in ran.iterdir()}
    assert len(worker) == 3 * 6 + 2 * 3
    assert set(worker.values()) <= {"gw0", "gw1"}
    for name in ("a", "b", "c"):
        assert len({worker[f"{name}{i}"] for i in range(6)}) == 1, worker
    hugepage_workers = {worker[f"{m}{i}"] for m in ("h1", "h2") for i in range(3)}
    assert len(hugepage_workers) == 1, worker
