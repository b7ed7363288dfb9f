"""Entries in-process: the service's put / commit / abort / lookup over a real SQLite ledger
and real memfds, no daemon, no socket (``tests/integration/test_entries.py`` has those).

What is checked here: accounting through a commit (the pool and the quota count an
entry once, also in a full pool), a commit that runs out of memory leaving nothing
behind, the seals of a committed entry, the in-memory lookup index and lease, and the
released-entry bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from hits import hit
from maasd import errors
from maasd.allocator import MemoryPool
from maasd.core import Service
from maasd.models import PoolSpec, Principal
from maasd.settings import Settings
from waiting import wait_until

MiB = 1 << 20
F_SEAL_FUTURE_WRITE = 0x10


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(
        Settings(
            data_dir=str(tmp_path / "data"),
            admin_key="admin-key-for-tests",
            pools=[PoolSpec(name="small", numa_node=0, capacity_bytes=8 * MiB)],
            node_name="unit-host",
        )
    )
    s.start(reaper=False)
    yield s
    s.close()


def tenant(svc: Service, quota: int = 64 * MiB, name: str = "t") -> Principal:
    return svc.auth.authenticate(svc.tenants.create(name, quota).api_key)


def pool(svc: Service) -> MemoryPool:
    (live,) = svc.live.all()
    return live.pool


def put_committed(svc: Service, who: Principal, key: str, size: int) -> str:
    h = svc.entries.put(who, key, size)
    os.pwrite(h.fd, b"entry:" + key.encode(), 0)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    return h.buffer_id


def test_a_full_pool_commits_and_counts_the_entry_once(svc: Service) -> None:
    who = tenant(svc)
    bid = put_committed(svc, who, "whole-pool", 8 * MiB)  # the pool holds nothing else
    assert pool(svc).used == 8 * MiB
    assert svc.tenants.usage(who).used_bytes == 8 * MiB
    found = hit(svc.tiers.find(who, ["whole-pool"]))
    try:
        assert found.buffer_id == bid
        assert os.pread(found.fd, 16, 0) == b"entry:whole-pool"
        assert fcntl.fcntl(found.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert fcntl.fcntl(found.fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
    finally:
        os.close(found.fd)
        svc.handles.drop(who, bid)
    region = svc.regions.region(bid)
    assert region is not None
    assert region.frozen
    svc.buffers.release(who, bid)
    assert pool(svc).used == 0
    assert svc.tenants.usage(who).used_bytes == 0


def test_the_staging_region_is_scrubbed_and_freed_after_the_commit(svc: Service) -> None:
    who = tenant(svc)
    h = svc.entries.put(who, "scrubbed-later", MiB)
    staging = svc.regions.region(h.buffer_id)
    assert staging is not None
    try:
        os.pwrite(h.fd, b"\xa5" * MiB, 0)
        svc.entries.commit(who, h.buffer_id, owned=True)
        assert pool(svc).used == MiB  # counted once, as the committed entry
        svc.reclaimer.drain()  # its punch runs after the commit's answer
        assert staging.closed
        assert os.pread(h.fd, MiB, 0) == bytes(MiB)  # what its writer kept reads zeros
        assert os.fstat(h.fd).st_blocks == 0
    finally:
        os.close(h.fd)
    found = hit(svc.tiers.find(who, ["scrubbed-later"]))
    try:
        assert os.pread(found.fd, MiB, 0) == b"\xa5" * MiB
    finally:
        os.close(found.fd)
        svc.handles.drop(who, found.buffer_id)


def test_a_commit_without_memory_is_507_and_leaves_nothing(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    who = tenant(svc)
    h = svc.entries.put(who, "no-room", MiB)
    os.close(h.fd)
    reserve = MemoryPool.reserve

    def no_memory(self: MemoryPool, size: int, *args: object, **kw: object) -> object:
        if kw.get("accounted") is False:  # the commit's copy
            raise errors.BackingError("madvise(23): [ENOMEM] Cannot allocate memory", errno.ENOMEM)
        return reserve(self, size, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(MemoryPool, "reserve", no_memory)
    with pytest.raises(errors.PoolExhausted, match="no memory to commit"):
        svc.entries.commit(who, h.buffer_id, owned=True)
    assert svc.regions.region(h.buffer_id) is None
    assert svc.tenants.usage(who).used_bytes == 0
    assert pool(svc).used == 0
    assert svc.tiers.find(who, ["no-room"]) is None
    assert svc.metrics.registry.get_sample_value(
        "maasd_entry_aborts_total", {"tenant": str(who.tenant_id), "reason": "commit_failed"}
    )


def test_commit_and_abort_rules(svc: Service) -> None:
    who, other = tenant(svc, name="a"), tenant(svc, name="b")
    h = svc.entries.put(who, "k", 4096)
    os.close(h.fd)
    assert svc.tiers.find(who, ["k"]) is None  # staged: invisible
    with pytest.raises(errors.NotFound):
        svc.handles.open(who, h.buffer_id)  # not even attachable
    with pytest.raises(errors.NotFound):
        svc.entries.commit(other, h.buffer_id, owned=False)  # foreign
    with pytest.raises(errors.StateConflict):
        svc.entries.commit(who, h.buffer_id, owned=False)  # another connection's
    with pytest.raises(errors.DuplicateKey):
        svc.entries.put(who, "k", 4096)
    svc.entries.commit(who, h.buffer_id, owned=True)
    with pytest.raises(errors.StateConflict):
        svc.entries.commit(who, h.buffer_id, owned=True)
    with pytest.raises(errors.StateConflict):
        svc.entries.abort(who, h.buffer_id, owned=True)  # committed: DELETE releases it
    svc.entries.abandon(who, h.buffer_id)  # a connection closing: leaves a committed one alone
    assert svc.regions.region(h.buffer_id) is not None
    g = svc.entries.put(who, "g", 4096)
    os.close(g.fd)
    svc.entries.abort(who, g.buffer_id, owned=True)
    svc.entries.abort(who, g.buffer_id, owned=True)  # gone already: nothing left to do
    assert svc.tenants.usage(who).used_bytes == 4096


def test_lookup_takes_the_longest_key_and_extends_the_lease_in_memory(svc: Service) -> None:
    who = tenant(svc)
    short = put_committed(svc, who, "a", 4096)
    long_ = put_committed(svc, who, "ab", 4096)
    before = svc.buffers.buffer(who, long_).expires_at
    time.sleep(0.01)
    found = hit(svc.tiers.find(who, ["a", "ab", "abc"]))
    os.close(found.fd)
    assert (found.key, found.buffer_id) == ("ab", long_)
    assert long_ in svc.uses.pending_uses()
    assert svc.uses.pending_lease(long_) is not None
    assert svc.buffers.buffer(who, long_).expires_at == before  # nothing written yet
    svc.uses.flush()
    assert svc.buffers.buffer(who, long_).expires_at > before
    svc.buffers.release(who, long_)
    found = hit(svc.tiers.find(who, ["a", "ab"]))
    os.close(found.fd)
    assert found.buffer_id == short
    assert svc.attachments.attached(short) == 1


def test_the_reaper_spares_an_entry_hit_after_its_lease_ended_in_the_ledger(
    svc: Service,
) -> None:
    who = tenant(svc)
    h = svc.entries.put(who, "hot", 4096, None, 1)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    later = time.time() + 5  # the ledger's lease (1 s) has ended by then
    found = hit(svc.tiers.find(who, ["hot"]))
    os.close(found.fd)
    svc.uses.touch(h.buffer_id, later, later + 1)  # a hit "at" that time
    assert svc.reaper.reap(now=later) == 0  # flushed first: the lease moved past `later`
    assert svc.regions.region(h.buffer_id) is not None
    assert svc.reaper.reap(now=later + 10) == 1


def test_a_released_entry_held_open_counts_until_its_last_description_goes(svc: Service) -> None:
    who = tenant(svc)
    size = 64 * 1024
    bid = put_committed(svc, who, "r", size)
    taken = pool(svc).used
    found = hit(svc.tiers.find(who, ["r"]))
    attach = svc.handles.open(who, bid)  # a dup of the same read-only description
    assert svc.holders.held_bytes() == 0
    svc.buffers.release(who, bid)
    assert os.pread(found.fd, 8, 0) == bytes(8)  # scrubbed under the reader
    assert svc.holders.held_bytes() == size
    # Its row stays releasing: counted in the quota and the pool until it is free.
    row = svc.store.buffers.buffer(bid)
    assert row is not None
    assert row.state == "releasing"
    assert svc.tenants.usage(who).used_bytes == size
    assert pool(svc).used == taken
    svc.handles.drop(who, bid)
    svc.handles.drop(who, bid)  # detaching changes nothing: the kernel says who holds it
    os.close(found.fd)
    assert svc.holders.held_bytes() == size  # one fd of it left
    assert svc.store.buffers.buffer(bid) is not None
    os.close(attach.fd)
    wait_until(
        lambda: svc.store.buffers.buffer(bid) is None, message="the row ends with its last fd"
    )
    assert svc.holders.held_bytes() == 0
    assert svc.tenants.usage(who).used_bytes == 0
    assert pool(svc).used == taken - size
    assert [(e.kind, e.buffer_id) for e in svc.tenants.events(limit=1)] == [("release", bid)]
    assert svc.regions.entry_stats() == {}


def test_a_released_entry_no_one_holds_ends_at_once(svc: Service) -> None:
    who = tenant(svc)
    bid = put_committed(svc, who, "r", 64 * 1024)
    found = hit(svc.tiers.find(who, ["r"]))
    os.close(found.fd)
    svc.buffers.release(who, bid)
    assert svc.store.buffers.buffer(bid) is None
    assert svc.tenants.usage(who).used_bytes == 0
    assert svc.holders.held_bytes() == 0


@pytest.mark.parametrize("by", ["admin_delete", "tenant_delete", "fence"])
def test_a_put_whose_row_is_released_midway_leaves_no_memory_behind(
    svc: Service, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    """A release between the put's admission and the hold of its region finds no region to
    scrub; the put learns it from the runtime (no read of the row) and drops the region."""
    who = tenant(svc)
    admin = svc.auth.authenticate("admin-key-for-tests")
    reserve = MemoryPool.reserve

    def released_meanwhile(self: MemoryPool, size: int, *args: object, **kw: object) -> object:
        region = reserve(self, size, *args, **kw)  # type: ignore[arg-type]
        (row,) = svc.store.buffers.buffers(tenant_id=who.tenant_id, states=None)
        if by == "admin_delete":
            svc.buffers.release(admin, row.id)
        elif by == "tenant_delete":  # what a tenant delete (or the reaper) does per buffer
            svc.buffers._releaser.release_row(row, reason="tenant_delete")
        else:  # this host forgotten while cut off: its rows gone, then its fence
            svc.store.reserves.finish_release(row.id, kind="tenant_delete")
            svc.hosts.fence()
        assert svc.store.buffers.buffer(row.id) is None
        return region

    monkeypatch.setattr(MemoryPool, "reserve", released_meanwhile)
    with pytest.raises(errors.NotFound, match="released while it was put"):
        svc.entries.put(who, "gone", MiB)
    assert svc.regions.buffer_ids() == []
    assert len(svc.regions.puts) == 0
    if by != "fence":  # (a fence drops the pools too)
        assert pool(svc).used == 0
        assert svc.tenants.usage(who).used_bytes == 0


def test_a_put_reads_nothing_after_its_admission(svc: Service) -> None:
    """What the put's check of its row was (a read, ~0.5 ms) is a note in memory now."""
    who = tenant(svc)
    seen: list[str] = []
    store: Any = svc.store
    engines = {id(e): e for e in (store.db.write, store.db.single, store.db.read)}.values()

    def sql(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement.split(None, 1)[0].upper())

    for engine in engines:
        event.listen(engine, "before_cursor_execute", sql)
    handle = svc.entries.put(who, "k", MiB)
    os.close(handle.fd)
    last_write = max(i for i, word in enumerate(seen) if word in ("INSERT", "UPDATE", "DELETE"))
    assert "SELECT" not in seen[last_write + 1 :]
    assert svc.store.buffers.buffer(handle.buffer_id).state == "staged"  # type: ignore[union-attr]
    assert len(svc.regions.puts) == 0


def test_a_hit_on_an_entry_the_caller_holds_is_not_counted_again(svc: Service) -> None:
    """A worker's mapping-cache hit: the connection holds the entry already, so the hit is
    answered (a new fd, a use, the lease) without a second attachment to give back."""
    who = tenant(svc)
    bid = put_committed(svc, who, "held", 4096)
    first = hit(svc.tiers.find(who, ["held"]))
    assert svc.attachments.attached(bid) == 1
    again = hit(svc.tiers.find(who, ["held"], {bid: 1}))
    assert again.buffer_id == bid
    assert svc.attachments.attached(bid) == 1  # still the first one only
    other = hit(svc.tiers.find(who, ["held"], {"another-buffer": 1}))
    assert svc.attachments.attached(bid) == 2  # a connection that does not hold it: counted
    for found in (first, again, other):
        os.close(found.fd)
    svc.handles.drop(who, bid)
    svc.handles.drop(who, bid)
    assert svc.attachments.attached(bid) == 0


def test_a_commit_answering_a_writer_hands_its_staging_region_on_only_after_the_answer(
    svc: Service,
) -> None:
    """The broker serves a commit inside ``answering``: the entry is published (the ledger
    says live, a lookup finds the sealed copy) before anything deferred runs; the staging
    region goes to the reclaimer — and its bytes to zero — only once the deferred work
    runs, after the reply."""
    from maasd.core.answered import answering

    who = tenant(svc)
    h = svc.entries.put(who, "deferred-retire", MiB)
    staging = svc.regions.region(h.buffer_id)
    assert staging is not None
    hooked: list[str] = []
    svc.entries.on_commit(lambda _t, key, _b, _s: hooked.append(key))
    try:
        os.pwrite(h.fd, b"\x5a" * MiB, 0)
        with answering() as later:
            svc.entries.commit(who, h.buffer_id, owned=True)
            row = svc.store.buffers.buffer(h.buffer_id)
            assert row is not None
            assert row.state == "live"  # published before
            found = hit(svc.tiers.find(who, ["deferred-retire"]))
            os.close(found.fd)
            svc.handles.drop(who, found.buffer_id)
            assert not staging.released  # not handed on yet
            assert not staging.closed
            assert hooked == []  # nor the write-behind told
            assert os.pread(h.fd, 4, 0) == b"\x5a" * 4
            later.run()
        assert staging.released
        assert hooked == ["deferred-retire"]
        svc.reclaimer.drain()
        assert staging.closed
        assert os.pread(h.fd, MiB, 0) == bytes(MiB)  # what its writer kept reads zeros
    finally:
        os.close(h.fd)
    assert pool(svc).used == MiB  # the committed entry, counted once
