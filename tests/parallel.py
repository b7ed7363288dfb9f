"""How ``scripts/test`` spreads the suite over CPUs (pytest-xdist, ``--dist loadgroup``).

Every test of a module runs on one worker, after one another (a module-scoped daemon is
started once), and modules that share a host-wide resource run on one worker too, so
that they never run at the same time as each other:

- ``hugepages``: the modules that take huge pages (the ``hugetlb`` marker, or the
  ``tests/hugepages.py`` helpers: a hog takes every free huge page, a test raises and
  restores ``vm.nr_hugepages``);
- ``llama``: the modules that evaluate a model (the ``llama`` marker, or a llama-server
  fleet): two evaluations at once on two CPUs would each take twice as long, and the
  router's tests judge a backend by how soon it answers.

Without xdist (``MAASD_TEST_WORKERS=1``, or ``pytest`` run by hand) the markers change
nothing.

Two things make the markers count, and ``tests/unit/test_parallel_groups.py`` runs a small
suite under xdist to prove they still do: this hook runs first (pytest-xdist reads the
markers in its own ``pytest_collection_modifyitems`` on each worker), and pytest is older
than 9.2 (whose node ids ignore the group xdist 3.8 writes into them:
pytest-dev/pytest-xdist#1386). Without either, every test is scheduled on its own: a
module's tests are spread over workers, each starting its own module-scoped daemon.
"""

from __future__ import annotations

import types

import pytest

#: The fixtures (tests/router_fleet.py) of a module that runs llama-server.
LLAMA_FIXTURES = frozenset({"llama_server", "gemma_gguf", "routers"})


def _group_of(module: types.ModuleType, names: set[str]) -> str:
    """``names``: the markers and fixtures of the module's tests."""
    if "hugetlb" in names or _uses(module, "hugepages"):
        return "hugepages"
    if "llama" in names or names & LLAMA_FIXTURES or _uses(module, "router_fleet"):
        return "llama"
    return module.__name__


def _uses(module: types.ModuleType, helper: str) -> bool:
    """Whether ``module`` imported the test helper module ``helper`` or a name from it."""
    for value in vars(module).values():
        if isinstance(value, types.ModuleType) and value.__name__ == helper:
            return True
        if getattr(value, "__module__", None) == helper:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    names: dict[types.ModuleType, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            seen = names.setdefault(module, set())
            seen.update(m.name for m in item.iter_markers())
            seen.update(getattr(item, "fixturenames", ()))
    groups = {module: _group_of(module, seen) for module, seen in names.items()}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[module]))
