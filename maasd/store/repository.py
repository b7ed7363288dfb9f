"""The ledger's one entry point: :class:`Store` — one repository per aggregate over one
:class:`Database`, and the ledger's life (migrate, close).

The SQL lives with its aggregate, one repository object each
(:class:`~maasd.store.base.Repository`: it holds the database it shares with the others,
``repo.db``, and no other state), an attribute of the store:

* ``store.tenants`` — :class:`TenantRepo` (:mod:`maasd.store.tenants`): tenants (with
  their usage) and API keys;
* ``store.pools`` — :class:`PoolRepo` (:mod:`maasd.store.pools`): the pools of a host
  (with their usage);
* buffers and entries, in two halves (:mod:`maasd.store.buffers`): ``store.reserves`` —
  :class:`ReserveRepo`, a buffer's row admitted (the reserve transaction, whose victims
  the pure :mod:`maasd.store.eviction` chooses) and deleted (the release); and
  ``store.buffers`` — :class:`BufferRepo`, its states, leases and lookups in between;
* ``store.events`` — :class:`EventRepo` (:mod:`maasd.store.events`): the audit trail;
* ``store.hosts`` — :class:`HostRepo` (:mod:`maasd.store.hosts`): the daemon hosts
  sharing the ledger;
* ``store.totals`` — :class:`TotalsRepo` (:mod:`maasd.store.totals`): the running usage
  totals, checked against their rows.

``store.db`` (:mod:`maasd.store.database`) holds the engines, the connections, the
write lock and the circuit they share; the transaction rules all of them follow are in
:mod:`maasd.store.base`. A transaction that touches several aggregates' tables (the
reserve locks its tenant's and pool's rows and writes events; forgetting a host deletes
its buffers and pools) is the statements of one repository on one connection, as it
always was: no repository calls another.

The composition root (:mod:`maasd.core.app`) hands each core module the repositories it
uses (``Reaper(..., store.buffers, ...)``), never the store; ``tests/unit/test_ownership.py``
holds it to that.

Example::

    store = Store("sqlite:////var/lib/maasd/maasd.db")
    store.upgrade()
    store.tenants.add_tenant(new_id(), "acme", 8 << 30, time.time())
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from maasd.errors import ConfigError, LedgerUnavailable
from maasd.store.base import OnDatabase, unavailable
from maasd.store.buffers import BufferRepo, ReserveRepo
from maasd.store.database import Database
from maasd.store.engine import SchemaState, alembic_config, schema_state
from maasd.store.events import EventRepo
from maasd.store.hosts import HostRepo
from maasd.store.pools import PoolRepo
from maasd.store.tenants import TenantRepo
from maasd.store.totals import TotalsRepo
from maasd.store.watchdog import unwatched

__all__ = ["Store"]

#: Arbitrary, fixed: the PostgreSQL advisory lock that serialises migrations.
MIGRATION_LOCK_ID = 0x6D616173  # "maas"


class Store(OnDatabase):
    """The ledger: pools, tenants, keys, buffers and events in one database, one
    repository per aggregate (the module docstring lists them).

    Thread-safe; one instance per daemon. ``url`` is ``sqlite:///PATH`` (the
    embedded default) or a PostgreSQL URL (``postgresql://``,
    ``postgresql+psycopg://``, or ``postgresql+asyncpg://``, which is run
    through psycopg 3 because the store is synchronous); anything else raises
    :class:`~maasd.errors.ConfigError`. The schema is created only by
    :meth:`upgrade` (Alembic).

    >>> store = Store("sqlite:////tmp/maasd-doctest.db")  # doctest: +SKIP
    >>> store.upgrade()                                    # doctest: +SKIP
    >>> store.tenants.tenants()                            # doctest: +SKIP
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
        db = Database(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            echo=echo,
            connect_timeout_s=connect_timeout_s,
            statement_timeout_s=statement_timeout_s,
        )
        self.db = db
        self.tenants = TenantRepo(db)
        self.pools = PoolRepo(db)
        self.reserves = ReserveRepo(db)
        self.buffers = BufferRepo(db)
        self.events = EventRepo(db)
        self.hosts = HostRepo(db)
        self.totals = TotalsRepo(db)

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
        drifted (:meth:`~maasd.store.totals.TotalsRepo.mend_totals`: O(buffers)). A
        ledger at the newest schema (:meth:`schema_state`) is left as it is; one at a
        revision this maasd does not ship is :class:`~maasd.errors.ConfigError`.
        """
        try:
            self._upgrade(revision)
        except (sa.exc.DBAPIError, sa.exc.TimeoutError) as exc:
            # A database that cannot be reached at start (refused, no answer in
            # db_connect_timeout_s) was a page of SQLAlchemy's traceback: one line.
            why = unavailable(exc)
            if why is None:
                raise
            raise LedgerUnavailable(f"the ledger database cannot serve now ({why})") from None
        if revision == "head":
            self.totals.mend_totals()

    def _upgrade(self, revision: str) -> None:
        with self.db.write.begin() as conn:
            if self.is_postgres:
                unwatched(conn.info)  # a migration may take as long as it needs
                # A migration may take longer than any request's statement may.
                conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
                conn.execute(
                    sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID}
                )
            state = schema_state(conn)
            if state.unknown:  # Alembic's own error is a traceback naming only the revision
                raise ConfigError(
                    f"the ledger is at schema revision {','.join(sorted(state.current))}, "
                    f"which this maasd does not know (its newest: {','.join(sorted(state.heads))}"
                    "): a newer maasd migrated it; run that version, or restore a backup"
                )
            if revision != "head" or not state.at_head:
                from alembic import command  # only now: at the head, no Alembic at all

                command.upgrade(alembic_config(connection=conn), revision)

    def schema_state(self) -> SchemaState:
        """Where the ledger's schema is against this maasd's migrations (read only: what
        :meth:`upgrade` would do; ``maasd doctor``'s ledger check)."""
        with self.engine.connect() as conn:
            return schema_state(conn)

    def dispose(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        self.db.dispose()
