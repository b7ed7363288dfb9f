"""Alembic migrations: the only way the ledger's schema comes to exist.

Each test gets an empty database — a SQLite file, and a fresh PostgreSQL
database when ``MAASD_TEST_PG_URL`` is set (``scripts/pg-test-server``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from ledger import current_revision, downgrade, head_revision
from maasd.store import Store, alembic_config, metadata
from pgdb import BACKENDS, fresh_pg_database


@pytest.fixture(params=BACKENDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The URL of an empty database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'maasd.db'}"
        return
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def store(empty_url: str) -> Iterator[Store]:
    s = Store(empty_url)
    try:
        yield s
    finally:
        s.dispose()


def tables(store: Store) -> set[str]:
    return set(sa.inspect(store.engine).get_table_names()) - {"alembic_version"}


def indexes(store: Store) -> dict[str, set[str]]:
    insp = sa.inspect(store.engine)
    # PostgreSQL also lists the index behind each UNIQUE constraint: those are compared
    # as constraints, in unique_constraints().
    return {
        t: {
            ix["name"]
            for ix in insp.get_indexes(t)
            if ix["name"] and not ix.get("duplicates_constraint")
        }
        for t in tables(store)
    }


def unique_constraints(store: Store) -> dict[str, set[str]]:
    insp = sa.inspect(store.engine)
    return {t: {str(uq["name"]) for uq in insp.get_unique_constraints(t)} for t in tables(store)}


def declared_unique_constraints() -> dict[str, set[str]]:
    return {
        t.name: {str(c.name) for c in t.constraints if isinstance(c, sa.UniqueConstraint)}
        for t in metadata.sorted_tables
    }


def declared_indexes() -> dict[str, set[str]]:
    return {t.name: {str(ix.name) for ix in t.indexes} for t in metadata.sorted_tables}


def schema_diff(store: Store) -> list[Any]:
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, metadata))


def test_upgrade_from_empty_to_head(store: Store) -> None:
    assert current_revision(store) is None
    assert tables(store) == set()
    store.upgrade()
    assert current_revision(store) == head_revision()
    assert tables(store) == set(metadata.tables)
    assert indexes(store) == declared_indexes()
    assert unique_constraints(store) == declared_unique_constraints()
    assert schema_diff(store) == []
    store.upgrade()  # idempotent
    assert current_revision(store) == head_revision()


def test_downgrade_to_base_and_up_again(store: Store) -> None:
    store.upgrade()
    downgrade(store, "base")
    assert current_revision(store) is None
    assert tables(store) == set()
    store.upgrade()
    assert tables(store) == set(metadata.tables)
    assert schema_diff(store) == []


POOL = {
    "numa_node": 0,
    "backing": "memfd",
    "persistence": "volatile",
    "latency_us": 1,
    "capacity_bytes": 9,
    "page_bytes": 4096,
    "prefault": True,
    "scrub": "zero",
    "spill_dir": None,
    "created_at": 0.0,
}
BUFFER = {
    "tenant_id": "t1",
    "size_bytes": 1,
    "numa_node": 0,
    "persistence": "volatile",
    "label": None,
    "evictable": False,
    "state": "live",
    "created_at": 0.0,
    "expires_at": 1.0,
    "last_used_at": 0.0,
}


def add_tenant_and_pools(conn: sa.Connection) -> None:
    """Tenant t1; pools p1 on host h1 and p2 on host h2 (columns every revision has)."""
    conn.execute(
        sa.text("INSERT INTO tenants (id, name, quota_bytes, created_at) VALUES ('t1', 't', 9, 0)")
    )
    for pool_id, host in (("p1", "h1"), ("p2", "h2")):
        conn.execute(
            sa.insert(sa.table("pools", *(sa.column(c) for c in ("id", "host", "name", *POOL)))),
            {"id": pool_id, "host": host, "name": "p", **POOL},
        )


def insert_buffers(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    """Insert buffers with only the columns given (so it works at any revision)."""
    for row in rows:
        table = sa.table("buffers", *(sa.column(c) for c in row))
        conn.execute(sa.insert(table), row)


def test_partial_unique_key_index(store: Store) -> None:
    """A key is unique per tenant and host; NULL keys never clash; other hosts keep their own."""
    store.upgrade()
    row = {**BUFFER, "pool_id": "p1", "host": "h1"}
    with store.engine.begin() as conn:
        add_tenant_and_pools(conn)
        insert_buffers(conn, [{**row, "id": "a", "key": None}, {**row, "id": "b", "key": None}])
        insert_buffers(conn, [{**row, "id": "c", "key": "k"}])
        insert_buffers(conn, [{**row, "id": "e", "key": "k", "pool_id": "p2", "host": "h2"}])
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        insert_buffers(conn, [{**row, "id": "d", "key": "k"}])


def test_upgrade_from_0001_backfills_and_defaults_the_new_columns(store: Store) -> None:
    store.upgrade("0001")
    with store.engine.begin() as conn:
        add_tenant_and_pools(conn)
        insert_buffers(
            conn,
            [
                {**BUFFER, "id": "a", "pool_id": "p1", "key": "k1"},
                {**BUFFER, "id": "b", "pool_id": "p2", "key": "k2"},
            ],
        )
    store.upgrade()
    assert schema_diff(store) == []
    with store.engine.connect() as conn:
        buffers = conn.execute(
            sa.text("SELECT id, host, kind, committed_at FROM buffers ORDER BY id")
        ).all()
        assert [tuple(r) for r in buffers] == [
            ("a", "h1", "buffer", None),
            ("b", "h2", "buffer", None),
        ]
        tenant = conn.execute(sa.text("SELECT max_buffers, deleting_at FROM tenants")).one()
        assert tuple(tenant) == (None, None)
        pools = conn.execute(sa.text("SELECT warm_bytes, deleting_at FROM pools")).all()
        assert [tuple(r) for r in pools] == [(0, None), (0, None)]
    with store.engine.begin() as conn:  # the new index: h2 may now hold its own "k1"
        insert_buffers(conn, [{**BUFFER, "id": "c", "pool_id": "p2", "host": "h2", "key": "k1"}])


def test_downgrade_to_0001_keeps_the_rows(store: Store) -> None:
    store.upgrade()
    with store.engine.begin() as conn:
        add_tenant_and_pools(conn)
        insert_buffers(conn, [{**BUFFER, "id": "a", "pool_id": "p1", "host": "h1", "key": "k"}])
    downgrade(store, "0001")
    assert current_revision(store) == "0001"
    columns = {c["name"] for c in sa.inspect(store.engine).get_columns("buffers")}
    assert not columns & {"host", "kind", "committed_at"}
    assert "uq_buffers_tenant_id_key" in indexes(store)["buffers"]
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, key FROM buffers")).all() == [("a", "k")]
    store.upgrade()
    assert schema_diff(store) == []


def test_foreign_keys_enforced(store: Store) -> None:
    store.upgrade()
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(
            sa.insert(metadata.tables["api_keys"]),
            {"id": "k", "tenant_id": "nobody", "digest": b"x" * 32, "created_at": 0.0},
        )


def test_upgrade_through_a_url_config(empty_url: str) -> None:
    """migrations/env.py also works on its own, as ``maasd migrate`` or an operator may use it."""
    command.upgrade(alembic_config(url=empty_url), "head")
    s = Store(empty_url)
    try:
        assert current_revision(s) == head_revision()
        assert tables(s) == set(metadata.tables)
    finally:
        s.dispose()


def test_concurrent_upgrades_serialise(empty_url: str) -> None:
    """Two daemons starting at once: both upgrades succeed, the schema is made once."""
    stores = [Store(empty_url) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def run(s: Store) -> None:
        barrier.wait()
        try:
            s.upgrade()
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        assert current_revision(stores[0]) == head_revision()
        assert schema_diff(stores[0]) == []
    finally:
        for s in stores:
            s.dispose()


def test_upgrade_to_0003_lists_the_hosts_of_pools_as_never_seen(store: Store) -> None:
    store.upgrade("0002")
    with store.engine.begin() as conn:
        add_tenant_and_pools(conn)
    store.upgrade()
    assert schema_diff(store) == []
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT name, incarnation, last_seen, stopped_at FROM hosts ORDER BY name")
        ).all()
    assert [tuple(r) for r in rows] == [("h1", "", 0.0, None), ("h2", "", 0.0, None)]


def test_a_key_revocation_or_deletion_notifies_the_listeners(store: Store) -> None:
    """PostgreSQL: migration 0003's trigger announces key changes on ``maasd_keys``."""
    if not store.is_postgres:
        pytest.skip("one daemon per SQLite ledger: nobody to tell")
    import psycopg

    store.upgrade()
    args, kwargs = store.engine.dialect.create_connect_args(store.url)
    with psycopg.connect(*args, **kwargs, autocommit=True) as listener:
        listener.execute("LISTEN maasd_keys")
        with store.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tenants VALUES ('t1', 't', 9, 0, NULL, NULL)"))
            conn.execute(
                sa.text("INSERT INTO api_keys VALUES ('k1', 't1', :d, 0, NULL)"), {"d": b"x"}
            )
        assert list(listener.notifies(timeout=0.2)) == []  # issuing a key is no news
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE api_keys SET revoked_at = 1 WHERE id = 'k1'"))
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == ["maasd_keys"]
        with store.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM api_keys"))
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == ["maasd_keys"]
    downgrade(store, "0002")
    with store.engine.connect() as conn:
        triggers = conn.execute(
            sa.text("SELECT tgname FROM pg_trigger WHERE tgname = 'maasd_keys_changed'")
        ).all()
    assert triggers == []


def test_upgrade_to_0008_leaves_the_lease_length_of_the_rows_there_unknown(store: Store) -> None:
    """Rows from before 0008 have no ``ttl_s`` nor ``lease_set_at`` (NULL: their length is
    taken as reserved, ``expires_at − created_at``); down again, the rows stay and the
    totals' triggers (0007, which a rebuild of ``buffers`` would drop) still count them."""
    store.upgrade("0007")
    with store.engine.begin() as conn:
        add_tenant_and_pools(conn)
        insert_buffers(conn, [{**BUFFER, "id": "a", "pool_id": "p1", "host": "h1"}])
    store.upgrade()
    assert schema_diff(store) == []
    row = store.buffers.buffer("a")
    assert row is not None
    assert (row.ttl_s, row.lease_set_at, row.lease_s) == (None, None, 1)
    store.buffers.renew("a", None, 100.0, ttl_s=30, now=70.0)
    renewed = store.buffers.buffer("a")
    assert renewed is not None
    assert (renewed.ttl_s, renewed.lease_set_at, renewed.lease_s) == (30, 70.0, 30)
    downgrade(store, "0007")
    columns = {c["name"] for c in sa.inspect(store.engine).get_columns("buffers")}
    assert not columns & {"ttl_s", "lease_set_at"}
    with store.engine.begin() as conn:
        insert_buffers(conn, [{**BUFFER, "id": "b", "pool_id": "p1", "host": "h1"}])
        totals = conn.execute(sa.text("SELECT used_bytes, buffers FROM tenants")).one()
    assert tuple(totals) == (2, 2)
    store.upgrade()
    assert schema_diff(store) == []
