"""The store as one entry point: URLs, the migrations it ships, SQLite's connection rules."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa

from ledger import head_revision, make_tenant
from maasd.errors import ConfigError
from maasd.store import Store, alembic_config, migrations_dir, normalize_url
from maasd.store.engine import REVISIONS, alembic_schema_state, schema_state

pytest_plugins = ("ledger",)  # the ``store`` fixture, on each backend


def test_url_normalisation() -> None:
    assert str(normalize_url("postgresql+asyncpg://u@db/x?ssl=require")) == (
        "postgresql+psycopg://u@db/x?sslmode=require"
    )
    assert normalize_url("postgresql://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:////tmp/x.db").database == "/tmp/x.db"
    for bad in ("sqlite://", "sqlite:///:memory:", "mysql://u@db/x", "not a url"):
        with pytest.raises(ConfigError):
            normalize_url(bad)


def test_migrations_dir_found() -> None:
    assert (migrations_dir() / "env.py").is_file()
    assert head_revision() == "0008"


def test_sqlite_pragmas(tmp_path: Any) -> None:
    s = Store(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
    finally:
        s.dispose()


def test_sqlite_write_transactions_begin_immediate(tmp_path: Any) -> None:
    """A write transaction holds the write lock from BEGIN on, before any statement of its
    own: a second writer waits (here: fails at once). A read sends no BEGIN at all."""
    import sqlite3

    s = Store(f"sqlite:///{tmp_path / 'w.db'}")
    s.upgrade()
    other = sqlite3.connect(tmp_path / "w.db", isolation_level=None, timeout=0)
    try:
        for durable in (True, False):
            with (
                s.db.writing(durable=durable),
                pytest.raises(sqlite3.OperationalError, match="locked"),
            ):
                other.execute("BEGIN IMMEDIATE")  # "database is locked"
            other.execute("BEGIN IMMEDIATE")  # released at the commit
            other.execute("ROLLBACK")
        statements: list[str] = []
        sa.event.listen(s.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        make_tenant(s)
        s.tenants.tenants()  # a read sends no BEGIN at all
        assert not any(x.startswith("BEGIN") for x in statements)
        assert statements  # (the listener does see the ledger's statements)
    finally:
        other.close()
        s.dispose()


def test_a_pragma_refused_for_a_lock_is_retried_and_any_other_error_is_not(tmp_path: Any) -> None:
    """SQLite answers the WAL switch SQLITE_BUSY at once while another connection holds the
    lock: the pragma is tried again until the lock goes (told by the error's code); an
    error of another code is raised at the first try."""
    import sqlite3
    import threading

    from maasd.store.engine import _retry_locked

    path = tmp_path / "r.db"
    holder = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(sqlite3.OperationalError) as refused:
            other.execute("PRAGMA journal_mode=WAL")
        assert refused.value.sqlite_errorname == "SQLITE_BUSY"
        threading.Timer(0.05, holder.execute, ("COMMIT",)).start()
        _retry_locked(other.cursor(), "PRAGMA journal_mode=WAL", deadline_s=5)
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            _retry_locked(other.cursor(), "SELECT * FROM missing", deadline_s=5)
    finally:
        other.close()
        holder.close()


def test_the_schema_state_is_what_upgrade_and_doctor_read(tmp_path: Any) -> None:
    s = Store(f"sqlite:///{tmp_path / 's.db'}")
    try:
        fresh = s.schema_state()
        assert fresh.current == frozenset()
        assert not fresh.at_head
        assert not fresh.unknown
        assert fresh.heads == {head_revision()}
        assert head_revision() in fresh.known
        s.upgrade()
        migrated = s.schema_state()
        assert migrated.at_head
        assert migrated.current == {head_revision()}
        s.upgrade()  # at the newest schema: nothing to migrate, and no error
        assert s.schema_state() == migrated
    finally:
        s.dispose()


def test_the_revision_list_is_alembics_own_walk_oldest_first() -> None:
    """``REVISIONS`` (what a start at the head reads without Alembic) is every migration
    script's revision in order: a new migration fails this until it is listed."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    walked = [rev.revision for rev in script.walk_revisions()]  # newest first
    assert tuple(reversed(walked)) == REVISIONS
    assert script.get_heads() == [REVISIONS[-1]]


def test_a_ledger_at_the_head_reads_as_alembic_reads_it(store: Store) -> None:
    with store.engine.connect() as conn:
        state = schema_state(conn)
        assert state == alembic_schema_state(conn)
    assert state.at_head
    assert not state.unknown


def test_a_start_on_a_ledger_at_the_head_does_not_import_alembic(tmp_path: Any) -> None:
    """The second upgrade (every restart) reads the version table and stops there; the
    first, on an empty ledger, still runs Alembic's migrations."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    code = (
        "import sys; from maasd.store import Store; s = Store(sys.argv[1]); s.upgrade(); "
        "print(s.schema_state().at_head, 'alembic' in sys.modules)"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, url], capture_output=True, text=True, timeout=120
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert [run.stdout.split() for run in runs] == [["True", "True"], ["True", "False"]]


def test_upgrade_refuses_a_ledger_a_newer_maasd_migrated(tmp_path: Any) -> None:
    """A ledger at a revision this maasd does not ship (its package rolled back after a
    newer one migrated) is a ConfigError naming both revisions, and is left as it is."""
    s = Store(f"sqlite:///{tmp_path / 's.db'}")
    try:
        s.upgrade()
        with s.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_future'")
        with pytest.raises(ConfigError) as exc:
            s.upgrade()
        assert "9999_future" in exc.value.detail
        assert head_revision() in exc.value.detail  # type: ignore[operator]
        assert "newer maasd" in exc.value.detail
        assert s.schema_state().current == {"9999_future"}
    finally:
        s.dispose()
