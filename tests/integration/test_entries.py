"""The entry fast path through a real daemon, with frames written by the test (committed entries immutable).

``put`` → write → ``commit`` → ``lookup`` from other processes; what a committed
entry refuses (kernel-enforced immutability); what a writer that goes away, a
foreign tenant, a full quota or pool, a malformed frame and a release while mapped
leave behind. The client library's side is ``test_entries_client.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import mmap
import os
import secrets
import time
import uuid
from typing import Any

import msgspec
import pytest

from entry_probe import libc as _libc
from maasd.bounds import MAX_LOOKUP_KEYS
from maasd.protocol import (
    HEADER,
    Abort,
    Attach,
    Attached,
    Commit,
    Detach,
    Error,
    Lookup,
    Ok,
    Put,
    Reserved,
)
from rawentries import commit, connect, pattern, probe, put, put_committed, write
from sockpeer import lookup, miss
from waiting import wait_until

MiB = 1 << 20
F_SEAL_FUTURE_WRITE = 0x10
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | F_SEAL_FUTURE_WRITE


# --- helpers --------------------------------------------------------------------------------


def tenant_use(daemon: Any, tenant_id: str) -> tuple[int, int]:
    """(used_bytes, buffers) of the tenant in the ledger, every state counted."""
    body = daemon.admin.get(f"/v1/tenants/{tenant_id}").json()
    return body["used_bytes"], body["buffers"]


def daemon_fds(daemon: Any) -> tuple[int, int]:
    """(open fds, of which memfds) of the daemon process — not counting the ledger's
    SQLite files, whose pooled connections open as threads first need them."""
    fd_dir = f"/proc/{daemon.proc.pid}/fd"
    links = []
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"{fd_dir}/{name}"))
    links = [link for link in links if not link.endswith(("maasd.db", "-wal", "-shm"))]
    return len(links), sum(link.startswith("/memfd:") for link in links)


def fds_back_to(daemon: Any, base: tuple[int, int]) -> bool:
    """No memfd more than ``base``, and no fd more (sockets of finished HTTP requests of
    other tests may close meanwhile: fewer is fine)."""
    total, memfds = daemon_fds(daemon)
    return memfds == base[1] and total <= base[0]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tenant(daemon: Any) -> tuple[str, str]:
    return daemon.tenant("entries", 64 * MiB)


# --- publish, then read-only for everyone ---------------------------------------------------


def test_committed_entry_is_found_by_another_process_and_cannot_be_written(daemon, tenant):
    data = pattern(3 * MiB + 123)
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        bid = put_committed(w, "model:p1", data)
    out = probe(daemon, tenant[1], ["model:p", "model:p1", "model:p12"])
    assert out["reply"] == "Found"
    assert (out["buffer_id"], out["key"], out["fds"]) == (bid, "model:p1", 1)
    assert out["mode"] == "rdonly"
    assert out["seals"] & SEALED == SEALED
    assert out["before"] == out["after"] == sha(data + bytes(out["size"] - len(data)))
    attempts = out["attempts"]
    assert attempts.pop("mmap_private_writable") == "allowed"  # copy-on-write: file unchanged
    assert attempts.pop("reopen_rdwr") == "allowed"  # the kernel checks the seals, not the mode
    refused = {name: outcome.startswith("refused") for name, outcome in attempts.items()}
    assert all(refused.values()), attempts
    assert attempts["reopened_write"] == attempts["reopened_pwrite"] == "refused: EPERM"
    assert attempts["reopened_mmap_shared_writable"] == "refused: EPERM"
    assert attempts["mprotect_writable"] == "refused: EACCES"
    assert attempts["reopened_mprotect_writable"] == "refused: EACCES"


def test_attach_of_a_committed_entry_sends_a_read_only_fd(daemon, tenant):
    with contextlib.closing(connect(daemon, tenant[1])) as r:
        bid = put_committed(r, "attach-me", pattern(8192))
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        (fd,) = fds
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(PermissionError):
                mmap.mmap(fd, reply.size_bytes)
            assert os.pread(fd, 8192, 0) == pattern(8192)
        finally:
            os.close(fd)
        assert r.call(Detach(buffer_id=bid)) == (Ok(), [])


def test_a_lookup_before_commit_misses_and_the_key_appears_at_commit(daemon, tenant):
    rest = daemon.client(tenant[1])
    with (
        contextlib.closing(connect(daemon, tenant[1])) as w,
        contextlib.closing(connect(daemon, tenant[1])) as other,
    ):
        reply, fd = put(w, "later", 4096)
        write(fd, pattern(4096))
        miss(w, ["later"])
        miss(other, ["later"])
        assert rest.post("/v1/buffers/lookup", json={"keys": ["later"]}).status_code == 404
        a, fds = other.call(Attach(buffer_id=reply.buffer_id))  # a staged entry: not there yet
        assert (isinstance(a, Error) and a.status, fds) == (404, [])
        # the writer alone may settle it
        for op in (Commit(buffer_id=reply.buffer_id), Abort(buffer_id=reply.buffer_id)):
            err, _ = other.call(op)
            assert isinstance(err, Error)
            assert err.status == 409, err
        commit(w, reply.buffer_id)
        found, rfd = lookup(other, ["later"])
        assert found.buffer_id == reply.buffer_id
        assert os.pread(rfd, 4096, 0) == pattern(4096)
        os.close(rfd)
        os.close(fd)
        hit = rest.post("/v1/buffers/lookup", json={"keys": ["later"]})
        assert hit.status_code == 200
        assert hit.json()["buffer"]["id"] == reply.buffer_id
        # settled: neither may commit or abort it again
        for r in (w, other):
            for op in (Commit(buffer_id=reply.buffer_id), Abort(buffer_id=reply.buffer_id)):
                err, _ = r.call(op)
                assert isinstance(err, Error)
                assert err.status == 409, err
    rest.close()


def test_a_writer_that_disconnects_before_commit_leaves_nothing_behind(daemon, tenant):
    tid, key = tenant
    # Steady state first: a put and a disconnect once, so that the ledger's pooled
    # connections and the admin's HTTP connection are open before counting.
    warm = connect(daemon, key)
    os.close(put(warm, "warm-up", 4096)[1])
    warm.close()
    wait_until(lambda: tenant_use(daemon, tid) == (0, 0), message="the warm-up released")
    base_use, base_fds = tenant_use(daemon, tid), daemon_fds(daemon)
    w = connect(daemon, key)
    reply, fd = put(w, "abandoned", 2 * MiB)
    kept = mmap.mmap(fd, reply.size_bytes)
    kept[:] = pattern(reply.size_bytes)
    assert tenant_use(daemon, tid) == (base_use[0] + 2 * MiB, base_use[1] + 1)
    w.close()
    wait_until(lambda: tenant_use(daemon, tid) == base_use, message="ledger rows and usage back")
    wait_until(
        lambda: fds_back_to(daemon, base_fds),
        message=f"the daemon's fds back to {base_fds}: {daemon_fds(daemon)}",
    )
    assert kept[:] == bytes(reply.size_bytes)  # scrubbed, seen through the writer's own mapping
    kept.close()
    os.close(fd)
    with contextlib.closing(connect(daemon, key)) as r:
        miss(r, ["abandoned"])
        reply2, fd2 = put(r, "abandoned", 4096)  # the key is free again
        os.close(fd2)
        assert r.call(Abort(buffer_id=reply2.buffer_id)) == (Ok(), [])
    wait_until(lambda: tenant_use(daemon, tid) == base_use, message="the abort released it")


def _mapping(fd: int, size: int, prot: int) -> int:
    addr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return int(addr)


def test_nothing_the_writer_kept_changes_a_committed_entry(daemon, tenant):
    size = 64 * 1024
    data = pattern(size, seed=7)
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        reply, fd = put(w, "kept", size)
        writable = mmap.mmap(fd, size)
        writable[:] = data
        ro_addr = _mapping(fd, size, mmap.PROT_READ)  # read-only, made before the commit
        child_go, parent_go = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:  # a forked child holding the writable fd and mapping
            try:
                os.read(child_go[0], 1)
                writable[:16] = b"C" * 16
                os.pwrite(fd, b"D" * 16, 32)
                os.write(parent_go[1], b"1")
            finally:
                os._exit(0)
        commit(w, reply.buffer_id)
        # after the commit: the writer's mapping, an mprotect, the child, all write away
        writable[100:116] = b"W" * 16
        assert _libc.mprotect(ro_addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        ctypes.memset(ro_addr + 200, 0x4D, 16)
        os.pwrite(fd, b"P" * 16, 300)
        os.write(child_go[1], b"1")
        assert os.read(parent_go[0], 1) == b"1"
        os.waitpid(pid, 0)
        out = probe(daemon, tenant[1], ["kept"])
        assert out["before"] == sha(data)  # none of it reached the entry
        found, rfd = lookup(w, ["kept"])
        assert os.pread(rfd, size, 0) == data
        os.close(rfd)
        _libc.munmap(ro_addr, size)
        writable.close()
        os.close(fd)
        for p in (*child_go, *parent_go):
            os.close(p)


# --- isolation, quota, capacity ---------------------------------------------------------------


def test_a_foreign_tenant_lookup_misses_with_no_fd(daemon, tenant):
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        bid = put_committed(w, "mine", pattern(4096))
    _other_id, other_key = daemon.tenant("stranger", 16 * MiB)
    out = probe(daemon, other_key, ["mine"])
    assert (out["reply"], out["status"], out["fds"]) == ("Error", 404, 0)
    with contextlib.closing(connect(daemon, other_key)) as r:
        miss(r, ["mine"])
        for op in (Attach(buffer_id=bid), Commit(buffer_id=bid), Abort(buffer_id=bid)):
            reply, fds = r.call(op)
            assert fds == []
            assert isinstance(reply, Error)
            assert reply.status == 404, (op, reply)


def test_put_over_quota_is_409(daemon):
    tid, key = daemon.tenant("small", 1 * MiB)
    with contextlib.closing(connect(daemon, key)) as r:
        reply, fds = r.call(Put(key="big", size_bytes=2 * MiB))
        assert fds == []
        assert isinstance(reply, Error)
        assert reply.status == 409
        assert reply.type is not None
        assert reply.type.endswith("/quota-exceeded")
        assert tenant_use(daemon, tid) == (0, 0)


def test_put_over_pool_capacity_evicts_entries_then_answers_507(daemon):
    pool = f"small-{secrets.token_hex(3)}"
    r = daemon.admin.post(
        "/v1/pools", json={"name": pool, "numa_node": 0, "capacity_bytes": 4 * MiB}
    )
    assert r.status_code == 201, r.text
    (_a, key_a), (_b, key_b) = (
        daemon.tenant("evictee", 32 * MiB),
        daemon.tenant("evictor", 32 * MiB),
    )
    try:
        with (
            contextlib.closing(connect(daemon, key_a)) as ra,
            contextlib.closing(connect(daemon, key_b)) as rb,
        ):
            reply, fd = put(ra, "old", 3 * MiB, pool=pool)
            write(fd, pattern(3 * MiB))
            os.close(fd)
            commit(ra, reply.buffer_id)
            old = reply.buffer_id
            _found, reader_fd = lookup(ra, ["old"])
            held = mmap.mmap(reader_fd, 3 * MiB, prot=mmap.PROT_READ)
            assert held[:64] == pattern(3 * MiB)[:64]
            evictions = daemon.metric("maasd_entry_evictions_total", tenant=_a)
            # another tenant needs the room: the least recently used entry goes ...
            reply, fds = rb.call(Put(key="new", size_bytes=3 * MiB, pool=pool))
            miss(ra, ["old"])
            assert held[:] == bytes(3 * MiB)  # the evicted entry reads zeros
            assert daemon.metric("maasd_entry_evictions_total", tenant=_a) == evictions + 1
            # ... but its reader still maps it: its pages stay taken until it lets go
            assert (fds, getattr(reply, "status", None)) == ([], 507), reply
            assert daemon.metric("maasd_released_entry_bytes") >= 3 * MiB
            held.close()
            os.close(reader_fd)
            wait_until(
                lambda: daemon.admin.get(f"/v1/buffers/{old}").status_code == 404,
                message="the evicted entry's row ends when its reader lets go",
            )
            got, fd_b = put(rb, "new", 3 * MiB, pool=pool)  # again, once it let go
            os.close(fd_b)
            # non-evictable memory fills the pool: nothing left to evict → 507
            buf = daemon.client(key_a).post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB})
            assert buf.status_code == 201, buf.text
            reply, fds = rb.call(Put(key="newer", size_bytes=MiB, pool=pool))
            assert fds == []
            assert isinstance(reply, Error)
            assert reply.status == 507
            assert reply.type is not None
            assert reply.type.endswith("/pool-exhausted")
            assert rb.call(Abort(buffer_id=got.buffer_id)) == (Ok(), [])
            daemon.client(key_a).delete(f"/v1/buffers/{buf.json()['id']}")
    finally:
        assert daemon.admin.delete(f"/v1/pools/{pool}", params={"drain": "true"}).status_code == 204


# --- malformed frames -------------------------------------------------------------------------

BAD_FRAMES = [
    ("put-no-key", {"op": "put", "size_bytes": 4096}),
    ("put-empty-key", {"op": "put", "key": "", "size_bytes": 4096}),
    ("put-key-513", {"op": "put", "key": "k" * 513, "size_bytes": 4096}),
    ("put-key-int", {"op": "put", "key": 5, "size_bytes": 4096}),
    ("put-size-0", {"op": "put", "key": "k", "size_bytes": 0}),
    ("put-size-negative", {"op": "put", "key": "k", "size_bytes": -4096}),
    ("put-size-2^64-1", {"op": "put", "key": "k", "size_bytes": 2**64 - 1}),
    ("put-size-2^63", {"op": "put", "key": "k", "size_bytes": 2**63}),
    ("put-size-string", {"op": "put", "key": "k", "size_bytes": "4096"}),
    ("put-size-float", {"op": "put", "key": "k", "size_bytes": 4096.0}),
    ("put-size-bool", {"op": "put", "key": "k", "size_bytes": True}),
    ("put-ttl-0", {"op": "put", "key": "k", "size_bytes": 4096, "ttl_s": 0}),
    ("put-pool-empty", {"op": "put", "key": "k", "size_bytes": 4096, "pool": ""}),
    ("put-unknown-field", {"op": "put", "key": "k", "size_bytes": 4096, "evictable": False}),
    ("lookup-no-keys", {"op": "lookup"}),
    ("lookup-keys-empty", {"op": "lookup", "keys": []}),
    ("lookup-keys-string", {"op": "lookup", "keys": "k"}),
    ("lookup-key-empty", {"op": "lookup", "keys": ["k", ""]}),
    ("lookup-key-int", {"op": "lookup", "keys": [1]}),
    ("lookup-key-513", {"op": "lookup", "keys": ["k" * 513]}),
    ("lookup-keys-1025", {"op": "lookup", "keys": [f"k{i}" for i in range(MAX_LOOKUP_KEYS + 1)]}),
    ("lookup-unknown-field", {"op": "lookup", "keys": ["k"], "tenant_id": "0" * 32}),
    ("commit-no-id", {"op": "commit"}),
    ("commit-id-int", {"op": "commit", "buffer_id": 7}),
    ("abort-unknown-field", {"op": "abort", "buffer_id": "x", "force": True}),
]


@pytest.mark.parametrize(("case", "body"), BAD_FRAMES, ids=[c for c, _ in BAD_FRAMES])
def test_malformed_entry_frames_answer_400_and_change_nothing(daemon, tenant, case, body):
    tid, key = tenant
    base = tenant_use(daemon, tid)
    with contextlib.closing(connect(daemon, key)) as r:
        raw = msgspec.msgpack.encode(body)
        r.send_raw(HEADER.pack(len(raw)) + raw)
        reply, fds = r.recv()
        assert fds == []
        assert isinstance(reply, Error), (case, reply)
        assert reply.status == 400, (case, reply)
        assert reply.detail
        miss(r, ["k"])  # the connection is still served
    assert tenant_use(daemon, tid) == base


def test_1024_keys_are_accepted_on_the_socket_and_over_rest(daemon, tenant):
    keys = [f"k{i}" for i in range(MAX_LOOKUP_KEYS)]
    with contextlib.closing(connect(daemon, tenant[1])) as r:
        miss(r, keys)
        bid = put_committed(r, keys[500], pattern(4096))
        found, fd = lookup(r, keys)
        assert (found.key, found.buffer_id) == (keys[500], bid)
        os.close(fd)
    with daemon.client(tenant[1]) as rest:
        hit = rest.post("/v1/buffers/lookup", json={"keys": keys})
        assert hit.status_code == 200, hit.text
        assert hit.json()["key"] == keys[500]
        over = rest.post("/v1/buffers/lookup", json={"keys": [*keys, "one-more"]})
        assert over.status_code == 400


# --- release while mapped, leases --------------------------------------------------------------


def test_a_released_entry_reads_zeros_and_counts_until_its_reader_lets_go(daemon, tenant):
    size = 256 * 1024
    rest = daemon.client(tenant[1])
    base = daemon.metric("maasd_released_entry_bytes")
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        bid = put_committed(w, "to-release", pattern(size))
    reader = connect(daemon, tenant[1])
    _found, fd = lookup(reader, ["to-release"])
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    assert mm[:] == pattern(size)
    assert rest.delete(f"/v1/buffers/{bid}").status_code == 204
    assert mm[:] == bytes(size)  # scrubbed before the DELETE answered
    assert daemon.metric("maasd_released_entry_bytes") == base + size
    miss(reader, ["to-release"])
    # the daemon told the connection (a pushed frame) and dropped its attachment itself
    assert reader.pushed == [bid]
    assert reader.call(Detach(buffer_id=bid))[0].status == 404
    os.close(fd)  # fd closed: the mapping still holds it
    assert daemon.metric("maasd_released_entry_bytes") == base + size
    mm.close()
    wait_until(lambda: daemon.metric("maasd_released_entry_bytes") == base, message="counted down")
    # a reader that closed its fd before the release holds nothing
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        bid = put_committed(w, "to-release-2", pattern(size))
    _found, fd = lookup(reader, ["to-release-2"])
    os.close(fd)
    assert rest.delete(f"/v1/buffers/{bid}").status_code == 204
    assert daemon.metric("maasd_released_entry_bytes") == base
    assert rest.get(f"/v1/buffers/{bid}").status_code == 404
    reader.close()
    rest.close()


def test_a_reopened_or_inherited_fd_keeps_a_released_entry_counted(daemon):
    """Held by a re-open through /proc/<pid>/fd and by a forked child's inherited fd, a
    released entry's row stays (``releasing``, in the quota) until the last one closes."""
    size = MiB
    tenant_id, key = daemon.tenant("reopener", size)
    with contextlib.closing(connect(daemon, key)) as w:
        bid = put_committed(w, "held", pattern(size))
        _found, fd = lookup(w, ["held"])
        reopened = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY)  # a new description
        r, wr = os.pipe()
        child = os.fork()
        if child == 0:  # inherits `fd` (the daemon's description) and keeps it until told
            os.close(wr)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        os.close(fd)  # the parent's copy goes; the child's stays
        with daemon.client(key) as rest:
            assert rest.delete(f"/v1/buffers/{bid}").status_code == 204
            assert os.pread(reopened, 4096, 0) == bytes(4096)  # scrubbed all the same
            body = daemon.admin.get(f"/v1/tenants/{tenant_id}").json()
            assert body["used_bytes"] == size  # still the tenant's
            assert rest.get(f"/v1/buffers/{bid}").status_code == 404  # to its tenant: gone
            assert daemon.admin.get(f"/v1/buffers/{bid}").json()["state"] == "releasing"
            reply, fds = w.call(Put(key="more", size_bytes=size))
            assert fds == []
            assert isinstance(reply, Error), reply
            assert reply.status == 409, reply
            os.close(reopened)
            assert daemon.admin.get(f"/v1/buffers/{bid}").status_code == 200  # the child's
            os.write(wr, b"x")
            os.close(wr)
            os.waitpid(child, 0)
            wait_until(
                lambda: daemon.admin.get(f"/v1/buffers/{bid}").status_code == 404,
                message="the row ends with the last holder",
            )
            assert daemon.admin.get(f"/v1/tenants/{tenant_id}").json()["used_bytes"] == 0
            reply, fds = w.call(Put(key="more", size_bytes=size))  # the quota is free again
            assert isinstance(reply, Reserved), reply
            for f in fds:
                os.close(f)
            events = daemon.admin.get("/v1/events", params={"tenant_id": tenant_id}).json()
            assert [e["kind"] for e in events if e["buffer_id"] == bid] == ["release", "reserve"]


def _expires_at(daemon: Any, key: str, bid: str) -> float:
    from datetime import datetime

    with daemon.client(key) as rest:
        stamp = rest.get(f"/v1/buffers/{bid}").json()["expires_at"]
    return datetime.fromisoformat(stamp).timestamp()


def test_hits_extend_the_lease_in_memory_and_a_hot_entry_is_never_reaped(daemon, tenant):
    with contextlib.closing(connect(daemon, tenant[1])) as r:
        reply, fd = put(r, "hot", 4096, ttl_s=1)
        os.close(fd)
        commit(r, reply.buffer_id)
        first = _expires_at(daemon, tenant[1], reply.buffer_id)
        deadline = time.monotonic() + 3.0  # three leases long; the reaper runs every 0.2 s
        while time.monotonic() < deadline:
            _found, rfd = lookup(r, ["hot"])
            os.close(rfd)
            time.sleep(0.25)
        wait_until(lambda: _expires_at(daemon, tenant[1], reply.buffer_id) > first + 2)
        # left alone (asked about over REST, which is not a hit), it expires
        with daemon.client(tenant[1]) as rest:
            url = f"/v1/buffers/{reply.buffer_id}"
            wait_until(lambda: rest.get(url).status_code == 404, timeout=10)
        miss(r, ["hot"])


def test_a_revoked_key_is_refused_on_the_next_inline_op(daemon, tenant):
    tid = tenant[0]
    with contextlib.closing(connect(daemon, tenant[1])) as w:
        put_committed(w, "rev", pattern(4096))
    info = daemon.admin.post(f"/v1/tenants/{tid}/keys").json()
    with contextlib.closing(connect(daemon, info["api_key"])) as r:
        _found, fd = lookup(r, ["rev"])
        os.close(fd)
        assert daemon.admin.delete(f"/v1/tenants/{tid}/keys/{info['id']}").status_code == 204
        reply, fds = r.call_racing_close(Lookup(keys=["rev"]))
        assert fds == []
        assert isinstance(reply, Error)
        assert reply.status == 401
        assert r.closed_by_peer()


def test_unknown_ids_and_foreign_commits(daemon, tenant):
    with contextlib.closing(connect(daemon, tenant[1])) as r:
        for op in (Commit(buffer_id=uuid.uuid4().hex), Abort(buffer_id=uuid.uuid4().hex)):
            reply, fds = r.call(op)
            assert fds == []
            assert isinstance(reply, Error)
            assert reply.status == 404
        # a REST buffer is not an entry this connection put
        with daemon.client(tenant[1]) as rest:
            bid = rest.post("/v1/reserve", json={"size_bytes": 4096}).json()["id"]
            reply, _ = r.call(Commit(buffer_id=bid))
            assert isinstance(reply, Error)
            assert reply.status == 409
            assert rest.delete(f"/v1/buffers/{bid}").status_code == 204
