"""The running usage totals (maasd.store.totals): each tenant's and pool's bytes and count
of buffers, kept by the ledger's triggers in the transaction of every row change, equal
to what its rows say after every kind of change — and the check that finds (and mends)
one that does not."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from ledger import HOST, NOW, buf, downgrade, hammer, make_pool, make_tenant, reserve_live
from maasd.errors import MaasdError
from maasd.store import Store, schema
from maasd.store.totals import Drift, drifts
from maasd.tenancy.keys import new_id

pytest_plugins = ("ledger",)


def sums(store: Store) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """What the rows say, summed here in Python: per tenant and per pool, (bytes, count)."""
    by_tenant: dict[str, tuple[int, int]] = {t.id: (0, 0) for t in store.tenants.tenants()}
    by_pool: dict[str, tuple[int, int]] = {p.id: (0, 0) for p in store.pools.all_pools()}
    for b in store.buffers.buffers(states=None):
        for d, k in ((by_tenant, b.tenant_id), (by_pool, b.pool_id)):
            n, c = d[k]
            d[k] = (n + b.size_bytes, c + 1)
    return by_tenant, by_pool


def totals(store: Store) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """What the ledger's totals say (the tenants' rows, the pools' usage)."""
    return (
        {t.id: (t.used_bytes, t.buffers) for t in store.tenants.tenants()},
        store.pools.usage_by_pool(None),
    )


def assert_exact(store: Store) -> None:
    assert totals(store) == sums(store)
    assert store.totals.check_totals() == []


# ------------------------------------------------------------------------ the arithmetic
def test_drifts_compares_bytes_and_count_alone() -> None:
    rows = [("b", 5, 1, 5, 2), ("a", 7, 2, 6, 2), ("c", 0, 0, 0, 0), ("d", 3, 1, 3, 1)]
    found = drifts("tenant", rows)
    assert found == [
        Drift("tenant", "a", (7, 2), (6, 2)),
        Drift("tenant", "b", (5, 1), (5, 2)),
    ]
    assert "7 bytes in 2 buffers" in str(found[0])
    assert "its rows 6 bytes in 2" in str(found[0])
    assert drifts("pool", []) == []


def test_every_row_change_moves_the_totals_of_its_tenant_and_pool(store: Store) -> None:
    p, q = make_pool(store, "p", 10_000), make_pool(store, "q", 10_000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    assert_exact(store)
    a1 = reserve_live(store, buf(a, p, 100))
    a2 = reserve_live(store, buf(a, q, 200))
    b1 = reserve_live(store, buf(b, p, 400))
    assert totals(store) == (
        {a.id: (300, 2), b.id: (400, 1)},
        {p.id: (500, 2), q.id: (200, 1)},
    )
    assert_exact(store)
    # Releasing still counts (memory being scrubbed is memory in use): no change yet.
    store.buffers.mark_releasing(a1.id, a.id)
    assert totals(store)[0][a.id] == (300, 2)
    store.reserves.finish_release(a1.id)
    assert totals(store) == ({a.id: (200, 1), b.id: (400, 1)}, {p.id: (400, 1), q.id: (200, 1)})
    assert store.reserves.finish_release(a1.id) is None  # already gone: nothing counted twice
    assert_exact(store)
    n = store.reserves.finish_release_many([a2.id, b1.id, new_id()], "shutdown")
    assert n == 2
    assert totals(store) == ({a.id: (0, 0), b.id: (0, 0)}, {p.id: (0, 0), q.id: (0, 0)})
    assert_exact(store)


def test_a_refused_reserve_and_a_failed_one_leave_the_totals_as_they_were(store: Store) -> None:
    p, t = make_pool(store, capacity=1000), make_tenant(store, quota=500)
    reserve_live(store, buf(t, p, 400, key="k"))
    before = totals(store)
    for bad in (buf(t, p, 101), buf(t, p, 1, key="k"), buf(t, p, 2000)):
        with pytest.raises(MaasdError):
            store.reserves.begin_reserve(bad)
        assert totals(store) == before
    row = buf(t, p, 50)
    store.reserves.begin_reserve(row)  # admitted, then its memory could not be made
    assert totals(store)[0][t.id] == (450, 2)
    store.reserves.finish_release(row.id, kind="reserve_failed")
    assert totals(store) == before
    assert_exact(store)


def test_eviction_counts_its_victims_until_their_release_finishes(store: Store) -> None:
    p, t = make_pool(store, capacity=10_000), make_tenant(store, quota=300)
    old = [reserve_live(store, buf(t, p, 100, evictable=True)) for _ in range(3)]
    row = buf(t, p, 150)
    victims = store.reserves.begin_reserve(row)
    assert [v.id for v in victims] == [old[0].id, old[1].id]
    # The victims are releasing, the new row reserving: all counted, over the quota a while.
    assert totals(store)[0][t.id] == (450, 4)
    assert_exact(store)
    for v in victims:
        store.reserves.finish_release(v.id, "evict", record=False)
    assert totals(store)[0][t.id] == (250, 2)
    assert_exact(store)


def test_a_forgotten_hosts_buffers_leave_the_totals(store: Store) -> None:
    here, there = make_pool(store, "p", 10_000), make_pool(store, "p", 10_000, host="dead")
    t = make_tenant(store, quota=10_000)
    reserve_live(store, buf(t, here, 100))
    for _ in range(3):
        reserve_live(store, buf(t, there, 10))
    store.hosts.claim_host("dead", new_id(), 1.0, stale_s=1.0)
    with store.engine.begin() as conn:  # its heartbeat long ago
        conn.execute(sa.update(schema.hosts).values(last_seen=0.0))
    gone = store.hosts.forget_host("dead", stale_s=1.0)
    assert len(gone) == 3
    assert totals(store) == ({t.id: (100, 1)}, {here.id: (100, 1)})
    assert_exact(store)


def test_a_resized_or_moved_row_moves_its_bytes(store: Store) -> None:
    """Nothing in the daemon changes a row's size, tenant or pool; if anything ever does,
    the totals follow (the triggers cover every column they count by)."""
    p, q = make_pool(store, "p", 10_000), make_pool(store, "q", 10_000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    row = reserve_live(store, buf(a, p, 100))
    B = schema.buffers
    with store.engine.begin() as conn:
        conn.execute(sa.update(B).where(B.c.id == row.id).values(size_bytes=333))
    assert totals(store) == ({a.id: (333, 1), b.id: (0, 0)}, {p.id: (333, 1), q.id: (0, 0)})
    with store.engine.begin() as conn:
        conn.execute(sa.update(B).where(B.c.id == row.id).values(tenant_id=b.id, pool_id=q.id))
    assert totals(store) == ({a.id: (0, 0), b.id: (333, 1)}, {p.id: (0, 0), q.id: (333, 1)})
    assert_exact(store)


def test_a_drift_is_found_and_mended_under_the_rows_lock(store: Store) -> None:
    p, t = make_pool(store, capacity=10_000), make_tenant(store, quota=10_000)
    reserve_live(store, buf(t, p, 100))
    T, P = schema.tenants, schema.pools
    with store.engine.begin() as conn:  # what a bug (or a hand-made edit) would leave
        conn.execute(sa.update(T).where(T.c.id == t.id).values(used_bytes=7, buffers=9))
        conn.execute(sa.update(P).where(P.c.id == p.id).values(buffers=0))
    found = store.totals.check_totals()
    assert found == [
        Drift("tenant", t.id, (7, 9), (100, 1)),
        Drift("pool", p.id, (100, 0), (100, 1)),
    ]
    assert store.totals.check_totals() == found  # a check alone changes nothing
    assert store.totals.check_totals(repair=True) == found
    assert_exact(store)
    # and the reserve decides by the mended totals: 9,900 bytes left, not 9,993
    with pytest.raises(MaasdError, match="uses 100 of its 10000"):
        store.reserves.begin_reserve(buf(t, p, 9901))


def test_the_migration_back_fills_the_totals_from_the_rows(store: Store) -> None:
    p, t = make_pool(store, capacity=10_000), make_tenant(store, quota=10_000)
    u = make_tenant(store, "u", quota=10_000)
    for size in (10, 20, 30):
        reserve_live(store, buf(t, p, size))
    downgrade(store, "0006")
    with store.engine.begin() as conn:  # rows 0006 knows, written without any trigger
        row = msgspec.structs.asdict(msgspec.structs.replace(buf(u, p, 1000), state="live"))
        for newer in ("ttl_s", "lease_set_at"):  # columns of migration 0008
            del row[newer]
        conn.execute(sa.insert(sa.table("buffers", *(sa.column(k) for k in row))), row)
    store.upgrade()
    assert totals(store) == ({t.id: (60, 3), u.id: (1000, 1)}, {p.id: (1060, 4)})
    assert_exact(store)


def test_totals_stay_exact_under_concurrent_reserves_evictions_and_releases(
    store: Store,
) -> None:
    """Threads reserving (with evictions of the tenant's own and of the pool's), releasing
    and finishing their victims' releases, over two tenants sharing one pool: the totals
    equal the rows at the end, and no reserve ever found the quota or pool overrun."""
    pool = make_pool(store, capacity=40 * 100)
    tenants = [make_tenant(store, n, quota=25 * 100) for n in ("a", "b")]

    def work(i: int) -> Any:
        t = tenants[i % 2]
        row = buf(t, pool, 100, evictable=True, last_used=NOW + i)
        for victim in store.reserves.begin_reserve(row):
            store.reserves.finish_release(victim.id, "evict", record=False)
        store.buffers.set_state(row.id, "live")
        if i % 3 == 0:  # and some released by their tenant
            store.buffers.mark_releasing(row.id, t.id)
            store.reserves.finish_release(row.id)
        return row.id

    results = hammer(8, 25, work)
    errors = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(e, MaasdError) for e in errors), errors
    assert_exact(store)
    by_tenant, by_pool = totals(store)
    assert all(used <= 25 * 100 for used, _n in by_tenant.values())
    assert by_pool[pool.id][0] <= 40 * 100
    assert sum(n for _b, n in by_tenant.values()) == by_pool[pool.id][1] > 0


def test_a_tenant_delete_after_its_releases_leaves_no_total_behind(store: Store) -> None:
    p, t = make_pool(store, capacity=10_000), make_tenant(store, quota=10_000)
    rows = [reserve_live(store, buf(t, p, 100)) for _ in range(4)]
    store.tenants.mark_tenant_deleting(t.id, now=NOW)
    hammer(
        4,
        1,
        lambda i: store.reserves.finish_release(store.buffers.mark_releasing(rows[i].id, None).id),
    )
    assert totals(store) == ({t.id: (0, 0)}, {p.id: (0, 0)})
    store.tenants.delete_tenant(t.id)
    assert totals(store) == ({}, {p.id: (0, 0)})
    assert_exact(store)
    assert store.pools.usage_by_pool(HOST) == {p.id: (0, 0)}


def test_every_migration_run_mends_a_drift_and_says_so(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    p, t = make_pool(store, capacity=10_000), make_tenant(store, quota=10_000)
    reserve_live(store, buf(t, p, 100))
    with store.engine.begin() as conn:
        conn.execute(sa.update(schema.tenants).values(used_bytes=0))
    store.upgrade()  # what every daemon start does first
    assert_exact(store)
    assert f"tenant {t.id}: its totals say 0 bytes in 1 buffers, its rows 100" in caplog.text
    caplog.clear()
    store.upgrade()
    assert "drifted" not in caplog.text
