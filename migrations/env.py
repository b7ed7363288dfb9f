"""Alembic environment for the maasd ledger.

There is no ``alembic.ini``: the store builds its configuration in code
(:func:`maasd.store.engine.alembic_config`). Normally ``Store.upgrade()`` hands
its own connection in through ``config.attributes["connection"]``, already
inside a write transaction (``BEGIN IMMEDIATE`` on SQLite, an advisory lock on
PostgreSQL), so that the whole upgrade is one transaction and two daemons
starting together cannot both migrate. Otherwise the URL comes from the
``sqlalchemy.url`` option or ``MAASD_DB_URL``.

SQLite cannot ``ALTER`` most things, so autogenerate renders batch operations
there (``render_as_batch``); write new migrations with ``op.batch_alter_table``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

from maasd.store.engine import create_engine
from maasd.store.schema import metadata

config = context.config
target_metadata = metadata


def _configure(connection: Connection) -> None:
    if connection.dialect.name == "sqlite":
        # Batch migrations rebuild tables (create copy, drop old, rename). With
        # foreign_keys=ON, check references at COMMIT instead of mid-rebuild.
        # (PRAGMA foreign_keys itself cannot change inside a transaction.)
        connection.exec_driver_sql("PRAGMA defer_foreign_keys=ON")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("MAASD_DB_URL")
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or MAASD_DB_URL")
    return url


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (``alembic upgrade --sql``)."""
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), pool_size=1, max_overflow=0)
    try:
        # One transaction for the whole upgrade, committed on success.
        with engine.begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
