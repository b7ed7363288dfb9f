"""PostgreSQL for the ledger tests: the server from MAASD_TEST_PG_URL, a fresh database each time.

``BACKENDS`` parametrises a test over SQLite (always) and PostgreSQL (when
``MAASD_TEST_PG_URL`` is set — ``scripts/test`` starts a throw-away server for it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from maasd.store import normalize_url

PG_URL = os.environ.get("MAASD_TEST_PG_URL")

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgres",
        id="postgres",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(
                not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"
            ),
        ],
    ),
]


@contextlib.contextmanager
def fresh_pg_database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped afterwards."""
    assert PG_URL
    admin = sa.create_engine(normalize_url(PG_URL), isolation_level="AUTOCOMMIT")
    name = f"maasd_test_{secrets.token_hex(6)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield normalize_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
