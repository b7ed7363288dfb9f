"""The one object every repository of the ledger shares: :class:`Database` — its engines,
the three kinds of connection (:mod:`maasd.store.base`'s module docstring), this process's
write lock on SQLite, and the circuit that fails calls at once while the database is down.

Each repository (:class:`maasd.store.base.Repository`: one per aggregate) is handed
one at construction and holds it (``repo.db``): it reaches the database only through it.
:class:`maasd.store.Store` makes one and builds every repository over it; a transaction
that spans aggregates (a reserve locks its tenant's and its pool's rows and writes
events) is one repository's statement list on one connection of this object, never two
repositories' calls.

>>> db = Database("sqlite:////tmp/maasd-doctest.db")   # doctest: +SKIP
>>> TenantRepo(db).tenants()                           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.engine import URL, Engine

from maasd.store import hotpath
from maasd.store.base import ledger_errors
from maasd.store.circuit import LedgerCircuit
from maasd.store.engine import DURABLE, create_engine, normalize_url
from maasd.store.notify import Listener
from maasd.store.watchdog import CheckoutWatchdog

__all__ = ["Database"]

#: What the circuit's probe reads: a table every migrated ledger has, so a SQLite file
#: that cannot be read fails it (a bare ``SELECT 1`` would not touch the file).
_PROBE = sa.text("SELECT 1 FROM alembic_version")
#: What the write probe commits (SQLite): the row rewritten as it is — a page of the
#: WAL written and synced, nothing changed.
_WRITE_PROBE = "UPDATE alembic_version SET version_num = version_num"
#: How long the write probe waits for the write lock.
_WRITE_PROBE_WAIT_S = 0.25


class Database:
    """The ledger's engines and connections. Thread-safe; one per daemon.

    ``url`` is ``sqlite:///PATH`` or a PostgreSQL URL (:func:`~maasd.store.engine.normalize_url`:
    anything else is a :class:`~maasd.errors.ConfigError`).
    """

    def __init__(
        self,
        url: str | URL,
        *,
        pool_size: int = 16,
        max_overflow: int = 64,
        echo: bool = False,
        connect_timeout_s: float = 3.0,
        statement_timeout_s: float = 10.0,
    ) -> None:
        self.url: URL = normalize_url(url)
        self.engine: Engine = create_engine(
            self.url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            echo=echo,
            # a request waits for a free connection no longer than for a new one
            pool_timeout=max(1.0, connect_timeout_s),
            connect_timeout_s=connect_timeout_s,
            statement_timeout_s=statement_timeout_s,
        )
        self.dialect: str = self.engine.dialect.name
        #: PostgreSQL (row locks, several daemons) rather than SQLite (one writer).
        self.is_postgres: bool = self.dialect == "postgresql"
        #: PostgreSQL: cuts a connection held past every bound (a frozen server).
        self.watchdog: CheckoutWatchdog | None = None
        if self.is_postgres:
            # two statements at their timeout (a transaction's), a connect, a second
            limit = 2 * statement_timeout_s + connect_timeout_s + 1.0
            self.watchdog = CheckoutWatchdog(self.engine, limit)
        #: Reads (no BEGIN on SQLite, autocommit on PostgreSQL); single-statement writes
        #: (BEGIN IMMEDIATE on SQLite, autocommit on PostgreSQL); write transactions
        #: (BEGIN IMMEDIATE on SQLite, READ COMMITTED on PostgreSQL).
        self.read: Engine
        self.single: Engine
        if self.is_postgres:
            autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self.read = autocommit
            self.single = autocommit
        else:
            self.read = self.engine.execution_options(maasd_begin="none")
            self.single = self.engine  # BEGIN IMMEDIATE
        self.write: Engine = self.engine
        # Committed without waiting for the disk (store/base.py, "Durability"): on SQLite
        # only. A PostgreSQL server can crash and lose its unflushed commits while this
        # daemon keeps the memory they were about; there every write waits.
        self.write_lax: Engine
        self.single_lax: Engine
        if self.is_postgres:
            self.write_lax, self.single_lax = self.write, self.single
        else:
            self.write_lax = self.single_lax = self.engine.execution_options(**{DURABLE: False})
        # SQLite has one writer at a time. Queueing this process's writers on a lock
        # hands the database over at once; leaving it to the busy timeout makes them
        # poll with growing sleeps (up to 100 ms), which is what made the reserve p99
        # long under load. Other processes (migrations, tools) still meet the timeout.
        self.wlock: AbstractContextManager[Any] = (
            nullcontext() if self.is_postgres else threading.RLock()
        )
        #: Open while the database is known to be down (:mod:`maasd.store.circuit`).
        self.circuit = LedgerCircuit(
            self.probe, write_probe=None if self.is_postgres else self.write_probe
        )

    def probe(self) -> None:
        """One read that needs the database itself (a file read, a server round trip)."""
        with self.read.connect() as conn:
            conn.execute(_PROBE).first()

    def write_probe(self) -> None:
        """One committed write that changes nothing, waiting at most
        :data:`_WRITE_PROBE_WAIT_S` for the write lock (SQLite: a file locked by another
        process, full, or read-only fails it) — on a connection of its own, so that the
        pool's keep their busy timeout."""
        import sqlite3

        args, kwargs = self.engine.dialect.create_connect_args(self.url)
        kwargs.update(timeout=_WRITE_PROBE_WAIT_S, isolation_level=None)
        connect: Any = sqlite3.connect  # the dialect's arguments, as the pool passes them
        with self.wlock:
            conn = connect(*args, **kwargs)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(_WRITE_PROBE)
                conn.execute("COMMIT")
            finally:
                conn.close()  # a transaction left open is rolled back

    @contextlib.contextmanager
    def writing(self, *, durable: bool = True) -> Iterator[Connection]:
        """A write transaction, committed when the block ends without an exception;
        ``durable=False``: without waiting for the disk (see :mod:`maasd.store.base`)."""
        engine = self.write if durable else self.write_lax
        with self._queued(), ledger_errors(self.circuit), engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def single_statement(self, *, durable: bool = True) -> Iterator[Connection]:
        """A connection for one write statement (its own transaction)."""
        engine = self.single if durable else self.single_lax
        with self._queued(), ledger_errors(self.circuit), engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _queued(self) -> Iterator[None]:
        """This process's writer queue (SQLite), with the circuit checked before and again
        once through it: writers that queued behind one waiting out the busy timeout
        fail at once when it opened the circuit, instead of each waiting in turn."""
        hotpath.count()
        self.circuit.check()
        with self.wlock:
            self.circuit.check()
            yield

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for reads (no BEGIN on SQLite, autocommit on PostgreSQL)."""
        hotpath.count()
        self.circuit.check(write=False)
        with ledger_errors(self.circuit), self.read.connect() as conn:
            yield conn

    def listener(
        self,
        channel: str,
        *,
        on_up: Callable[[], None],
        on_event: Callable[[], None],
        on_down: Callable[[], None],
    ) -> Listener:
        """A :class:`~maasd.store.notify.Listener` on ``channel`` (PostgreSQL only; not started)."""
        if not self.is_postgres:
            raise RuntimeError("LISTEN needs PostgreSQL")
        return Listener(self.engine, channel, on_up=on_up, on_event=on_event, on_down=on_down)

    def dispose(self) -> None:
        """Close every pooled connection. The database must not be used afterwards."""
        self.circuit.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.engine.dispose()
