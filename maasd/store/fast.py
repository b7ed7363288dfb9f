"""The ledger's hot statements on the DBAPI cursor, each compiled once per dialect.

``Connection.execute`` of a cached Core statement still builds an execution context, a
cursor result and its row processors around every call: ~40–60 µs of CPU here, where
SQLite's own work for one of the ledger's statements is ~10–30 µs. A REST reserve and
release (the admission, the release's compare-and-set and its end) run ~6 statements a
pair, so that machinery was most of the service threads' time. A :class:`Hot`
statement keeps what SQLAlchemy would send — the same SQL text, compiled by the same
dialect, with the bind values in the compiled order (a statement's literal values
included) through the same bind processors — and runs it on the cursor of the
transaction's own DBAPI connection, inside the transaction SQLAlchemy began (its pool,
its ``begin`` listener, :mod:`maasd.store.engine`'s ``BEGIN IMMEDIATE``, its commit or
rollback). Rows come back as tuples through the columns' result processors (SQLite's
booleans become ``bool``), ready for ``BufferRow(*row)``.

What stays SQLAlchemy's:

* **errors** — a DBAPI error goes through the connection's own handling
  (``Connection._handle_dbapi_exception``): the same :class:`sqlalchemy.exc.DBAPIError`
  subclass (``IntegrityError`` for a unique violation, ``OperationalError`` for a
  locked SQLite file…), a disconnect invalidates the connection (and the pool's older
  ones) and says so (``connection_invalidated``). So :func:`maasd.store.base.violation`
  classifies it and :func:`maasd.store.base.ledger_errors` opens the circuit as before;
* **cursor events** — ``before_cursor_execute``/``after_cursor_execute`` listeners are
  called as SQLAlchemy calls them (tests and ``profile_reserve.py`` count statements);
  with none, the check costs two attribute reads.

Only for statements without expanding (``IN``) parameters, run with one parameter dict
(or :meth:`Hot.many`, ``executemany``); the rest of the ledger keeps ``conn.execute``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import BindParameter

__all__ = ["Hot"]

_REQUIRED = object()  # a bind the caller must pass (no value compiled into the statement)
Processor = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class _Plan:
    """One statement compiled for one dialect."""

    sql: str
    #: positional paramstyle (SQLite's ``?``): values as a tuple in ``names``' order;
    #: otherwise (psycopg's ``%(name)s``) a dict keyed by ``keys``
    positional: bool
    #: the bind names in the order the SQL takes them (each once when named)
    names: tuple[str, ...]
    #: the parameter name each bind is sent under (the escaped name, when named)
    keys: tuple[str, ...]
    #: per bind: its compiled value, or _REQUIRED
    values: tuple[Any, ...]
    #: per bind: its type's bind processor for this dialect, or None
    binds: tuple[Processor | None, ...]
    #: the result columns' types (RETURNING or SELECT), for their result processors
    result_types: tuple[Any, ...]

    def params(self, given: Mapping[str, Any]) -> Any:
        out = []
        for name, value, process in zip(self.names, self.values, self.binds, strict=True):
            if value is _REQUIRED or name in given:
                value = given[name]
            out.append(value if process is None else process(value))
        return tuple(out) if self.positional else dict(zip(self.keys, out, strict=True))


class Hot:
    """A Core statement run on the DBAPI cursor (see the module docstring).

    ``columns``: for an ``insert(table)`` without ``values()``, the columns the
    parameters give (as SQLAlchemy compiles an insert for the keys it is executed with).
    """

    __slots__ = ("_columns", "_lock", "_plans", "_results", "stmt")

    def __init__(self, stmt: Any, *, columns: Sequence[str] | None = None) -> None:
        self.stmt = stmt
        self._columns = list(columns) if columns is not None else None
        self._plans: dict[Dialect, _Plan] = {}
        #: per plan, the result processors (known once a cursor described the columns)
        self._results: dict[Dialect, tuple[tuple[int, Processor], ...]] = {}
        self._lock = threading.Lock()

    def plan(self, dialect: Dialect) -> _Plan:
        """The statement compiled for ``dialect`` (once; then read from a dict)."""
        try:
            return self._plans[dialect]
        except KeyError:
            pass
        with self._lock:
            if dialect not in self._plans:
                self._plans[dialect] = _compile(self.stmt, dialect, self._columns)
            return self._plans[dialect]

    # -- execution ------------------------------------------------------------------------

    def first(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row (``None``: none), the rest left unread."""
        rows = self._execute(conn, params, fetch=1)
        return rows[0] if rows else None

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Every row."""
        rows = self._execute(conn, params, fetch=-1)
        assert isinstance(rows, list)
        return rows

    def count(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """The rows the statement changed (an UPDATE's or DELETE's ``rowcount``)."""
        n = self._execute(conn, params, fetch=0)
        assert isinstance(n, int)
        return n

    def run(self, conn: Connection, params: Mapping[str, Any]) -> None:
        """Run it, reading nothing back (an INSERT without RETURNING)."""
        self._execute(conn, params, fetch=0)

    def many(self, conn: Connection, params: Sequence[Mapping[str, Any]]) -> None:
        """``executemany``: the statement once per parameter dict (an INSERT's rows)."""
        self._execute(conn, params, fetch=0, many=True)

    def _execute(self, conn: Connection, given: Any, *, fetch: int, many: bool = False) -> Any:
        dialect = conn.dialect
        plan = self._plans.get(dialect) or self.plan(dialect)
        sql = plan.sql
        params: Any = [plan.params(g) for g in given] if many else plan.params(given)
        dbapi_conn: Any = conn.connection.dbapi_connection
        cursor = None
        try:
            cursor = dbapi_conn.cursor()
            before, after = _listeners(conn)
            if before:
                for fn in conn.dispatch.before_cursor_execute:
                    sql, params = fn(conn, cursor, sql, params, None, many) or (sql, params)
            if many:
                cursor.executemany(sql, params)
            else:
                cursor.execute(sql, params)
            if after:
                conn.dispatch.after_cursor_execute(conn, cursor, sql, params, None, many)
            if fetch == 0:
                out: Any = cursor.rowcount
            else:
                out = cursor.fetchmany(1) if fetch == 1 else cursor.fetchall()
                if out:
                    out = self._processed(dialect, cursor, out)
        except dialect.loaded_dbapi.Error as e:
            _raise(conn, e, sql, params, cursor)
        finally:
            if cursor is not None:
                # a connection gone: the error above says so already
                with contextlib.suppress(Exception):
                    cursor.close()
        return out

    def _processed(self, dialect: Dialect, cursor: Any, rows: list[Any]) -> list[Any]:
        """``rows`` as tuples through their columns' result processors (if any)."""
        results = self._results.get(dialect)
        if results is None:
            results = _result_processors(self.plan(dialect), dialect, cursor.description)
            self._results[dialect] = results
        if not results:
            return [tuple(r) for r in rows] if type(rows[0]) is not tuple else rows
        out = []
        for r in rows:
            values = list(r)
            for i, process in results:
                values[i] = process(values[i])
            out.append(tuple(values))
        return out


#: Where a connection keeps whether cursor events have listeners (see :func:`_listeners`).
_LISTENED = "_maasd_cursor_listeners"


def _listeners(conn: Connection) -> tuple[bool, bool]:
    """Whether ``before_cursor_execute``/``after_cursor_execute`` have listeners on ``conn``,
    asked once per :class:`~sqlalchemy.engine.Connection` (one transaction here): the
    question goes through the joined dispatchers of the connection, its option engine
    and its engine, ~3–10 µs here, where a statement's own work is ~10–30 µs. A listener
    added while a connection is checked out is seen from its next one."""
    try:
        found: tuple[bool, bool] = conn.__dict__[_LISTENED]
    except KeyError:
        dispatch = conn.dispatch
        found = (bool(dispatch.before_cursor_execute), bool(dispatch.after_cursor_execute))
        conn.__dict__[_LISTENED] = found
    return found


def _compile(stmt: Any, dialect: Dialect, columns: list[str] | None) -> _Plan:
    """What SQLAlchemy sends for ``stmt`` on ``dialect``: its SQL once the late-rendered
    parameters are expanded (a literal ``IN ('live', 'staged')`` becomes one bind per
    value), and each bind's place, value (a required one: the caller's) and processor."""
    compiled: Any = stmt.compile(dialect=dialect, column_keys=columns)
    binds: dict[str, BindParameter[Any]] = compiled.binds
    required = {name: _REQUIRED for name, b in binds.items() if b.required}
    for name, bind in binds.items():
        if bind.callable is not None or (bind.expanding and bind.required):
            raise ValueError(f"bind {name!r} is computed at execution: the statement cannot be hot")
    # (the expansion of the constant ones; the required ones stand for themselves)
    state = compiled.construct_expanded_state(required, escape_names=False)
    parameters = state.parameters
    positional = bool(compiled.positional)
    names = tuple(state.positiontup) if positional else tuple(parameters)
    escaped = compiled.escaped_bind_names or {}
    processors = {
        name: bind.type.dialect_impl(dialect).bind_processor(dialect)
        for name, bind in binds.items()
    }
    processors.update(state.processors)  # the expanded ones'
    return _Plan(
        sql=state.statement,
        positional=positional,
        names=names,
        keys=tuple(escaped.get(n, n) for n in names),
        values=tuple(parameters[n] for n in names),
        binds=tuple(processors.get(n) for n in names),
        result_types=tuple(c.type for c in getattr(stmt, "exported_columns", ())),
    )


def _result_processors(
    plan: _Plan, dialect: Dialect, description: Any
) -> tuple[tuple[int, Processor], ...]:
    found = []
    for i, type_ in enumerate(plan.result_types):
        coltype = description[i][1] if description is not None and i < len(description) else None
        process = type_.dialect_impl(dialect).result_processor(dialect, coltype)
        if process is not None:
            found.append((i, process))
    return tuple(found)


def _raise(conn: Connection, e: BaseException, sql: str, params: Any, cursor: Any) -> NoReturn:
    """Raise ``e`` as SQLAlchemy would have from ``conn.execute``: wrapped in its
    ``DBAPIError`` subclass, the connection invalidated on a disconnect."""
    handle = getattr(conn, "_handle_dbapi_exception", None)
    if handle is not None:
        handle(e, sql, params, cursor, None)  # raises
    import sqlalchemy as sa

    raise sa.exc.DBAPIError.instance(
        sql, params, e, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect
    ) from e
