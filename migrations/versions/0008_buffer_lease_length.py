"""A buffer's lease length, and when a renew last set its lease.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05

- ``buffers.ttl_s``: the lease's length as its tenant last gave it (the reserve's or
  put's, then each renew's), what a lookup hit extends it by. A restart took it as
  ``expires_at − created_at``, which a renew or a hit before the restart had made longer
  than the tenant gave. NULL for the rows already there: for those that formula stands in.
- ``buffers.lease_set_at``: when a renew last set the lease (NULL: never). A lookup hit's
  batched extension is written only if the hit came after it, so that one taken to be
  written before a renew to a shorter lease cannot undo it.

Plain ADD COLUMNs, on SQLite too: a batch rebuild of ``buffers`` would drop the totals'
triggers (migration 0007).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("buffers", sa.Column("ttl_s", sa.BigInteger(), nullable=True))
    op.add_column("buffers", sa.Column("lease_set_at", sa.Float(), nullable=True))


def downgrade() -> None:
    for column in ("lease_set_at", "ttl_s"):
        op.drop_column("buffers", column)
