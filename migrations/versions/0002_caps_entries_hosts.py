"""Buffer caps, deletes in progress, warm stock, entries, and a buffer's host.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

- ``tenants.max_buffers`` (NULL = the daemon's default cap) and ``tenants.deleting_at``;
- ``pools.warm_bytes`` (default 0) and ``pools.deleting_at``;
- ``buffers.host`` (backfilled from the buffer's pool), ``buffers.kind`` (default
  ``'buffer'``) and ``buffers.committed_at``;
- the unique key index becomes (tenant_id, host, key): several hosts sharing one
  PostgreSQL each keep their own copy of a prefix.

The meaning of each column is written in :mod:`maasd.store.schema`. Downgrading
restores the (tenant_id, key) index, so it fails if one tenant holds the same key
on two hosts; the rows must be released first.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMNs: the parent tables (tenants, pools) must not be rebuilt in batch
    # mode on SQLite, which would drop rows that buffers and keys still refer to.
    op.add_column("tenants", sa.Column("max_buffers", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("deleting_at", sa.Float(), nullable=True))
    op.add_column(
        "pools", sa.Column("warm_bytes", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column("pools", sa.Column("deleting_at", sa.Float(), nullable=True))
    # buffers is rebuilt on SQLite to make host NOT NULL once backfilled (nothing refers
    # to its rows, so that is safe). The partial key index is dropped first, so that the
    # rebuild never has to carry it over.
    op.drop_index("uq_buffers_tenant_id_key", table_name="buffers")
    with op.batch_alter_table("buffers") as batch:
        batch.add_column(sa.Column("host", sa.String(255), nullable=True))
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="buffer"))
        batch.add_column(sa.Column("committed_at", sa.Float(), nullable=True))
    op.execute(
        "UPDATE buffers SET host = (SELECT pools.host FROM pools WHERE pools.id = buffers.pool_id)"
    )
    with op.batch_alter_table("buffers") as batch:
        batch.alter_column("host", existing_type=sa.String(255), nullable=False)
    op.create_index(
        "uq_buffers_tenant_id_host_key",
        "buffers",
        ["tenant_id", "host", "key"],
        unique=True,
        sqlite_where=sa.text("key IS NOT NULL"),
        postgresql_where=sa.text("key IS NOT NULL"),
    )


def downgrade() -> None:
    # Plain DROP COLUMNs (SQLite ≥ 3.35 has them), for the same reason as above.
    op.drop_index("uq_buffers_tenant_id_host_key", table_name="buffers")
    for column in ("committed_at", "kind", "host"):
        op.drop_column("buffers", column)
    op.create_index(
        "uq_buffers_tenant_id_key",
        "buffers",
        ["tenant_id", "key"],
        unique=True,
        sqlite_where=sa.text("key IS NOT NULL"),
        postgresql_where=sa.text("key IS NOT NULL"),
    )
    for column in ("deleting_at", "warm_bytes"):
        op.drop_column("pools", column)
    for column in ("deleting_at", "max_buffers"):
        op.drop_column("tenants", column)
