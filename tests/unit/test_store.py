"""The ledger (maasd.store.Store) against real databases.

Every test runs on a real SQLite file in ``tmp_path`` and, when
``MAASD_TEST_PG_URL`` points at a PostgreSQL server (``scripts/pg-test-server``
starts one), on PostgreSQL too: a fresh database per test module, emptied
before each test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from maasd.errors import (
    DuplicateKey,
    InvalidRequest,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
    StateConflict,
    TooLarge,
)
from maasd.store import BufferRow, PoolRow, Store, TenantRow, migrations_dir, normalize_url
from maasd.tenancy.keys import digest, new_id, new_token
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
        s._truncate()
    try:
        yield s
    finally:
        s.dispose()


def make_pool(
    store: Store, name: str = "node0", capacity: int = 10_000, host: str = HOST
) -> PoolRow:
    return store.add_pool(
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
    return store.add_tenant(new_id(), name, quota, NOW)


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


def reserve_live(store: Store, row: BufferRow) -> BufferRow:
    """What the service does: admit, (allocate), go live; finish any victims."""
    for victim in store.begin_reserve(row):
        store.finish_release(victim.id, "evict")
    store.set_state(row.id, "live")
    got = store.buffer(row.id)
    assert got is not None
    return got


def state_of(store: Store, buffer_id: str) -> str | None:
    """The buffer's state in the ledger, ``None`` when it has no row."""
    row = store.buffer(buffer_id)
    return None if row is None else row.state


def snapshot(store: Store) -> tuple[Any, ...]:
    return (
        msgspec.to_builtins(store.buffers(states=None)),
        msgspec.to_builtins(store.tenants()),
        store.usage_by_pool(HOST),
        len(store.events(10_000)),
    )


# ---------------------------------------------------------------- engine
def test_url_normalisation() -> None:
    assert str(normalize_url("postgresql+asyncpg://u@db/x?ssl=require")) == (
        "postgresql+psycopg://u@db/x?sslmode=require"
    )
    assert normalize_url("postgresql://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@db/x").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:////tmp/x.db").database == "/tmp/x.db"
    for bad in ("sqlite://", "sqlite:///:memory:", "mysql://u@db/x", "not a url"):
        with pytest.raises(InvalidRequest):
            normalize_url(bad)


def test_migrations_dir_found() -> None:
    assert (migrations_dir() / "env.py").is_file()
    assert Store.head_revision() == "0001"


def test_sqlite_pragmas(tmp_path: Any) -> None:
    s = Store(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
    finally:
        s.dispose()


def test_sqlite_write_transactions_begin_immediate(tmp_path: Any) -> None:
    """A write transaction holds the write lock from BEGIN on: a second writer waits."""
    s = Store(f"sqlite:///{tmp_path / 'w.db'}")
    s.upgrade()
    try:
        statements: list[str] = []
        sa.event.listen(s.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        make_tenant(s)
        assert statements[0] == "BEGIN IMMEDIATE"
        statements.clear()
        s.tenants()  # a read sends no BEGIN at all
        assert not any(x.startswith("BEGIN") for x in statements)
    finally:
        s.dispose()


# ---------------------------------------------------------------- pools
def test_pools(store: Store) -> None:
    a = make_pool(store, "node0")
    b = make_pool(store, "node1")
    other = make_pool(store, "node0", host="host-b")  # same name, other host: fine
    assert [p.name for p in store.pools(HOST)] == ["node0", "node1"]
    assert [p.id for p in store.pools("host-b")] == [other.id]
    assert store.pool(HOST, "node1") == b
    assert store.pool(HOST, a.id) == a
    assert store.pool(HOST, other.id) is None
    assert store.pool(HOST, "nope") is None
    with pytest.raises(StateConflict):
        make_pool(store, "node0")
    assert store.usage_by_pool(HOST) == {a.id: (0, 0), b.id: (0, 0)}


def test_delete_pool(store: Store) -> None:
    pool, tenant = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(tenant, pool, 100))
    with pytest.raises(StateConflict):
        store.delete_pool(pool.id)
    store.mark_releasing(row.id, None)
    store.finish_release(row.id)
    store.delete_pool(pool.id)
    assert store.pools(HOST) == []
    with pytest.raises(NotFound):
        store.delete_pool(pool.id)


# ---------------------------------------------------------------- tenants
def test_tenants(store: Store) -> None:
    t = make_tenant(store, "acme", 1000)
    assert store.tenant(t.id) == t
    assert store.tenant("acme") == t
    assert store.tenant("nope") is None
    with pytest.raises(StateConflict):
        make_tenant(store, "acme")
    make_tenant(store, "beta")
    assert [x.name for x in store.tenants()] == ["acme", "beta"]
    store.set_quota(t.id, 5)
    tenant = store.tenant(t.id)
    assert tenant is not None
    assert tenant.quota_bytes == 5
    with pytest.raises(NotFound):
        store.set_quota(new_id(), 5)
    with pytest.raises(InvalidRequest):
        store.set_quota(t.id, -1)


def test_tenant_usage(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    reserve_live(store, buf(t, pool, 100))
    store.begin_reserve(buf(t, pool, 50))  # reserving counts too
    tenant = store.tenant(t.id)
    assert tenant is not None
    assert (tenant.used_bytes, tenant.buffers) == (150, 2)
    assert store.usage_by_pool(HOST) == {pool.id: (150, 2)}


def test_delete_tenant(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    token = new_token()
    store.add_key(new_id(), t.id, digest(token), NOW)
    row = reserve_live(store, buf(t, pool, 100))
    with pytest.raises(StateConflict):
        store.delete_tenant(t.id)
    assert store.tenant(t.id) is not None
    store.mark_releasing(row.id, t.id)
    store.finish_release(row.id, "tenant_delete")
    store.delete_tenant(t.id)
    assert store.tenant(t.id) is None
    assert store.key_by_digest(digest(token)) is None
    with pytest.raises(NotFound):
        store.delete_tenant(t.id)
    make_tenant(store, "acme")  # the name is free again


# ---------------------------------------------------------------- keys
def test_keys(store: Store) -> None:
    t, other = make_tenant(store, "acme"), make_tenant(store, "beta")
    token = new_token()
    k = store.add_key(new_id(), t.id, digest(token), NOW)
    assert store.key_by_digest(digest(token)) == k
    assert store.key_by_digest(digest(new_token())) is None
    assert store.keys(t.id) == [k]
    assert store.revoke_key(other.id, k.id) is False  # foreign
    assert store.revoke_key(t.id, new_id()) is False  # unknown
    assert store.revoke_key(t.id, k.id) is True
    assert store.key_by_digest(digest(token)) is None
    assert store.revoke_key(t.id, k.id) is False  # already revoked
    t2 = [new_token() for _ in range(3)]
    for tok in t2:
        store.add_key(new_id(), t.id, digest(tok), NOW)
    assert store.revoke_keys(t.id) == 3
    assert all(store.key_by_digest(digest(tok)) is None for tok in t2)
    with pytest.raises(NotFound):
        store.add_key(new_id(), new_id(), digest(new_token()), NOW)


# ---------------------------------------------------------------- reserve
def test_quota_enforced_exactly_at_the_boundary(store: Store) -> None:
    pool, t = make_pool(store, capacity=10_000), make_tenant(store, quota=1000)
    reserve_live(store, buf(t, pool, 600))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded) as info:
        store.begin_reserve(buf(t, pool, 401))
    assert "600" in info.value.detail
    assert "1000" in info.value.detail
    assert "401" in info.value.detail
    assert snapshot(store) == before
    reserve_live(store, buf(t, pool, 400))  # exactly the quota
    tenant = store.tenant(t.id)
    assert tenant is not None
    assert tenant.used_bytes == 1000
    with pytest.raises(QuotaExceeded):
        store.begin_reserve(buf(t, pool, 1))


def test_pool_capacity_enforced_exactly_at_the_boundary(store: Store) -> None:
    pool = make_pool(store, capacity=1000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    reserve_live(store, buf(a, pool, 700))
    before = snapshot(store)
    with pytest.raises(PoolExhausted) as info:
        store.begin_reserve(buf(b, pool, 301))
    assert "300" in info.value.detail
    assert "1000" in info.value.detail
    assert snapshot(store) == before
    reserve_live(store, buf(b, pool, 300))
    assert store.usage_by_pool(HOST)[pool.id] == (1000, 2)
    with pytest.raises(PoolExhausted):
        store.begin_reserve(buf(b, pool, 1))


def test_too_large_and_unknown_references(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=10_000)
    with pytest.raises(TooLarge):
        store.begin_reserve(buf(t, pool, 1001))
    ghost_pool = msgspec.structs.replace(pool, id=new_id())
    ghost_tenant = msgspec.structs.replace(t, id=new_id())
    with pytest.raises(NotFound):
        store.begin_reserve(buf(t, ghost_pool, 1))
    with pytest.raises(NotFound):
        store.begin_reserve(buf(ghost_tenant, pool, 1))
    with pytest.raises(InvalidRequest):
        store.begin_reserve(buf(t, pool, 0))
    assert store.buffers(states=None) == []


def test_quota_check_can_be_skipped(store: Store) -> None:
    pool, t = make_pool(store, capacity=1000), make_tenant(store, quota=10)
    store.begin_reserve(buf(t, pool, 500), quota_check=False)
    with pytest.raises(PoolExhausted):  # capacity still holds
        store.begin_reserve(buf(t, pool, 501), quota_check=False)


def test_duplicate_key(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    first = reserve_live(store, buf(a, pool, 10, key="k"))
    with pytest.raises(DuplicateKey):
        store.begin_reserve(buf(a, pool, 10, key="k"))
    reserve_live(store, buf(b, pool, 10, key="k"))  # another tenant's keys are its own
    reserve_live(store, buf(a, pool, 10, key=None))
    reserve_live(store, buf(a, pool, 10, key=None))  # NULL keys never clash
    # A buffer being released gives its key up at once.
    released = store.mark_releasing(first.id, a.id)
    assert released.key is None
    assert released.state == "releasing"
    reserve_live(store, buf(a, pool, 10, key="k"))


def test_duplicate_key_checked_against_reserving_buffers(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    store.begin_reserve(buf(t, pool, 10, key="k"))
    with pytest.raises(DuplicateKey):
        store.begin_reserve(buf(t, pool, 10, key="k"))


# ---------------------------------------------------------------- eviction
def test_eviction_picks_lru_evictable_only(store: Store) -> None:
    pool, t = make_pool(store, capacity=100_000), make_tenant(store, quota=1000)
    pinned = reserve_live(store, buf(t, pool, 400, last_used=0.5))  # oldest, but not evictable
    old = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=1.0))
    mid = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=2.0))
    new = reserve_live(store, buf(t, pool, 200, evictable=True, last_used=3.0))
    # used 1000 of 1000; 300 more need the two least recently used evictable ones.
    row = buf(t, pool, 300)
    victims = store.begin_reserve(row)
    assert [v.id for v in victims] == [old.id, mid.id]
    assert all(v.state == "releasing" for v in victims)
    live = {b.id for b in store.buffers(states=("live",))}
    assert live == {pinned.id, new.id}
    assert {b.id for b in store.buffers(states=("reserving",))} == {row.id}
    kinds = [e.kind for e in store.events(3)]
    assert kinds == ["reserve", "evict", "evict"]


def test_eviction_never_touches_non_evictable(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store, quota=1000)
    reserve_live(store, buf(t, pool, 700))
    reserve_live(store, buf(t, pool, 200, evictable=True))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded, match="even after evicting 200"):
        store.begin_reserve(buf(t, pool, 400))
    assert snapshot(store) == before  # the evictable one was not taken either


def test_eviction_skips_non_live(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store, quota=1000)
    store.begin_reserve(buf(t, pool, 800, evictable=True))  # still reserving
    with pytest.raises(QuotaExceeded):
        store.begin_reserve(buf(t, pool, 300))


def test_quota_eviction_takes_only_the_tenants_own(store: Store) -> None:
    pool = make_pool(store, capacity=100_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 1000)
    theirs = reserve_live(store, buf(b, pool, 500, evictable=True, last_used=0.0))  # the LRU of all
    mine = reserve_live(store, buf(a, pool, 800, evictable=True, last_used=5.0))
    victims = store.begin_reserve(buf(a, pool, 500))
    assert [v.id for v in victims] == [mine.id]
    still = store.buffer(theirs.id)
    assert still is not None
    assert still.state == "live"


def test_quota_eviction_fails_when_only_others_are_evictable(store: Store) -> None:
    pool = make_pool(store, capacity=100_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 1000)
    reserve_live(store, buf(b, pool, 500, evictable=True))
    reserve_live(store, buf(a, pool, 800))
    before = snapshot(store)
    with pytest.raises(QuotaExceeded):
        store.begin_reserve(buf(a, pool, 500))
    assert snapshot(store) == before


def test_pool_eviction_takes_any_tenants_buffers_in_that_pool(store: Store) -> None:
    pool = make_pool(store, "p", capacity=1000)
    elsewhere = make_pool(store, "q", capacity=10_000)
    a, b = make_tenant(store, "a", 10_000), make_tenant(store, "b", 10_000)
    other_pool = reserve_live(store, buf(b, elsewhere, 900, evictable=True, last_used=0.0))
    theirs = reserve_live(store, buf(b, pool, 300, evictable=True, last_used=1.0))
    mine = reserve_live(store, buf(a, pool, 300, evictable=True, last_used=2.0))
    reserve_live(store, buf(b, pool, 400, evictable=False, last_used=0.1))
    victims = store.begin_reserve(buf(a, pool, 300))
    assert [v.id for v in victims] == [theirs.id]
    assert state_of(store, mine.id) == "live"
    assert state_of(store, other_pool.id) == "live"
    with pytest.raises(PoolExhausted, match="even after evicting 300"):
        store.begin_reserve(buf(a, pool, 700))


def test_eviction_for_quota_and_capacity_together(store: Store) -> None:
    p = make_pool(store, "p", capacity=1000)
    q = make_pool(store, "q", capacity=10_000)
    a, b = make_tenant(store, "a", 1000), make_tenant(store, "b", 10_000)
    a_in_q = reserve_live(store, buf(a, q, 500, evictable=True, last_used=1.0))
    b_in_p = reserve_live(store, buf(b, p, 500, evictable=True, last_used=2.0))
    a_in_p = reserve_live(store, buf(a, p, 500, evictable=True, last_used=3.0))
    # a: 1000/1000 used, p: 1000/1000 used; 500 more in p needs 500 of a's and 500 of p's:
    # LRU order is a_in_q (helps quota), b_in_p (helps pool) — a_in_p survives.
    victims = store.begin_reserve(buf(a, p, 500))
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
    victims = store.begin_reserve(buf(a, p, 300))  # only capacity is short
    assert [v.id for v in victims] == [in_p.id]
    assert state_of(store, in_q.id) == "live"


# ---------------------------------------------------------------- buffer life
def test_release_cycle(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    row = reserve_live(store, buf(a, pool, 100, key="k"))
    with pytest.raises(NotFound):
        store.mark_releasing(row.id, b.id)  # foreign
    with pytest.raises(NotFound):
        store.mark_releasing(new_id(), a.id)  # unknown
    assert store.buffer(row.id, a.id) is not None
    first = store.mark_releasing(row.id, a.id)
    again = store.mark_releasing(row.id, a.id)  # idempotent
    assert first == again
    assert first.state == "releasing"
    assert store.mark_releasing(row.id, None).id == row.id  # admin
    gone = store.finish_release(row.id, "release")
    assert gone is not None
    assert gone.id == row.id
    assert store.finish_release(row.id) is None
    assert store.buffer(row.id) is None
    ev = store.events(1)[0]
    assert (ev.kind, ev.buffer_id, ev.bytes, ev.tenant_id) == ("release", row.id, 100, a.id)
    tenant = store.tenant(a.id)
    assert tenant is not None
    assert tenant.used_bytes == 0


def test_set_state(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = buf(t, pool, 10, key="k")
    store.begin_reserve(row)
    assert store.buffers() == []  # default: live only
    store.set_state(row.id, "live")
    assert [b.id for b in store.buffers()] == [row.id]
    store.set_state(row.id, "releasing")
    got = store.buffer(row.id)
    assert got is not None
    assert got.state == "releasing"
    assert got.key is None
    with pytest.raises(InvalidRequest):
        store.set_state(row.id, "dead")
    with pytest.raises(NotFound):
        store.set_state(new_id(), "live")


def test_buffer_visibility(store: Store) -> None:
    p, q = make_pool(store, "p"), make_pool(store, "q")
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    ap = reserve_live(store, buf(a, p, 10))
    aq = reserve_live(store, buf(a, q, 10))
    bp = reserve_live(store, buf(b, p, 10))
    assert store.buffer(ap.id, a.id) == ap
    assert store.buffer(ap.id, b.id) is None
    assert store.buffer(ap.id, None) == ap
    assert {x.id for x in store.buffers(a.id)} == {ap.id, aq.id}
    assert {x.id for x in store.buffers(pool_id=p.id)} == {ap.id, bp.id}
    assert [x.id for x in store.buffers(a.id, q.id)] == [aq.id]
    assert {x.id for x in store.buffers()} == {ap.id, aq.id, bp.id}
    assert store.buffers(states=("reserving",)) == []
    assert {x.id for x in store.buffers(host=HOST)} == {ap.id, aq.id, bp.id}
    assert store.buffers(host="elsewhere") == []


def test_renew(store: Store) -> None:
    pool = make_pool(store)
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    row = reserve_live(store, buf(a, pool, 10))
    renewed = store.renew(row.id, a.id, NOW + 9999)
    assert renewed.expires_at == NOW + 9999
    stored = store.buffer(row.id)
    assert stored is not None
    assert stored.expires_at == NOW + 9999
    with pytest.raises(NotFound):
        store.renew(row.id, b.id, NOW)
    with pytest.raises(NotFound):
        store.renew(new_id(), a.id, NOW)
    assert store.renew(row.id, None, NOW + 1).expires_at == NOW + 1  # admin
    store.mark_releasing(row.id, a.id)
    with pytest.raises(NotFound):
        store.renew(row.id, a.id, NOW)


def test_touch_numa_checkpoint(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(t, pool, 10))
    assert store.touch(row.id, NOW + 5) is True
    assert store.touch(new_id(), NOW) is False
    store.set_numa_node(row.id, 1)
    store.set_checkpoint(row.id, "/spill/x", "sha256:abc", NOW + 6)
    got = store.buffer(row.id)
    assert got is not None
    assert (got.last_used_at, got.numa_node) == (NOW + 5, 1)
    assert (got.checkpoint_path, got.checksum, got.checkpointed_at) == (
        "/spill/x",
        "sha256:abc",
        NOW + 6,
    )
    with pytest.raises(NotFound):
        store.set_numa_node(new_id(), 0)
    with pytest.raises(NotFound):
        store.set_checkpoint(new_id(), "/x", "y", NOW)


def test_expired(store: Store) -> None:
    p = make_pool(store, "p")
    remote = make_pool(store, "p", host="host-b")
    t = make_tenant(store)
    due = reserve_live(store, buf(t, p, 10, expires=NOW + 10))
    later = reserve_live(store, buf(t, p, 10, expires=NOW + 20))
    reserve_live(store, buf(t, remote, 10, expires=NOW))  # another daemon's
    releasing = reserve_live(store, buf(t, p, 10, expires=NOW))
    store.mark_releasing(releasing.id, None)
    assert store.expired(NOW + 10, HOST) == []  # strictly after the end
    assert [b.id for b in store.expired(NOW + 10.5, HOST)] == [due.id]
    assert [b.id for b in store.expired(NOW + 30, HOST)] == [due.id, later.id]
    assert len(store.expired(NOW + 30, "host-b")) == 1


def test_mark_expired_is_a_compare_and_set(store: Store) -> None:
    pool, t = make_pool(store), make_tenant(store)
    row = reserve_live(store, buf(t, pool, 10, expires=NOW + 10))
    assert [b.id for b in store.expired(NOW + 11, HOST)] == [row.id]
    store.renew(row.id, t.id, NOW + 100)  # renewed after the reaper looked
    assert store.mark_expired(row.id, NOW + 11) is None
    assert state_of(store, row.id) == "live"
    got = store.mark_expired(row.id, NOW + 101)
    assert got is not None
    assert got.state == "releasing"
    assert store.mark_expired(row.id, NOW + 101) is None  # already releasing
    assert store.mark_expired(new_id(), NOW) is None


def test_lookup_longest_prefix_and_isolation(store: Store) -> None:
    pool = make_pool(store)
    remote = make_pool(store, "node0", host="host-b")
    a, b = make_tenant(store, "a"), make_tenant(store, "b")
    k1 = reserve_live(store, buf(a, pool, 10, key="m:1"))
    k3 = reserve_live(store, buf(a, pool, 10, key="m:1:2:3"))
    reserve_live(store, buf(b, pool, 10, key="m:1:2"))  # b's, invisible to a
    reserve_live(store, buf(b, pool, 10, key="m:1:2:3:4"))
    keys = ["m:1", "m:1:2", "m:1:2:3", "m:1:2:3:4"]
    hit = store.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1:2:3"
    assert hit[1].id == k3.id
    hit = store.lookup(a.id, keys[:2])
    assert hit is not None
    assert hit[1].id == k1.id
    hit_b = store.lookup(b.id, keys)
    assert hit_b is not None
    assert hit_b[0] == "m:1:2:3:4"
    assert store.lookup(a.id, ["x", "y"]) is None
    assert store.lookup(a.id, []) is None
    # not live → not found
    store.mark_releasing(k3.id, a.id)
    hit = store.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1"
    reserving = buf(a, pool, 10, key="m:1:2")
    store.begin_reserve(reserving)
    hit = store.lookup(a.id, keys)
    assert hit is not None
    assert hit[0] == "m:1"
    # host filter
    far = reserve_live(store, buf(a, remote, 10, key="m:1:2:3:4"))
    hit = store.lookup(a.id, keys)
    assert hit is not None
    assert hit[1].id == far.id
    hit = store.lookup(a.id, keys, host=HOST)
    assert hit is not None
    assert hit[1].id == k1.id


def test_buffers_on_host(store: Store) -> None:
    p = make_pool(store, "p")
    remote = make_pool(store, "p", host="host-b")
    t = make_tenant(store)
    live = reserve_live(store, buf(t, p, 10))
    reserving = buf(t, p, 10)
    store.begin_reserve(reserving)
    releasing = reserve_live(store, buf(t, p, 10))
    store.mark_releasing(releasing.id, None)
    reserve_live(store, buf(t, remote, 10))
    got = {b.id: b.state for b in store.buffers_on_host(HOST)}
    assert got == {live.id: "live", reserving.id: "reserving", releasing.id: "releasing"}


def test_events(store: Store) -> None:
    store.record_event("recover", at=NOW, detail="3 buffers", nbytes=30)
    store.record_event("pool_delete", pool_id="p1")
    evs = store.events(2)
    assert [e.kind for e in evs] == ["pool_delete", "recover"]
    assert (evs[1].at, evs[1].detail, evs[1].bytes) == (NOW, "3 buffers", 30)
    assert len(store.events(1)) == 1


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


def test_concurrent_reserves_never_overcommit_quota(store: Store) -> None:
    size, fits = 100, 10
    pool = make_pool(store, capacity=1_000_000)
    t = make_tenant(store, quota=size * fits)
    results = hammer(32, 2, lambda _i: store.begin_reserve(buf(t, pool, size)))
    granted = [r for r in results if r == []]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(granted) == fits, [
        r for r in results if r != [] and not isinstance(r, QuotaExceeded)
    ]
    assert len(refused) == 64 - fits
    tenant = store.tenant(t.id)
    assert tenant is not None
    assert (tenant.used_bytes, tenant.buffers) == (fits * size, fits)
    assert sum(b.size_bytes for b in store.buffers(states=None)) == fits * size


def test_concurrent_reserves_never_overcommit_pool(store: Store) -> None:
    size, fits = 100, 10
    pool = make_pool(store, capacity=size * fits)
    tenants = [make_tenant(store, f"t{i}", quota=1_000_000) for i in range(8)]
    results = hammer(32, 2, lambda i: store.begin_reserve(buf(tenants[i % 8], pool, size)))
    granted = [r for r in results if r == []]
    refused = [r for r in results if isinstance(r, PoolExhausted)]
    assert len(granted) == fits, [
        r for r in results if r != [] and not isinstance(r, PoolExhausted)
    ]
    assert len(refused) == 64 - fits
    assert store.usage_by_pool(HOST)[pool.id] == (fits * size, fits)


def test_concurrent_eviction_evicts_each_victim_once(store: Store) -> None:
    """Many reserves into a full pool of evictable buffers: never a double eviction."""
    size, fits = 100, 8
    pool = make_pool(store, capacity=size * fits)
    tenants = [make_tenant(store, f"t{i}", quota=1_000_000) for i in range(4)]
    for i in range(fits):
        reserve_live(store, buf(tenants[i % 4], pool, size, evictable=True))

    def work(i: int) -> list[BufferRow]:
        row = buf(tenants[i % 4], pool, size, evictable=True, last_used=time.time())
        victims = store.begin_reserve(row)
        store.set_state(row.id, "live")
        for v in victims:
            store.finish_release(v.id, "evict")
        return victims

    results = hammer(16, 2, work)
    errors = [r for r in results if not isinstance(r, list)]
    # A reserve may find the pool full of victims still being scrubbed by others:
    # that is a PoolExhausted, never anything else.
    assert all(isinstance(e, PoolExhausted) for e in errors), errors
    victims = [v.id for r in results if isinstance(r, list) for v in r]
    assert len(victims) == len(set(victims))
    used, count = store.usage_by_pool(HOST)[pool.id]
    assert used <= size * fits
    assert used == sum(b.size_bytes for b in store.buffers(pool_id=pool.id, states=None))
