"""How the ledger's repositories talk to the database: connections and transaction rules.

SQLAlchemy Core on one synchronous engine (see :mod:`maasd.store.engine` for
why). Three kinds of connection, chosen per method:

* **reads** — one statement, no explicit transaction: on SQLite no ``BEGIN``
  is sent (a single ``SELECT`` is atomic by itself), on PostgreSQL the
  connection is in autocommit, so a read is one round trip;
* **single-statement writes** (``renew``, ``set_state`` …) — ``BEGIN IMMEDIATE``
  on SQLite (take the write lock before reading anything), autocommit on
  PostgreSQL (the statement is its own transaction);
* **write transactions** (reserve, deletes, anything that reads then writes)
  — ``BEGIN IMMEDIATE`` on SQLite, which serialises all writers; on
  PostgreSQL (READ COMMITTED) the rows that guard the decision — the tenant,
  then the pool — are locked with ``SELECT … FOR UPDATE`` first, and usage is
  summed by a *later* statement, whose fresh snapshot therefore includes
  everything committed by the previous holder of those locks.

Usage is never stored: it is ``SUM(size_bytes)`` over a tenant's (or pool's)
buffers in every state (:data:`~maasd.store.schema.ACCOUNTED_STATES`) —
memory being set up or scrubbed is memory in use — computed inside the
transaction that decides.

Statements are built once at import time, in the module of the aggregate they
belong to, with bind parameters, so SQLAlchemy's compiled cache serves each
call; rows become records positionally (``BufferRow(*row)``), the cheapest
conversion msgspec offers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, cast, func
from sqlalchemy.engine import Engine

__all__ = ["Connections", "used", "violation"]


def used(column: Any) -> Any:
    """``SUM(column)`` as a BigInteger, 0 when there are no rows.

    (PostgreSQL's ``sum(bigint)`` is ``numeric``; the cast keeps it an ``int``.)
    """
    return cast(func.coalesce(func.sum(column), 0), BigInteger)


def violation(exc: sa.exc.IntegrityError) -> tuple[str, str]:
    """Classify an integrity error: ``("unique" | "foreign_key" | "other", what)``.

    ``what`` names the constraint on PostgreSQL (``uq_buffers_tenant_id_host_key``)
    and the columns on SQLite (``buffers.tenant_id, buffers.host, buffers.key``).
    """
    orig = exc.orig
    message = str(orig)
    sqlstate = getattr(orig, "sqlstate", None)  # psycopg
    diag = getattr(orig, "diag", None)
    what = (getattr(diag, "constraint_name", None) or message) if diag is not None else message
    if sqlstate == "23505" or "UNIQUE constraint failed" in message:
        return "unique", what
    if sqlstate == "23503" or "FOREIGN KEY constraint failed" in message:
        return "foreign_key", what
    return "other", what


class Connections:
    """The three kinds of connection of the module docstring, for the repositories.

    :class:`maasd.store.Store` sets these attributes up; each repository mixin
    reaches the database only through the helpers below.
    """

    #: Reads (no BEGIN on SQLite, autocommit on PostgreSQL).
    _read: Engine
    #: Single-statement writes (BEGIN IMMEDIATE on SQLite, autocommit on PostgreSQL).
    _single: Engine
    #: Write transactions (BEGIN IMMEDIATE on SQLite, READ COMMITTED on PostgreSQL).
    _write: Engine
    #: This process's writers queue here on SQLite (a no-op on PostgreSQL).
    _wlock: AbstractContextManager[Any]
    #: PostgreSQL (row locks, several daemons) rather than SQLite (one writer).
    is_postgres: bool

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Connection]:
        """A write transaction, committed when the block ends without an exception."""
        with self._wlock, self._write.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _single_statement(self) -> Iterator[Connection]:
        """A connection for one write statement (its own transaction)."""
        with self._wlock, self._single.begin() as conn:
            yield conn

    # Rows are typed Any: each becomes a record positionally, which mypy cannot check.
    def _read_rows(self, stmt: Any, params: dict[str, Any] | None = None) -> list[Any]:
        with self._read.connect() as conn:
            return list(conn.execute(stmt, params or {}).all())

    def _read_first(self, stmt: Any, params: dict[str, Any]) -> Any:
        with self._read.connect() as conn:
            return conn.execute(stmt, params).first()

    def _single_first(self, stmt: Any, params: dict[str, Any]) -> Any:
        with self._single_statement() as conn:
            return conn.execute(stmt, params).first()

    def _single_count(self, stmt: Any, params: dict[str, Any]) -> int:
        with self._single_statement() as conn:
            return int(conn.execute(stmt, params).rowcount)
