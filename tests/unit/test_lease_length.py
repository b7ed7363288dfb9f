"""A lease's length (what a lookup hit extends it by, what a worker renews it to) and the
order of a renew and the hits around it, in-process: a real SQLite ledger in ``tmp_path``,
real memfds, no reaper thread.

* A restart takes the length from the row (``ttl_s``, as the tenant last gave it), not from
  ``expires_at − created_at``, which a renew or a hit had made longer (a row from before
  migration 0008 has no ``ttl_s``: then, and only then, that formula).
* A hit's extension taken to be written (a flush, a reserve's admission) before a renew to
  a shorter lease does not undo the renew; a hit after the renew extends it by the new length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from hits import hit
from maasd.core import Service
from maasd.models import PoolSpec, Principal, ReserveSpec, rfc3339
from maasd.settings import Settings
from maasd.store import Extension, schema

MiB = 1 << 20


def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=str(tmp_path / "data"),
        admin_key="admin-key-for-tests",
        pools=[
            PoolSpec(
                name="pers",
                numa_node=0,
                capacity_bytes=16 * MiB,
                persistence="persistent",
                scrub="punch",
            )
        ],
        node_name="unit-host",
    )


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    yield s
    s.close()


def tenant(svc: Service, name: str = "t") -> Principal:
    return svc.auth.authenticate(svc.tenants.create(name, 64 * MiB).api_key)


def put_committed(svc: Service, who: Principal, key: str, ttl_s: int) -> str:
    h = svc.entries.put(who, key, 4096, "pers", ttl_s)
    os.pwrite(h.fd, key.encode(), 0)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    return h.buffer_id


def renewed_then_hit_later(svc: Service, who: Principal, buffer_id: str, later: float) -> None:
    """Renew the buffer to 30 s, then a hit ``later`` seconds on extends it by that (as a
    hit does, batched): its lease ends 30 s after the hit, ``later`` + 30 s after now."""
    svc.buffers.renew(who, buffer_id, 30)
    at = time.time() + later
    svc.uses.touch(buffer_id, at, at + 30)
    svc.uses.flush()


def test_a_restart_keeps_the_lease_length_the_tenant_last_gave(tmp_path: Path) -> None:
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    entry = put_committed(s, who, "k", 600)
    buf = s.reserves.reserve(who, ReserveSpec(size_bytes=MiB, pool="pers", ttl_s=600)).id
    for b in (entry, buf):
        renewed_then_hit_later(s, who, b, 100)
        row = s.store.buffers.buffer(b)
        assert row is not None
        assert row.ttl_s == 30
        assert row.expires_at - row.created_at > 120  # what the length was taken as
    s.close()  # checkpoints both: a restart restores them

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        for b in (entry, buf):
            held = s2.regions.held(b)
            assert held is not None
            assert held.ttl_s == 30
        handle = s2.handles.open(who, buf)  # what a Worker renews the buffer to
        os.close(handle.fd)
        assert handle.ttl_s == 30
        before = time.time()
        found = hit(s2.tiers.find(who, ["k"]))
        os.close(found.fd)
        extended = s2.uses.pending_lease(entry)
        assert extended is not None
        assert before + 30 <= extended <= time.time() + 30  # by 30 s, not by 130
    finally:
        s2.close()


def test_a_row_from_before_the_lease_length_was_kept_takes_its_lease_as_reserved(
    tmp_path: Path,
) -> None:
    """No ``ttl_s`` (a row of a ledger older than migration 0008): the length is what it was
    reserved with as far as the row tells, ``expires_at − created_at``."""
    s = Service(settings(tmp_path))
    s.start(reaper=False)
    who = tenant(s)
    entry = put_committed(s, who, "k", 600)
    renewed_then_hit_later(s, who, entry, 100)
    B = schema.buffers
    with s.store.engine.begin() as conn:
        conn.execute(sa.update(B).where(B.c.id == entry).values(ttl_s=None, lease_set_at=None))
    row = s.store.buffers.buffer(entry)
    assert row is not None
    assert row.ttl_s is None
    s.close()

    s2 = Service(settings(tmp_path))
    s2.start(reaper=False)
    try:
        held = s2.regions.held(entry)
        assert held is not None
        assert held.ttl_s == round(row.expires_at - row.created_at)
        assert held.ttl_s == row.lease_s
    finally:
        s2.close()


def test_a_hit_taken_before_a_shorter_renew_does_not_undo_it(svc: Service) -> None:
    """The race: a flush (or a reserve's admission) takes the batch with a hit's extension
    by the old length, a renew to a shorter lease lands, then the taken batch is written.
    The renew holds; a hit after it extends the lease by the renewed length."""
    who = tenant(svc)
    entry = put_committed(svc, who, "k", 600)
    found = hit(svc.tiers.find(who, ["k"]))  # extends the lease by 600 s, in the batch
    os.close(found.fd)
    svc.handles.drop(who, entry)
    uses, leases = svc.uses.take()  # a flush has taken the batch ...
    assert entry in leases
    svc.buffers.renew(who, entry, 30)  # ... the renew lands ...
    svc.store.buffers.touch_many(uses, leases)  # ... and the flush writes what it took
    row = svc.store.buffers.buffer(entry)
    assert row is not None
    assert row.expires_at < time.time() + 31  # the renewed lease, not 600 s
    assert row.ttl_s == 30
    # written back unwritten (a failed flush), it is refused all the same
    svc.uses.untake(uses, leases)
    svc.uses.flush()
    again = svc.store.buffers.buffer(entry)
    assert again is not None
    assert again.expires_at == row.expires_at
    # a hit after the renew extends the lease, by the renewed length
    time.sleep(0.01)
    found = hit(svc.tiers.find(who, ["k"]))
    os.close(found.fd)
    svc.handles.drop(who, entry)
    svc.uses.flush()
    after = svc.store.buffers.buffer(entry)
    assert after is not None
    assert row.expires_at < after.expires_at <= time.time() + 30


def test_a_reserve_that_took_the_batch_before_a_shorter_renew_does_not_undo_it(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race through a reserve's admission, which takes the batch and writes it in
    its own transaction: the renew that landed in between holds."""
    who = tenant(svc)
    entry = put_committed(svc, who, "k", 600)
    found = hit(svc.tiers.find(who, ["k"]))
    os.close(found.fd)
    svc.handles.drop(who, entry)
    take = svc.uses.take

    def take_then_renew() -> tuple[dict[str, float], dict[str, Extension]]:
        taken = take()
        assert entry in taken[1]
        svc.buffers.renew(who, entry, 30)  # lands after the reserve took the batch
        return taken

    monkeypatch.setattr(svc.uses, "take", take_then_renew)
    svc.reserves.reserve(who, ReserveSpec(size_bytes=4096, pool="pers"))
    row = svc.store.buffers.buffer(entry)
    assert row is not None
    assert row.expires_at < time.time() + 31


def test_a_batch_put_back_keeps_the_extension_of_the_later_hit(svc: Service) -> None:
    """A batch taken and not written (the ledger down, a reserve refused) is put back: of
    an extension taken before a renew to a shorter lease and one of a hit after it, the
    later hit's is kept — the earlier one's longer end is one the ledger refuses."""
    who = tenant(svc)
    entry = put_committed(svc, who, "k", 600)
    found = hit(svc.tiers.find(who, ["k"]))
    os.close(found.fd)
    svc.handles.drop(who, entry)
    uses, leases = svc.uses.take()  # taken, and its write will fail
    renewed = svc.buffers.renew(who, entry, 30)
    time.sleep(0.01)
    found = hit(svc.tiers.find(who, ["k"]))  # by 30 s from now
    os.close(found.fd)
    svc.handles.drop(who, entry)
    svc.uses.untake(uses, leases)
    pending = svc.uses.pending_lease(entry)
    assert pending is not None
    assert pending <= time.time() + 30
    svc.uses.flush()
    row = svc.store.buffers.buffer(entry)
    assert row is not None
    assert row.expires_at == pending  # the later hit's extension, written
    assert renewed.expires_at < rfc3339(row.expires_at)


def test_a_hit_as_a_renew_drops_the_batched_extension_extends_by_the_new_length(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renew sets the new length where hits read it before it drops the extension the
    batch holds: a hit landing right after the drop extends by the renewed length (had it
    read the old one, its extension, a hit after the renew, would be written)."""
    who = tenant(svc)
    entry = put_committed(svc, who, "k", 600)
    forget = svc.uses.forget_lease

    def forget_then_hit(buffer_id: str) -> None:
        forget(buffer_id)
        found = hit(svc.tiers.find(who, ["k"]))
        os.close(found.fd)
        svc.handles.drop(who, entry)

    monkeypatch.setattr(svc.uses, "forget_lease", forget_then_hit)
    svc.buffers.renew(who, entry, 30)
    svc.uses.flush()
    row = svc.store.buffers.buffer(entry)
    assert row is not None
    assert row.expires_at <= time.time() + 30
