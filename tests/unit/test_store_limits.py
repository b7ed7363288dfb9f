"""A tenant's buffer cap, deletes in progress and the reserve's compare-and-set, in the
ledger (maasd.store), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from ledger import HOST, NOW, buf, hammer, make_pool, make_tenant, reserve_live, state_of
from maasd.errors import (
    BufferCountExceeded,
    InvalidRequest,
    NotFound,
    StateConflict,
    Unauthorized,
)
from maasd.store import Store
from maasd.tenancy.keys import digest, new_id, new_token

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


# ---------------------------------------------------------------- max_buffers
def test_the_cap_refuses_one_buffer_more_and_changes_nothing(store: Store) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    store.tenants.update_tenant(t.id, max_buffers=3)
    reserve_live(store, buf(t, pool, 10))
    reserve_live(store, buf(t, pool, 10))
    store.reserves.begin_reserve(buf(t, pool, 10))  # a reserve in flight counts too
    before = store.tenants.tenant(t.id)
    with pytest.raises(BufferCountExceeded, match="holds 3 buffers, its max_buffers is 3"):
        store.reserves.begin_reserve(buf(t, pool, 10))
    assert store.tenants.tenant(t.id) == before
    # another tenant is not affected
    other = make_tenant(store, "other", quota=1 << 30)
    store.tenants.update_tenant(other.id, max_buffers=1)
    reserve_live(store, buf(other, pool, 10))


def test_the_default_cap_applies_when_the_tenant_has_none(store: Store) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    reserve_live(store, buf(t, pool, 10), default_cap=2)
    reserve_live(store, buf(t, pool, 10), default_cap=2)
    with pytest.raises(BufferCountExceeded, match="its max_buffers is 2"):
        store.reserves.begin_reserve(buf(t, pool, 10), default_cap=2)
    store.reserves.begin_reserve(buf(t, pool, 10))  # no default cap: none
    store.tenants.update_tenant(t.id, max_buffers=4)  # the tenant's own cap wins
    reserve_live(store, buf(t, pool, 10), default_cap=2)


def test_at_the_cap_the_tenants_own_evictable_buffers_go_first_lru(store: Store) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    other = make_tenant(store, "other", quota=1 << 30)
    theirs = reserve_live(store, buf(other, pool, 10, evictable=True, last_used=1.0))
    store.tenants.update_tenant(t.id, max_buffers=3)
    old = reserve_live(store, buf(t, pool, 10, evictable=True, last_used=2.0))
    kept = reserve_live(store, buf(t, pool, 10, evictable=True, last_used=3.0))
    pinned = reserve_live(store, buf(t, pool, 10, last_used=0.5))  # not evictable
    victims = store.reserves.begin_reserve(buf(t, pool, 10))
    assert [v.id for v in victims] == [old.id]
    assert [state_of(store, b.id) for b in (old, kept, pinned, theirs)] == [
        "releasing",
        "live",
        "live",
        "live",
    ]


def test_at_the_cap_without_evictable_buffers_nothing_is_evicted(store: Store) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    other = make_tenant(store, "other", quota=1 << 30)
    theirs = reserve_live(store, buf(other, pool, 10, evictable=True))
    store.tenants.update_tenant(t.id, max_buffers=1)
    reserve_live(store, buf(t, pool, 10))
    with pytest.raises(BufferCountExceeded):
        store.reserves.begin_reserve(buf(t, pool, 10))
    assert state_of(store, theirs.id) == "live"


def test_concurrent_reserves_never_exceed_the_cap(store: Store) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    store.tenants.update_tenant(t.id, max_buffers=5)
    results = hammer(8, 4, lambda _i: store.reserves.begin_reserve(buf(t, pool, 10)))
    assert sum(1 for r in results if r == []) == 5
    assert all(isinstance(r, BufferCountExceeded) for r in results if r != [])
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.buffers == 5


# ---------------------------------------------------------------- update_tenant
def test_update_tenant_sets_either_or_both_with_an_event_each(store: Store) -> None:
    t = make_tenant(store, quota=100)
    store.tenants.update_tenant(t.id, quota_bytes=7, max_buffers=9)
    got = store.tenants.tenant(t.id)
    assert got is not None
    assert (got.quota_bytes, got.max_buffers) == (7, 9)
    kinds = [(e.kind, e.bytes, e.detail) for e in store.events.events(2, tenant_id=t.id)]
    assert sorted(kinds, key=str) == sorted(
        [("quota_set", 7, None), ("max_buffers_set", None, "9")], key=str
    )
    store.tenants.update_tenant(t.id, max_buffers=4)
    got = store.tenants.tenant(t.id)
    assert got is not None
    assert (got.quota_bytes, got.max_buffers) == (7, 4)


@pytest.mark.parametrize(
    "change",
    [{}, {"quota_bytes": -1}, {"max_buffers": 0}, {"quota_bytes": 5, "max_buffers": 0}],
)
def test_update_tenant_refuses_bad_values_and_changes_nothing(
    store: Store, change: dict[str, int]
) -> None:
    t = make_tenant(store, quota=100)
    with pytest.raises(InvalidRequest):
        store.tenants.update_tenant(t.id, **change)
    assert store.tenants.tenant(t.id) == t


def test_update_tenant_of_an_unknown_tenant(store: Store) -> None:
    with pytest.raises(NotFound):
        store.tenants.update_tenant(new_id(), max_buffers=3)


# ---------------------------------------------------------------- deletes in progress
def test_a_tenant_being_deleted_has_no_keys_and_no_new_reserves(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    token = new_token()
    store.tenants.add_key(new_id(), t.id, digest(token), NOW)
    live = reserve_live(store, buf(t, pool, 100))
    assert store.tenants.mark_tenant_deleting(t.id, now=NOW + 1) == 1
    assert store.tenants.key_by_digest(digest(token)) is None
    with pytest.raises(Unauthorized, match="being deleted"):
        store.reserves.begin_reserve(buf(t, pool, 10))
    assert store.tenants.deleting_tenants() == [t.id]
    # resumed: the first mark stays, nothing more to revoke
    assert store.tenants.mark_tenant_deleting(t.id, now=NOW + 5) == 0
    got = store.tenants.tenant(t.id)
    assert got is not None
    assert got.deleting_at == NOW + 1
    store.reserves.finish_release(store.buffers.mark_releasing(live.id, None).id)
    store.tenants.delete_tenant(t.id)
    assert store.tenants.deleting_tenants() == []
    with pytest.raises(NotFound):
        store.tenants.mark_tenant_deleting(t.id)


def test_a_pool_being_deleted_takes_no_new_reserve(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    assert store.pools.mark_pool_deleting(pool.id, now=NOW + 1) == NOW + 1
    with pytest.raises(StateConflict, match="being deleted"):
        store.reserves.begin_reserve(buf(t, pool, 10))
    assert store.pools.mark_pool_deleting(pool.id, now=NOW + 9) == NOW + 1
    assert [p.deleting_at for p in store.pools.pools(HOST)] == [NOW + 1]
    with pytest.raises(NotFound):
        store.pools.mark_pool_deleting(new_id())


# ---------------------------------------------------------------- compare-and-set
def test_advance_is_a_compare_and_set(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = buf(t, pool, 10)
    store.reserves.begin_reserve(row)
    assert store.buffers.advance(row.id, "reserving", "live")
    assert not store.buffers.advance(row.id, "reserving", "live")
    other = buf(t, pool, 10)
    store.reserves.begin_reserve(other)
    store.buffers.mark_releasing(other.id, None)  # a delete claimed it meanwhile
    assert not store.buffers.advance(other.id, "reserving", "live")
    assert state_of(store, other.id) == "releasing"
    assert not store.buffers.advance(new_id(), "reserving", "live")
    with pytest.raises(InvalidRequest):
        store.buffers.advance(row.id, "reserving", "gone")  # type: ignore[arg-type]


def test_finish_release_many_deletes_in_one_go_with_an_event_each(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    rows = [reserve_live(store, buf(t, pool, 10)) for _ in range(5)]
    ids = [r.id for r in rows[:4]] + [new_id()]
    assert store.reserves.finish_release_many(ids, "shutdown", now=NOW) == 4
    assert [b.id for b in store.buffers.buffers(tenant_id=t.id)] == [rows[4].id]
    shutdown = [e for e in store.events.events(100) if e.kind == "shutdown"]
    assert sorted(e.buffer_id or "" for e in shutdown) == sorted(r.id for r in rows[:4])
    assert store.reserves.finish_release_many([], "shutdown") == 0
