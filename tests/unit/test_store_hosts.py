"""Hosts in the ledger (maasd.store.hosts): claims, heartbeats, forgetting; SQLite and PostgreSQL.

Liveness here is measured on the database's clock, so the tests move time by
choosing ``stale_s`` (a host is live while its heartbeat is younger than that),
never by sleeping.
"""

from __future__ import annotations

import time

import pytest

from ledger import buf, make_pool, make_tenant, reserve_live, snapshot
from maasd.errors import NotFound, QuotaExceeded, StateConflict
from maasd.store import HostUsage, Store
from maasd.store.hosts import db_now
from maasd.tenancy.keys import new_id

pytest_plugins = ("ledger",)

LONG = 3600.0  # a heartbeat is always younger than this: the host is live
NONE = 0.0  # a heartbeat is never younger than this: the host is silent


def hosts(store: Store) -> dict[str, HostUsage]:
    return {h.name: h for h in store.hosts.hosts()}


def test_the_database_clock_is_epoch_seconds(store: Store) -> None:
    with store.engine.connect() as conn:
        now = conn.execute(db_now().select()).scalar_one()
    assert abs(now - time.time()) < 60  # the same machine: the same clock, give or take


def test_a_claim_a_heartbeat_and_a_clean_stop(store: Store) -> None:
    first = new_id()
    assert store.hosts.claim_host("h1", first, 0.5, stale_s=LONG) is None
    (h,) = store.hosts.hosts()
    assert (h.name, h.incarnation, h.heartbeat_s, h.stopped_at) == ("h1", first, 0.5, None)
    assert h.started_at <= h.last_seen <= h.now
    assert store.hosts.heartbeat("h1", first)
    assert store.hosts.hosts()[0].last_seen >= h.last_seen
    assert not store.hosts.heartbeat("h1", new_id())  # another incarnation's beat does not count
    assert not store.hosts.heartbeat("h2", first)
    store.hosts.stop_host("h1", first)
    assert store.hosts.hosts()[0].stopped_at is not None
    assert not store.hosts.heartbeat("h1", first)  # a stopped host does not beat again


def test_a_second_claim_is_refused_while_the_first_beats(store: Store) -> None:
    first, second = new_id(), new_id()
    assert store.hosts.claim_host("h1", first, 1.0, stale_s=LONG) is None
    other = store.hosts.claim_host("h1", second, 1.0, stale_s=LONG)
    assert other is not None
    assert other.incarnation == first
    # ... unless it is exactly the row the caller watched not move (a dead previous run)
    assert store.hosts.claim_host("h1", second, 1.0, stale_s=LONG, take_over=other) is None
    assert hosts(store)["h1"].incarnation == second
    assert not store.hosts.heartbeat("h1", first)  # the old run learns it lost the name
    # a row that moved since it was watched is not taken over
    assert store.hosts.heartbeat("h1", second)
    assert store.hosts.claim_host("h1", new_id(), 1.0, stale_s=LONG, take_over=other) is not None


def test_a_silent_or_stopped_host_is_claimed_at_once(store: Store) -> None:
    first = new_id()
    store.hosts.claim_host("h1", first, 1.0, stale_s=LONG)
    assert store.hosts.claim_host("h1", new_id(), 1.0, stale_s=NONE) is None  # silent
    second = hosts(store)["h1"].incarnation
    store.hosts.stop_host("h1", second)
    third = new_id()
    assert store.hosts.claim_host("h1", third, 1.0, stale_s=LONG) is None  # stopped
    h = hosts(store)["h1"]
    assert (h.incarnation, h.stopped_at) == (third, None)


def test_forgetting_a_host_releases_its_buffers_and_drops_its_pools(store: Store) -> None:
    t = make_tenant(store, "acme", 10_000)
    mine, theirs = make_pool(store, "node0", host="here"), make_pool(store, "node0", host="gone")
    keep = reserve_live(store, buf(t, mine, 1000))
    lost = [reserve_live(store, buf(t, theirs, 2000)), reserve_live(store, buf(t, theirs, 3000))]
    for name in ("here", "gone"):
        store.hosts.claim_host(name, new_id(), 1.0, stale_s=LONG)
    assert hosts(store)["gone"].used_bytes == 5000
    assert hosts(store)["gone"].pools == 1

    before = snapshot(store)
    with pytest.raises(StateConflict, match="serving"):
        store.hosts.forget_host("gone", stale_s=LONG)
    assert snapshot(store) == before  # a refused forget changes nothing
    with pytest.raises(NotFound):
        store.hosts.forget_host("never", stale_s=NONE)

    gone = store.hosts.forget_host("gone", stale_s=NONE)
    assert sorted(b.id for b in gone) == sorted(b.id for b in lost)
    assert set(hosts(store)) == {"here"}
    assert [p.host for p in store.pools.all_pools()] == ["here"]
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.used_bytes == keep.size_bytes  # only what the live host holds counts
    kinds = [(e.kind, e.buffer_id) for e in store.events.events(10)]
    assert kinds[0] == ("host_forget", None)
    assert {b for k, b in kinds if k == "host_forget"} >= {b.id for b in lost}


def test_pools_of_every_host(store: Store) -> None:
    t = make_tenant(store, "acme", 10_000)
    a, b = make_pool(store, "node0", host="a"), make_pool(store, "node0", host="b")
    reserve_live(store, buf(t, b, 4096))
    assert [(p.host, p.name) for p in store.pools.all_pools()] == [("a", "node0"), ("b", "node0")]
    assert store.pools.usage_by_pool(None) == {a.id: (0, 0), b.id: (4096, 1)}
    assert store.pools.usage_by_pool("a") == {a.id: (0, 0)}
    assert store.pools.pool_row(b.id) == b
    assert store.pools.pool_row(new_id()) is None


def test_a_quota_shortfall_evicts_only_on_the_reserving_host(store: Store) -> None:
    """Only the daemon holding a buffer can scrub it: another host's entries are not victims."""
    t = make_tenant(store, "acme", 8192)
    here, there = make_pool(store, "node0", host="here"), make_pool(store, "node0", host="there")
    far = reserve_live(store, buf(t, there, 4096, evictable=True, last_used=1.0))
    near = reserve_live(store, buf(t, here, 4096, evictable=True, last_used=2.0))
    # 4096 more bytes: the least recently used entry is far, but near is the one evicted
    victims = store.reserves.begin_reserve(buf(t, here, 4096))
    assert [v.id for v in victims] == [near.id]
    store.reserves.finish_release(near.id, "evict", record=False)
    # now only far could make room: refused rather than evicted from here
    with pytest.raises(QuotaExceeded):
        store.reserves.begin_reserve(buf(t, here, 4096))
    still = store.buffers.buffer(far.id)
    assert still is not None
    assert still.state == "live"
