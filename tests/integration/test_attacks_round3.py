"""A hostile tenant against memory held after release, the eviction that waits for it,
and tenant or pool deletes (SPEC §2, invariants 1 and 9).

Each test is a real daemon and real tenants on its socket; the attacker holds the memory
of its own entries in the ways :mod:`holder_attack` knows (a kept fd, detached so that no
connection is told anything when the entry goes).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path

import pytest
import test_ledger_outage

from conftest import Daemon
from hardening import after_attack, ledger_ids, tenant_usage
from maasd.protocol import Commit, Detach, Found, Lookup, Ok, Put, Reserved
from pgdb import PG_URL
from rawentries import connect, demote_one, pattern, probe, tier_pool
from sockpeer import Raw, miss
from waiting import wait_until

MiB = 1 << 20
#: A daemon on PostgreSQL through a proxy a test cuts (the fixture of test_ledger_outage).
outage = test_ledger_outage.outage


def _pool(d: Daemon, name: str) -> dict[str, object]:
    r = d.admin.get(f"/v1/pools/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _put_commit(w: Raw, key: str, size: int, pool: str) -> str:
    reply, fds = w.call(Put(key=key, size_bytes=size, pool=pool))
    assert isinstance(reply, Reserved), reply
    os.pwrite(fds[0], b"\x42" * 4096, 0)
    os.close(fds[0])
    assert isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
    return reply.buffer_id


def _hold_detached(w: Raw, key: str) -> int:
    """A read-only fd of the entry, kept after a detach: no connection holds it."""
    found, (fd,) = w.call(Lookup(keys=[key]))
    assert isinstance(found, Found), found
    assert isinstance(w.call(Detach(buffer_id=found.buffer_id))[0], Ok)
    return fd


class _Kept:
    """What an attack keeps open, its entries' fds and its connections: all closed when
    the test is done with them, whatever happened."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.peers: list[Raw] = []

    def tenant(self, d: Daemon, name: str, quota: int) -> tuple[str, str, Raw]:
        """A new tenant and a connection of its own: (its id, its key, the connection)."""
        tenant_id, key = d.tenant(name, quota)
        peer = connect(d, key)
        self.peers.append(peer)
        return tenant_id, key, peer

    def put_and_hold(self, w: Raw, n: int, size: int, pool: str, prefix: str = "kept") -> None:
        """``n`` entries of ``size`` put in ``pool`` through ``w``, each one's fd kept after
        a detach (:func:`_hold_detached`)."""
        for i in range(n):
            _put_commit(w, f"{prefix}-{i}", size, pool)
            self.fds.append(_hold_detached(w, f"{prefix}-{i}"))

    def __enter__(self) -> _Kept:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)
        for peer in self.peers:
            peer.close()


def _put_must_fit(b: Raw, pool: str, size: int, why: str) -> Reserved:
    """B's next put, which must be answered a reservation (its fd closed): ``why``."""
    reply, fds = b.call(Put(key="b-next", size_bytes=size, pool=pool))
    for fd in fds:
        os.close(fd)
    assert isinstance(reply, Reserved), f"{why}: {reply}"
    return reply


def _hold_then_delete_tenant(d: Daemon, kept: _Kept, pool: str, n: int, size: int) -> str:
    """A tenant that keeps ``n`` entries' fds (detached, in ``kept``), then is deleted:
    its id."""
    tenant_id, _, w = kept.tenant(d, "hostile-deleted", n * size)
    kept.put_and_hold(w, n, size, pool)
    w.close()
    assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
    return tenant_id


def _delete_tenants_then_check(d: Daemon, *tenant_ids: str) -> None:
    for tenant_id in tenant_ids:
        assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
    after_attack(d)


def test_held_cold_entries_of_one_tenant_do_not_fail_anothers_put_in_a_shared_pool(
    daemon: Daemon,
):
    """Tenant A puts cold entries in a shared pool and keeps each one's fd, detached, so no
    connection is told when they go. Tenant B fills the rest of the pool with its own
    entries; its next put must evict. A's entries are the least recently used: each is
    evicted, stays held (counted, rightly), and frees nothing. B's own evictable entries
    can make room, so B's put must succeed — A must not be able to fail it (nor make it
    wait for holders no one can tell to let go)."""
    size = MiB
    pool = daemon.pool(f"shared-{secrets.token_hex(3)}", 8 * size)["name"]
    with _Kept() as kept:
        tenant_a, key_a, a = kept.tenant(daemon, "hostile-a", 8 * size)
        tenant_b, _, b = kept.tenant(daemon, "victim-b", 8 * size)
        kept.put_and_hold(a, 5, size, pool, "cold")  # A's, first: the least recently used
        for i in range(3):  # B's: the pool is full (8 MiB)
            _put_commit(b, f"b-{i}", size, pool)
        reply = _put_must_fit(b, pool, size, "B's put was refused because of A")
        assert isinstance(b.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
        # what A holds is still A's: counted in its quota, never more than it
        u = tenant_usage(daemon, key_a)
        assert u["used_bytes"] == 5 * size, u
    wait_until(lambda: tenant_usage(daemon, key_a)["used_bytes"] == 0, message="A's memory freed")
    _delete_tenants_then_check(daemon, tenant_a, tenant_b)


def test_held_attached_entries_of_a_peer_that_never_reads_do_not_fail_anothers_put(
    daemon: Daemon,
):
    """The same, with A's fds kept attached on a connection that never reads what the
    daemon pushes (it is told ``released`` and ignores it). B's own entries are attached
    too (an honest worker's cache): every candidate is attached, A's are the oldest. A
    may cost B's put the one bounded wait, but not fail it."""
    size = MiB
    pool = daemon.pool(f"shared-{secrets.token_hex(3)}", 8 * size)["name"]
    with _Kept() as kept:
        tenant_a, key_a, a = kept.tenant(daemon, "hostile-attached", 8 * size)
        tenant_b, _, b = kept.tenant(daemon, "victim-attached", 8 * size)
        for i in range(5):
            _put_commit(a, f"cold-{i}", size, pool)
            found, fds = a.call(Lookup(keys=[f"cold-{i}"]))
            assert isinstance(found, Found), found
            kept.fds.extend(fds)  # attached, never detached; pushes are never read
        for i in range(3):
            _put_commit(b, f"b-{i}", size, pool)
            found, fds = b.call(Lookup(keys=[f"b-{i}"]))
            assert isinstance(found, Found), found
            for fd in fds:  # an honest worker lets go when told; this one already has
                os.close(fd)
        _put_must_fit(b, pool, size, "B's put was refused because of A")
    _delete_tenants_then_check(daemon, tenant_a, tenant_b)


def test_held_entries_of_a_deleted_tenant_are_not_handed_out_again(daemon: Daemon):
    """A tenant keeps the fds of its entries (detached), then is deleted by the admin. Its
    rows end with it, but the pages stay resident while the process holds them: the pool
    (its allocator) goes on counting them, so another tenant cannot be handed that memory
    again until the holder lets go."""
    size = MiB
    pool = daemon.pool(f"deleted-{secrets.token_hex(3)}", 8 * size)["name"]
    tenant_b, key_b = daemon.tenant("next-tenant", 8 * size)
    with _Kept() as kept:
        _hold_then_delete_tenant(daemon, kept, pool, 4, size)
        info = _pool(daemon, pool)
        assert info["held_bytes"] == 4 * size, info
        with daemon.client(key_b) as c:
            r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 8 * size})
            assert r.status_code == 507, r.text
            r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 4 * size})
            assert r.status_code == 201, r.text
            assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
    wait_until(lambda: _pool(daemon, pool)["held_bytes"] == 0, message="held memory freed")
    with daemon.client(key_b) as c:
        r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 8 * size})
        assert r.status_code == 201, r.text
        assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
    _delete_tenants_then_check(daemon, tenant_b)


def test_a_deleted_tenants_held_entries_stay_in_the_pools_ledger(daemon: Daemon):
    """The deleted tenant's held entries keep their rows (``releasing``) until the holder
    lets go: the pool's use shows them, and another tenant's put that needs room evicts
    its own entries rather than meet the allocator's 507. The tenant's delete ends (the
    reaper's pass) once they are gone."""
    size = MiB
    pool = daemon.pool(f"deleted-{secrets.token_hex(3)}", 8 * size)["name"]
    with _Kept() as kept:
        tenant_b, _, b = kept.tenant(daemon, "next-tenant", 8 * size)
        tenant_a = _hold_then_delete_tenant(daemon, kept, pool, 4, size)
        info = _pool(daemon, pool)
        assert info["held_bytes"] == 4 * size, info
        for i in range(4):  # B's own evictable entries: what the rest of the pool holds
            _put_commit(b, f"b-{i}", size, pool)
        assert info["used_bytes"] == 4 * size, f"held memory not in its pool's use: {info}"
        reply = _put_must_fit(b, pool, size, "B's own entries could make room")
        assert isinstance(b.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
        assert daemon.admin.get(f"/v1/tenants/{tenant_a}").status_code == 200  # deleting
    wait_until(
        lambda: daemon.admin.get(f"/v1/tenants/{tenant_a}").status_code == 404,
        message="the deleted tenant gone once nothing of it is held",
    )
    assert _pool(daemon, pool)["held_bytes"] == 0
    _delete_tenants_then_check(daemon, tenant_b)


def test_a_pool_drain_while_entries_are_held_keeps_counting_them(daemon: Daemon):
    """A tenant keeps its entries' fds (detached) and the admin drains their pool. The
    memory is still resident: it must stay in the tenant's quota (which it filled with
    the held half and could otherwise fill again) — the drain answers 409 saying what is
    held, the pool takes nothing new, and a drain after the holder let go ends it."""
    size = MiB
    pool = daemon.pool(f"drain-{secrets.token_hex(3)}", 8 * size)
    with _Kept() as kept:
        tenant_id, key, w = kept.tenant(daemon, "hostile-drain", 8 * size)
        kept.put_and_hold(w, 4, size, pool["name"])
        r = daemon.admin.delete(f"/v1/pools/{pool['id']}?drain=true")
        assert r.status_code == 409, r.text
        assert "held open" in r.json()["detail"], r.text
        u = tenant_usage(daemon, key)
        assert (u["used_bytes"], u["held_bytes"]) == (4 * size, 4 * size), u
        with daemon.client(key) as c:  # the held half counts: 8 MiB more would exceed it
            r = c.post("/v1/reserve", json={"size_bytes": 8 * size})
            assert r.status_code == 409, r.text
            r = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": size})
            assert r.status_code == 409, r.text  # the pool is being deleted
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, message="held memory freed")
    assert daemon.admin.delete(f"/v1/pools/{pool['id']}?drain=true").status_code == 204
    assert daemon.admin.get(f"/v1/pools/{pool['id']}").status_code == 404
    _delete_tenants_then_check(daemon, tenant_id)


def test_a_disk_dir_cannot_be_another_pools_through_a_symlink(daemon: Daemon, tmp_path: Path):
    """A tier empties its directory when it is made: a second pool whose ``disk_dir`` is
    the first one's under another name (a symlink) would erase the first one's files."""
    first = tmp_path / "tier-one"
    alias = tmp_path / "alias"
    alias.symlink_to(first, target_is_directory=True)
    one = daemon.pool(f"tier-{secrets.token_hex(3)}", 4 * MiB, disk_dir=str(first), disk_bytes=MiB)
    (first / "0123.ent").write_bytes(b"stands for a demoted entry of the first pool")
    before = daemon.admin.get("/v1/pools").json()
    body = {"name": f"tier-{secrets.token_hex(3)}", "numa_node": 0, "capacity_bytes": 4 * MiB}
    r = daemon.admin.post("/v1/pools", json={**body, "disk_dir": str(alias), "disk_bytes": MiB})
    assert r.status_code == 409, r.text
    assert (first / "0123.ent").exists()
    assert daemon.admin.get("/v1/pools").json() == before
    assert daemon.admin.delete(f"/v1/pools/{one['id']}").status_code == 204


def test_another_tenant_never_reaches_an_entry_on_disk(fresh_daemon: Daemon, tmp_path: Path):
    """Tenant A's entry is demoted to the pool's disk tier. Tenant B, in the same pool,
    looks the same key up: a miss, nothing promoted (into anyone's quota); B's own entry
    under that key, put and evicted, does not replace A's copy, and A's lookup promotes
    A's bytes."""
    d = fresh_daemon.start()
    disk = tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key_a = d.tenant("disk-owner", 64 * MiB)
    tenant_b, key_b = d.tenant("disk-prober", 64 * MiB)
    data = pattern(MiB, 5)
    a = demote_one(d, key_a, pool, data, fill=9)
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) == 1, timeout=20)
    b = connect(d, key_b)
    try:
        miss(b, ["hot"])
        assert d.metric("maasd_disk_promotions_total", pool=pool) == 0
        assert tenant_usage(d, key_b)["used_bytes"] == 0
        demote_one(d, key_b, pool, pattern(MiB, 6), fill=9).close()  # B's own "hot"
        got = probe(d, key_a, ["hot"])
        assert got["reply"] == "Found", got
        assert got["after"] == hashlib.sha256(data).hexdigest()
    finally:
        a.close()
        b.close()
    assert d.admin.delete(f"/v1/tenants/{tenant_b}").status_code == 204


def test_a_kill_while_deletes_wait_for_held_entries_leaks_nothing(fresh_daemon: Daemon):
    """A tenant delete and a pool drain left waiting for entries a process holds, then a
    SIGKILL: the fresh daemon holds none of the old memfds, so it finishes both at its
    start, and the ledger has no row left of either."""
    d = fresh_daemon.start()
    size = MiB
    pool = d.pool(f"kill-{secrets.token_hex(3)}", 8 * size)
    with _Kept() as kept:
        tenant_id = _hold_then_delete_tenant(d, kept, pool["name"], 2, size)
        other_id, key, w = kept.tenant(d, "drained", 8 * size)
        _put_commit(w, "kept", size, pool["name"])
        kept.fds.append(_hold_detached(w, "kept"))
        w.close()
        assert d.admin.delete(f"/v1/pools/{pool['id']}?drain=true").status_code == 409
        assert d.admin.get(f"/v1/tenants/{tenant_id}").status_code == 200  # deleting
        d.kill()
        d.start()
        assert d.admin.get(f"/v1/tenants/{tenant_id}").status_code == 404
        assert d.admin.get(f"/v1/pools/{pool['id']}").status_code == 404
        assert ledger_ids(d) == []
        assert tenant_usage(d, key)["used_bytes"] == 0
    _delete_tenants_then_check(d, other_id)


@pytest.mark.postgres
@pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
def test_a_held_entry_let_go_during_a_ledger_outage_is_freed_when_it_is_back(outage):
    """A released entry a process holds, and the holder lets go while the daemon is cut
    from its ledger: the row's end cannot be written then. Once the ledger is back the
    entry's bytes must leave its tenant's quota (not stay counted until a restart)."""
    d, proxy = outage
    size = MiB
    _, key = d.tenant("held-outage", 4 * size)
    w = connect(d, key)
    fd = -1
    try:
        buffer_id = _put_commit(w, "kept", size, "node0")
        fd = _hold_detached(w, "kept")
        with d.client(key) as c:
            assert c.delete(f"/v1/buffers/{buffer_id}").status_code == 204
        assert tenant_usage(d, key)["held_bytes"] == size
        proxy.cut()
        os.close(fd)
        fd = -1
        time.sleep(0.5)  # the reader thread sees the inode go while the ledger is out
        proxy.resume()
        wait_until(
            lambda: tenant_usage(d, key)["used_bytes"] == 0,
            timeout=30,
            message="the held entry's bytes freed once the ledger is back",
        )
    finally:
        if fd >= 0:
            os.close(fd)
        w.close()
