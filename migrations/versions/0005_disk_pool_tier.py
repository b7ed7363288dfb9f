"""A pool's disk tier: its directory and its byte budget.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

- ``pools.disk_dir`` (NULL = no disk tier) and ``pools.disk_bytes`` (default 0).

Nothing about the entries on disk is in the ledger: their keys live only in the daemon's
memory, so a restart empties the tier (docs/operations.md, "The disk tier").
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMNs: pools is a parent table, never rebuilt in batch mode on SQLite.
    op.add_column("pools", sa.Column("disk_dir", sa.Text(), nullable=True))
    op.add_column(
        "pools", sa.Column("disk_bytes", sa.BigInteger(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    for column in ("disk_bytes", "disk_dir"):
        op.drop_column("pools", column)
