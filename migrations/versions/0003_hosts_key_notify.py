"""Hosts with a heartbeat, and key changes announced to every daemon (PostgreSQL).

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01

- ``hosts``: one row per daemon host sharing the ledger (its incarnation, start,
  heartbeat and clean stop, on the database's clock). Backfilled from the hosts
  that own pools, as never seen (``last_seen`` 0), so that an operator can forget a
  host of an older ledger that never comes back.
- PostgreSQL only: a statement trigger on ``api_keys`` that runs
  ``pg_notify('maasd_keys', '')`` after any revocation (``UPDATE OF revoked_at``)
  or deletion of keys. The notification is sent when the revoking transaction
  commits, by whichever path revoked (a daemon, an operator's SQL), and every
  daemon listening empties its key cache. SQLite has one daemon per ledger: it
  needs no trigger.

The meaning of each column is written in :mod:`maasd.store.schema`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The channel daemons LISTEN on (maasd.store.notify.KEYS_CHANNEL must match).
CHANNEL = "maasd_keys"

_FUNCTION = f"""
CREATE OR REPLACE FUNCTION maasd_keys_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', '');
    RETURN NULL;
END
$$
"""
_TRIGGER = """
CREATE TRIGGER maasd_keys_changed
AFTER UPDATE OF revoked_at OR DELETE ON api_keys
FOR EACH STATEMENT EXECUTE FUNCTION maasd_keys_changed()
"""


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("incarnation", sa.String(32), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.Column("heartbeat_s", sa.Float(), nullable=False),
        sa.Column("stopped_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_hosts"),
    )
    op.execute(
        "INSERT INTO hosts (name, incarnation, started_at, last_seen, heartbeat_s) "
        "SELECT DISTINCT host, '', 0, 0, 1 FROM pools"
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FUNCTION)
        op.execute(_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS maasd_keys_changed ON api_keys")
        op.execute("DROP FUNCTION IF EXISTS maasd_keys_changed()")
    op.drop_table("hosts")
