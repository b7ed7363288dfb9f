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
    assert store.current_revision() is None
    assert tables(store) == set()
    store.upgrade()
    assert store.current_revision() == Store.head_revision()
    assert tables(store) == set(metadata.tables)
    assert indexes(store) == declared_indexes()
    assert unique_constraints(store) == declared_unique_constraints()
    assert schema_diff(store) == []
    store.upgrade()  # idempotent
    assert store.current_revision() == Store.head_revision()


def test_downgrade_to_base_and_up_again(store: Store) -> None:
    store.upgrade()
    store.downgrade("base")
    assert store.current_revision() is None
    assert tables(store) == set()
    store.upgrade()
    assert tables(store) == set(metadata.tables)
    assert schema_diff(store) == []


def test_partial_unique_key_index(store: Store) -> None:
    """The (tenant_id, key) index is unique for keys and ignores NULL keys."""
    store.upgrade()
    b = metadata.tables["buffers"]
    row = {
        "tenant_id": "t1",
        "pool_id": "p1",
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
    with store.engine.begin() as conn:
        conn.execute(
            sa.insert(metadata.tables["tenants"]),
            {"id": "t1", "name": "t", "quota_bytes": 9, "created_at": 0.0},
        )
        conn.execute(
            sa.insert(metadata.tables["pools"]),
            {
                "id": "p1",
                "host": "h",
                "name": "p",
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
            },
        )
        conn.execute(
            sa.insert(b), [{**row, "id": "a", "key": None}, {**row, "id": "b", "key": None}]
        )
        conn.execute(sa.insert(b), {**row, "id": "c", "key": "k"})
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(sa.insert(b), {**row, "id": "d", "key": "k"})


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
        assert s.current_revision() == Store.head_revision()
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
        assert stores[0].current_revision() == Store.head_revision()
        assert schema_diff(stores[0]) == []
    finally:
        for s in stores:
            s.dispose()
