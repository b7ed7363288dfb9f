"""The client mirrors the daemon without importing it: these tests hold the two together.

- Problems: every problem code the daemon can answer (``maasd.problems.catalog()``)
  has a client exception class with the same status, in the same place of the tree.
- Records: every response record of ``maasd.models`` / ``maasd.topology`` has a
  client type with the same field names, and a server record — encoded as the API
  encodes it, with every optional field set and with every one ``None`` — decodes
  as its client type to the same values.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from maasd import errors, models, problems, topology
from maasd.client import errors as client_errors
from maasd.client import types as client_types

# -- problems -----------------------------------------------------------------------------


def _server_classes() -> list[type[errors.MaasdError]]:
    out: list[type[errors.MaasdError]] = []
    todo = [errors.MaasdError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_the_client_table_equals_the_server_catalog() -> None:
    assert client_errors.catalog() == problems.catalog()


def test_each_class_is_filed_under_its_own_code() -> None:
    for code, (_status, cls) in client_errors.PROBLEMS.items():
        assert cls.code == code


@pytest.mark.parametrize(
    "server_cls",
    [c for c in _server_classes() if c.code in problems.catalog()],
    ids=lambda c: c.code,
)
def test_a_server_error_becomes_its_client_class(server_cls: type[errors.MaasdError]) -> None:
    problem = problems.problem_of(server_cls("what happened"))
    exc = client_errors.error_from_problem(problem.status, msgspec.to_builtins(problem))
    expected = client_errors.PROBLEMS[server_cls.code][1]
    assert type(exc) is expected
    assert exc.status == problem.status
    assert exc.detail == "what happened"
    # the tree has the same shape: a subclass on the server is a subclass in the client
    for parent in server_cls.__mro__[1:]:
        if issubclass(parent, errors.MaasdError) and parent.code in client_errors.PROBLEMS:
            assert issubclass(expected, client_errors.PROBLEMS[parent.code][1]), parent


@pytest.mark.parametrize("status", sorted(problems.HTTP_ONLY))
def test_problems_of_the_http_layer_have_client_classes(status: int) -> None:
    problem = problems.http_problem(status, "no")
    exc = client_errors.error_from_problem(status, msgspec.to_builtins(problem))
    assert type(exc) is client_errors.PROBLEMS[problems.HTTP_ONLY[status][0]][1]


def test_an_internal_error_is_a_server_error() -> None:
    problem = problems.problem_of(RuntimeError("boom"))
    exc = client_errors.error_from_problem(problem.status, msgspec.to_builtins(problem))
    assert isinstance(exc, client_errors.InternalError)
    assert isinstance(exc, client_errors.ServerError)


# -- records -----------------------------------------------------------------------------------

PAIRS: list[tuple[type[msgspec.Struct], type[msgspec.Struct]]] = [
    (models.PoolInfo, client_types.Pool),
    (models.DiskTierInfo, client_types.DiskTier),
    (models.Measured, client_types.Measured),
    (models.MeasuredFrom, client_types.MeasuredFrom),
    (models.HostInfo, client_types.Host),
    (models.TenantInfo, client_types.Tenant),
    (models.NewTenant, client_types.NewTenant),
    (models.KeyInfo, client_types.KeyInfo),
    (models.Usage, client_types.Usage),
    (models.BufferInfo, client_types.Buffer),
    (models.Checkpoint, client_types.Checkpoint),
    (models.LookupHit, client_types.LookupHit),
    (models.Event, client_types.Event),
    (topology.Topology, client_types.Topology),
    (topology.Node, client_types.NumaNode),
]

#: Structs of maasd.models that are inputs or internal, never an answer of the API.
NOT_ANSWERS = {models.PoolSpec, models.ReserveSpec, models.Principal}


def _sample(t: mi.Type, with_none: bool, n: int = 0) -> Any:
    """A value of type ``t``: every optional set (or, ``with_none``, every optional None)."""
    if isinstance(t, mi.UnionType):
        others = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if with_none and len(others) < len(t.types):
            return None
        return _sample(others[0], with_none, n)
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: _sample(f.type, with_none, n + i) for i, f in enumerate(t.fields)})
    simple: dict[type[mi.Type], Any] = {
        mi.StrType: f"s{n}",
        mi.IntType: 7 + n,
        mi.FloatType: 1.5 + n,
        mi.BoolType: n % 2 == 1,
        mi.NoneType: None,
    }
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.LiteralType):
        return t.values[n % len(t.values)]
    if isinstance(t, mi.ListType):
        return [_sample(t.item_type, with_none, n), _sample(t.item_type, with_none, n + 1)]
    if isinstance(t, mi.DictType):
        return {_sample(t.key_type, with_none, n): _sample(t.value_type, with_none, n)}
    raise AssertionError(f"no sample for {t!r}: teach _sample this type")


def test_every_answer_of_the_daemon_has_a_client_type() -> None:
    answers = {
        obj
        for _name, obj in inspect.getmembers(models, inspect.isclass)
        if issubclass(obj, msgspec.Struct) and obj.__module__ == models.__name__
    }
    assert answers - NOT_ANSWERS == {s for s, _c in PAIRS if s.__module__ == models.__name__}


@pytest.mark.parametrize(("server", "client"), PAIRS, ids=lambda c: c.__name__)
def test_same_field_names(server: type[msgspec.Struct], client: type[msgspec.Struct]) -> None:
    assert {f.name for f in msgspec.structs.fields(server)} == {
        f.name for f in msgspec.structs.fields(client)
    }


@pytest.mark.parametrize("with_none", [False, True], ids=["set", "none"])
@pytest.mark.parametrize(("server", "client"), PAIRS, ids=lambda c: c.__name__)
def test_a_server_record_decodes_as_its_client_type(
    server: type[msgspec.Struct], client: type[msgspec.Struct], with_none: bool
) -> None:
    record = _sample(mi.type_info(server), with_none)
    wire = msgspec.json.encode(record)
    decoded = msgspec.json.decode(wire, type=client)  # strict types: a mismatch raises
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(record)


@pytest.mark.parametrize(("server", "client"), PAIRS, ids=lambda c: c.__name__)
def test_the_client_needs_nothing_the_server_may_leave_out(
    server: type[msgspec.Struct], client: type[msgspec.Struct]
) -> None:
    """A field the client requires is one the server always sends (no default there)."""
    server_required = {f.name for f in msgspec.structs.fields(server) if f.required}
    client_required = {f.name for f in msgspec.structs.fields(client) if f.required}
    assert client_required <= server_required
