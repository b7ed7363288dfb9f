"""Each core module is handed the repositories of the aggregates it uses, never the whole
``Store``.

The composition root (:mod:`maasd.core.app`) builds one :class:`~maasd.store.Store` — one
repository object per aggregate over one database — and hands each part only the
repositories it uses (``store.buffers``, ``store.hosts``...), each parameter typed with
its repository class, so that mypy holds each part to its aggregates. These tests hold
the wiring to it twice: in the source (no core module but the composition root names
``Store``) and at run time (no part of a built daemon holds the store, and every
repository a part holds is the store's own, over its one database).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maasd.core import Service
from maasd.settings import Settings
from maasd.store import Repository

CORE = Path(__file__).resolve().parents[2] / "maasd" / "core"

#: The core modules that take the whole ``Store``, and why.
WHOLE_LEDGER = {
    "app.py": "the composition root: it builds the store, migrates and closes it, and "
    "hands each part its repositories",
}


def _takes_store(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module in ("maasd.store", "maasd.store.repository")
        and any(alias.name == "Store" for alias in node.names)
        for node in ast.walk(tree)
    )


def test_only_the_composition_root_takes_the_whole_ledger() -> None:
    taking = {p.name for p in CORE.glob("*.py") if _takes_store(p)}
    assert taking <= WHOLE_LEDGER.keys(), (
        f"{sorted(taking - WHOLE_LEDGER.keys())} import Store: type the parameter with the "
        "repository the module uses (maasd.store exports each), or list it here with why"
    )


def test_the_list_has_no_module_that_no_longer_needs_it() -> None:
    stale = {name for name in WHOLE_LEDGER if not _takes_store(CORE / name)}
    assert not stale, f"{sorted(stale)} no longer take the whole Store: drop them from the list"


# ------------------------------------------------------------------ at run time
@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(Settings(data_dir=str(tmp_path / "data"), admin_key="k" * 32, pools=[]))
    try:
        yield s
    finally:
        s.store.dispose()


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    yield from getattr(obj, "__dict__", {}).items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                yield name, getattr(obj, name)


def _parts(svc: Service) -> Iterator[tuple[str, Any]]:
    """Every object of the core reachable from the service's attributes (the use-cases,
    their helpers, their helpers' helpers), by the path that reached it first."""
    seen: set[int] = {id(svc), id(svc.store)}
    todo: list[tuple[str, Any]] = [(f"svc.{n}", v) for n, v in _attributes(svc) if n != "store"]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or not type(obj).__module__.startswith("maasd.core"):
            continue
        seen.add(id(obj))
        yield path, obj
        todo += [(f"{path}.{n}", v) for n, v in _attributes(obj)]


def test_no_part_of_a_daemon_holds_the_whole_store(svc: Service) -> None:
    parts = dict(_parts(svc))
    assert len(parts) > 20  # the walk reached the parts (a walk that finds none proves nothing)
    holding = [
        f"{path}.{n}" for path, obj in parts.items() for n, v in _attributes(obj) if v is svc.store
    ]
    assert not holding, f"{holding} hold the whole Store: hand them their repositories"


def test_each_repository_a_part_holds_is_the_stores_own(svc: Service) -> None:
    own = {id(v): name for name, v in vars(svc.store).items() if isinstance(v, Repository)}
    assert set(own.values()) == {
        "tenants", "pools", "reserves", "buffers", "events", "hosts", "totals"
    }  # fmt: skip
    held: dict[str, set[str]] = {}
    for path, obj in _parts(svc):
        for n, v in _attributes(obj):
            if isinstance(v, Repository):
                assert id(v) in own, f"{path}.{n} is a {type(v).__name__} of its own"
                assert v.db is svc.store.db
                held.setdefault(type(obj).__name__, set()).add(own[id(v)])
    # A sample of the wiring, as app.py states it: each part, only its aggregates.
    assert held["Hosts"] == {"hosts"}
    assert held["Auth"] == {"tenants"}
    assert held["Releaser"] == {"buffers", "reserves"}
    assert held["Tenants"] == {"tenants", "buffers", "events"}
    assert held["Reserves"] == {"reserves", "buffers", "pools"}
