"""Tenants and API keys in the ledger (maasd.store.tenants), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from ledger import (
    HOST,
    NOW,
    buf,
    make_pool,
    make_tenant,
    reserve_live,
)
from maasd.errors import InvalidRequest, NotFound, StateConflict
from maasd.store import Store
from maasd.tenancy.keys import digest, new_id, new_token

#: The ``store`` fixture (SQLite, and PostgreSQL when configured) and its helpers.
pytest_plugins = ("ledger",)


def test_tenants(store: Store) -> None:
    t = make_tenant(store, "acme", 1000)
    assert store.tenants.tenant(t.id) == t
    assert (t.max_buffers, t.deleting_at, t.used_bytes, t.buffers) == (None, None, 0, 0)
    assert store.tenants.tenant("acme") == t
    assert store.tenants.tenant("nope") is None
    with pytest.raises(StateConflict):
        make_tenant(store, "acme")
    make_tenant(store, "beta")
    assert [x.name for x in store.tenants.tenants()] == ["acme", "beta"]
    store.tenants.set_quota(t.id, 5)
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.quota_bytes == 5
    with pytest.raises(NotFound):
        store.tenants.set_quota(new_id(), 5)
    with pytest.raises(InvalidRequest):
        store.tenants.set_quota(t.id, -1)


def test_tenant_usage(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    reserve_live(store, buf(t, pool, 100))
    store.reserves.begin_reserve(buf(t, pool, 50))  # reserving counts too
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert (tenant.used_bytes, tenant.buffers) == (150, 2)
    assert store.pools.usage_by_pool(HOST) == {pool.id: (150, 2)}


def test_delete_tenant(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    token = new_token()
    store.tenants.add_key(new_id(), t.id, digest(token), NOW)
    row = reserve_live(store, buf(t, pool, 100))
    with pytest.raises(StateConflict):
        store.tenants.delete_tenant(t.id)
    assert store.tenants.tenant(t.id) is not None
    store.buffers.mark_releasing(row.id, t.id)
    store.reserves.finish_release(row.id, "tenant_delete")
    store.tenants.delete_tenant(t.id)
    assert store.tenants.tenant(t.id) is None
    assert store.tenants.key_by_digest(digest(token)) is None
    with pytest.raises(NotFound):
        store.tenants.delete_tenant(t.id)
    make_tenant(store, "acme")  # the name is free again


# ---------------------------------------------------------------- keys
def test_keys(store: Store) -> None:
    t, other = make_tenant(store, "acme"), make_tenant(store, "beta")
    token = new_token()
    k = store.tenants.add_key(new_id(), t.id, digest(token), NOW)
    assert store.tenants.key_by_digest(digest(token)) == k
    assert store.tenants.key_by_digest(digest(new_token())) is None
    assert store.tenants.revoke_key(other.id, k.id) is False  # foreign
    assert store.tenants.revoke_key(t.id, new_id()) is False  # unknown
    assert store.tenants.revoke_key(t.id, k.id) is True
    assert store.tenants.key_by_digest(digest(token)) is None
    assert store.tenants.revoke_key(t.id, k.id) is False  # already revoked
    t2 = [new_token() for _ in range(3)]
    for tok in t2:
        store.tenants.add_key(new_id(), t.id, digest(tok), NOW)
    assert store.tenants.revoke_keys(t.id) == 3
    assert all(store.tenants.key_by_digest(digest(tok)) is None for tok in t2)
    with pytest.raises(NotFound):
        store.tenants.add_key(new_id(), new_id(), digest(new_token()), NOW)


def test_a_tenants_disk_quota(store: Store) -> None:
    from maasd.core.tenants import disk_quota, tenant_info

    t = make_tenant(store, "acme", 1000)
    assert t.disk_quota_bytes is None  # the default: disk_quota_factor × the quota
    assert disk_quota(t, 4) == 4000
    own = store.tenants.add_tenant(new_id(), "beta", 1000, NOW, disk_quota_bytes=123)
    assert store.tenants.tenant(own.id) == own
    assert own.disk_quota_bytes == 123
    assert disk_quota(own, 4) == 123
    info = tenant_info(own, 10, disk_factor=4, disk_used=77)
    assert (info.disk_quota_bytes, info.disk_used_bytes) == (123, 77)
    with pytest.raises(InvalidRequest):
        store.tenants.add_tenant(new_id(), "gamma", 1000, NOW, disk_quota_bytes=-1)
    assert store.tenants.tenant("gamma") is None
    store.tenants.update_tenant(t.id, disk_quota_bytes=0)  # nothing of it kept on disk
    after = store.tenants.tenant(t.id)
    assert after is not None
    assert (after.disk_quota_bytes, after.quota_bytes, after.max_buffers) == (0, 1000, None)
    assert disk_quota(after, 4) == 0
    events = [e for e in store.events.events(10, tenant_id=t.id) if e.kind == "disk_quota_set"]
    assert [e.bytes for e in events] == [0]
    with pytest.raises(InvalidRequest):
        store.tenants.update_tenant(t.id, disk_quota_bytes=-5)
    with pytest.raises(NotFound):
        store.tenants.update_tenant(new_id(), disk_quota_bytes=5)
    assert store.tenants.tenant(t.id) == after


def test_the_default_disk_quota_of_a_huge_quota_is_a_64_bit_integer(store: Store) -> None:
    """factor × a quota near 2^63 would answer a disk quota past any 64-bit integer (a
    client in another language could not read the tenant): it stops at MAX_BYTES."""
    from maasd.bounds import MAX_BYTES
    from maasd.core.tenants import disk_quota

    t = make_tenant(store, "huge", MAX_BYTES)
    assert disk_quota(t, 4) == MAX_BYTES
    half = make_tenant(store, "half", MAX_BYTES // 4)
    assert disk_quota(half, 4) == MAX_BYTES // 4 * 4


def test_a_repository_stands_alone_over_the_database_it_is_handed(store: Store) -> None:
    """Each repository reaches the ledger only through the ``Database`` it is handed: one
    built over the store's database sees (and makes) the same rows, and nothing else of
    the store is needed — a module can be given its aggregate's repository alone."""
    from maasd.store.events import EventRepo
    from maasd.store.tenants import TenantRepo

    tenants = TenantRepo(store.db)
    tid = new_id()
    tenants.add_tenant(tid, "alone", 1 << 20, 1.0)
    assert store.tenants.tenant(tid) is not None
    assert [t.id for t in tenants.tenants() if t.id == tid] == [tid]
    assert tenants.is_postgres == store.is_postgres
    assert [e.kind for e in EventRepo(store.db).events(tenant_id=tid)] == ["tenant_create"]


def test_serving_leaves_out_tenants_deleted_or_being_deleted(store: Store) -> None:
    """What a host asks of the tenants it keeps entries of on its disk tiers: the others
    were deleted, maybe through another daemon, and their entries are to be erased."""
    kept, deleting, deleted = (make_tenant(store, n) for n in ("kept", "deleting", "deleted"))
    store.tenants.mark_tenant_deleting(deleting.id)
    store.tenants.delete_tenant(deleted.id)
    ids = [kept.id, deleting.id, deleted.id, new_id()]
    assert store.tenants.serving(ids) == {kept.id}
    assert store.tenants.serving([]) == set()
