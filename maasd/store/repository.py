"""The ledger's one entry point: ``Store`` — every repository over one :class:`Database`.

The SQL lives with its aggregate, one repository each (:class:`~maasd.store.base.Repository`:
handed the database it shares with the others, and no other state):

* :mod:`maasd.store.tenants` — :class:`TenantRepo`: tenants (with their usage) and API keys;
* :mod:`maasd.store.pools` — :class:`PoolRepo`: the pools of a host (with their usage);
* :mod:`maasd.store.buffers` — buffers and entries: :class:`ReserveRepo` (the reserve
  transaction, whose victims the pure :mod:`maasd.store.eviction` chooses, and the
  release) and :class:`BufferRepo` (states, leases, lookups);
* :mod:`maasd.store.events` — :class:`EventRepo`: the audit trail;
* :mod:`maasd.store.hosts` — :class:`HostRepo`: the daemon hosts sharing the ledger;
* :mod:`maasd.store.totals` — :class:`TotalsRepo`: the running usage totals, checked
  against their rows;

:mod:`maasd.store.database` holds the engines and connections they share, and the
transaction rules all of them follow are in :mod:`maasd.store.base`.
:mod:`maasd.store.notify` listens for what other daemons announce (PostgreSQL).

A module that needs one aggregate can be handed its repository alone (``TenantRepo(db)``);
:class:`Store` is all of them over one database, for the callers that use the whole ledger.
The core's modules are typed with the repository they use (``store: BufferRepo``,
``store: HostRepo``, :class:`BufferLedger` for both halves of the buffers aggregate), so
that mypy holds each to its aggregate while the composition root hands them one store.

Example::

    store = Store("sqlite:////var/lib/maasd/maasd.db")
    store.upgrade()
    store.add_tenant(new_id(), "acme", 8 << 30, time.time())
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from maasd.store.buffers import BufferRepo, ReserveRepo
from maasd.store.database import Database
from maasd.store.engine import alembic_config
from maasd.store.events import EventRepo
from maasd.store.hosts import HostRepo
from maasd.store.notify import Listener
from maasd.store.pools import PoolRepo
from maasd.store.tenants import TenantRepo
from maasd.store.totals import TotalsRepo
from maasd.store.watchdog import unwatched

__all__ = ["BufferLedger", "Store"]

#: Arbitrary, fixed: the PostgreSQL advisory lock that serialises migrations.
MIGRATION_LOCK_ID = 0x6D616173  # "maas"


class BufferLedger(ReserveRepo, BufferRepo):
    """The buffers-and-entries aggregate whole: its reserve and release transactions
    (:class:`ReserveRepo`) with its states, leases and lookups (:class:`BufferRepo`), for
    the core modules that both release and read buffers (release, recovery, the lifecycle)."""


class Store(TenantRepo, PoolRepo, BufferLedger, EventRepo, HostRepo, TotalsRepo):
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
        default_max_buffers: int | None = None,
    ) -> None:
        super().__init__(
            Database(
                url,
                pool_size=pool_size,
                max_overflow=max_overflow,
                echo=echo,
                connect_timeout_s=connect_timeout_s,
                statement_timeout_s=statement_timeout_s,
            )
        )
        if default_max_buffers is not None:
            self.default_max_buffers = default_max_buffers

    @property
    def url(self) -> URL:
        return self.db.url

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def dialect(self) -> str:
        return self.db.dialect

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

        with self.db.write.begin() as conn:
            if self.is_postgres:
                unwatched(conn.info)  # a migration may take as long as it needs
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
        self.db.dispose()
