"""Attacks on the entry fast path of a real daemon, kept as regression tests (SPEC §2, §4, §5).

A writer that ``put`` an entry and then never commits (a hung worker, or one that
does it on purpose) must not hold the entry's bytes beyond what a buffer may: its
lease ends it, and the tenant or the admin can release it. A reader that keeps a
committed entry's read-only fd after the entry is released must not make the daemon
keep memory beyond the tenant's quota.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from conftest import Daemon
from hardening import after_attack
from maasd.protocol import Commit, Detach, Error, Found, Lookup, Ok, Put, Reserved
from sockpeer import Raw
from waiting import wait_until

MiB = 1 << 20


def staged_entry(d: Daemon, key: str, ttl_s: int = 600) -> tuple[Raw, Reserved, int]:
    """A writer connection that put a 1 MiB entry and filled it, and will not commit."""
    w = Raw(d.socket_path, timeout=30)
    w.hello(key)
    reply, fds = w.call(Put(key=f"stuck-{secrets.token_hex(4)}", size_bytes=MiB, ttl_s=ttl_s))
    assert isinstance(reply, Reserved), reply
    assert len(fds) == 1
    os.pwrite(fds[0], b"\x5a" * MiB, 0)
    return w, reply, fds[0]


def used(d: Daemon, tenant_id: str) -> int:
    body = d.admin.get(f"/v1/tenants/{tenant_id}").json()
    return int(body["used_bytes"])


def released(d: Daemon, tenant_id: str, w: Raw, reserved: Reserved, fd: int) -> None:
    """The staged entry is gone: not counted, its bytes zero, its commit a 409."""
    assert used(d, tenant_id) == 0
    assert os.pread(fd, 4096, 0) == bytes(4096)  # scrubbed
    reply, fds = w.call(Commit(buffer_id=reserved.buffer_id))
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == 409, reply


def test_a_staged_entry_whose_lease_ended_is_released(daemon: Daemon) -> None:
    tenant_id, key = daemon.tenant("stuck-writer", 16 * MiB)
    w, reserved, fd = staged_entry(daemon, key, ttl_s=1)
    try:
        assert used(daemon, tenant_id) == MiB
        # The writer stays connected and idle, past the lease it asked for.
        wait_until(
            lambda: daemon.admin.get(f"/v1/buffers/{reserved.buffer_id}").status_code == 404,
            timeout=15,
            message="the staged entry released at the end of its lease",
        )
        released(daemon, tenant_id, w, reserved, fd)
    finally:
        os.close(fd)
        w.close()
    after_attack(daemon)


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_a_staged_entry_can_be_released_by_delete(daemon: Daemon, who: str) -> None:
    tenant_id, key = daemon.tenant("stuck-writer", 16 * MiB)
    w, reserved, fd = staged_entry(daemon, key)
    path = f"/v1/buffers/{reserved.buffer_id}"
    try:
        with daemon.client(key) as c:
            assert c.get(path).json()["state"] == "staged"  # it is listed: it exists
            r = (c if who == "tenant" else daemon.admin).delete(path)
            assert r.status_code == 204, r.text
            assert c.get(path).status_code == 404
        released(daemon, tenant_id, w, reserved, fd)
    finally:
        os.close(fd)
        w.close()
    after_attack(daemon)


def test_a_staged_entry_is_renewed_but_neither_pinned_nor_checkpointed(
    daemon: Daemon, tmp_path: Path
) -> None:
    """REST on an entry its writer has not committed: renew extends its lease (it has one
    from the put); pin and checkpoint are 409 (its bytes move to another region at the
    commit); once committed, both work."""
    spill = str(tmp_path / "spill")
    name = f"spill-{secrets.token_hex(3)}"
    pool = daemon.pool(name, 16 * MiB, persistence="persistent", spill_dir=spill)["id"]
    _, key = daemon.tenant("stuck-writer", 16 * MiB)
    w = Raw(daemon.socket_path, timeout=30)
    w.hello(key)
    reserved, fds = w.call(Put(key="half-written", size_bytes=MiB, pool=pool, ttl_s=60))
    assert isinstance(reserved, Reserved), reserved
    path = f"/v1/buffers/{reserved.buffer_id}"
    try:
        with daemon.client(key) as c:
            before = c.get(path).json()
            r = c.post(f"{path}/renew", json={"ttl_s": 3600})
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "staged"
            assert r.json()["expires_at"] > before["expires_at"]
            for r in (c.patch(f"{path}/pin", json={"numa_node": 0}), c.post(f"{path}/checkpoint")):
                assert r.status_code == 409, r.text
                assert r.json()["type"].endswith("state-conflict")
                assert "not committed yet" in r.json()["detail"]
            assert os.listdir(tmp_path / "spill") == []
            assert isinstance(w.call(Commit(buffer_id=reserved.buffer_id))[0], Ok)
            assert c.patch(f"{path}/pin", json={"numa_node": 0}).status_code == 200
            assert c.post(f"{path}/checkpoint").status_code == 200
    finally:
        for fd in fds:
            os.close(fd)
        w.close()
    assert daemon.admin.delete(f"/v1/pools/{pool}", params={"drain": "true"}).status_code == 204
    after_attack(daemon)


def test_read_only_fds_kept_after_release_hold_no_more_than_the_quota(daemon: Daemon) -> None:
    quota = 4 * MiB
    tenant_id, key = daemon.tenant("fd-keeper", quota)
    w = Raw(daemon.socket_path, timeout=30)
    w.hello(key)
    kept: list[int] = []
    refused = None
    try:
        with daemon.client(key) as c:
            for i in range(6):
                reply, fds = w.call(Put(key=f"keep-{i}", size_bytes=quota))
                for fd in fds:
                    os.pwrite(fd, b"\xa5" * quota, 0)
                    os.close(fd)
                if not isinstance(reply, Reserved):
                    refused = reply  # what is still held counts
                    break
                assert isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
                found, fds = w.call(Lookup(keys=[f"keep-{i}"]))
                assert isinstance(found, Found), found
                kept.extend(fds)  # the attacker keeps the read-only fd ...
                assert isinstance(w.call(Detach(buffer_id=reply.buffer_id))[0], Ok)
                r = c.delete(f"/v1/buffers/{reply.buffer_id}")  # ... of a released entry
                assert r.status_code == 204, r.text
        for fd in kept:
            assert os.pread(fd, 4096, 0) == bytes(4096)  # scrubbed, as it should be
        # But its pages are still there: memory no pool and no quota counts.
        resident = sum(os.fstat(fd).st_blocks * 512 for fd in kept)
        assert resident <= quota, f"{resident >> 20} MiB held by a tenant of {quota >> 20} MiB"
        assert isinstance(refused, Error), refused
        assert (refused.type or "").endswith("quota-exceeded"), refused
        assert used(daemon, tenant_id) == quota  # the held entry, still counted
    finally:
        for fd in kept:
            os.close(fd)
    try:
        # The last holder let go: the row ends, the quota is free again.
        wait_until(lambda: used(daemon, tenant_id) == 0, message="the held entry's row ends")
        reply, fds = w.call(Put(key="after", size_bytes=quota))
        assert isinstance(reply, Reserved), reply
        for fd in fds:
            os.close(fd)
    finally:
        w.close()
    after_attack(daemon)
