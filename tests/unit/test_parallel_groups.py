"""Which modules share a pytest-xdist worker (tests/parallel.py)."""

from __future__ import annotations

import types

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
