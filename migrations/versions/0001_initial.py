"""Initial ledger: pools, tenants, api_keys, buffers, events.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written out in full rather than generated from ``maasd.store.schema`` at run
time: a migration is a frozen record of one schema version, and must not change
when the declaration does.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("numa_node", sa.Integer(), nullable=False),
        sa.Column("backing", sa.String(16), nullable=False),
        sa.Column("persistence", sa.String(16), nullable=False),
        sa.Column("latency_us", sa.Integer(), nullable=False),
        sa.Column("capacity_bytes", sa.BigInteger(), nullable=False),
        sa.Column("page_bytes", sa.BigInteger(), nullable=False),
        sa.Column("prefault", sa.Boolean(), nullable=False),
        sa.Column("scrub", sa.String(16), nullable=False),
        sa.Column("spill_dir", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pools"),
        sa.UniqueConstraint("host", "name", name="uq_pools_host_name"),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("quota_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("digest", sa.LargeBinary(32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
    )
    op.create_index("ix_api_keys_digest", "api_keys", ["digest"], unique=True)
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "buffers",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("pool_id", sa.String(32), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("numa_node", sa.Integer(), nullable=False),
        sa.Column("persistence", sa.String(16), nullable=False),
        sa.Column("label", sa.String(128), nullable=True),
        sa.Column("key", sa.String(512), nullable=True),
        sa.Column("evictable", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("last_used_at", sa.Float(), nullable=False),
        sa.Column("checkpoint_path", sa.Text(), nullable=True),
        sa.Column("checksum", sa.String(128), nullable=True),
        sa.Column("checkpointed_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_buffers_tenant_id_tenants"),
        sa.ForeignKeyConstraint(["pool_id"], ["pools.id"], name="fk_buffers_pool_id_pools"),
        sa.PrimaryKeyConstraint("id", name="pk_buffers"),
    )
    op.create_index("ix_buffers_tenant_id_state", "buffers", ["tenant_id", "state"])
    op.create_index("ix_buffers_pool_id_state", "buffers", ["pool_id", "state"])
    op.create_index("ix_buffers_expires_at", "buffers", ["expires_at"])
    # A key is unique among one tenant's buffers; rows without a key do not take part.
    op.create_index(
        "uq_buffers_tenant_id_key",
        "buffers",
        ["tenant_id", "key"],
        unique=True,
        sqlite_where=sa.text("key IS NOT NULL"),
        postgresql_where=sa.text("key IS NOT NULL"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=True),
        sa.Column("buffer_id", sa.String(32), nullable=True),
        sa.Column("pool_id", sa.String(32), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )


def downgrade() -> None:
    op.drop_table("events")
    op.drop_index("uq_buffers_tenant_id_key", table_name="buffers")
    op.drop_index("ix_buffers_expires_at", table_name="buffers")
    op.drop_index("ix_buffers_pool_id_state", table_name="buffers")
    op.drop_index("ix_buffers_tenant_id_state", table_name="buffers")
    op.drop_table("buffers")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_index("ix_api_keys_digest", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
    op.drop_table("pools")
