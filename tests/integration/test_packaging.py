"""The wheel ships every package under maasd/, its type marker and the Alembic scripts.

Packages are discovered (``[tool.setuptools.packages.find]``), so this test walks the
source tree rather than listing them: a new subpackage is checked without editing it.
The wheel is built by pip from a copy of the sources (in isolation, as a user's
``pip install`` would), so the checkout gets no ``build/`` directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]


def source_packages() -> set[str]:
    """Every directory under maasd/ that holds modules (namespace packages too), as wheel
    paths; the migrations symlink is left to its own test."""
    found = set()
    for root, dirnames, files in os.walk(REPO / "maasd"):
        dirnames[:] = [
            d for d in dirnames if d != "__pycache__" and not (Path(root) / d).is_symlink()
        ]
        if any(f.endswith(".py") for f in files):
            found.add(Path(root).relative_to(REPO).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("maasd", "migrations"):
        shutil.copytree(
            REPO / name,
            src / name,
            symlinks=True,  # maasd/migrations stays the link it is in the checkout
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("maasd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_the_walk_sees_the_known_packages() -> None:
    # Guards the walk itself: an empty result would make the next test pass vacuously.
    assert {"maasd", "maasd/allocator", "maasd/api", "maasd/cli", "maasd/store"} <= (
        source_packages()
    )


def test_every_package_and_module_is_in_the_wheel(wheel_files: set[str]) -> None:
    for package in sorted(source_packages()):
        modules = {p.relative_to(REPO).as_posix() for p in (REPO / package).glob("*.py")}
        missing = modules - wheel_files
        assert not missing, f"{package}: not in the wheel: {sorted(missing)}"


def test_the_type_marker_is_in_the_wheel(wheel_files: set[str]) -> None:
    assert "maasd/py.typed" in wheel_files


def test_the_migrations_are_in_the_wheel_as_maasd_migrations(wheel_files: set[str]) -> None:
    expected = {
        f"maasd/{p.relative_to(REPO).as_posix()}"
        for p in [
            REPO / "migrations" / "env.py",
            REPO / "migrations" / "script.py.mako",
            *(REPO / "migrations" / "versions").glob("*.py"),
        ]
    }
    assert any(name.startswith("maasd/migrations/versions/") for name in expected)
    assert expected <= wheel_files, sorted(expected - wheel_files)
    assert not any(name.startswith("migrations/") for name in wheel_files)  # not top level


def test_the_api_pages_assets_are_in_the_wheel(wheel_files: set[str]) -> None:
    # /docs serves Swagger UI from the package (no CDN): every vendored file ships.
    assets = REPO / "maasd" / "api" / "swagger_ui"
    expected = {f"maasd/api/swagger_ui/{p.name}" for p in assets.iterdir()}
    assert "maasd/api/swagger_ui/swagger-ui-bundle.js" in expected
    assert expected <= wheel_files, sorted(expected - wheel_files)
