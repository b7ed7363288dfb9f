"""The service's rules, in-process: a real SQLite ledger in ``tmp_path``, real memfds.

No daemon, no HTTP and no reaper thread (``start(reaper=False)``): the rules
are called directly — QoS candidate choice, eviction, the reserve/release
flow, checkpoints, and ``recover()`` on a ledger crafted to look like what a
crash leaves behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from maasd import errors
from maasd.allocator import Region
from maasd.bounds import bytes_of_gib
from maasd.core import Service, limits
from maasd.core.livepools import LivePool
from maasd.models import BufferState, Checkpoint, PoolInfo, PoolSpec, Principal, ReserveSpec
from maasd.settings import Settings
from maasd.store import BufferRow, KeyRow
from waiting import wait_until

MiB = 1 << 20

POOLS = [
    PoolSpec(name="fast", numa_node=0, capacity_bytes=32 * MiB, latency_us=1),
    PoolSpec(name="slow", numa_node=0, capacity_bytes=64 * MiB, latency_us=10),
    PoolSpec(
        name="pers",
        numa_node=0,
        capacity_bytes=16 * MiB,
        latency_us=5,
        persistence="persistent",
        scrub="punch",
    ),
]


def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=str(tmp_path / "data"),
        admin_key="admin-key-for-tests",
        pools=list(POOLS),
        node_name="unit-host",
    )


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    yield s
    s.close()


def tenant(svc: Service, quota: int = 256 * MiB, name: str = "t") -> Principal:
    return svc.auth.authenticate(svc.tenants.create(name, quota).api_key)


def req(size: int, **kw: Any) -> ReserveSpec:
    return ReserveSpec(size_bytes=size, **kw)


def pool_named(svc: Service, name: str) -> PoolInfo:
    return next(p for p in svc.pools.infos() if p.name == name)


def sample(svc: Service, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


def ledger_row(svc: Service, buffer_id: str) -> BufferRow:
    row = svc.store.buffers.buffer(buffer_id)
    assert row is not None, f"buffer {buffer_id} has no ledger row"
    return row


def region_of(svc: Service, buffer_id: str) -> Region:
    region = svc.regions.region(buffer_id)
    assert region is not None, f"buffer {buffer_id} has no region here"
    return region


def view(svc: Service, buffer_id: str) -> np.ndarray:
    return np.frombuffer(region_of(svc, buffer_id).view(), dtype=np.uint8)


def live_pool(svc: Service, pool_id: str) -> LivePool:
    live = svc.live.get(pool_id)
    assert live is not None, f"pool {pool_id} is not live"
    return live


def allocated(svc: Service, pool_name: str) -> int:
    """Bytes the in-process allocator of the pool accounts (the ledger is pool_named's)."""
    return live_pool(svc, pool_named(svc, pool_name).id).pool.used


def spill_dir(svc: Service, pool_id: str) -> Path:
    spill = live_pool(svc, pool_id).row.spill_dir
    assert spill is not None
    return Path(spill)


# -- QoS candidate choice -------------------------------------------------------------------


def test_reserve_picks_the_pool_with_most_free_space_that_meets_the_qos(svc: Service) -> None:
    who = tenant(svc)
    slow, fast = pool_named(svc, "slow"), pool_named(svc, "fast")
    assert svc.reserves.reserve(who, req(MiB)).pool_id == slow.id  # most free, no QoS asked
    assert (
        svc.reserves.reserve(who, req(MiB, latency_us=5)).pool_id == fast.id
    )  # only fast is ≤ 5 µs
    assert svc.reserves.reserve(who, req(MiB, latency_us=10)).pool_id == slow.id
    assert (
        svc.reserves.reserve(who, req(MiB, persistence="persistent")).pool_id
        == pool_named(svc, "pers").id
    )
    # Fill slow until fast has more room: the choice follows the free space.
    svc.reserves.reserve(who, req(40 * MiB, persistence="volatile"))
    assert pool_named(svc, "slow").free_bytes < pool_named(svc, "fast").free_bytes
    assert svc.reserves.reserve(who, req(MiB, persistence="volatile")).pool_id == fast.id


def test_qos_nobody_meets_placement_and_size_errors(svc: Service) -> None:
    who = tenant(svc)
    with pytest.raises(errors.QosUnmet):
        svc.reserves.reserve(who, req(MiB, latency_us=0))
    with pytest.raises(errors.QosUnmet):
        svc.reserves.reserve(who, req(MiB, persistence="persistent", pool="fast"))
    with pytest.raises(errors.PlacementError):
        svc.reserves.reserve(who, req(MiB, numa_node=999))
    with pytest.raises(errors.TooLarge):
        svc.reserves.reserve(who, req(65 * MiB))  # larger than any pool
    with pytest.raises(errors.TooLarge):
        svc.reserves.reserve(who, req(33 * MiB, pool="fast"))  # larger than this pool
    with pytest.raises(errors.NotFound):
        svc.reserves.reserve(who, req(MiB, pool="nope"))
    for huge in ((1 << 63) - 1, (1 << 63) - 4096):  # one class of answer, rounding or not
        with pytest.raises(errors.TooLarge):
            svc.reserves.reserve(who, req(huge))
    with pytest.raises(errors.Forbidden):
        svc.reserves.reserve(svc.auth.authenticate("admin-key-for-tests"), req(MiB))
    assert svc.store.buffers.buffers(states=None) == []  # nothing was admitted
    assert sample(svc, "maasd_reserve_total", outcome="granted") == 0


def test_sizes_are_rounded_to_pages_and_counted_rounded(svc: Service) -> None:
    who = tenant(svc, quota=8192)
    buf = svc.reserves.reserve(who, req(4097, pool="fast"))
    assert buf.size_bytes == 8192
    assert svc.tenants.usage(who).used_bytes == 8192
    with pytest.raises(errors.QuotaExceeded):
        svc.reserves.reserve(who, req(1, pool="fast"))
    gb = svc.reserves.reserve(tenant(svc, name="g"), req(bytes_of_gib(0.001), pool="fast"))
    assert gb.size_bytes == -(-int(0.001 * (1 << 30) + 1) // 4096) * 4096


def test_pool_full_is_507_and_changes_nothing(svc: Service) -> None:
    a, b = tenant(svc, name="a"), tenant(svc, name="b")
    svc.reserves.reserve(a, req(30 * MiB, pool="fast"))
    with pytest.raises(errors.PoolExhausted):
        svc.reserves.reserve(b, req(3 * MiB, pool="fast"))
    assert svc.tenants.usage(b).used_bytes == 0
    assert pool_named(svc, "fast").used_bytes == 30 * MiB


# -- reserve / release / renew ------------------------------------------------------------


def test_release_scrubs_before_returning_and_gives_the_bytes_back(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(2 * MiB, pool="fast"))
    handle = svc.handles.open(who, buf.id)
    try:
        import mmap

        m = mmap.mmap(handle.fd, handle.size_bytes)
        m[:] = b"\x5a" * handle.size_bytes
        svc.buffers.release(who, buf.id)
        assert m[:] == bytes(handle.size_bytes)  # the worker's stale mapping reads zeros
        m.close()
    finally:
        os.close(handle.fd)
    assert pool_named(svc, "fast").used_bytes == 0
    assert allocated(svc, "fast") == 0
    with pytest.raises(errors.NotFound):
        svc.buffers.release(who, buf.id)
    assert sample(svc, "maasd_release_total", reason="release") == 1
    assert sample(svc, "maasd_scrub_bytes_total", mode="zero") == 2 * MiB


def test_foreign_buffers_are_not_found(svc: Service) -> None:
    a, b = tenant(svc, name="a"), tenant(svc, name="b")
    buf = svc.reserves.reserve(a, req(MiB))
    for call in (
        lambda: svc.buffers.buffer(b, buf.id),
        lambda: svc.buffers.release(b, buf.id),
        lambda: svc.buffers.renew(b, buf.id, 60),
        lambda: svc.handles.open(b, buf.id),
        lambda: svc.buffers.checkpoint(b, buf.id),
        lambda: svc.buffers.pin(b, buf.id, 0),
    ):
        with pytest.raises(errors.NotFound):
            call()
    assert svc.buffers.buffer(a, buf.id).id == buf.id


def test_reap_releases_expired_leases_only(svc: Service) -> None:
    who = tenant(svc)
    short = svc.reserves.reserve(who, req(MiB, ttl_s=1))
    long = svc.reserves.reserve(who, req(MiB, ttl_s=600))
    assert svc.reaper.reap(now=time.time()) == 0
    assert svc.reaper.reap(now=time.time() + 5) == 1
    assert [b.id for b in svc.buffers.buffers(who)] == [long.id]
    assert sample(svc, "maasd_leases_reaped_total") == 1
    renewed = svc.buffers.renew(who, long.id, 3600)
    assert renewed.expires_at > long.expires_at
    assert svc.reaper.reap(now=time.time() + 700) == 0
    assert svc.store.buffers.buffer(short.id) is None


@pytest.mark.parametrize("claim", ["deleted", "marked"])
def test_a_reserve_whose_row_is_claimed_midway_leaves_no_memory_behind(
    svc: Service, monkeypatch, claim: str
) -> None:
    """A tenant delete or pool drain claims the row while its region is being made: the
    reserve loses its compare-and-set to live, scrubs its own region and finishes the
    release; nothing is left in the ledger or in memory."""
    who = tenant(svc)
    real = svc.store.buffers.advance
    seen: list[Any] = []

    def claimed_meanwhile(
        buffer_id: str, from_state: BufferState, to_state: BufferState, *, durable: bool = True
    ) -> bool:
        region = svc.regions.region(buffer_id)
        assert region is not None  # the region is findable before the row can go live
        seen.append(region)
        view(svc, buffer_id)[:] = 7
        if claim == "deleted":
            svc.store.reserves.finish_release(buffer_id, kind="tenant_delete")
        else:
            svc.store.buffers.mark_releasing(buffer_id, None)
        return real(buffer_id, from_state, to_state, durable=durable)

    monkeypatch.setattr(svc.store.buffers, "advance", claimed_meanwhile)
    with pytest.raises(errors.StateConflict, match="released while it was being reserved"):
        svc.reserves.reserve(who, req(MiB, pool="fast", key="k"))  # keyed: reserving, then live
    assert svc.regions.buffer_ids() == []
    assert allocated(svc, "fast") == 0
    assert svc.store.buffers.buffers(states=None) == []
    assert seen[0].released


@pytest.mark.parametrize("claim", ["tenant delete", "pool drain"])
def test_a_plain_buffer_admitted_live_and_released_before_it_is_held_leaves_nothing(
    svc: Service, monkeypatch, claim: str
) -> None:
    """A plain buffer (no key, never evicted) is admitted live in one transaction. A release
    that comes before its region is held (a tenant delete or a pool drain, each through
    the daemon's own release) finds no region and leaves a note; the reserve reads it once
    it holds the region, drops the region and answers 409: no row, no memory, no write
    after the admission."""
    who = tenant(svc)
    real = svc.reserves._check_placement  # between the region's making and its hold
    seen: list[Any] = []

    def claimed_meanwhile(row: Any, live: Any, region: Region) -> None:
        admitted = svc.store.buffers.buffer(row.id)
        assert admitted is not None
        assert admitted.state == "live"  # live from its admission
        seen.append(region)
        if claim == "tenant delete":
            svc.tenants.delete(str(who.tenant_id))
        else:
            svc.pools.delete(pool_named(svc, "fast").id, drain=True)
        real(row, live, region)

    monkeypatch.setattr(svc.reserves, "_check_placement", claimed_meanwhile)
    advances = []
    monkeypatch.setattr(svc.store.buffers, "advance", lambda *a, **_k: advances.append(a))
    with pytest.raises(errors.StateConflict, match="released while it was being reserved"):
        svc.reserves.reserve(who, req(MiB, pool="fast"))
    assert advances == []  # the admission was its one write
    assert svc.regions.buffer_ids() == []
    assert svc.store.buffers.buffers(states=None) == []
    # scrubbed and given back: released to its pool (whose reclaimer closes it), or closed
    # here once the pool was gone
    assert seen[0].released or seen[0].closed


# -- eviction -----------------------------------------------------------------------------


def test_quota_eviction_is_lru_by_attach_and_scrubs(svc: Service) -> None:
    who = tenant(svc, quota=8 * MiB)
    bufs = [svc.reserves.reserve(who, req(2 * MiB, evictable=True, pool="fast")) for _ in range(4)]
    for i, b in enumerate(bufs):
        view(svc, b.id)[:] = i + 1
    for i in (2, 0, 3, 1):  # attach order: 2 is now least recently used, then 0
        os.close(svc.handles.open(who, bufs[i].id).fd)
        svc.handles.drop(who, bufs[i].id)
        time.sleep(0.002)
    regions = {b.id: region_of(svc, b.id) for b in bufs}
    new = svc.reserves.reserve(who, req(3 * MiB, pool="fast"))
    left = {b.id for b in svc.buffers.buffers(who)}
    assert left == {bufs[3].id, bufs[1].id, new.id}
    assert svc.regions.region(bufs[2].id) is None
    svc.reclaimer.drain()  # "zero" pools close the memfd in the background, after the scrub
    assert regions[bufs[2].id].closed
    assert regions[bufs[0].id].closed
    assert sample(svc, "maasd_evictions_total") == 2
    assert sample(svc, "maasd_release_total", reason="evict") == 2
    assert svc.tenants.usage(who).used_bytes == 7 * MiB
    # The reserve and, in the same transaction, one "evict" per victim naming it as the
    # cause — and no other "evict" event when the victim's row goes.
    events = svc.store.events.events(100)
    assert any(e.kind == "reserve" and e.buffer_id == new.id for e in events)
    evicts = [(e.buffer_id, e.detail) for e in events if e.kind == "evict"]
    assert sorted(evicts) == sorted([(bufs[2].id, f"for {new.id}"), (bufs[0].id, f"for {new.id}")])


def test_quota_eviction_never_touches_other_tenants_or_non_evictable(svc: Service) -> None:
    a, b = tenant(svc, name="a"), tenant(svc, quota=4 * MiB, name="b")
    theirs = svc.reserves.reserve(a, req(4 * MiB, evictable=True, pool="fast"))
    mine = svc.reserves.reserve(b, req(4 * MiB, pool="fast"))
    with pytest.raises(errors.QuotaExceeded):
        svc.reserves.reserve(b, req(MiB, pool="fast"))
    assert {x.id for x in svc.buffers.buffers(svc.auth.authenticate("admin-key-for-tests"))} == {
        theirs.id,
        mine.id,
    }
    assert sample(svc, "maasd_evictions_total") == 0


def test_capacity_eviction_takes_any_tenants_evictable_buffers_in_that_pool(svc: Service) -> None:
    a, b = tenant(svc, name="a"), tenant(svc, name="b")
    elsewhere = svc.reserves.reserve(a, req(MiB, evictable=True, pool="slow"))
    cache = [svc.reserves.reserve(a, req(8 * MiB, evictable=True, pool="fast")) for _ in range(3)]
    keep = svc.reserves.reserve(b, req(8 * MiB, pool="fast"))
    got = svc.reserves.reserve(b, req(12 * MiB, pool="fast"))  # 12 MiB short: two 8 MiB victims
    alive = {x.id for x in svc.store.buffers.buffers()}
    assert alive == {elsewhere.id, cache[2].id, keep.id, got.id}
    assert pool_named(svc, "fast").used_bytes == 28 * MiB
    assert allocated(svc, "fast") == 28 * MiB
    with pytest.raises(errors.PoolExhausted):
        svc.reserves.reserve(
            b, req(13 * MiB, pool="fast")
        )  # 9 MiB short, 8 evictable: nothing goes
    assert cache[2].id in {x.id for x in svc.store.buffers.buffers()}


# -- checkpoints and shutdown ---------------------------------------------------------------


def test_checkpoint_writes_a_new_file_then_drops_the_old_one(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(MiB, persistence="persistent"))
    spill = spill_dir(svc, buf.pool_id)
    paths = []
    for v in (1, 2):
        view(svc, buf.id)[:] = v
        ck = svc.buffers.checkpoint(who, buf.id)
        assert ck.checksum == hashlib.sha256(bytes([v]) * MiB).hexdigest()
        row = svc.store.buffers.buffer(buf.id)
        assert row is not None
        assert row.checksum == ck.checksum
        paths.append(row.checkpoint_path)
    assert paths[0] != paths[1]
    assert [str(p) for p in spill.iterdir()] == [paths[1]]
    with pytest.raises(errors.StateConflict):
        svc.buffers.checkpoint(who, svc.reserves.reserve(who, req(MiB, pool="fast")).id)


def checkpointing(
    svc: Service, who: Principal, buffer_id: str, n: int
) -> tuple[list[threading.Thread], list[Checkpoint | errors.MaasdError]]:
    """``n`` threads (not started yet) each checkpointing the buffer, and what they got."""
    outcome: list[Checkpoint | errors.MaasdError] = []

    def checkpoint() -> None:
        try:
            outcome.append(svc.buffers.checkpoint(who, buffer_id))
        except errors.MaasdError as e:
            outcome.append(e)

    return [threading.Thread(target=checkpoint) for _ in range(n)], outcome


def test_a_checkpoint_while_another_of_the_buffer_is_written_is_409_at_once(
    svc: Service,
) -> None:
    """Of two checkpoints of one buffer, the second does not wait for the first (each
    would hold a REST thread for nothing): it is refused at once."""
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(MiB, persistence="persistent"))
    view(svc, buf.id)[:] = 5
    threads, outcome = checkpointing(svc, who, buf.id, 2)
    with svc.regions.buffer_lock(buf.id):  # the first checkpoint cannot finish yet
        for t in threads:
            t.start()
        # One of the two claimed the buffer and waits for its lock; the other is refused
        # without waiting for either.
        wait_until(lambda: len(outcome) == 1, message="the second checkpoint refused")
        refused = outcome[0]
        assert isinstance(refused, errors.StateConflict), refused
        assert f"a checkpoint of buffer {buf.id} is in progress" in refused.detail
    for t in threads:
        t.join()
    written = outcome[1]
    assert isinstance(written, Checkpoint), written
    assert written.checksum == hashlib.sha256(bytes([5]) * MiB).hexdigest()
    assert isinstance(svc.buffers.checkpoint(who, buf.id), Checkpoint)  # and again, once it ended


def test_release_during_a_checkpoint_waits_for_it(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(16 * MiB, persistence="persistent"))
    view(svc, buf.id)[:] = 3
    threads, outcome = checkpointing(svc, who, buf.id, 3)
    for t in threads:
        t.start()
    svc.buffers.release(who, buf.id)  # must not unmap under a checkpoint that is reading
    for t in threads:
        t.join()
    assert len(outcome) == 3
    for o in outcome:
        # One of two, by design: each checkpoint either lost the race to the release
        # (409 or 404), or wrote the whole content.
        if isinstance(o, errors.MaasdError):
            assert isinstance(o, (errors.StateConflict, errors.NotFound)), o
        else:
            assert o.checksum == hashlib.sha256(bytes([3]) * 16 * MiB).hexdigest()
    spill = spill_dir(svc, buf.pool_id)
    assert list(spill.iterdir()) == []


def test_close_checkpoints_persistent_and_releases_volatile(tmp_path: Path) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    pers = s.reserves.reserve(who, req(MiB, persistence="persistent"))
    vol = s.reserves.reserve(who, req(MiB, pool="fast"))
    view(s, pers.id)[:] = 77
    s.close()

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        assert [b.id for b in s2.store.buffers.buffers(states=None)] == [pers.id]
        assert np.all(view(s2, pers.id) == 77)
        assert s2.store.buffers.buffer(vol.id) is None
        assert live_pool(s2, pers.pool_id).pool.used == MiB
    finally:
        s2.close()


# -- recover() on a crafted ledger ----------------------------------------------------------


def test_recover_settles_what_a_crash_leaves(tmp_path: Path) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    t = s.tenants.create("crashed", 256 * MiB)
    pools = {p.name: p for p in s.pools.infos()}
    spill = spill_dir(s, pools["pers"].id)
    now = time.time()

    def row(name: str, pool: str, state: BufferState, **kw: Any) -> BufferRow:
        r = BufferRow(
            id=f"{name:0<32}",
            tenant_id=t.id,
            pool_id=pools[pool].id,
            host=s.host,
            size_bytes=MiB,
            numa_node=0,
            persistence=pools[pool].persistence,
            label=name,
            key=None,
            evictable=False,
            state="reserving",
            created_at=now,
            expires_at=now + 600,
            last_used_at=now,
        )
        s.store.reserves.begin_reserve(r)
        if state != "reserving":
            s.store.buffers.set_state(r.id, state)
        for k, v in kw.items():
            if k == "content":
                path = spill / f"{r.id}.1.ckpt"
                path.write_bytes(v)
                s.store.buffers.set_checkpoint(
                    r.id, str(path), kw.get("checksum") or hashlib.sha256(v).hexdigest(), now
                )
        return r

    good = os.urandom(MiB)
    restored = row("good", "pers", "live", content=good)
    # The crash-between-rename-and-commit case: a newer file the ledger never recorded.
    (spill / f"{restored.id}.2.ckpt").write_bytes(os.urandom(MiB))
    lost = [
        row("reserving", "fast", "reserving"),
        row("releasing", "fast", "releasing"),
        row("volatile", "slow", "live"),
        row("unsaved", "pers", "live"),
        row("corrupt", "pers", "live", content=os.urandom(MiB), checksum="0" * 64),
        row("persreleasing", "pers", "releasing", content=os.urandom(MiB)),
        row("short", "pers", "live", content=b"\x01" * 4096),
    ]
    (spill / "orphan.ckpt").write_bytes(b"x")
    (spill / "half-written.ckpt.tmp").write_bytes(b"y")
    s.store.dispose()  # no close(): the process "died" here

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        rows = s2.store.buffers.buffers(states=None)
        assert [r.id for r in rows] == [restored.id]
        assert rows[0].state == "live"
        assert bytes(view(s2, restored.id)) == good
        assert live_pool(s2, pools["pers"].id).pool.used == MiB
        for p in s2.pools.infos():
            assert p.used_bytes == (MiB if p.name == "pers" else 0)
        assert sorted(os.listdir(spill)) == [f"{restored.id}.1.ckpt"]
        assert s2.tenants.info(t.id).used_bytes == MiB
        kinds = [e.kind for e in s2.store.events.events(50)]
        assert kinds.count("recover") == len(lost)
        # Recovery is idempotent: a second pass has nothing to do.
        assert s2.recovery.recover() == {}
    finally:
        s2.close()


# -- batched uses and the reaper's compare-and-set ------------------------------------------


def test_attach_times_are_batched_and_reach_the_ledger_before_a_reserve(svc: Service) -> None:
    who = tenant(svc)
    old = svc.reserves.reserve(who, req(MiB, evictable=True))
    new = svc.reserves.reserve(who, req(MiB, evictable=True))
    before = ledger_row(svc, old.id).last_used_at
    handle = svc.handles.open(who, old.id)  # no ledger write on the attach path
    os.close(handle.fd)
    assert ledger_row(svc, old.id).last_used_at == before
    assert old.id in svc.uses.pending_uses()
    svc.reserves.reserve(who, req(MiB))  # a reserve flushes first: LRU sees the attach
    assert ledger_row(svc, old.id).last_used_at > ledger_row(svc, new.id).last_used_at
    assert svc.uses.pending_uses() == {}


def test_reap_leaves_a_lease_renewed_after_the_query(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(MiB, ttl_s=1))
    expired = svc.store.buffers.expired

    def expired_then_renewed(now: float, host: str) -> list[BufferRow]:
        rows = expired(now, host)
        svc.buffers.renew(who, buf.id, 600)  # the tenant renews in between
        return rows

    monkeypatch.setattr(svc.store.buffers, "expired", expired_then_renewed)
    assert svc.reaper.reap(time.time() + 5) == 0
    assert svc.buffers.buffer(who, buf.id).state == "live"


def test_a_second_release_of_the_same_buffer_is_not_found(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(MiB))
    svc.buffers.release(who, buf.id)
    with pytest.raises(errors.NotFound):
        svc.buffers.release(who, buf.id)


def test_a_revoked_key_is_refused_at_once_even_after_it_was_cached(svc: Service) -> None:
    new = svc.tenants.create("cached", MiB)
    assert svc.auth.authenticate(new.api_key).tenant_id == new.id  # checked: now remembered
    assert svc.auth.authenticate(new.api_key).tenant_id == new.id
    svc.tenants.revoke_key(new.id, new.key_id)
    with pytest.raises(errors.Unauthorized):
        svc.auth.authenticate(new.api_key)
    other = svc.tenants.create("deleted", MiB)
    svc.auth.authenticate(other.api_key)
    svc.tenants.delete(other.id)
    with pytest.raises(errors.Unauthorized):
        svc.auth.authenticate(other.api_key)


def test_a_revocation_racing_a_first_check_is_not_cached(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = svc.tenants.create("racing", MiB)
    read = svc.store.tenants.key_by_digest

    def read_then_revoke(digest: bytes) -> KeyRow | None:
        row = read(digest)  # the check saw the key valid …
        svc.tenants.revoke_key(new.id, new.key_id)  # … and the admin revoked it right after
        return row

    monkeypatch.setattr(svc.store.tenants, "key_by_digest", read_then_revoke)
    svc.auth.authenticate(new.api_key)  # in flight before the revocation: allowed once
    monkeypatch.setattr(svc.store.tenants, "key_by_digest", read)
    with pytest.raises(errors.Unauthorized):
        svc.auth.authenticate(new.api_key)  # but never remembered


def test_a_buffer_reports_its_measured_placement(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(3 * MiB))  # reserve itself checks a sample of pages
    assert buf.placement is None  # … but reports no full count (costly per GiB)
    got = svc.buffers.buffer(who, buf.id)
    assert got.placement == {"0": buf.size_bytes // os.sysconf("SC_PAGE_SIZE")}
    assert [b.placement for b in svc.buffers.buffers(who)] == [None]  # lists stay cheap


def test_reserve_refuses_pages_that_landed_off_node(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maasd.allocator.region import Region

    def elsewhere(self: Region, sample: int | None = None) -> dict[int, int]:
        del sample  # Region.placement's signature; the answer does not depend on it
        return {self.node + 1: 16}

    who = tenant(svc)
    before = pool_named(svc, "slow").used_bytes
    monkeypatch.setattr(Region, "placement", elsewhere)
    with pytest.raises(errors.PlacementError):
        svc.reserves.reserve(who, req(MiB))
    monkeypatch.undo()
    assert pool_named(svc, "slow").used_bytes == before
    assert svc.buffers.buffers(who) == []


def test_attachments_are_counted_per_buffer_and_per_tenant(svc: Service) -> None:
    who, other = tenant(svc, name="a"), tenant(svc, name="b")
    a, b = svc.reserves.reserve(who, req(MiB)), svc.reserves.reserve(who, req(MiB))
    theirs = svc.reserves.reserve(other, req(MiB))
    handles = [
        svc.handles.open(who, a.id),
        svc.handles.open(who, a.id),
        svc.handles.open(who, b.id),
    ]
    handles.append(svc.handles.open(other, theirs.id))
    for h in handles:
        os.close(h.fd)
    assert who.tenant_id is not None
    assert (svc.attachments.attached(a.id), svc.attachments.attached(b.id)) == (2, 1)
    assert svc.attachments.tenant_attached(who.tenant_id) == 3
    assert sample(svc, "maasd_attached_handles", tenant=who.tenant_id) == 3
    svc.handles.drop(who, a.id)
    assert (svc.attachments.attached(a.id), svc.attachments.attached(b.id)) == (1, 1)
    svc.handles.drop(who, a.id)
    svc.handles.drop(who, a.id)  # one more than was attached: nothing goes below zero
    assert (svc.attachments.attached(a.id), svc.attachments.attached(b.id)) == (0, 1)
    assert svc.attachments.tenant_attached(who.tenant_id) == 1
    assert sample(svc, "maasd_attached_handles", tenant=who.tenant_id) == 1
    assert svc.attachments.attached(theirs.id) == 1  # another tenant's are its own
    with pytest.raises(errors.NotFound):
        svc.handles.open(other, a.id)  # and a foreign buffer is never attached
    assert svc.attachments.attached(a.id) == 0


def test_the_reclaimer_runs_with_the_service_and_stops_with_it(tmp_path: Path) -> None:
    s = Service(settings(tmp_path))
    assert not s.reclaimer.running
    s.start(reaper=False)
    assert s.reclaimer.running
    who = tenant(s)
    buf = s.reserves.reserve(who, req(MiB, pool="fast"))  # a "zero" pool: closed in the background
    region = region_of(s, buf.id)
    s.buffers.release(who, buf.id)
    s.reclaimer.drain()
    assert region.closed
    kept = s.reserves.reserve(who, req(MiB, pool="slow"))
    left = region_of(s, kept.id)
    s.close()  # releases the volatile buffer, then drains and stops the reclaimer
    assert not s.reclaimer.running
    assert left.closed


# -- limits: the buffer cap, the region budget, kernel refusals -------------------------------


def test_the_buffer_cap_applies_to_reserves_and_patch_changes_it(svc: Service) -> None:
    who = tenant(svc)
    t = svc.tenants.update(who.tenant_id or "", max_buffers=2)
    assert t.max_buffers == 2
    assert svc.tenants.usage(who).max_buffers == 2
    a = svc.reserves.reserve(who, req(4096, pool="fast"))
    svc.reserves.reserve(who, req(4096, pool="fast", evictable=True))
    svc.reserves.reserve(who, req(4096, pool="fast"))  # evicts the evictable one, LRU
    assert sample(svc, "maasd_evictions_total") == 1
    with pytest.raises(errors.BufferCountExceeded, match="max_buffers is 2"):
        svc.reserves.reserve(who, req(4096, pool="fast"))
    svc.buffers.release(who, a.id)
    svc.reserves.reserve(who, req(4096, pool="fast"))
    both = svc.tenants.update(who.tenant_id or "", quota_bytes=MiB, max_buffers=5)
    assert (both.quota_bytes, both.max_buffers) == (MiB, 5)
    with pytest.raises(errors.InvalidRequest):
        svc.tenants.update(who.tenant_id or "")


def test_the_default_cap_is_the_settings(tmp_path: Path) -> None:
    s = Service(msgspec.structs.replace(settings(tmp_path), max_buffers_per_tenant=1))
    s.start(reaper=False)
    try:
        who = tenant(s)
        assert s.tenants.info(who.tenant_id or "").max_buffers == 1
        s.reserves.reserve(who, req(4096, pool="fast"))
        with pytest.raises(errors.BufferCountExceeded):
            s.reserves.reserve(who, req(4096, pool="fast"))
    finally:
        s.close()


def test_at_the_region_budget_a_reserve_is_a_507_and_the_ledger_is_untouched(
    svc: Service,
) -> None:
    who = tenant(svc)
    svc.budget.budget = svc.budget.held() + 1  # one region more, then the budget is full
    svc.reserves.reserve(who, req(4096, pool="fast"))
    before = svc.store.buffers.buffers(states=None)
    with pytest.raises(errors.ResourceLimit, match="open files"):
        svc.reserves.reserve(who, req(4096, pool="fast"))
    assert svc.store.buffers.buffers(states=None) == before
    assert sample(svc, "maasd_reserve_total", outcome="resource-limit") == 1


def test_a_region_counts_as_its_tenants_until_it_is_held(svc: Service, monkeypatch) -> None:
    """The tenant's share is checked against the regions Regions holds for it plus those
    in flight: a region must be one or the other at every moment, or a concurrent reserve
    of the tenant would see neither and pass its share (a hostile test held share + 1)."""
    who = tenant(svc)
    assert who.tenant_id is not None
    seen: list[tuple[int, int]] = []
    hold = svc.regions.hold

    def counts() -> tuple[int, int]:
        tid: str = who.tenant_id  # type: ignore[assignment]
        return svc.regions.tenant_regions(tid), svc.budget._tenant_in_flight[tid]

    def counting_hold(buffer_id: str, held: Any) -> None:
        seen.append(counts())  # about to be held: in flight
        hold(buffer_id, held)
        seen.append(counts())  # held (and in flight for a moment more: never neither)

    monkeypatch.setattr(svc.regions, "hold", counting_hold)
    svc.reserves.reserve(who, req(4096, pool="fast"))
    svc.reserves.reserve(who, req(4096, pool="fast", key="k", evictable=True))
    assert seen == [(0, 1), (1, 1), (1, 1), (2, 1)]
    assert svc.budget._tenant_in_flight[who.tenant_id] == 0  # counted out once held


def test_a_kernel_out_of_files_on_reserve_is_a_507_naming_the_limit(
    svc: Service, monkeypatch
) -> None:
    from maasd.allocator import _sys

    who = tenant(svc)

    def emfile(name: str, flags: int) -> int:
        raise _sys._fail("memfd_create", f"memfd_create({name!r}, flags={flags:#x})", errno.EMFILE)

    monkeypatch.setattr(_sys, "memfd_create", emfile)
    with pytest.raises(errors.ResourceLimit, match="RLIMIT_NOFILE"):
        svc.reserves.reserve(who, req(4096, pool="fast"))
    assert svc.store.buffers.buffers(states=None) == []
    assert allocated(svc, "fast") == 0


def test_health_checks_say_whether_files_remain(svc: Service, monkeypatch) -> None:
    checks = svc.health_checks()
    assert set(checks) == {"files"}  # a ledger outage is a 507, not a restart
    ok, detail = checks["files"]()
    assert ok
    assert "buffer regions" in detail
    monkeypatch.setattr(limits, "open_files", lambda: svc.budget.limits.open_files)
    ok, detail = checks["files"]()
    assert not ok
    assert detail.startswith("out of open files")


def test_a_buffer_released_while_attached_shows_in_the_metrics(svc: Service) -> None:
    who = tenant(svc)
    buf = svc.reserves.reserve(who, req(MiB, pool="fast"))
    handle = svc.handles.open(who, buf.id)
    try:
        svc.buffers.release(who, buf.id)
        labels = {"tenant": who.tenant_id or "", "kind": "buffer"}
        assert sample(svc, "maasd_released_attached_buffers", **labels) == 1
        assert sample(svc, "maasd_released_attached_bytes", **labels) == MiB
        assert sample(svc, "maasd_released_attached_handles", **labels) == 1
        svc.handles.drop(who, buf.id)
        assert sample(svc, "maasd_released_attached_buffers", **labels) == 0
    finally:
        os.close(handle.fd)
    assert sample(svc, "maasd_buffer_region_budget") == svc.budget.budget


# -- deletes that never stop half-way -------------------------------------------------------


def burst(svc: Service, who: Principal, pool: str, stop: threading.Event) -> list[Any]:
    """Reserve 4 KiB buffers in ``pool`` from 4 threads until ``stop``; the outcomes."""
    out: list[Any] = []

    def run() -> None:
        while not stop.is_set():
            try:
                out.append(svc.reserves.reserve(who, req(4096, pool=pool)))
            except Exception as e:
                out.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for th in threads:
        th.start()
    stop.wait()
    for th in threads:
        th.join(30)
    return out


@pytest.mark.parametrize("trial", range(5))
def test_a_tenant_delete_during_a_reserve_burst_finishes(svc: Service, trial: int) -> None:
    who = tenant(svc, name=f"t{trial}")
    stop = threading.Event()
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(burst(svc, who, "fast", stop)))
    runner.start()
    time.sleep(0.05 + 0.02 * trial)
    svc.tenants.delete(who.tenant_id or "")  # never a half-done StateConflict
    stop.set()
    runner.join(30)
    assert any(not isinstance(r, Exception) for r in results)
    failed = {type(r) for r in results if isinstance(r, Exception)}
    assert failed <= {errors.Unauthorized, errors.StateConflict, errors.NotFound}, failed
    assert svc.store.buffers.buffers(tenant_id=who.tenant_id, states=None) == []
    assert svc.store.tenants.tenant(who.tenant_id or "") is None
    svc.reclaimer.drain()
    assert svc.regions.buffer_ids() == []
    assert allocated(svc, "fast") == 0


def test_a_pool_drain_during_a_reserve_burst_finishes(svc: Service) -> None:
    who = tenant(svc)
    extra = svc.pools.create(PoolSpec(name="tmp", numa_node=0, capacity_bytes=8 * MiB))
    stop = threading.Event()
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(burst(svc, who, "tmp", stop)))
    runner.start()
    time.sleep(0.1)
    svc.pools.delete("tmp", drain=True)
    stop.set()
    runner.join(30)
    failed = {type(r) for r in results if isinstance(r, Exception)}
    assert failed <= {errors.StateConflict, errors.NotFound, errors.PoolExhausted}, failed
    assert svc.store.buffers.buffers(pool_id=extra.id, states=None) == []
    assert svc.live.get(extra.id) is None
    assert svc.regions.buffer_ids() == []
    with pytest.raises(errors.NotFound):
        svc.reserves.reserve(who, req(4096, pool="tmp"))


def test_a_pool_being_drained_takes_no_reserve_and_is_no_candidate(svc: Service) -> None:
    who = tenant(svc)
    fast = pool_named(svc, "fast")
    at = svc.store.pools.mark_pool_deleting(fast.id)
    live = live_pool(svc, fast.id)
    live.row = msgspec.structs.replace(live.row, deleting_at=at)
    with pytest.raises(errors.StateConflict, match="being deleted"):
        svc.reserves.reserve(who, req(4096, pool="fast"))
    auto = svc.reserves.reserve(who, req(4096, latency_us=100))
    assert auto.pool_id != fast.id


def test_a_delete_cut_short_by_a_crash_finishes_at_the_next_start(tmp_path: Path) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    s.reserves.reserve(who, req(MiB, pool="fast"))
    s.reserves.reserve(who, req(MiB, pool="slow"))
    extra = s.pools.create(PoolSpec(name="tmp", numa_node=0, capacity_bytes=8 * MiB))
    other = tenant(s, name="other")
    s.reserves.reserve(other, req(MiB, pool="tmp"))
    # what a SIGKILL right after the marks leaves: both marked, nothing released yet
    s.store.tenants.mark_tenant_deleting(who.tenant_id or "")
    s.store.pools.mark_pool_deleting(extra.id)
    s.store.dispose()

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        assert s2.store.tenants.tenant(who.tenant_id or "") is None
        assert s2.store.tenants.deleting_tenants() == []
        assert "tmp" not in {p.name for p in s2.pools.infos()}
        assert s2.store.buffers.buffers(states=None) == []
        assert {e.kind for e in s2.tenants.events(50)} >= {"tenant_delete", "pool_delete"}
    finally:
        s2.close()


# -- shutdown ---------------------------------------------------------------------------------


def test_close_releases_volatile_buffers_in_one_statement(tmp_path: Path, monkeypatch) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    bufs = [s.reserves.reserve(who, req(4096, pool="fast")) for _ in range(50)]
    regions = [region_of(s, b.id) for b in bufs]
    for r in regions[:3]:
        np.frombuffer(r.view(), dtype=np.uint8)[:] = 9
    handles = [s.handles.open(who, b.id) for b in bufs[:3]]
    singles: list[str] = []
    monkeypatch.setattr(s.store.buffers, "mark_releasing", lambda *_a, **_k: singles.append("mark"))
    monkeypatch.setattr(
        s.store.reserves, "finish_release", lambda *_a, **_k: singles.append("finish")
    )
    try:
        s.close()
        assert singles == []  # no round trip per buffer
        assert all(r.closed for r in regions)
        for h in handles:  # what a worker still holding the fd reads: zeros
            assert os.pread(h.fd, 4096, 0) == bytes(4096)
    finally:
        for h in handles:
            os.close(h.fd)
    s2 = Service(settings(tmp_path))
    try:
        s2.store.upgrade()
        assert s2.store.buffers.buffers(states=None) == []
        assert len([e for e in s2.store.events.events(1000) if e.kind == "shutdown"]) == 50
    finally:
        s2.store.dispose()


def test_close_checkpoints_persistent_buffers_together(tmp_path: Path, monkeypatch) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    bufs = [s.reserves.reserve(who, req(4096, persistence="persistent")) for _ in range(20)]
    for i, b in enumerate(bufs):
        view(s, b.id)[:] = i + 1
    first = s.buffers.checkpoint(who, bufs[0].id)  # an older checkpoint, replaced at close
    old_path = ledger_row(s, bufs[0].id).checkpoint_path
    view(s, bufs[0].id)[:] = 99

    def one_by_one(*_a: object) -> None:
        raise AssertionError("a ledger round trip per buffer")

    monkeypatch.setattr(s.store.buffers, "set_checkpoint", one_by_one)
    s.close()
    assert old_path is not None
    assert not os.path.exists(old_path)

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        assert {b.id for b in s2.store.buffers.buffers(states=None)} == {b.id for b in bufs}
        assert np.all(view(s2, bufs[0].id) == 99)
        assert ledger_row(s2, bufs[0].id).checksum != first.checksum
        for i, b in enumerate(bufs[1:], start=2):
            assert np.all(view(s2, b.id) == i)
    finally:
        s2.close()


# -- the admin key from a file ----------------------------------------------------------------


def key_settings(tmp_path: Path, **kw: Any) -> Settings:
    return msgspec.structs.replace(settings(tmp_path), admin_key=None, **kw)


def test_the_admin_key_from_a_file_or_a_credential(tmp_path: Path, monkeypatch) -> None:
    key = tmp_path / "admin-key"
    key.write_text("from-a-file-0123456789\n")
    key.chmod(0o600)
    for source, s in (
        ("file", Service(key_settings(tmp_path, admin_key_file=str(key)))),
        ("credential", None),
    ):
        if s is None:
            monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
            s = Service(key_settings(tmp_path))
        s.start(reaper=False)
        try:
            assert s.auth.authenticate("from-a-file-0123456789").is_admin, source
            assert s.auth.admin_key_generated is None
            assert not (tmp_path / "data" / "admin.key").exists()
        finally:
            s.close()


@pytest.mark.parametrize(
    ("text", "mode", "says"),
    [
        ("k" * 30, 0o640, "readable by others"),
        ("k" * 30, 0o604, "readable by others"),
        ("  \n", 0o600, "is empty"),
        (None, 0o600, "No such file"),
    ],
)
def test_an_unusable_admin_key_file_stops_the_start(
    tmp_path: Path, text: str | None, mode: int, says: str
) -> None:
    key = tmp_path / "admin-key"
    if text is not None:
        key.write_text(text)
        key.chmod(mode)
    s = Service(key_settings(tmp_path, admin_key_file=str(key)))
    try:
        with pytest.raises(errors.ConfigError, match=says):
            s.start(reaper=False)
    finally:
        s.reclaimer.stop()
        s.store.dispose()


@pytest.mark.parametrize("source", ["setting", "file"])
def test_a_metrics_key_that_is_the_admin_key_stops_the_start(tmp_path: Path, source: str) -> None:
    """The API takes the metrics key for what it is (good for GET /metrics only) before it
    looks for an admin: the same key for both refused the admin everywhere else, silently."""
    same = "the-same-key-0123456789abcdef"
    if source == "setting":
        conf = msgspec.structs.replace(settings(tmp_path), admin_key=same, metrics_key=same)
    else:
        key = tmp_path / "admin-key"
        key.write_text(same + "\n")
        key.chmod(0o600)
        conf = key_settings(tmp_path, admin_key_file=str(key), metrics_key=same)
    s = Service(conf)
    try:
        with pytest.raises(errors.ConfigError, match="is the admin key"):
            s.start(reaper=False)
    finally:
        s.reclaimer.stop()
        s.store.dispose()


def test_entry_puts_count_against_the_buffer_cap_and_the_region_budget(svc: Service) -> None:
    who = tenant(svc)
    svc.tenants.update(who.tenant_id or "", max_buffers=2)
    a = svc.entries.put(who, "k1", 4096, pool="fast")
    os.close(a.fd)
    svc.reserves.reserve(who, req(4096, pool="fast"))
    with pytest.raises(errors.BufferCountExceeded):  # staged entries count too
        svc.entries.put(who, "k2", 4096, pool="fast")
    svc.entries.commit(who, a.buffer_id, owned=True)
    b = svc.entries.put(who, "k3", 4096, pool="fast")  # the committed entry k1 is evicted
    os.close(b.fd)
    assert {r.key for r in svc.store.buffers.buffers(tenant_id=who.tenant_id, states=None)} == {
        None,
        "k3",
    }
    svc.tenants.update(who.tenant_id or "", max_buffers=10)
    svc.budget.budget = svc.budget.held()  # the daemon's own budget is full
    with pytest.raises(errors.ResourceLimit):
        svc.entries.put(who, "k4", 4096, pool="fast")


def test_a_generated_admin_key_file_is_there_whole_or_not_at_all(
    tmp_path: Path, monkeypatch
) -> None:
    """A crash (here: the fsync failing) while the key is written leaves no admin.key —
    never an empty one, which every later start would refuse — and no temporary file
    that outlives the next try; the next start generates the key."""
    from maasd.core.auth import write_key_file

    path = tmp_path / "admin.key"
    real_fsync = os.fsync

    def crash(_fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="Input/output error"):
        write_key_file(path, "first-key")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    (tmp_path / "admin.key.tmp").write_text("a crash's leftover")
    assert write_key_file(path, "second-key") == "second-key"
    assert path.read_text() == "second-key\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.key"]
    # Never over a key file that exists: the one there is kept, and returned.
    assert write_key_file(path, "third-key") == "second-key"
    assert path.read_text() == "second-key\n"
