"""The closed vocabularies of maasd.bounds hold every value the code uses, and the API says so.

- Every event kind, release reason and entry-abort reason written as a literal in the
  server's code (found by reading the source: the arguments of ``event``,
  ``buffer_event``, ``finish_release``, ``finish_release_many``, ``release_row``,
  ``release_memory``, ``_release_staged`` and the ``reason`` labels of the release
  counter) is a member of its Literal; so mypy's check of the typed parameters cannot
  be bypassed by a call it does not see (a dict, a ``str`` variable).
- The ledger's buffer states and the allocator's tuples are the Literals' members.
- The OpenAPI document lists each field typed by one of them as an ``enum`` of exactly
  its members.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest

from inprocess_api import service
from maasd import bounds
from maasd.allocator import pool, region, scrub
from maasd.api.app import create_app
from maasd.core import Service
from maasd.store import schema

SOURCE = Path(__file__).resolve().parents[2] / "maasd"

#: callee name -> (Literal its kind/reason belongs to, positional index, keyword)
CALLS: dict[str, tuple[Any, int | None, str]] = {
    "event": (bounds.EventKind, 0, "kind"),
    "buffer_event": (bounds.EventKind, 0, "kind"),
    "finish_release": (bounds.ReleaseReason, 1, "kind"),
    "finish_release_many": (bounds.ReleaseReason, 1, "kind"),
    "release_row": (bounds.ReleaseReason, None, "reason"),
    "release_memory": (bounds.ReleaseReason, None, "reason"),
    "release_staged": (bounds.EntryAbortReason, 2, "reason"),
}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _literal_args(call: ast.Call, index: int | None, keyword: str) -> Iterator[str]:
    if index is not None and len(call.args) > index:
        yield from _strings(call.args[index])
    for kw in call.keywords:
        if kw.arg == keyword:
            yield from _strings(kw.value)


def _strings(node: ast.expr) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value


def _used() -> list[tuple[str, str, Any]]:
    """(where, value, Literal) for every literal kind or reason passed in maasd/."""
    found: list[tuple[str, str, Any]] = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            where = f"{path.relative_to(SOURCE.parent)}:{node.lineno}"
            if name in CALLS:
                vocabulary, index, keyword = CALLS[name]
                for const in _literal_args(node, index, keyword):
                    found.append((where, const, vocabulary))
            # the release counter: self._metrics.release_total.labels(reason=...)
            if (
                name == "labels"
                and isinstance(node.func, ast.Attribute)
                and _name(node.func.value) == "release_total"
            ):
                for const in _literal_args(node, None, "reason"):
                    found.append((where, const, bounds.ReleaseReason))
    return found


def test_the_source_scan_finds_the_calls() -> None:
    # A scan that found nothing would pass whatever the code says.
    values = {value for _where, value, _vocabulary in _used()}
    assert {"reserve", "evict", "expire", "shutdown", "abort", "host_forget"} <= values


def test_every_kind_and_reason_the_code_writes_is_in_its_literal() -> None:
    stray = [
        (where, value) for where, value, vocabulary in _used() if value not in get_args(vocabulary)
    ]
    assert not stray, stray


def test_the_vocabularies_nest() -> None:
    assert set(get_args(bounds.EntryAbortReason)) <= set(get_args(bounds.ReleaseReason))
    assert set(get_args(bounds.ReleaseReason)) <= set(get_args(bounds.EventKind))
    for alias in (bounds.EventKind, bounds.ReleaseReason, bounds.BufferState):
        values = get_args(alias)
        assert len(values) == len(set(values)), alias
        assert all(isinstance(v, str) for v in values), alias


def test_the_ledger_and_the_allocator_use_the_same_sets() -> None:
    assert tuple(schema.BUFFER_STATES) == get_args(bounds.BufferState)
    assert get_args(bounds.Backing) == region.BACKINGS
    assert get_args(bounds.ScrubMode) == scrub.SCRUB_MODES
    assert get_args(bounds.Persistence) == pool.PERSISTENCES


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("vocabularies"))
    yield s
    s.close()


@pytest.mark.parametrize(
    ("record", "field", "vocabulary"),
    [
        ("PoolInfo", "backing", bounds.Backing),
        ("PoolInfo", "persistence", bounds.Persistence),
        ("PoolInfo", "scrub", bounds.ScrubMode),
        ("BufferInfo", "persistence", bounds.Persistence),
        ("BufferInfo", "state", bounds.BufferState),
        ("Event", "kind", bounds.EventKind),
        ("PoolSpec", "backing", bounds.Backing),
        ("PoolSpec", "persistence", bounds.Persistence),
        ("PoolSpec", "scrub", bounds.ScrubMode),
    ],
)
def test_the_openapi_document_lists_each_vocabulary_as_an_enum(
    svc: Service, record: str, field: str, vocabulary: Any
) -> None:
    doc = create_app(svc).openapi_schema.to_schema()
    prop = doc["components"]["schemas"][record]["properties"][field]
    assert sorted(prop["enum"]) == sorted(get_args(vocabulary)), prop
