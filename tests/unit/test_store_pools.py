"""Pools in the ledger (maasd.store.pools) on SQLite and, when configured, PostgreSQL."""

from __future__ import annotations

import pytest

from ledger import HOST, buf, make_pool, make_tenant, reserve_live
from maasd.errors import NotFound, StateConflict
from maasd.store import Store

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


def test_pools(store: Store) -> None:
    a = make_pool(store, "node0")
    b = make_pool(store, "node1")
    other = make_pool(store, "node0", host="host-b")  # same name, other host: fine
    assert [p.name for p in store.pools.pools(HOST)] == ["node0", "node1"]
    assert [p.id for p in store.pools.pools("host-b")] == [other.id]
    assert store.pools.pools(HOST) == [a, b]  # the rows as inserted, new columns at their defaults
    assert (a.warm_bytes, a.deleting_at) == (0, None)
    with pytest.raises(StateConflict):
        make_pool(store, "node0")
    assert store.pools.usage_by_pool(HOST) == {a.id: (0, 0), b.id: (0, 0)}


def test_delete_pool(store: Store) -> None:
    pool, tenant = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(tenant, pool, 100))
    with pytest.raises(StateConflict):
        store.pools.delete_pool(pool.id)
    store.buffers.mark_releasing(row.id, None)
    store.reserves.finish_release(row.id)
    store.pools.delete_pool(pool.id)
    assert store.pools.pools(HOST) == []
    with pytest.raises(NotFound):
        store.pools.delete_pool(pool.id)


def test_set_pool_warm(store: Store) -> None:
    a, b = make_pool(store, "node0"), make_pool(store, "node1")
    store.pools.set_pool_warm(a.id, 4096)
    assert [p.warm_bytes for p in store.pools.pools(HOST)] == [4096, 0]
    assert store.pools.pools(HOST)[1] == b
    with pytest.raises(NotFound):
        store.pools.set_pool_warm("no-such-pool", 4096)


def test_a_deleted_pool_is_remembered_per_host(store: Store) -> None:
    a = make_pool(store, "node0")
    make_pool(store, "node0", host="host-b")
    make_pool(store, "node1")
    assert store.pools.deleted_pools(HOST, ["node0", "node1"]) == set()
    store.pools.delete_pool(a.id)
    assert store.pools.deleted_pools(HOST, ["node0", "node1"]) == {"node0"}
    assert store.pools.deleted_pools("host-b", ["node0"]) == set()  # its own node0 is untouched
    assert store.pools.deleted_pools(HOST, []) == set()
    (ev,) = [e for e in store.events.events() if e.kind == "pool_delete"]
    assert ev.detail == f"node0 on {HOST}"
