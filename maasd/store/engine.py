"""Engine factory: URL normalisation, SQLite pragmas and ``BEGIN IMMEDIATE``,
and the programmatic Alembic configuration.

Why the store is synchronous, even for ``postgresql+asyncpg://`` URLs: every
use-case of :mod:`maasd.core` runs in a worker thread (the REST API hands each
call to ``anyio.to_thread``, the broker serves each connection in a thread of
its own), next to blocking memory work. A synchronous
engine fits that; an async one would need an event loop per thread. The daemon
still accepts asyncpg URLs (operators copy them from other services), so they
are translated to the equivalent psycopg 3 URL — same server, same database,
synchronous driver.

SQLite transactions. Python's ``sqlite3`` module (before 3.12's ``autocommit``)
starts transactions itself, lazily and DEFERRED, which lets two writers both
read the ledger and then race for the write lock. As the SQLAlchemy pysqlite
documentation recommends ("Enabling Non-Legacy SQLite Transactional Modes"),
the driver's own BEGIN is switched off (``isolation_level = None``) and a
``begin`` event emits ours: ``BEGIN IMMEDIATE`` (take the write lock first, so
a quota check and its insert are one serial step), or nothing at all for
connections tagged ``maasd_begin="none"`` (single-statement reads, which SQLite
runs atomically on their own).

Durability per transaction (SQLite). Every write transaction waits for the disk
(``synchronous=FULL``: an fsync of the WAL per commit) unless its connection
carries the execution option ``maasd_durable=False``: then it commits without
waiting (``synchronous=NORMAL``: the WAL is written, not fsynced). Such a commit
survives a crash of the daemon — the bytes are in the kernel's page cache — and
may be lost only with the machine (power, kernel); a later FULL commit makes it
durable too, since the WAL is written in order. The store decides which
transactions may do that (:mod:`maasd.store.base`); here it is applied. SQLite
refuses to change ``synchronous`` inside a transaction, so it is set on the
connection right before ``BEGIN``, in every transaction (durable or not) that
writes: a pooled connection never carries NORMAL into the next one. PostgreSQL
commits every transaction with the server's ``synchronous_commit`` (the store
never asks it not to wait: :class:`~maasd.store.database.Database`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from maasd.errors import ConfigError

__all__ = [
    "BUSY_TIMEOUT_MS",
    "DURABLE",
    "SchemaState",
    "alembic_config",
    "create_engine",
    "migrations_dir",
    "normalize_url",
    "pg_liveness",
    "schema_state",
]

#: How long a SQLite writer waits for the write lock before giving up.
BUSY_TIMEOUT_MS = 10_000

_SQLITE_PRAGMAS = (
    # First, so that even switching to WAL waits for a concurrent writer.
    f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
    "PRAGMA journal_mode=WAL",
    # FULL: a commit is on disk before it returns (crash safety: docs/operations.md).
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
)

#: The execution option that lets a transaction commit without waiting for the disk
#: (``engine.execution_options(**{DURABLE: False})``; see the module docstring).
DURABLE = "maasd_durable"
#: SQLite's ``synchronous`` for durable transactions and for the others.
_SYNC_FULL, _SYNC_NORMAL = "FULL", "NORMAL"

# Drivers of other URLs that are rewritten to psycopg 3 (see module docstring).
_PG_TO_PSYCOPG = {"", "asyncpg", "psycopg", "psycopg_async"}


def normalize_url(url: str | URL) -> URL:
    """Validate a database URL and return the synchronous URL the store uses.

    >>> str(normalize_url("postgresql+asyncpg://u:p@db:5432/maasd"))
    'postgresql+psycopg://u:***@db:5432/maasd'
    >>> str(normalize_url("sqlite:////var/lib/maasd/maasd.db"))
    'sqlite:////var/lib/maasd/maasd.db'

    ``postgresql://`` and ``postgres://`` (whose SQLAlchemy default would be
    psycopg2) and ``postgresql+asyncpg://`` all become ``postgresql+psycopg://``;
    asyncpg's ``ssl=`` query option becomes libpq's ``sslmode=``. SQLite must
    be a file: an in-memory database is private to one connection, which the
    pooled, multi-threaded store cannot honour. Anything else raises
    :class:`~maasd.errors.ConfigError`.
    """
    try:
        u = make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"not a database URL: {exc}") from None
    backend, _, driver = u.drivername.partition("+")
    if backend in ("postgresql", "postgres"):
        if driver in _PG_TO_PSYCOPG:
            query = dict(u.query)
            if driver == "asyncpg" and "ssl" in query and "sslmode" not in query:
                query["sslmode"] = query.pop("ssl")
            u = u.set(drivername="postgresql+psycopg", query=query)
        return u
    if backend == "sqlite":
        if u.database in (None, "", ":memory:") or u.query.get("mode") == "memory":
            raise ConfigError("an in-memory SQLite database cannot be shared; use a file")
        return u
    raise ConfigError(
        f"unsupported database {backend!r}: use sqlite:///PATH or postgresql+psycopg://…"
    )


def _retry_locked(cursor: Any, sql: str, deadline_s: float = BUSY_TIMEOUT_MS / 1000) -> None:
    """Run ``sql``, retrying while SQLite answers "database is locked" (``SQLITE_BUSY``;
    ``SQLITE_LOCKED`` too), told by the error's code, never its message.

    Switching a new database to WAL needs an exclusive lock, and SQLite answers
    that pragma with SQLITE_BUSY at once instead of calling the busy handler —
    seen when several processes open a fresh ledger together (``maasd migrate``
    beside ``maasd serve``). Everything else waits in the busy timeout already.
    """
    import sqlite3
    import time

    give_up = time.monotonic() + deadline_s
    delay = 0.001
    while True:
        try:
            cursor.execute(sql)
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc) or time.monotonic() > give_up:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        else:
            return


def _is_locked(exc: Exception) -> bool:
    """Whether SQLite refused for a lock another connection holds: the primary result
    code (the low byte of an extended one, such as ``SQLITE_BUSY_RECOVERY``) of the
    driver's error is ``SQLITE_BUSY`` or ``SQLITE_LOCKED``."""
    import sqlite3

    code = getattr(exc, "sqlite_errorcode", None)  # set by the driver, Python 3.11+
    return code is not None and (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def create_engine(
    url: str | URL,
    *,
    pool_size: int = 8,
    max_overflow: int = 32,
    pool_timeout: float = 30.0,
    echo: bool = False,
    connect_timeout_s: float = 3.0,
    statement_timeout_s: float = 10.0,
) -> Engine:
    """A synchronous engine for ``url`` (see :func:`normalize_url`), set up for the ledger.

    On SQLite every new DBAPI connection gets the WAL/``synchronous=FULL``/
    foreign-key pragmas, and every transaction starts with ``BEGIN IMMEDIATE``
    unless its connection carries the execution option ``maasd_begin="none"``.
    On SQLite, a transaction whose connection carries ``maasd_durable=False`` commits
    without waiting for the disk (see the module docstring).

    On PostgreSQL every wait is bounded (docs/scale-out.md, "Failure modes"): a connect
    by ``connect_timeout_s``, a statement by ``statement_timeout_s`` (the server cancels
    it), and a server that vanished without a word by TCP keepalives and
    ``tcp_user_timeout`` (unacknowledged data), so that a ledger call on a dead network
    fails within seconds, not after the kernel's minutes.
    """
    u = normalize_url(url)
    kwargs: dict[str, Any] = {
        "pool_size": pool_size,
        "max_overflow": max_overflow,
        "pool_timeout": pool_timeout,
        "echo": echo,
    }
    if u.get_backend_name() == "postgresql":
        kwargs["connect_args"] = pg_liveness(connect_timeout_s, statement_timeout_s)
        kwargs["pool_recycle"] = 3600
        return sa.create_engine(u, **kwargs)

    kwargs["connect_args"] = {"timeout": BUSY_TIMEOUT_MS / 1000}
    engine = sa.create_engine(u, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver must not BEGIN on its own; _sqlite_begin below does.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            for pragma in _SQLITE_PRAGMAS:
                _retry_locked(cursor, pragma)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: sa.Connection) -> None:
        options = conn.get_execution_options()
        if options.get("maasd_begin") == "none":
            return  # a read: it commits nothing, whatever the level
        _set_synchronous(conn, _SYNC_NORMAL if options.get(DURABLE) is False else _SYNC_FULL)
        _begin_immediate(conn)

    return engine


def pg_liveness(connect_timeout_s: float, statement_timeout_s: float) -> dict[str, Any]:
    """libpq options that bound every wait on a PostgreSQL ledger (see :func:`create_engine`).

    >>> pg_liveness(3, 10)["options"]
    '-c statement_timeout=10000'
    """
    statement_ms = max(1, round(statement_timeout_s * 1000))
    return {
        "application_name": "maasd",
        "connect_timeout": max(1, round(connect_timeout_s)),  # libpq: whole seconds, ≥ 1
        "options": f"-c statement_timeout={statement_ms}",
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 2,
        "tcp_user_timeout": statement_ms + 1000,
    }


def _set_synchronous(conn: sa.Connection, level: str) -> None:
    """Set SQLite's ``synchronous`` on ``conn`` (outside a transaction) unless it is set.

    The level set last is remembered in the DBAPI connection's ``info`` (which the
    pool clears when it replaces the connection), so a run of transactions of one
    kind pays no statement for it (a ``PRAGMA`` costs ~5 µs here, a NORMAL commit
    ~20–40 µs). Through the raw DBAPI connection: it is not one of the ledger's
    statements and needs none of SQLAlchemy's work around one.
    """
    info = conn.info
    if info.get(_SYNC_KEY) != level:
        dbapi: Any = conn.connection.driver_connection
        dbapi.execute(f"PRAGMA synchronous={level}")
        info[_SYNC_KEY] = level


def _begin_immediate(conn: sa.Connection) -> None:
    """``BEGIN IMMEDIATE`` on ``conn``'s DBAPI connection, its error raised as SQLAlchemy's.

    Through the raw connection, as :func:`_set_synchronous`: ``exec_driver_sql`` would run
    it through SQLAlchemy's whole statement machinery (~0.1 ms of CPU here, a tenth of a
    volatile buffer's reserve + release, which begins four transactions). SQLAlchemy
    does not wrap what a ``begin`` listener raises, so this does (as it would have): a
    write lock held past the busy timeout is still a ``sa.exc.OperationalError`` for
    :func:`maasd.store.base.unavailable` ("database is locked": the write circuit).
    """
    import sqlite3

    dbapi: Any = conn.connection.driver_connection
    try:
        dbapi.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as e:
        raise sa.exc.DBAPIError.instance(
            "BEGIN IMMEDIATE", (), e, sqlite3.Error, dialect=conn.dialect
        ) from e


#: Where :func:`_set_synchronous` remembers a connection's level.
_SYNC_KEY = "maasd_synchronous"


def migrations_dir() -> Path:
    """The Alembic script directory: ``migrations/`` next to the ``maasd`` package.

    That is where it is in a checkout and in an editable install. A wheel may
    instead ship it inside the package (``maasd/migrations``), which is tried
    second.
    """
    import maasd

    package = Path(maasd.__file__).resolve().parent
    for candidate in (package.parent / "migrations", package / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise RuntimeError(
        f"Alembic migrations not found next to {package} (looked for migrations/env.py)"
    )


@dataclass(frozen=True)
class SchemaState:
    """Where a ledger's schema is against this maasd's migrations."""

    #: The ledger's revisions (none: not migrated yet).
    current: frozenset[str]
    #: This maasd's newest revisions.
    heads: frozenset[str]
    #: Every revision this maasd ships.
    known: frozenset[str]

    @property
    def at_head(self) -> bool:
        """Nothing to migrate."""
        return self.current == self.heads

    @property
    def unknown(self) -> bool:
        """A revision this maasd does not ship: a newer maasd migrated the ledger."""
        return not self.current <= self.known


#: Every revision under ``migrations/versions``, oldest first: the last is the head. A
#: ledger at the head is recognised from this list, without Alembic, whose import and
#: loading of the migration scripts were ~0.2 s of CPU at every start (a restart, and
#: each of a test suite's daemons); any other ledger is read by Alembic as before.
#: ``tests/unit/test_store_engine.py`` checks the list against Alembic's own walk.
REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008")
#: Alembic's version table (its default name, in the connection's default schema).
_VERSION_TABLE = "alembic_version"


def schema_state(conn: sa.Connection) -> SchemaState:
    """The schema of the ledger ``conn`` reaches against this maasd's migrations (read only)."""
    head = REVISIONS[-1]
    if _current_revisions(conn) == {head}:
        return SchemaState(
            current=frozenset((head,)), heads=frozenset((head,)), known=frozenset(REVISIONS)
        )
    return alembic_schema_state(conn)


def alembic_schema_state(conn: sa.Connection) -> SchemaState:
    """:func:`schema_state` as Alembic reads it, from the migration scripts themselves."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    return SchemaState(
        current=frozenset(MigrationContext.configure(conn).get_current_heads()),
        heads=frozenset(script.get_heads()),
        known=frozenset(rev.revision for rev in script.walk_revisions()),
    )


def _current_revisions(conn: sa.Connection) -> set[str]:
    """The revisions in the ledger's version table (none: no table yet), as Alembic reads
    them, without Alembic. Asking for the table first keeps a PostgreSQL transaction
    clean (a failed ``SELECT`` would abort it)."""
    if not conn.dialect.has_table(conn, _VERSION_TABLE):
        return set()
    rows = conn.exec_driver_sql(f"SELECT version_num FROM {_VERSION_TABLE}")
    return {str(r[0]) for r in rows}


def alembic_config(*, connection: sa.Connection | None = None, url: str | URL | None = None) -> Any:
    """A programmatic ``alembic.config.Config`` (no ``alembic.ini``).

    Pass ``connection`` to run migrations inside that connection's transaction
    (what :meth:`maasd.store.Store.upgrade` does), or ``url`` to let
    ``migrations/env.py`` open its own engine.
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        rendered = normalize_url(url).render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg
