"""The ledger as the store tests use it: fixtures over real databases, row builders, and
what the tests do to a database that the daemon never does (look at its schema
revision, migrate it down, empty it).

The ``store`` fixture runs a test on a real SQLite file in ``tmp_path`` and, when
``MAASD_TEST_PG_URL`` points at a PostgreSQL server (``scripts/pg-test-server``
starts one), on PostgreSQL too: a fresh database per test module, emptied before
each test. A test module gets the fixtures by declaring this module a plugin::

    pytest_plugins = ("ledger",)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from maasd.store import BufferRow, PoolRow, Store, TenantRow, alembic_config, metadata
from maasd.tenancy.keys import new_id
from pgdb import BACKENDS, fresh_pg_database

HOST = "host-a"
NOW = 1_700_000_000.0


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def pg_database_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this module, dropped afterwards."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    if request.param == "sqlite":
        s = Store(f"sqlite:///{tmp_path / 'maasd.db'}")
        s.upgrade()
    else:
        s = Store(request.getfixturevalue("pg_database_url"))
        s.upgrade()
        truncate(s)
    try:
        yield s
    finally:
        s.dispose()


def make_pool(
    store: Store, name: str = "node0", capacity: int = 10_000, host: str = HOST
) -> PoolRow:
    return store.pools.add_pool(
        PoolRow(
            id=new_id(),
            host=host,
            name=name,
            numa_node=0,
            backing="memfd",
            persistence="volatile",
            latency_us=1,
            capacity_bytes=capacity,
            page_bytes=4096,
            prefault=True,
            scrub="zero",
            spill_dir=None,
            created_at=NOW,
        )
    )


def make_tenant(store: Store, name: str = "acme", quota: int = 10_000) -> TenantRow:
    return store.tenants.add_tenant(new_id(), name, quota, NOW)


_clock = iter(range(1, 10**9))


def buf(
    tenant: TenantRow,
    pool: PoolRow,
    size: int,
    *,
    key: str | None = None,
    evictable: bool = False,
    last_used: float | None = None,
    expires: float = NOW + 600,
) -> BufferRow:
    return BufferRow(
        id=new_id(),
        tenant_id=tenant.id,
        pool_id=pool.id,
        host=pool.host,
        size_bytes=size,
        numa_node=pool.numa_node,
        persistence="volatile",
        label=None,
        key=key,
        evictable=evictable,
        state="reserving",
        created_at=NOW,
        expires_at=expires,
        last_used_at=float(next(_clock)) if last_used is None else last_used,
    )


def reserve_live(store: Store, row: BufferRow, *, default_cap: int | None = None) -> BufferRow:
    """What the service does: admit, (allocate), go live; finish any victims."""
    for victim in store.reserves.begin_reserve(row, default_cap=default_cap):
        store.reserves.finish_release(victim.id, "evict", record=False)
    store.buffers.set_state(row.id, "live")
    got = store.buffers.buffer(row.id)
    assert got is not None
    return got


def state_of(store: Store, buffer_id: str) -> str | None:
    """The buffer's state in the ledger, ``None`` when it has no row."""
    row = store.buffers.buffer(buffer_id)
    return None if row is None else row.state


def snapshot(store: Store) -> tuple[Any, ...]:
    return (
        msgspec.to_builtins(store.buffers.buffers(states=None)),
        msgspec.to_builtins(store.tenants.tenants()),
        store.pools.usage_by_pool(HOST),
        len(store.events.events(10_000)),
    )


# ---------------------------------------------------------------- concurrency
def hammer(n_threads: int, per_thread: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` ``per_thread`` times in each of ``n_threads`` threads, all at once."""
    barrier = threading.Barrier(n_threads)
    results: list[Any] = []
    lock = threading.Lock()

    def run(t: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            try:
                r: Any = work(t * per_thread + j)
            except Exception as exc:  # collected, asserted on below
                r = exc
            with lock:
                results.append(r)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads)
    return results


# ---------------------------------------------------------------- schema
def current_revision(store: Store) -> str | None:
    """The database's Alembic revision, ``None`` for an empty database."""
    with store.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    """The newest revision the shipped migrations know."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def downgrade(store: Store, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"`` drops everything) in one transaction."""
    with store.engine.begin() as conn:
        command.downgrade(alembic_config(connection=conn), revision)


def truncate(store: Store) -> None:
    """Delete every row of every table (a database reused between tests)."""
    with store.engine.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            conn.execute(sa.delete(table))
