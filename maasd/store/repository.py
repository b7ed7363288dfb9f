"""The ledger's one entry point: ``Store`` — engine, connections, migrations, repositories.

The SQL lives with its aggregate, one repository mixin each:

* :mod:`maasd.store.tenants` — tenants (with their usage) and API keys;
* :mod:`maasd.store.pools` — the pools of a host (with their usage);
* :mod:`maasd.store.buffers` — buffers, leases, and the reserve transaction,
  whose victims the pure :mod:`maasd.store.eviction` chooses;
* :mod:`maasd.store.events` — the audit trail;
* :mod:`maasd.store.hosts` — the daemon hosts sharing the ledger, their heartbeats;
* :mod:`maasd.store.totals` — the running usage totals, checked against their rows;

and the transaction rules all of them follow are in :mod:`maasd.store.base`.
:mod:`maasd.store.notify` listens for what other daemons announce (PostgreSQL).

Example::

    store = Store("sqlite:////var/lib/maasd/maasd.db")
    store.upgrade()
    store.add_tenant(new_id(), "acme", 8 << 30, time.time())
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from maasd.store.buffers import BufferRepo, ReserveRepo
from maasd.store.circuit import LedgerCircuit
from maasd.store.engine import DURABLE, alembic_config, create_engine, normalize_url
from maasd.store.events import EventRepo
from maasd.store.hosts import HostRepo
from maasd.store.notify import Listener
from maasd.store.pools import PoolRepo
from maasd.store.tenants import TenantRepo
from maasd.store.totals import TotalsRepo

__all__ = ["Store"]

#: Arbitrary, fixed: the PostgreSQL advisory lock that serialises migrations.
MIGRATION_LOCK_ID = 0x6D616173  # "maas"
#: What the circuit's probe reads: a table every migrated ledger has, so a SQLite file
#: that cannot be read fails it (a bare ``SELECT 1`` would not touch the file).
_PROBE = sa.text("SELECT 1 FROM alembic_version")


class Store(TenantRepo, PoolRepo, ReserveRepo, BufferRepo, EventRepo, HostRepo, TotalsRepo):
    """The ledger: pools, tenants, keys, buffers and events in one database.

    Thread-safe; one instance per daemon. ``url`` is ``sqlite:///PATH`` (the
    embedded default) or a PostgreSQL URL (``postgresql://``,
    ``postgresql+psycopg://``, or ``postgresql+asyncpg://``, which is run
    through psycopg 3 because the store is synchronous); anything else raises
    :class:`~maasd.errors.ConfigError`. The schema is created only by
    :meth:`upgrade` (Alembic).

    >>> store = Store("sqlite:////tmp/maasd-doctest.db")  # doctest: +SKIP
    >>> store.upgrade()                                    # doctest: +SKIP
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
        self.is_postgres: bool = self.dialect == "postgresql"
        if self.is_postgres:
            autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self._read = autocommit
            self._single = autocommit
        else:
            self._read = self.engine.execution_options(maasd_begin="none")
            self._single = self.engine  # BEGIN IMMEDIATE
        self._write = self.engine
        # Committed without waiting for the disk (store/base.py, "Durability"): on SQLite
        # only. A PostgreSQL server can crash and lose its unflushed commits while this
        # daemon keeps the memory they were about; there every write waits.
        if self.is_postgres:
            self._write_lax, self._single_lax = self._write, self._single
        else:
            self._write_lax = self._single_lax = self.engine.execution_options(**{DURABLE: False})
        # SQLite has one writer at a time. Queueing this process's writers on a lock
        # hands the database over at once; leaving it to the busy timeout makes them
        # poll with growing sleeps (up to 100 ms), which is what made the reserve p99
        # long under load. Other processes (migrations, tools) still meet the timeout.
        self._wlock = nullcontext() if self.is_postgres else threading.RLock()
        #: Open while the database is known to be down (:mod:`maasd.store.circuit`).
        self.circuit = LedgerCircuit(self._probe)

    def _probe(self) -> None:
        """One read that needs the database itself (a file read, a server round trip)."""
        with self._read.connect() as conn:
            conn.execute(_PROBE).first()

    def __repr__(self) -> str:
        return f"Store({self.url.render_as_string(hide_password=True)!r})"

    def upgrade(self, revision: str = "head") -> None:
        """Migrate the database to ``revision`` (default: the newest) with Alembic.

        Runs inside one write transaction: ``BEGIN IMMEDIATE`` on SQLite, an
        advisory transaction lock on PostgreSQL, so that daemons starting
        together migrate one after the other (the second finds nothing to do).
        Then the usage totals are checked against their rows, and mended if they
        drifted (:meth:`~maasd.store.totals.TotalsRepo.mend_totals`: O(buffers)).
        """
        from alembic import command

        with self._write.begin() as conn:
            if self.is_postgres:
                # A migration may take longer than any request's statement may.
                conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
                conn.execute(
                    sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID}
                )
            command.upgrade(alembic_config(connection=conn), revision)
        if revision == "head":
            self.mend_totals()

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
        """Close every pooled connection. The store must not be used afterwards."""
        self.circuit.close()
        self.engine.dispose()
