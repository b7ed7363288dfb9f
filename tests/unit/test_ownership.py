"""Each core module is handed the part of the ledger it uses, not the whole ``Store``.

The composition root (:mod:`maasd.core.app`) builds one :class:`~maasd.store.Store` and
hands it to every part; the parts are typed with the repository of their aggregate
(``BufferRepo``, ``HostRepo``, ``TenantRepo``, ``BufferLedger``...), so that mypy holds
each to it. This test keeps the list of the modules that still take the whole ledger
from growing unnoticed: a new one names its repository, or joins the list with a reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "maasd" / "core"

#: The core modules that take the whole ``Store``, and why.
WHOLE_LEDGER = {
    "app.py": "the composition root: it builds the store",
    "auth.py": "keys (TenantRepo) and the revocation listener (Store.listener)",
    "buffers.py": "a buffer's rows, and a tenant's (by id or name) for the admin's list",
    "reserve.py": "a reserve admits against its pools' usage and writes the buffer's rows",
    "pools.py": "a pool's rows and the buffers in it",
    "tenants.py": "a tenant's delete ends its buffers and records its events",
}


def _takes_store(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "maasd.store"
        and any(alias.name == "Store" for alias in node.names)
        for node in ast.walk(tree)
    )


def test_only_the_listed_core_modules_take_the_whole_ledger() -> None:
    taking = {p.name for p in CORE.glob("*.py") if _takes_store(p)}
    assert taking <= WHOLE_LEDGER.keys(), (
        f"{sorted(taking - WHOLE_LEDGER.keys())} import Store: type the parameter with the "
        "repository the module uses (maasd.store exports each), or list it here with why"
    )


def test_the_list_has_no_module_that_no_longer_needs_it() -> None:
    stale = {name for name in WHOLE_LEDGER if not _takes_store(CORE / name)}
    assert not stale, f"{sorted(stale)} no longer take the whole Store: drop them from the list"
