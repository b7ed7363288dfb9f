"""The audit trail (maasd.store.events): written with each change, read newest first."""

from __future__ import annotations

from collections import Counter

from ledger import (
    NOW,
    buf,
    make_pool,
    make_tenant,
    reserve_live,
)
from maasd.store import Store

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


def test_each_change_writes_its_event_newest_first(store: Store) -> None:
    pool = make_pool(store, capacity=1000)
    t = make_tenant(store, "acme", 500)
    store.tenants.set_quota(t.id, 600)
    row = reserve_live(store, buf(t, pool, 100))
    store.buffers.mark_releasing(row.id, None)
    store.reserves.finish_release(row.id, "release", now=NOW + 1, detail="why")
    evs = store.events.events(10)
    assert [e.kind for e in evs] == [
        "release",
        "reserve",
        "quota_set",
        "tenant_create",
        "pool_create",
    ]
    assert [e.id for e in evs] == sorted((e.id for e in evs), reverse=True)
    release = evs[0]
    assert (release.at, release.detail, release.bytes) == (NOW + 1, "why", 100)
    assert (release.tenant_id, release.buffer_id, release.pool_id) == (t.id, row.id, pool.id)
    assert (evs[3].detail, evs[3].bytes) == ("acme", 500)
    assert (evs[4].detail, evs[4].bytes) == (pool.name, 1000)


def test_events_filter_by_tenant_and_page_back(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    for _ in range(3):
        reserve_live(store, buf(a, pool, 10))
        reserve_live(store, buf(b, pool, 10))
    mine = store.events.events(100, tenant_id=a.id)
    assert [e.kind for e in mine] == ["reserve"] * 3 + ["tenant_create"]
    assert {e.tenant_id for e in mine} == {a.id}
    page1 = store.events.events(2, tenant_id=a.id)
    page2 = store.events.events(2, tenant_id=a.id, before=page1[-1].id)
    assert page1 + page2 == mine
    assert store.events.events(1, before=min(e.id for e in store.events.events(100))) == []


def test_finishing_a_victim_does_not_record_its_eviction_again(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=10_000)
    victims = [reserve_live(store, buf(t, pool, 400, evictable=True)) for _ in range(2)]
    new = buf(t, pool, 700)  # 500 short: both go
    marked = store.reserves.begin_reserve(new)
    assert [v.id for v in marked] == [v.id for v in victims]
    for v in marked:
        gone = store.reserves.finish_release(v.id, "evict", record=False)
        assert gone is not None
    evicts = [e for e in store.events.events(100) if e.kind == "evict"]
    assert Counter(e.buffer_id for e in evicts) == {v.id: 1 for v in victims}
    assert {e.detail for e in evicts} == {f"for {new.id}"}
