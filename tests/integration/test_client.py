"""maasd.client against the real daemon: REST calls, typed errors, Worker mappings.

Zero-copy sharing and crash tests run workers in separate processes
(``python -c``), so the fds, the mappings and the SIGKILL are real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import msgspec
import numpy as np
import pytest

from maasd.client import (
    BadRequest,
    Buffer,
    Client,
    Conflict,
    ConnectionFailed,
    DuplicateKey,
    Forbidden,
    InvalidReference,
    MaasdClientError,
    NotFound,
    PoolExhausted,
    QosUnmet,
    QuotaExceeded,
    StateConflict,
    Unauthorized,
    Unprocessable,
    Worker,
)
from waiting import wait_until

MiB = 1 << 20

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from maasd.client import Worker

    sock, key, bid, mode = sys.argv[1:5]
    with Worker(sock, key, renew_interval_s=0) as w:
        m = w.attach(bid)
        a = m.array
        if mode == "share":
            # the parent wrote 0..250 cycling into the first MiB: check, then answer
            expect = (np.arange(1 << 20) % 251).astype(np.uint8)
            ok = bool(np.array_equal(a[: 1 << 20], expect))
            a[1 << 20 : (1 << 20) + 4096] = 0xAB
            print("ok" if ok else "mismatch", flush=True)
        elif mode == "hold":
            a[: 4096] = 0x5A
            print("ready", flush=True)
            time.sleep(600)
    """
)


def run_child(daemon, key: str, bid: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, daemon.socket_path, key, bid, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def tenant(daemon):
    tid, key = daemon.tenant("client", 128 * MiB)
    with Client(daemon.url, key) as c:
        yield tid, key, c


@pytest.fixture
def admin(daemon):
    with Client(daemon.url, daemon.admin_key) as c:
        yield c


# --- REST ----------------------------------------------------------------------------------


def test_reserve_by_pool_name_and_id_then_the_buffer_lifecycle(tenant):
    tid, _key, c = tenant
    pools = c.pools()
    node0 = next(p for p in pools if p.name == "node0")
    assert node0.capacity_bytes == 256 * MiB
    assert node0.numa_node == 0

    a = c.reserve(size_bytes=5000, pool="node0", label="a", key=f"k-{uuid.uuid4().hex}")
    assert isinstance(a, Buffer)
    assert a.tenant_id == tid
    assert a.pool_id == node0.id
    assert a.state == "live"
    assert a.size_bytes == 8192  # rounded up to the page size
    b = c.reserve(size_gb=1 / 1024, pool=node0.id, evictable=True)
    assert b.size_bytes == MiB
    assert b.evictable
    d = c.reserve(2 * MiB, latency_us=10, persistence="volatile", numa_node=0)
    assert d.numa_node == 0

    assert {x.id for x in c.buffers()} == {a.id, b.id, d.id}
    got = c.buffer(a.id)
    assert msgspec.structs.replace(got, placement=None) == a
    assert got.placement == {"0": a.size_bytes // 4096}  # measured on GET
    usage = c.usage()
    assert usage.tenant_id == tid
    assert usage.used_bytes == 8192 + MiB + 2 * MiB
    assert usage.buffers == 3

    renewed = c.renew(a.id, ttl_s=1200)
    assert renewed.expires_at is not None
    assert a.expires_at is not None
    assert renewed.expires_at > a.expires_at

    pinned = c.pin(d.id, numa_node=0)
    assert pinned.numa_node == 0
    assert pinned.placement is not None
    assert sum(pinned.placement.values()) == 2 * MiB // node0.page_bytes

    assert c.lookup(["nope", a.key or ""]) == msgspec.structs.replace(
        c.buffer(a.id), placement=None
    )
    hit = c.lookup_hit([a.key or ""])
    assert hit is not None
    assert hit.key == a.key
    assert c.lookup(["no-such-key"]) is None

    for x in (a, b, d):
        c.release(x.id)
    assert c.buffers() == []
    assert c.usage().used_bytes == 0
    topo = c.topology()
    assert topo.nodes
    assert topo.nodes[0].id == 0
    assert c.health().status == "ok"
    with pytest.raises(Forbidden):
        c.metrics()  # the admin key or the metrics key only


def test_a_put_entry_is_listed_staged_until_its_commit(daemon, tenant):
    """What the usage counts, the list shows: a put entry (staged) as well as live ones."""
    _, key, c = tenant
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        m = w.put("listed", 4096)
        assert [(b.id, b.state) for b in c.buffers()] == [(m.buffer_id, "staged")]
        assert c.usage().buffers == 1
        w.commit(m)
        assert [(b.id, b.state) for b in c.buffers()] == [(m.buffer_id, "live")]
        aborted = w.put("aborted", 4096)
        w.abort(aborted)
        assert [b.id for b in c.buffers()] == [m.buffer_id]
        c.release(m.buffer_id)
    assert c.buffers() == []


def test_admin_helpers(daemon, admin):
    name = f"adm-{uuid.uuid4().hex[:6]}"
    t = admin.create_tenant(name, 32 * MiB)
    assert t.name == name
    assert t.quota_bytes == 32 * MiB
    assert t.api_key
    assert any(x.id == t.id for x in admin.tenants())
    assert "maasd_" in admin.metrics()
    assert admin.set_quota(t.id, 16 * MiB).quota_bytes == 16 * MiB
    assert admin.tenant(t.id).quota_bytes == 16 * MiB
    k = admin.issue_key(t.id)
    with Client(daemon.url, k.api_key) as tc:
        assert tc.usage().tenant_id == t.id
        admin.revoke_key(t.id, k.id)
        with pytest.raises(Unauthorized):
            tc.usage()
    with Client(daemon.url, t.api_key) as tc:
        buf = tc.reserve(MiB)
        assert [b.id for b in admin.buffers(tenant_id=t.id)] == [buf.id]
    pool = admin.create_pool(name=f"p-{uuid.uuid4().hex[:6]}", numa_node=0, capacity_bytes=8 * MiB)
    assert pool.capacity_bytes == 8 * MiB
    assert pool.used_bytes == 0
    admin.delete_pool(pool.name)  # by name
    with pytest.raises(NotFound):
        admin.delete_pool(pool.id)
    admin.delete_tenant(t.id)
    with pytest.raises(NotFound):
        admin.tenant(t.id)


# --- typed errors ------------------------------------------------------------------------------


def test_400_bad_request(tenant):
    _tid, _key, c = tenant
    with pytest.raises(BadRequest) as info:
        c.request("POST", "/v1/reserve", content=b'{"size_bytes": ')
    assert info.value.status == 400
    assert info.value.problem["status"] == 400
    with pytest.raises(BadRequest) as info:
        c.request("POST", "/v1/reserve", json={"size_bytes": 4096, "colour": "red"})
    assert "colour" in info.value.detail
    with pytest.raises(BadRequest):
        c.reserve(size_bytes=-1)
    with pytest.raises(BadRequest):
        c.reserve(size_bytes=4096, size_gb=1.0)


def test_401_unauthorized(daemon):
    with Client(daemon.url, "wrong-key") as c, pytest.raises(Unauthorized) as info:
        c.usage()
    assert info.value.status == 401
    assert info.value.title


def test_403_forbidden(tenant):
    with pytest.raises(Forbidden) as info:
        tenant[2].create_tenant("nope", MiB)
    assert info.value.status == 403


def test_404_not_found_for_unknown_and_foreign(daemon, tenant):
    _tid, _key, c = tenant
    for call in (c.buffer, c.release, lambda i: c.renew(i, 60), lambda i: c.pin(i, 0)):
        with pytest.raises(NotFound) as info:
            call(uuid.uuid4().hex)
        assert info.value.status == 404
    _otid, okey = daemon.tenant("other", 8 * MiB)
    with Client(daemon.url, okey) as other:
        foreign = other.reserve(MiB)
        with pytest.raises(NotFound):
            c.buffer(foreign.id)
        with pytest.raises(NotFound):
            c.release(foreign.id)
        other.release(foreign.id)


def test_409_quota_exceeded_and_duplicate_key(daemon):
    _tid, key = daemon.tenant("quota", 4 * MiB)
    with Client(daemon.url, key) as c:
        buf = c.reserve(3 * MiB, key="dup")
        with pytest.raises(QuotaExceeded) as info:
            c.reserve(2 * MiB)
        assert isinstance(info.value, Conflict)
        assert info.value.status == 409
        assert info.value.type.endswith("quota-exceeded")
        with pytest.raises(DuplicateKey) as dup:
            c.reserve(4096, key="dup")
        assert dup.value.type.endswith("duplicate-key")
        assert dup.value.status == 409
        with pytest.raises(StateConflict):
            c.checkpoint(buf.id)  # volatile
        c.release(buf.id)


def test_422_unprocessable(tenant):
    _tid, _key, c = tenant
    with pytest.raises(QosUnmet) as info:
        c.reserve(MiB, persistence="persistent")  # the default pools are volatile
    assert info.value.status == 422
    assert info.value.type.endswith("qos-unmet")
    with pytest.raises(Unprocessable):
        c.reserve(MiB, numa_node=99)
    with pytest.raises(Unprocessable):
        c.reserve(512 * MiB, pool="node0")  # larger than the pool could ever hold


def test_507_pool_exhausted(daemon, admin):
    _tid, key = daemon.tenant("full", 64 * MiB)
    pool = admin.create_pool(
        name=f"small-{uuid.uuid4().hex[:6]}", numa_node=0, capacity_bytes=8 * MiB
    )
    try:
        with Client(daemon.url, key) as c:
            first = c.reserve(6 * MiB, pool=pool.name)
            with pytest.raises(PoolExhausted) as info:
                c.reserve(4 * MiB, pool=pool.name)
            assert info.value.status == 507
            assert info.value.type.endswith("pool-exhausted")
            c.release(first.id)
    finally:
        admin.delete_pool(pool.id, drain=True)


def test_connection_failed_for_a_dead_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        Client(f"http://127.0.0.1:{port}", "k", timeout=2) as c,
        pytest.raises(ConnectionFailed) as info,
    ):
        c.usage()
    assert isinstance(info.value, MaasdClientError)
    assert info.value.status == 0


def test_worker_errors_come_from_socket_error_frames(daemon, tenant):
    _tid, key, c = tenant
    with Worker(daemon.socket_path, key) as w:
        with pytest.raises(NotFound) as info:
            w.attach(uuid.uuid4().hex)
        assert info.value.type.endswith("not-found")
        assert info.value.problem["status"] == 404
        with pytest.raises(BadRequest):
            w.renew(uuid.uuid4().hex, ttl_s=-5)
    with pytest.raises(Unauthorized):
        Worker(daemon.socket_path, "nope")


# --- the data plane --------------------------------------------------------------------------


def test_worker_mapping_is_the_buffer(daemon, tenant):
    _tid, key, c = tenant
    buf = c.reserve(4 * MiB)
    with Worker(daemon.socket_path, key) as w:
        m = w.attach(buf.id)
        assert m.size == buf.size_bytes
        assert m.numa_node == buf.numa_node
        assert m.array.shape == (buf.size_bytes,)
        assert not m.array.any()
        m.array[:] = 7
        m2 = w.attach(buf.id)
        assert int(m2.array[-1]) == 7  # same pages, no copy
        m2.array[0] = 9
        assert int(m.array[0]) == 9
    assert m.closed
    assert m2.closed
    c.release(buf.id)


def test_zero_copy_sharing_between_processes(daemon, tenant):
    _tid, key, c = tenant
    buf = c.reserve(4 * MiB)
    with Worker(daemon.socket_path, key) as w:
        m = w.attach(buf.id)
        m.array[: 1 << 20] = (np.arange(1 << 20) % 251).astype(np.uint8)
        child = run_child(daemon, key, buf.id, "share")
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert out.strip() == "ok"
        # the child's write is visible through the parent's existing mapping
        assert (m.array[1 << 20 : (1 << 20) + 4096] == 0xAB).all()
    c.release(buf.id)


def test_release_while_mapped_reads_zeros_and_new_buffers_are_clean(daemon, tenant):
    _tid, key, c = tenant
    with Worker(daemon.socket_path, key) as w:
        for _ in range(3):
            buf = c.reserve(2 * MiB)
            m = w.attach(buf.id)
            assert not m.array.any()  # a new buffer never shows old bytes
            m.array[:] = 0xEE
            c.release(buf.id)
            assert not m.array.any()  # the stale mapping reads zeros
            m.array[0] = 1  # writing into a stale mapping harms no one
            m.close()
            with pytest.raises(NotFound):
                w.attach(buf.id)


def test_worker_sigkill_while_attached(daemon, tenant):
    tid, key, c = tenant
    buf = c.reserve(MiB)
    base = daemon.metric("maasd_attached_handles", tenant=tid)
    for _ in range(5):
        child = run_child(daemon, key, buf.id, "hold")
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            assert daemon.metric("maasd_attached_handles", tenant=tid) == base + 1
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        wait_until(
            lambda: daemon.metric("maasd_attached_handles", tenant=tid) == base,
            message="the killed worker's attachment is dropped",
        )
        assert daemon.healthy()
    # the buffer is intact for its owner
    assert c.buffer(buf.id).state == "live"
    with Worker(daemon.socket_path, key) as w:
        m = w.attach(buf.id)
        assert (m.array[:4096] == 0x5A).all()
    c.release(buf.id)


def test_revoked_key_while_a_worker_is_connected(daemon, admin, tenant):
    tid, _key, c = tenant
    buf = c.reserve(MiB)
    k = admin.issue_key(tid)
    w = Worker(daemon.socket_path, k.api_key, renew_interval_s=0)
    m = w.attach(buf.id)
    admin.revoke_key(tid, k.id)
    with pytest.raises(Unauthorized):
        w.renew(buf.id)
    with pytest.raises(ConnectionFailed):  # the daemon closed the connection
        w.attach(buf.id)
    w.close()
    assert m.closed
    wait_until(
        lambda: daemon.metric("maasd_attached_handles", tenant=tid) == 0,
        message="the revoked worker's attachment is dropped",
    )
    c.release(buf.id)


def test_worker_renews_leases_in_the_background(daemon, tenant):
    _tid, key, c = tenant
    buf = c.reserve(MiB, ttl_s=2)
    with Worker(daemon.socket_path, key, ttl_s=2) as w:  # renews every 2/3 s
        w.attach(buf.id)
        time.sleep(4)  # twice the lease: without renewal the reaper releases it
        assert c.buffer(buf.id).state == "live"
    c.release(buf.id)


def test_a_default_worker_keeps_a_short_lease_while_attached_then_lets_it_end(daemon, tenant):
    """SPEC §6: a default ``Worker`` renews each attached buffer before its own lease
    ends, to that lease (not a worker-wide 600 s): a 3 s buffer lives on while attached,
    its bytes intact, and ends a lease or so after its detach."""
    _tid, key, c = tenant
    buf = c.reserve(64 * 1024, ttl_s=3)
    with Worker(daemon.socket_path, key) as w:
        m = w.attach(buf.id)
        m.array[:8] = 7
        end = time.monotonic() + 8  # over two leases: the reaper runs every 0.2 s
        while time.monotonic() < end:
            assert c.buffer(buf.id).state == "live"
            time.sleep(0.5)
        assert bytes(m.array[:8]) == b"\x07" * 8
        w.detach(buf.id)
        wait_until(
            lambda: buf.id not in {b.id for b in c.buffers()},
            timeout=30,
            message="the lease ends once the buffer is detached",
        )


# --- references, pools by name, the audit trail ---------------------------------------------------


def test_pool_by_name_or_id_and_a_missing_one_names_the_pools(admin):
    node0 = admin.pool("node0")
    assert admin.pool(node0.id) == node0
    assert admin.pool_id("node0") == node0.id
    with pytest.raises(NotFound) as info:
        admin.pool("no-such-pool")
    assert info.value.detail.startswith("no pool 'no-such-pool'; pools: ")
    assert "node0" in info.value.detail


def test_a_path_like_reference_is_refused_and_changes_nothing(daemon, admin):
    tid, key = daemon.tenant("paths", MiB)
    k = admin.issue_key(tid)
    for ref in (f"{tid}/keys/{k.id}", "..", ".", ""):
        with pytest.raises(InvalidReference):
            admin.delete_tenant(ref)
    with pytest.raises(InvalidReference):
        admin.release("..")
    with Client(daemon.url, k.api_key) as c:
        assert c.usage().tenant_id == tid  # the key was not revoked
    assert admin.tenant(tid).id == tid  # nor the tenant deleted
    assert daemon.healthy()


def test_events_by_tenant_name(daemon, admin):
    tid, key = daemon.tenant("audited", 8 * MiB)
    name = admin.tenant(tid).name
    with Client(daemon.url, key) as c:
        c.release(c.reserve(MiB).id)
    kinds = [e.kind for e in admin.events(10, tenant_id=name)]
    assert kinds == ["release", "reserve", "key_issue", "tenant_create"]  # newest first
    newest = admin.events(1)[0]
    older = [e.id for e in admin.events(5, before=newest.id)]
    assert older == sorted(older, reverse=True)
    assert len(older) == 5
    assert max(older) < newest.id
