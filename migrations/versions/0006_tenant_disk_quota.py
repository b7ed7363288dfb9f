"""A tenant's own bound on the disk tiers' bytes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

- ``tenants.disk_quota_bytes`` (NULL = the default: ``disk_quota_factor`` × its quota).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN: tenants is a parent table, never rebuilt in batch mode on SQLite.
    op.add_column("tenants", sa.Column("disk_quota_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("tenants", "disk_quota_bytes")
