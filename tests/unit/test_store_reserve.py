"""The reserve transaction (maasd.store.buffers.ReserveRepo): quota, capacity, keys and
eviction decided atomically, also under many concurrent reserves."""

from __future__ import annotations

import time

import msgspec
import pytest

from ledger import (
    HOST,
    buf,
    hammer,
    make_pool,
    make_tenant,
    reserve_live,
    snapshot,
    state_of,
)
from maasd.errors import (
    DuplicateKey,
    InvalidRequest,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
    TooLarge,
)
from maasd.store import BufferRow, Store
from maasd.tenancy.keys import new_id

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


def test_quota_enforced_exactly_at_the_boundary(store: Store) -> None:
    pool, t = make_pool(store, capacity=10_000), make_tenant(store, quota=1000)
    reserve_live(store, buf(t, pool, 600))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded) as info:
        store.reserves.begin_reserve(buf(t, pool, 401))
    assert "600" in info.value.detail
    assert "1000" in info.value.detail
    assert "401" in info.value.detail
    assert snapshot(store) == before
    reserve_live(store, buf(t, pool, 400))  # exactly the quota
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.used_bytes == 1000
    with pytest.raises(QuotaExceeded):
        store.reserves.begin_reserve(buf(t, pool, 1))


def test_pool_capacity_enforced_exactly_at_the_boundary(store: Store) -> None:
    pool = make_pool(store, capacity=1000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    reserve_live(store, buf(a, pool, 700))
    before = snapshot(store)
    with pytest.raises(PoolExhausted) as info:
        store.reserves.begin_reserve(buf(b, pool, 301))
    assert "300" in info.value.detail
    assert "1000" in info.value.detail
    assert snapshot(store) == before
    reserve_live(store, buf(b, pool, 300))
    assert store.pools.usage_by_pool(HOST)[pool.id] == (1000, 2)
    with pytest.raises(PoolExhausted):
        store.reserves.begin_reserve(buf(b, pool, 1))


def test_too_large_and_unknown_references(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=10_000)
    with pytest.raises(TooLarge):
        store.reserves.begin_reserve(buf(t, pool, 1001))
    ghost_pool = msgspec.structs.replace(pool, id=new_id())
    ghost_tenant = msgspec.structs.replace(t, id=new_id())
    with pytest.raises(NotFound):
        store.reserves.begin_reserve(buf(t, ghost_pool, 1))
    with pytest.raises(NotFound):
        store.reserves.begin_reserve(buf(ghost_tenant, pool, 1))
    with pytest.raises(InvalidRequest):
        store.reserves.begin_reserve(buf(t, pool, 0))
    assert store.buffers.buffers(states=None) == []


def test_quota_check_can_be_skipped(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=10)
    store.reserves.begin_reserve(buf(t, pool, 500), quota_check=False)
    with pytest.raises(PoolExhausted):  # capacity still holds
        store.reserves.begin_reserve(buf(t, pool, 501), quota_check=False)


def test_duplicate_key(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    first = reserve_live(store, buf(a, pool, 10, key="k"))
    with pytest.raises(DuplicateKey):
        store.reserves.begin_reserve(buf(a, pool, 10, key="k"))
    reserve_live(store, buf(b, pool, 10, key="k"))  # another tenant's keys are its own
    reserve_live(store, buf(a, pool, 10, key=None))
    reserve_live(store, buf(a, pool, 10, key=None))  # NULL keys never clash
    # A buffer being released gives its key up at once.
    released = store.buffers.mark_releasing(first.id, a.id)
    assert released.key is None
    assert released.state == "releasing"
    reserve_live(store, buf(a, pool, 10, key="k"))


def test_duplicate_key_checked_against_reserving_buffers(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    store.reserves.begin_reserve(buf(t, pool, 10, key="k"))
    with pytest.raises(DuplicateKey):
        store.reserves.begin_reserve(buf(t, pool, 10, key="k"))


# ---------------------------------------------------------------- eviction
def test_eviction_picks_lru_evictable_only(store: Store) -> None:
    pool, t = make_pool(store, capacity=100_000), make_tenant(store, quota=1000)
    pinned = reserve_live(store, buf(t, pool, 400, last_used=0.5))  # oldest, but not evictable
    old = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=1.0))
    mid = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=2.0))
    new = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=3.0))
    # used 1000 of 1000; 300 more need the two least recently used evictable ones.
    row = buf(t, pool, 300)
    victims = store.reserves.begin_reserve(row)
    assert [v.id for v in victims] == [old.id, mid.id]
    assert all(v.state == "releasing" for v in victims)
    live = {b.id for b in store.buffers.buffers(states=("live",))}
    assert live == {pinned.id, new.id}
    assert {b.id for b in store.buffers.buffers(states=("reserving",))} == {row.id}
    kinds = [e.kind for e in store.events.events(3)]
    assert kinds == ["reserve", "evict", "evict"]


def test_eviction_never_touches_non_evictable(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store, quota=1000)
    reserve_live(store, buf(t, pool, 700))
    reserve_live(store, buf(t, pool, 200, evictable=True))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded, match="even after evicting 200"):
        store.reserves.begin_reserve(buf(t, pool, 400))
    assert snapshot(store) == before  # the evictable one was not taken either


def test_eviction_skips_non_live(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store, quota=1000)
    store.reserves.begin_reserve(buf(t, pool, 800, evictable=True))  # still reserving
    with pytest.raises(QuotaExceeded):
        store.reserves.begin_reserve(buf(t, pool, 300))


def test_quota_eviction_takes_only_the_tenants_own(store: Store) -> None:
    pool = make_pool(store, capacity=100_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 1000)
    theirs = reserve_live(store, buf(b, pool, 500, evictable=True, last_used=0.0))  # the LRU of all
    mine = reserve_live(store, buf(a, pool, 800, evictable=True, last_used=5.0))
    victims = store.reserves.begin_reserve(buf(a, pool, 500))
    assert [v.id for v in victims] == [mine.id]
    still = store.buffers.buffer(theirs.id)
    assert still is not None
    assert still.state == "live"


def test_quota_eviction_fails_when_only_others_are_evictable(store: Store) -> None:
    pool = make_pool(store, capacity=100_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 1000)
    reserve_live(store, buf(b, pool, 500, evictable=True))
    reserve_live(store, buf(a, pool, 800))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded):
        store.reserves.begin_reserve(buf(a, pool, 500))
    assert snapshot(store) == before


def test_pool_eviction_takes_any_tenants_buffers_in_that_pool(store: Store) -> None:
    pool = make_pool(store, "p", capacity=1000)
    elsewhere = make_pool(store, "q", capacity=10_000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    other_pool = reserve_live(store, buf(b, elsewhere, 900, evictable=True, last_used=0.0))
    theirs = reserve_live(store, buf(b, pool, 300, evictable=True, last_used=1.0))
    mine = reserve_live(store, buf(a, pool, 300, evictable=True, last_used=2.0))
    reserve_live(store, buf(b, pool, 400, evictable=False, last_used=0.1))
    victims = store.reserves.begin_reserve(buf(a, pool, 300))
    assert [v.id for v in victims] == [theirs.id]
    assert state_of(store, mine.id) == "live"
    assert state_of(store, other_pool.id) == "live"
    with pytest.raises(PoolExhausted, match="even after evicting 300"):
        store.reserves.begin_reserve(buf(a, pool, 700))


def test_eviction_for_quota_and_capacity_together(store: Store) -> None:
    p = make_pool(store, "p", capacity=1000)
    q = make_pool(store, "q", capacity=10_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 10_000)
    a_in_q = reserve_live(store, buf(a, q, 500, evictable=True, last_used=1.0))
    b_in_p = reserve_live(store, buf(b, p, 500, evictable=True, last_used=2.0))
    a_in_p = reserve_live(store, buf(a, p, 500, evictable=True, last_used=3.0))
    # a: 1000/1000 used, p: 1000/1000 used; 500 more in p needs 500 of a's and 500 of p's:
    # LRU order is a_in_q (helps quota), b_in_p (helps pool) — a_in_p survives.
    victims = store.reserves.begin_reserve(buf(a, p, 500))
    assert [v.id for v in victims] == [a_in_q.id, b_in_p.id]
    assert state_of(store, a_in_p.id) == "live"


def test_eviction_skips_candidates_that_free_nothing_needed(store: Store) -> None:
    p = make_pool(store, "p", capacity=1000)
    q = make_pool(store, "q", capacity=10_000)
    a = make_tenant(store, "a", 10_000)
    b = make_tenant(store, "b", 10_000)
    reserve_live(store, buf(b, p, 600))
    in_p = reserve_live(store, buf(a, p, 400, evictable=True, last_used=2.0))
    in_q = reserve_live(store, buf(a, q, 400, evictable=True, last_used=1.0))
    victims = store.reserves.begin_reserve(buf(a, p, 300))  # only capacity is short
    assert [v.id for v in victims] == [in_p.id]
    assert state_of(store, in_q.id) == "live"


# ---------------------------------------------------------------- concurrency
def test_concurrent_reserves_never_overcommit_quota(store: Store) -> None:
    size, fits = 100, 10
    pool = make_pool(store, capacity=1_000_000)
    t = make_tenant(store, quota=size * fits)
    results = hammer(32, 2, lambda _i: store.reserves.begin_reserve(buf(t, pool, size)))
    granted = [r for r in results if r == []]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(granted) == fits, [
        r for r in results if r != [] and not isinstance(r, QuotaExceeded)
    ]
    assert len(refused) == 64 - fits
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert (tenant.used_bytes, tenant.buffers) == (fits * size, fits)
    assert sum(b.size_bytes for b in store.buffers.buffers(states=None)) == fits * size


def test_concurrent_reserves_never_overcommit_pool(store: Store) -> None:
    size, fits = 100, 10
    pool = make_pool(store, capacity=size * fits)
    tenants = [make_tenant(store, f"t{i}", quota=1_000_000) for i in range(8)]
    results = hammer(32, 2, lambda i: store.reserves.begin_reserve(buf(tenants[i % 8], pool, size)))
    granted = [r for r in results if r == []]
    refused = [r for r in results if isinstance(r, PoolExhausted)]
    assert len(granted) == fits, [
        r for r in results if r != [] and not isinstance(r, PoolExhausted)
    ]
    assert len(refused) == 64 - fits
    assert store.pools.usage_by_pool(HOST)[pool.id] == (fits * size, fits)


def test_concurrent_eviction_evicts_each_victim_once(store: Store) -> None:
    """Many reserves into a full pool of evictable buffers: never a double eviction."""
    size, fits = 100, 8
    pool = make_pool(store, capacity=size * fits)
    tenants = [make_tenant(store, f"t{i}", quota=1_000_000) for i in range(4)]
    for i in range(fits):
        reserve_live(store, buf(tenants[i % 4], pool, size, evictable=True))

    def work(i: int) -> list[BufferRow]:
        row = buf(tenants[i % 4], pool, size, evictable=True, last_used=time.time())
        victims = store.reserves.begin_reserve(row)
        store.buffers.set_state(row.id, "live")
        for v in victims:
            store.reserves.finish_release(v.id, "evict", record=False)
        return victims

    results = hammer(16, 2, work)
    errors = [r for r in results if not isinstance(r, list)]
    # A reserve may find the pool full of victims still being scrubbed by others:
    # that is a PoolExhausted, never anything else.
    assert all(isinstance(e, PoolExhausted) for e in errors), errors
    victims = [v.id for r in results if isinstance(r, list) for v in r]
    assert len(victims) == len(set(victims))


def test_a_key_is_unique_per_host_not_across_hosts(store: Store) -> None:
    here, there = make_pool(store), make_pool(store, host="host-b")
    t = make_tenant(store)
    a = reserve_live(store, buf(t, here, 10, key="prefix"))
    b = reserve_live(store, buf(t, there, 10, key="prefix"))  # another host's own copy
    with pytest.raises(DuplicateKey):
        store.reserves.begin_reserve(buf(t, there, 10, key="prefix"))
    hit = store.buffers.lookup(t.id, ["prefix"], host=HOST)
    assert hit is not None
    assert hit[1].id == a.id
    hit = store.buffers.lookup(t.id, ["prefix"], host="host-b")
    assert hit is not None
    assert hit[1].id == b.id


def test_a_staged_buffer_counts_against_quota_and_capacity(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=500)
    row = buf(t, pool, 400, evictable=True)
    store.reserves.begin_reserve(row)
    store.buffers.set_state(row.id, "staged")
    with pytest.raises(QuotaExceeded):  # and not evictable while staged: only live ones are
        store.reserves.begin_reserve(buf(t, pool, 200))
    other = make_tenant(store, "other", quota=10_000)
    with pytest.raises(PoolExhausted):
        store.reserves.begin_reserve(buf(other, pool, 700))
