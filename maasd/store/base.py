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
  then the pool — are locked with ``SELECT … FOR UPDATE`` first, reading the
  usage totals kept on those very rows; anything else the decision reads is read
  by a *later* statement, whose fresh snapshot therefore includes everything
  committed by the previous holder of those locks.

Durability, per transaction. Every write waits for the disk (an fsync per
commit) unless its method is told ``durable=False``; the core says so only for
changes that concern volatile memory alone — a volatile pool's buffer admitted,
going live, committed, released, and the batched uses and lease extensions —
which then commit without waiting on SQLite: a crash of the daemon loses none of
them, a power loss may roll the last of them back, together with the memory they
were about (docs/operations.md, "Crash safety"). :func:`must_last` is the rule.
Tenants, keys, quotas, pools, hosts and a persistent buffer's rows are always
durable, and so is every PostgreSQL write: that server fails on its own, and a
commit it lost would leave a running daemon's memory unrecorded.

Usage is ``SUM(size_bytes)`` over a tenant's (or pool's) buffers in every state
(:data:`~maasd.store.schema.ACCOUNTED_STATES`) — memory being set up or scrubbed
is memory in use — kept as a running total on the tenant's (pool's) row by the
database, in the transaction that inserts or deletes a buffer
(:mod:`maasd.store.totals`), and read under that row's lock by the transaction
that decides.

Statements are built once at import time, in the module of the aggregate they
belong to, with bind parameters, so SQLAlchemy's compiled cache serves each
call; rows become records positionally (``BufferRow(*row)``), the cheapest
conversion msgspec offers. The few statements of a REST reserve and release run on
the DBAPI cursor instead, compiled once per dialect into what SQLAlchemy would send,
inside the same transactions (:mod:`maasd.store.fast`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import sqlalchemy as sa
from sqlalchemy import BigInteger, Connection, cast, func

from maasd.errors import LedgerUnavailable
from maasd.store.circuit import LedgerCircuit

if TYPE_CHECKING:
    from maasd.store.database import Database

__all__ = [
    "Repository",
    "Violation",
    "is_outage",
    "is_write_outage",
    "ledger_errors",
    "must_last",
    "used",
    "violation",
]

logger = logging.getLogger(__name__)

#: SQLSTATE classes that mean "the database cannot serve now", not "this statement is wrong":
#: 08 connection exception, 53 insufficient resources, 57 operator intervention (shutdown).
_UNAVAILABLE_SQLSTATES = ("08", "53", "57")
#: What SQLite (and a PostgreSQL client that never got a connection) says in those cases.
_UNAVAILABLE_WORDS = (
    ("database is locked", "busy: the database stayed locked past the busy timeout"),
    ("database or disk is full", "its disk is full"),
    ("readonly database", "its file cannot be written (read-only)"),
    ("disk i/o error", "a disk I/O error"),
    ("unable to open database", "the database file cannot be opened"),
    ("connection", "the database cannot be reached"),
    ("server closed", "the database closed the connection"),
    ("statement timeout", "a statement ran past the statement timeout"),
)
#: Of those reasons, the ones that mean the database is gone (an outage: the circuit
#: opens, :mod:`maasd.store.circuit`), not busy or full (those open it for writes only).
_OUTAGES = frozenset(
    {
        "the connection to the database was lost",
        "the database cannot serve now",
        "a disk I/O error",
        "the database file cannot be opened",
        "the database cannot be reached",
        "the database closed the connection",
    }
)
#: Of those reasons, the ones that mean a SQLite file can be read but not written now:
#: the circuit opens for writes only, so that each write does not wait out the busy
#: timeout in turn (:mod:`maasd.store.circuit`). Only SQLite's words give these.
_WRITE_OUTAGES = frozenset(
    {
        "busy: the database stayed locked past the busy timeout",
        "its disk is full",
        "its file cannot be written (read-only)",
    }
)


def unavailable(exc: BaseException) -> str | None:
    """Why the ledger cannot serve now, if ``exc`` says so; ``None`` for anything else
    (a constraint, or a statement of ours that is wrong: a bug, not an outage)."""
    if isinstance(exc, sa.exc.TimeoutError):  # the engine's pool: every connection busy
        return "no free database connection in time (the pool is exhausted)"
    if not isinstance(exc, sa.exc.DBAPIError) or isinstance(exc, sa.exc.IntegrityError):
        return None
    if exc.connection_invalidated:
        return "the connection to the database was lost"
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    if sqlstate == "57014":  # query_canceled: the statement timeout
        return "a statement ran past the statement timeout"
    if sqlstate[:2] == "53":
        return "the database is out of resources"
    if sqlstate[:2] == "40":  # serialization failure, deadlock: rolled back, retry
        return "the transaction met a concurrent one and was rolled back"
    if sqlstate[:2] in _UNAVAILABLE_SQLSTATES:
        return "the database cannot serve now"
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError)):
        message = str(exc.orig).lower()
        return next((why for words, why in _UNAVAILABLE_WORDS if words in message), None)
    return None


def is_outage(why: str) -> bool:
    """Whether :func:`unavailable`'s reason means the database is gone (not busy or full)."""
    return why in _OUTAGES


def is_write_outage(why: str) -> bool:
    """Whether :func:`unavailable`'s reason means the database cannot be written now
    (a SQLite file locked past the busy timeout, full, or read-only)."""
    return why in _WRITE_OUTAGES


@contextlib.contextmanager
def ledger_errors(circuit: LedgerCircuit | None = None) -> Iterator[None]:
    """Turn "the database cannot serve now" into :class:`LedgerUnavailable` (507, retry):
    the caller's request changed nothing. The database's own words go to the log only —
    they can name its host, which a tenant has no business learning. An outage opens
    ``circuit``: later calls fail at once until its probe finds the database again; a
    file that cannot be written opens it for writes only."""
    try:
        yield
    except (sa.exc.DBAPIError, sa.exc.TimeoutError) as exc:
        why = unavailable(exc)
        if why is None:
            raise
        logger.warning("ledger unavailable: %s", exc.__class__.__name__, exc_info=True)
        if circuit is not None and is_outage(why):
            circuit.trip(why)
        elif circuit is not None and is_write_outage(why):
            circuit.trip(why, writes_only=True)
        raise LedgerUnavailable(f"the ledger database cannot serve now ({why}); retry") from exc


def must_last(persistence: str) -> bool:
    """Whether a change to a buffer of this persistence must reach the disk before it
    is answered: yes for a persistent pool's buffers, whose bytes outlive the
    machine; no for a volatile pool's, whose memory a power loss takes with it
    (``recover()`` releases every volatile row at the next start anyway)."""
    return persistence != "volatile"


def used(column: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
    """``SUM(column)`` as a BigInteger, 0 when there are no rows.

    (PostgreSQL's ``sum(bigint)`` is ``numeric``; the cast keeps it an ``int``.)
    """
    return cast(func.coalesce(func.sum(column), 0), BigInteger)


@dataclass(frozen=True, slots=True)
class Violation:
    """An integrity error, classified by the driver's codes rather than its message.

    ``kind``: from PostgreSQL's SQLSTATE (psycopg's ``sqlstate``) or SQLite's extended
    result code (``sqlite_errorname``). ``constraint``: its name on PostgreSQL
    (``diag.constraint_name``: ``uq_buffers_tenant_id_host_key``), or the index SQLite
    names; ``columns``: the ``table.column`` list SQLite reports for a column
    constraint (the only place it says which; PostgreSQL names the constraint).
    """

    kind: Literal["unique", "foreign_key", "other"]
    constraint: str | None
    columns: tuple[str, ...]
    message: str

    def of(self, constraint: str, column: str) -> bool:
        """Whether it is ``constraint`` (PostgreSQL, an index SQLite names) or on ``column``."""
        return self.constraint == constraint or column in self.columns


_SQLITE_KINDS: dict[str, Literal["unique", "foreign_key"]] = {
    "SQLITE_CONSTRAINT_UNIQUE": "unique",
    "SQLITE_CONSTRAINT_PRIMARYKEY": "unique",
    "SQLITE_CONSTRAINT_FOREIGNKEY": "foreign_key",
}


def violation(exc: sa.exc.IntegrityError) -> Violation:
    """Classify an integrity error (see :class:`Violation`)."""
    orig = exc.orig
    message = str(orig)
    sqlstate = getattr(orig, "sqlstate", None)  # psycopg
    diag = getattr(orig, "diag", None)
    constraint = getattr(diag, "constraint_name", None) if diag is not None else None
    columns: tuple[str, ...] = ()
    sqlite_code = getattr(orig, "sqlite_errorname", None)  # sqlite3 (Python 3.11+)
    kind: Literal["unique", "foreign_key", "other"] = "other"
    if sqlstate == "23505":
        kind = "unique"
    elif sqlstate == "23503":
        kind = "foreign_key"
    elif sqlite_code is not None:
        kind = _SQLITE_KINDS.get(sqlite_code, "other")
        _, _, named = message.partition(" constraint failed: ")
        if named.startswith("index "):
            constraint = named.removeprefix("index ").strip("'")
        elif named:
            columns = tuple(c.strip() for c in named.split(","))
    return Violation(kind, constraint, columns, message)


class OnDatabase:
    """What anything holding the ledger's :class:`Database` (``db``) reads of it: which
    server it is, and its circuit (a repository, and :class:`maasd.store.Store`)."""

    db: Database

    @property
    def is_postgres(self) -> bool:
        """PostgreSQL (row locks, several daemons) rather than SQLite (one writer)."""
        return self.db.is_postgres

    @property
    def circuit(self) -> LedgerCircuit:
        """Open while the database is known to be down: every call fails at once."""
        return self.db.circuit


class Repository(OnDatabase):
    """The base of the ledger's repositories, one object per aggregate (tenants and keys,
    pools, buffers and entries, events, hosts, totals): each holds the one
    :class:`Database` they share (``db``, handed at construction) and reaches the
    database only through it — the helpers below are the three kinds of connection of
    the module docstring, read off ``db``. No repository calls another: a transaction
    that touches other aggregates' tables runs its own statements on its connection.

    A repository keeps no state of its own beyond ``db`` (the reserve's default cap is an
    argument of the reserve). :class:`maasd.store.Store` builds all of them over one database.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    def _writing(self, *, durable: bool = True) -> AbstractContextManager[Connection]:
        """A write transaction (:meth:`Database.writing`)."""
        return self.db.writing(durable=durable)

    def _single_statement(self, *, durable: bool = True) -> AbstractContextManager[Connection]:
        """A connection for one write statement (:meth:`Database.single_statement`)."""
        return self.db.single_statement(durable=durable)

    def _reading(self) -> AbstractContextManager[Connection]:
        """A connection for reads (:meth:`Database.reading`)."""
        return self.db.reading()

    # Rows are typed Any: each becomes a record positionally, which mypy cannot check.
    def _read_rows(self, stmt: Any, params: dict[str, Any] | None = None) -> list[Any]:
        with self._reading() as conn:
            return list(conn.execute(stmt, params or {}).all())

    def _read_first(self, stmt: Any, params: dict[str, Any]) -> Any:
        with self._reading() as conn:
            return conn.execute(stmt, params).first()

    def _single_first(self, stmt: Any, params: dict[str, Any], *, durable: bool = True) -> Any:
        with self._single_statement(durable=durable) as conn:
            return conn.execute(stmt, params).first()

    def _single_count(self, stmt: Any, params: dict[str, Any], *, durable: bool = True) -> int:
        with self._single_statement(durable=durable) as conn:
            return int(conn.execute(stmt, params).rowcount)
