"""A buffer's life in the ledger after its reserve (maasd.store.buffers.BufferRepo):
states, visibility, leases, uses, lookups, a host's buffers."""

from __future__ import annotations

import msgspec
import pytest

from ledger import (
    HOST,
    NOW,
    buf,
    make_pool,
    make_tenant,
    reserve_live,
    state_of,
)
from maasd.errors import InvalidRequest, NotFound
from maasd.store import Extension, Store
from maasd.tenancy.keys import new_id

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


def test_release_cycle(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    row = reserve_live(store, buf(a, pool, 100, key="k"))
    with pytest.raises(NotFound):
        store.buffers.mark_releasing(row.id, b.id)  # foreign
    with pytest.raises(NotFound):
        store.buffers.mark_releasing(new_id(), a.id)  # unknown
    assert store.buffers.buffer(row.id, a.id) is not None
    first = store.buffers.mark_releasing(row.id, a.id)
    again = store.buffers.mark_releasing(row.id, a.id)  # idempotent
    assert first == again
    assert first.state == "releasing"
    assert store.buffers.mark_releasing(row.id, None).id == row.id  # admin
    gone = store.reserves.finish_release(row.id, "release")
    assert gone is not None
    assert gone.id == row.id
    assert store.reserves.finish_release(row.id) is None
    assert store.buffers.buffer(row.id) is None
    ev = store.events.events(1)[0]
    assert (ev.kind, ev.buffer_id, ev.bytes, ev.tenant_id) == ("release", row.id, 100, a.id)
    tenant = store.tenants.tenant(a.id)
    assert tenant is not None
    assert tenant.used_bytes == 0


def test_set_state(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = buf(t, pool, 10, key="k")
    store.reserves.begin_reserve(row)
    assert store.buffers.buffers() == []  # default: live only
    store.buffers.set_state(row.id, "live")
    assert [b.id for b in store.buffers.buffers()] == [row.id]
    store.buffers.set_state(row.id, "releasing")
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert got.state == "releasing"
    assert got.key is None
    with pytest.raises(InvalidRequest):
        store.buffers.set_state(row.id, "dead")  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        store.buffers.set_state(new_id(), "live")


def test_buffer_visibility(store: Store) -> None:
    p, q = make_pool(store, "p"), make_pool(store, "q")
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    ap = reserve_live(store, buf(a, p, 10))
    aq = reserve_live(store, buf(a, q, 10))
    bp = reserve_live(store, buf(b, p, 10))
    assert store.buffers.buffer(ap.id, a.id) == ap
    assert store.buffers.buffer(ap.id, b.id) is None
    assert store.buffers.buffer(ap.id, None) == ap
    assert {x.id for x in store.buffers.buffers(a.id)} == {ap.id, aq.id}
    assert {x.id for x in store.buffers.buffers(pool_id=p.id)} == {ap.id, bp.id}
    assert [x.id for x in store.buffers.buffers(a.id, q.id)] == [aq.id]
    assert {x.id for x in store.buffers.buffers()} == {ap.id, aq.id, bp.id}
    assert store.buffers.buffers(states=("reserving",)) == []
    assert {x.id for x in store.buffers.buffers(host=HOST)} == {ap.id, aq.id, bp.id}
    assert store.buffers.buffers(host="elsewhere") == []


def test_a_hit_before_a_renew_does_not_undo_it_and_one_after_extends_it(store: Store) -> None:
    """A lookup hit's extension taken to be written (a flush, a reserve's admission) before
    a renew to a shorter lease, and written after it, is refused: the renew came later.
    A hit after the renew extends the renewed lease."""
    pool, t = make_pool(store), make_tenant(store)
    row = reserve_live(store, msgspec.structs.replace(buf(t, pool, 10), ttl_s=600))
    assert (row.ttl_s, row.lease_set_at, row.expires_at) == (600, None, NOW + 600)
    taken = {row.id: Extension(NOW + 50 + 600, NOW + 50)}  # a hit at NOW + 50
    renewed = store.buffers.renew(row.id, t.id, NOW + 100 + 30, ttl_s=30, now=NOW + 100)
    assert (renewed.ttl_s, renewed.lease_set_at, renewed.expires_at) == (30, NOW + 100, NOW + 130)
    store.buffers.touch_many({row.id: NOW + 50}, taken)
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert (got.expires_at, got.last_used_at) == (NOW + 130, NOW + 50)  # the use, not the lease
    store.buffers.touch_many({}, {row.id: Extension(NOW + 100 + 30, NOW + 100)})  # as it
    store.buffers.touch_many({}, {row.id: Extension(NOW + 110 + 30, NOW + 110)})  # later
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert got.expires_at == NOW + 140
    # a reserve's admission writes the batch by the same rule
    store.reserves.begin_reserve(buf(t, pool, 10), leases={row.id: Extension(NOW + 900, NOW + 99)})
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert got.expires_at == NOW + 140
    store.reserves.begin_reserve(buf(t, pool, 10), leases={row.id: Extension(NOW + 150, NOW + 120)})
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert (got.expires_at, got.ttl_s) == (NOW + 150, 30)  # a hit keeps the length


def test_renew(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    row = reserve_live(store, buf(a, pool, 10))
    renewed = store.buffers.renew(row.id, a.id, NOW + 9999)
    assert renewed.expires_at == NOW + 9999
    stored = store.buffers.buffer(row.id)
    assert stored is not None
    assert stored.expires_at == NOW + 9999
    with pytest.raises(NotFound):
        store.buffers.renew(row.id, b.id, NOW)
    with pytest.raises(NotFound):
        store.buffers.renew(new_id(), a.id, NOW)
    assert store.buffers.renew(row.id, None, NOW + 1).expires_at == NOW + 1  # admin
    store.buffers.mark_releasing(row.id, a.id)
    with pytest.raises(NotFound):
        store.buffers.renew(row.id, a.id, NOW)


def test_touch_numa_checkpoint(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(t, pool, 10))
    store.buffers.touch_many({row.id: NOW + 5, new_id(): NOW})  # an unknown id is no error
    store.buffers.set_numa_node(row.id, 1)
    store.buffers.set_checkpoint(row.id, "/spill/x", "sha256:abc", NOW + 6)
    got = store.buffers.buffer(row.id)
    assert got is not None
    assert (got.last_used_at, got.numa_node) == (NOW + 5, 1)
    assert (got.checkpoint_path, got.checksum, got.checkpointed_at) == (
        "/spill/x",
        "sha256:abc",
        NOW + 6,
    )
    with pytest.raises(NotFound):
        store.buffers.set_numa_node(new_id(), 0)
    with pytest.raises(NotFound):
        store.buffers.set_checkpoint(new_id(), "/x", "y", NOW)


def test_expired(store: Store) -> None:
    p = make_pool(store, "p")
    remote = make_pool(store, "p", host="host-b")
    t = make_tenant(store)
    due = reserve_live(store, buf(t, p, 10, expires=NOW + 10))
    later = reserve_live(store, buf(t, p, 10, expires=NOW + 20))
    reserve_live(store, buf(t, remote, 10, expires=NOW))  # another daemon's
    releasing = reserve_live(store, buf(t, p, 10, expires=NOW))
    store.buffers.mark_releasing(releasing.id, None)
    assert store.buffers.expired(NOW + 10, HOST) == []  # strictly after the end
    assert [b.id for b in store.buffers.expired(NOW + 10.5, HOST)] == [due.id]
    assert [b.id for b in store.buffers.expired(NOW + 30, HOST)] == [due.id, later.id]
    assert len(store.buffers.expired(NOW + 30, "host-b")) == 1


def test_mark_expired_is_a_compare_and_set(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(t, pool, 10, expires=NOW + 10))
    assert [b.id for b in store.buffers.expired(NOW + 11, HOST)] == [row.id]
    store.buffers.renew(row.id, t.id, NOW + 100)  # renewed after the reaper looked
    assert store.buffers.mark_expired(row.id, NOW + 11) is None
    assert state_of(store, row.id) == "live"
    got = store.buffers.mark_expired(row.id, NOW + 101)
    assert got is not None
    assert got.state == "releasing"
    assert store.buffers.mark_expired(row.id, NOW + 101) is None  # already releasing
    assert store.buffers.mark_expired(new_id(), NOW) is None


def test_lookup_longest_prefix_and_isolation(store: Store) -> None:
    pool = make_pool(store)
    remote = make_pool(store, "node0", host="host-b")
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    k1 = reserve_live(store, buf(a, pool, 10, key="m:1"))
    k3 = reserve_live(store, buf(a, pool, 10, key="m:1:2:3"))
    reserve_live(store, buf(b, pool, 10, key="m:1:2"))  # b's, invisible to a
    reserve_live(store, buf(b, pool, 10, key="m:1:2:3:4"))
    keys = ["m:1", "m:1:2", "m:1:2:3", "m:1:2:3:4"]
    hit = store.buffers.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1:2:3"
    assert hit[1].id == k3.id
    hit = store.buffers.lookup(a.id, keys[:2])
    assert hit is not None
    assert hit[1].id == k1.id
    hit_b = store.buffers.lookup(b.id, keys)
    assert hit_b is not None
    assert hit_b[0] == "m:1:2:3:4"
    assert store.buffers.lookup(a.id, ["x", "y"]) is None
    assert store.buffers.lookup(a.id, []) is None
    # not live → not found
    store.buffers.mark_releasing(k3.id, a.id)
    hit = store.buffers.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1"
    reserving = buf(a, pool, 10, key="m:1:2")
    store.reserves.begin_reserve(reserving)
    hit = store.buffers.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1"
    # host filter
    far = reserve_live(store, buf(a, remote, 10, key="m:1:2:3:4"))
    hit = store.buffers.lookup(a.id, keys)
    assert hit is not None
    assert hit[1].id == far.id
    hit = store.buffers.lookup(a.id, keys, host=HOST)
    assert hit is not None
    assert hit[1].id == k1.id


def test_buffers_on_host(store: Store) -> None:
    p = make_pool(store, "p")
    remote = make_pool(store, "p", host="host-b")
    t = make_tenant(store)
    live = reserve_live(store, buf(t, p, 10))
    reserving = buf(t, p, 10)
    store.reserves.begin_reserve(reserving)
    releasing = reserve_live(store, buf(t, p, 10))
    store.buffers.mark_releasing(releasing.id, None)
    reserve_live(store, buf(t, remote, 10))
    got = {b.id: b.state for b in store.buffers.buffers_on_host(HOST)}
    assert got == {live.id: "live", reserving.id: "reserving", releasing.id: "releasing"}


def test_a_buffer_row_carries_its_host_and_kind(store: Store) -> None:
    p = make_pool(store, "p")
    remote = make_pool(store, "p", host="host-b")
    t = make_tenant(store)
    here = reserve_live(store, buf(t, p, 10))
    there = reserve_live(store, buf(t, remote, 10))
    assert (here.host, there.host) == (HOST, "host-b")
    assert (here.kind, here.committed_at) == ("buffer", None)
    assert [b.id for b in store.buffers.buffers(host="host-b")] == [there.id]


def test_staged_buffers_are_accounted_but_never_found(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=1000)
    row = buf(t, pool, 600, key="k", evictable=True)
    store.reserves.begin_reserve(row)
    store.buffers.set_state(row.id, "staged")
    assert state_of(store, row.id) == "staged"
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert (tenant.used_bytes, tenant.buffers) == (600, 1)
    assert store.pools.usage_by_pool(HOST)[pool.id] == (600, 1)
    assert store.buffers.lookup(t.id, ["k"]) is None
    assert store.buffers.buffers() == []  # default: live only
    assert [b.id for b in store.buffers.buffers(states=("staged",))] == [row.id]
    assert [b.id for b in store.buffers.buffers_on_host(HOST)] == [row.id]


def _staged_entry(store: Store, tenant: object, pool: object, key: str) -> str:
    row = msgspec.structs.replace(buf(tenant, pool, 10, key=key), kind="entry")  # type: ignore[arg-type]
    store.reserves.begin_reserve(row)
    store.buffers.set_state(row.id, "staged")
    return row.id


def test_an_entry_is_staged_until_its_commit(store: Store) -> None:
    pool, t, other = make_pool(store), make_tenant(store), make_tenant(store, "other")
    entry = _staged_entry(store, t, pool, "k")
    assert store.buffers.lookup(t.id, ["k"]) is None  # staged: no lookup sees it
    assert store.tenants.tenant(t.id).used_bytes == 10  # type: ignore[union-attr]  # but it counts
    assert store.buffers.mark_staged_releasing(entry, other.id) is None  # foreign
    committed = store.buffers.commit(entry, NOW + 1)
    assert committed is not None
    assert (committed.state, committed.kind, committed.committed_at) == ("live", "entry", NOW + 1)
    assert store.buffers.commit(entry, NOW + 2) is None  # once only
    assert store.buffers.mark_staged_releasing(entry, t.id) is None  # committed: no abort
    hit = store.buffers.lookup(t.id, ["k"])
    assert hit is not None
    assert hit[1].id == entry
    aborted = _staged_entry(store, t, pool, "k2")
    row = store.buffers.mark_staged_releasing(aborted, t.id)
    assert row is not None
    assert (row.state, row.key) == ("releasing", None)
    assert store.buffers.commit(aborted, NOW) is None  # released meanwhile: the commit refuses


def test_a_staged_entry_has_a_lease_and_can_be_released(store: Store) -> None:
    """A writer that never commits holds its entry no longer than its lease: the reaper's
    compare-and-set and a DELETE take a staged entry, and its commit then finds it gone."""
    pool, t, other = make_pool(store), make_tenant(store), make_tenant(store, "other")
    expired = _staged_entry(store, t, pool, "k1")  # leases end at NOW + 600
    assert [b.id for b in store.buffers.expired(NOW + 601, HOST)] == [expired]
    renewed = store.buffers.renew(expired, t.id, NOW + 700)  # renewing a staged entry extends it
    assert (renewed.state, renewed.expires_at) == ("staged", NOW + 700)
    assert store.buffers.mark_expired(expired, NOW + 601) is None  # renewed since: left alone
    marked = store.buffers.mark_expired(expired, NOW + 701)
    assert marked is not None
    assert (marked.state, marked.key) == ("releasing", None)
    assert store.buffers.commit(expired, NOW + 702) is None  # the reaper won: the commit refuses
    # The commit wins: the reaper's compare-and-set then sees a live entry, on its lease.
    committed = _staged_entry(store, t, pool, "k2")
    assert store.buffers.commit(committed, NOW + 1) is not None
    assert store.buffers.mark_expired(committed, NOW + 2) is None
    # A DELETE (tenant or admin) claims a staged entry, once; not another tenant's.
    deleted = _staged_entry(store, t, pool, "k3")
    with pytest.raises(NotFound):
        store.buffers.mark_releasing(deleted, other.id, only_leased=True)
    assert store.buffers.mark_releasing(deleted, t.id, only_leased=True).state == "releasing"
    with pytest.raises(NotFound):
        store.buffers.mark_releasing(deleted, None, only_leased=True)  # claimed already
    assert store.buffers.commit(deleted, NOW + 3) is None


def test_uses_and_lease_extensions_are_written_together_and_never_shorten(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    a = reserve_live(store, buf(t, pool, 10, expires=NOW + 100))
    b = reserve_live(store, buf(t, pool, 10, expires=NOW + 100))
    hit = NOW + 5
    store.buffers.touch_many(
        {a.id: hit}, {a.id: Extension(hit + 200, hit), b.id: Extension(NOW + 50, hit)}
    )
    got_a, got_b = store.buffers.buffer(a.id), store.buffers.buffer(b.id)
    assert got_a is not None
    assert got_b is not None
    assert (got_a.last_used_at, got_a.expires_at) == (NOW + 5, NOW + 205)
    assert got_b.expires_at == NOW + 100  # a shorter lease than it has changes nothing
    store.buffers.touch_many({}, {})  # nothing to write: no transaction
