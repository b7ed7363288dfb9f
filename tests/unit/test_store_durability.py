"""Durability per transaction (maasd.store.engine, maasd.store.base): on SQLite a write
told ``durable=False`` commits without waiting for the disk (``synchronous=NORMAL``
for that transaction alone) and every other write, including the next one on the same
pooled connection, waits for it (``FULL``); on PostgreSQL every write waits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger import buf, make_pool, make_tenant
from maasd.store import Store, must_last
from pgdb import PG_URL, fresh_pg_database

#: ``PRAGMA synchronous`` values.
NORMAL, FULL = 1, 2


class Levels:
    """The durability level every commit of ``store`` ran with, read at the commit."""

    def __init__(self, store: Store) -> None:
        self.seen: list[Any] = []
        self.connections: set[int] = set()
        self._pg = store.is_postgres
        # The store's other engines are views of this one: its events are theirs.
        sa.event.listen(store.engine, "commit", self._commit)

    def _commit(self, conn: sa.Connection) -> None:
        dbapi: Any = conn.connection.driver_connection
        self.connections.add(id(dbapi))
        if self._pg:
            self.seen.append(conn.exec_driver_sql("SHOW synchronous_commit").scalar())
        else:
            self.seen.append(dbapi.execute("PRAGMA synchronous").fetchone()[0])

    def take(self) -> list[Any]:
        seen, self.seen = self.seen, []
        return seen


def _sqlite(tmp_path: Any, **kwargs: Any) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'd.db'}", **kwargs)
    s.upgrade()
    return s


@pytest.fixture
def sqlite_store(tmp_path: Any) -> Iterator[Store]:
    s = _sqlite(tmp_path)
    yield s
    s.dispose()


def test_must_last_only_volatile_is_lax() -> None:
    assert must_last("persistent")
    assert not must_last("volatile")


def test_sqlite_picks_the_level_per_transaction(sqlite_store: Store) -> None:
    s = sqlite_store
    pool, tenant = make_pool(s), make_tenant(s)
    levels = Levels(s)
    lax = buf(tenant, pool, 100, key="k1")
    s.reserves.begin_reserve(lax, durable=False)
    s.buffers.set_state(lax.id, "live", durable=False)
    s.buffers.mark_releasing(lax.id, None, durable=False)
    s.reserves.finish_release(lax.id, "release", durable=False)
    assert levels.take() == [NORMAL] * 4
    firm = buf(tenant, pool, 100, key="k2")
    s.reserves.begin_reserve(firm)
    s.buffers.set_state(firm.id, "live")
    s.buffers.mark_releasing(firm.id, None)
    s.reserves.finish_release(firm.id, "release")
    assert levels.take() == [FULL] * 4
    make_tenant(s, "other")  # everything that is not about a buffer: always durable
    assert levels.take() == [FULL]


def test_batched_uses_never_wait_for_the_disk(sqlite_store: Store) -> None:
    s = sqlite_store
    row = buf(make_tenant(s), make_pool(s), 100)
    s.reserves.begin_reserve(row)
    levels = Levels(s)
    s.buffers.touch_many({row.id: 5.0})
    assert levels.take() == [NORMAL]


def test_a_pooled_connection_is_back_to_full(tmp_path: Any) -> None:
    """One pooled connection: a lax transaction leaves it NORMAL only until the next
    write begins; a durable one after it commits with FULL, a lax one after that NORMAL."""
    s = _sqlite(tmp_path, pool_size=1, max_overflow=0)
    try:
        pool, tenant = make_pool(s), make_tenant(s)
        levels = Levels(s)
        rows = [buf(tenant, pool, 10) for _ in range(3)]
        s.reserves.begin_reserve(rows[0], durable=False)
        s.reserves.begin_reserve(rows[1])
        s.reserves.begin_reserve(rows[2], durable=False)
        s.buffers.set_state(rows[2].id, "live")  # a single statement, durable
        assert s.tenants.tenants()  # a read in between changes nothing
        s.reserves.finish_release(rows[0].id, "release")
        assert levels.take() == [NORMAL, FULL, NORMAL, FULL, FULL]
        assert len(levels.connections) == 1  # all on the same DBAPI connection
    finally:
        s.dispose()


def test_a_failed_lax_transaction_leaves_the_next_durable(tmp_path: Any) -> None:
    """A lax transaction that rolls back (here: a quota refusal) does not leave its level
    to the next durable write on the same connection."""
    s = _sqlite(tmp_path, pool_size=1, max_overflow=0)
    try:
        pool, tenant = make_pool(s), make_tenant(s, quota=100)
        levels = Levels(s)
        with pytest.raises(Exception, match="quota"):
            s.reserves.begin_reserve(buf(tenant, pool, 1000), durable=False)
        s.reserves.begin_reserve(buf(tenant, pool, 10))
        assert levels.take() == [FULL]
    finally:
        s.dispose()


@pytest.mark.postgres
@pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
def test_postgres_waits_for_every_commit() -> None:
    """The server can lose unflushed commits while the daemon keeps the memory they
    recorded: ``durable=False`` changes nothing there."""
    with fresh_pg_database() as url:
        s = Store(url, pool_size=1, max_overflow=0)
        try:
            s.upgrade()
            pool, tenant = make_pool(s), make_tenant(s)
            levels = Levels(s)
            row = buf(tenant, pool, 10)
            s.reserves.begin_reserve(row, durable=False)
            s.buffers.set_state(row.id, "live", durable=False)
            s.buffers.touch_many({row.id: 5.0})
            assert levels.take() == ["on"] * 3
        finally:
            s.dispose()
