"""Running totals of a tenant's and a pool's buffers, kept by the database.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A reserve summed the tenant's bytes, the pool's bytes and counted the tenant's
buffers over the buffers index: O(entries) per reserve, 2.7–5.8× slower at 10k
entries than at 1k (docs/performance.md, "Many entries on one daemon"). Now:

- ``tenants.used_bytes``, ``tenants.buffers``, ``pools.used_bytes``,
  ``pools.buffers``: the bytes and count of its buffers in every state, back-filled
  here from the rows;
- triggers on ``buffers`` keep them, in the statement that inserts, deletes (or
  moves or resizes: nothing does) a row, so in its transaction. On PostgreSQL a
  delete's totals are changed once per statement, per tenant then per pool in id
  order (a statement-level trigger over the deleted rows): a bulk delete locks the
  rows in the order every reserve does (tenant, then pool), and two bulk deletes
  in the same order, so they cannot deadlock.

A reserve reads the totals from the tenant's and the pool's rows it locks (``SELECT
… FOR UPDATE``): every change to them is an ``UPDATE`` of those rows, so the lock
serialises them across hosts as it did the sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = (("tenants", "tenant_id"), ("pools", "pool_id"))


def _sqlite_change(sign: str, rec: str) -> str:
    return "".join(
        f"UPDATE {table} SET used_bytes = used_bytes {sign} {rec}.size_bytes, "
        f"buffers = buffers {sign} 1 WHERE id = {rec}.{col};\n"
        for table, col in _TABLES
    )


_SQLITE = (
    "CREATE TRIGGER buffers_totals_insert AFTER INSERT ON buffers BEGIN\n"
    + _sqlite_change("+", "NEW")
    + "END",
    "CREATE TRIGGER buffers_totals_delete AFTER DELETE ON buffers BEGIN\n"
    + _sqlite_change("-", "OLD")
    + "END",
    "CREATE TRIGGER buffers_totals_update AFTER UPDATE OF tenant_id, pool_id, size_bytes "
    "ON buffers BEGIN\n" + _sqlite_change("-", "OLD") + _sqlite_change("+", "NEW") + "END",
)
_SQLITE_DROP = ("buffers_totals_insert", "buffers_totals_delete", "buffers_totals_update")


def _pg_change(sign: str, rec: str) -> str:
    return "".join(
        f"    UPDATE {table} SET used_bytes = used_bytes {sign} {rec}.size_bytes, "
        f"buffers = buffers {sign} 1 WHERE id = {rec}.{col};\n"
        for table, col in _TABLES
    )


def _pg_gone(table: str, col: str) -> str:
    return (
        f"  FOR r IN SELECT {col} AS id, sum(size_bytes) AS b, count(*) AS n FROM gone "
        f"GROUP BY {col} ORDER BY {col} LOOP\n"
        f"    UPDATE {table} SET used_bytes = used_bytes - r.b, buffers = buffers - r.n "
        "WHERE id = r.id;\n"
        "  END LOOP;\n"
    )


_PG = (
    "CREATE FUNCTION maasd_buffers_totals_row() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  IF TG_OP = 'UPDATE' THEN\n" + _pg_change("-", "OLD") + "  END IF;\n"
    "  IF TG_OP IN ('INSERT', 'UPDATE') THEN\n" + _pg_change("+", "NEW") + "  END IF;\n"
    "  RETURN NULL;\n"
    "END $$",
    "CREATE FUNCTION maasd_buffers_totals_gone() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "DECLARE r record;\n"
    "BEGIN\n" + "".join(_pg_gone(t, c) for t, c in _TABLES) + "  RETURN NULL;\n"
    "END $$",
    "CREATE TRIGGER buffers_totals_row AFTER INSERT OR UPDATE OF tenant_id, pool_id, "
    "size_bytes ON buffers FOR EACH ROW EXECUTE FUNCTION maasd_buffers_totals_row()",
    "CREATE TRIGGER buffers_totals_gone AFTER DELETE ON buffers REFERENCING OLD TABLE AS gone "
    "FOR EACH STATEMENT EXECUTE FUNCTION maasd_buffers_totals_gone()",
)
_PG_DROP = (
    "DROP TRIGGER buffers_totals_gone ON buffers",
    "DROP TRIGGER buffers_totals_row ON buffers",
    "DROP FUNCTION maasd_buffers_totals_gone()",
    "DROP FUNCTION maasd_buffers_totals_row()",
)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:  # no buffer row may change between the back-fill and the triggers
        op.execute("LOCK TABLE buffers IN SHARE ROW EXCLUSIVE MODE")
    for table, _col in _TABLES:
        # A plain ADD COLUMN: tenants and pools are parent tables, never rebuilt in batch mode.
        op.add_column(
            table, sa.Column("used_bytes", sa.BigInteger(), nullable=False, server_default="0")
        )
        op.add_column(
            table, sa.Column("buffers", sa.BigInteger(), nullable=False, server_default="0")
        )
    for ddl in _PG if postgres else _SQLITE:
        op.execute(ddl)
    for table, col in _TABLES:
        op.execute(
            f"UPDATE {table} SET "
            f"used_bytes = (SELECT COALESCE(SUM(b.size_bytes), 0) FROM buffers b "
            f"WHERE b.{col} = {table}.id), "
            f"buffers = (SELECT COUNT(*) FROM buffers b WHERE b.{col} = {table}.id)"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for ddl in _PG_DROP:
            op.execute(ddl)
    else:
        for name in _SQLITE_DROP:
            op.execute(f"DROP TRIGGER {name}")
    for table, _col in _TABLES:
        op.drop_column(table, "buffers")
        op.drop_column(table, "used_bytes")
