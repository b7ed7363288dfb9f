"""The Unix-socket handle server, spoken to over raw sockets written by the test.

Every protocol test runs twice: against an in-process :class:`maasd.broker.Broker`
over a small fake service (real sockets, real sealed memfds), and against the
real daemon (the ``daemon`` fixture of ``tests/conftest.py``). A few tests of
the broker's own lifecycle, and of ``Worker`` against it, use the fake only.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import socket
import stat
import threading
import time
import uuid

import httpx
import msgspec
import numpy as np
import pytest

from maasd.broker import Broker, Limits
from maasd.client import ConnectionFailed, NotFound, Unauthorized, Worker
from maasd.protocol import (
    HEADER,
    MAX_FRAME,
    Abort,
    Attach,
    Attached,
    Commit,
    Detach,
    Error,
    Found,
    Hello,
    Lookup,
    Ok,
    Put,
    Renew,
    Reserved,
    decode_reply,
)
from sockpeer import SEALS, FakeEnv, FakeService, MiB, Raw
from waiting import wait_until

# --- one interface over both back ends ------------------------------------------------


class DaemonEnv:
    kind = "daemon"

    def __init__(self, daemon) -> None:
        from maasd.client import Client

        self.daemon = daemon
        self.socket_path = str(daemon.socket_path)
        self.admin = Client(daemon.url, daemon.admin_key)
        self._clients: dict[str, Client] = {}

    def _client(self, key: str):
        from maasd.client import Client

        if key not in self._clients:
            self._clients[key] = Client(self.daemon.url, key)
        return self._clients[key]

    def new_tenant(self) -> tuple[str, str]:
        return self.daemon.tenant("raw-" + uuid.uuid4().hex[:8], 64 * MiB)

    def revocable_key(self, tenant_id: str) -> tuple[str, object]:
        info = self.admin.issue_key(tenant_id)
        return info.api_key, lambda: self.admin.revoke_key(tenant_id, info.id)

    def reserve(self, tenant: tuple[str, str], size: int = MiB) -> str:
        return self._client(tenant[1]).reserve(size_bytes=size, ttl_s=300).id

    def release(self, tenant: tuple[str, str], bid: str) -> None:
        self._client(tenant[1]).release(bid)

    def healthy(self) -> bool:
        r = httpx.get(self.daemon.url + "/healthz", timeout=10)
        return r.status_code == 200 and r.json() == {"status": "ok"}

    def attached(self, tenant_id: str) -> float:
        return attached_gauge(self.daemon.admin.get("/metrics", timeout=10).text, tenant_id)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self.admin.close()


def attached_gauge(metrics_text: str, tenant_id: str) -> float:
    pat = re.compile(r"^maasd_attached_handles\{([^}]*)\}\s+(\S+)", re.M)
    for labels, value in pat.findall(metrics_text):
        if f'tenant="{tenant_id}"' in labels:
            return float(value)
    return 0.0


@pytest.fixture(params=["fake", "daemon"])
def env(request, tmp_path):
    e: FakeEnv | DaemonEnv
    if request.param == "fake":
        e = FakeEnv(tmp_path)
    else:
        try:
            daemon = request.getfixturevalue("daemon")
        except pytest.FixtureLookupError:
            pytest.skip("the daemon fixture (tests/conftest.py) is not available")
        e = DaemonEnv(daemon)
    yield e
    e.close()


@pytest.fixture
def fake(tmp_path):
    e = FakeEnv(tmp_path)
    yield e
    e.close()


# --- the protocol, against both back ends ------------------------------------------------


def test_socket_file_mode_is_0660(env):
    st = os.stat(env.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_welcome_names_tenant_and_peer_pid(env):
    tid, key = env.new_tenant()
    with contextlib.closing(Raw(env.socket_path)) as r:
        w = r.hello(key)
    assert w.tenant_id == tid
    assert w.pid == os.getpid()


def test_attach_sends_a_sealed_memfd_of_exactly_the_buffer(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant, 3 * MiB)
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(tenant[1])
        reply, fds = r.call(Attach(buffer_id=bid))
        try:
            assert isinstance(reply, Attached), reply
            assert reply.buffer_id == bid
            assert reply.size_bytes == 3 * MiB
            assert len(fds) == 1
            fd = fds[0]
            assert os.fstat(fd).st_size == reply.size_bytes
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
            # sealed: the worker can neither shrink nor grow it
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, reply.size_bytes * 2)
            with mmap.mmap(fd, reply.size_bytes) as mm:
                mm[:4] = b"abcd"
        finally:
            for fd in fds:
                os.close(fd)
        # a second attach of the same buffer is the same file
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        assert len(fds) == 1
        assert os.pread(fds[0], 4, 0) == b"abcd"
        os.close(fds[0])
    env.release(tenant, bid)


def test_foreign_and_unknown_ids_answer_404_and_no_fd(env):
    owner, other = env.new_tenant(), env.new_tenant()
    bid = env.reserve(owner)
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(other[1])
        for target in (bid, uuid.uuid4().hex, "x", "../" + bid):
            r.send(Attach(buffer_id=target))
            # recvmsg by hand: the ancillary data must be empty
            data, anc, _flags, _ = r.sock.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
            assert anc == []
            (body,) = r.reader.feed(data)
            reply = decode_reply(body)
            assert isinstance(reply, Error), reply
            assert reply.status == 404, reply
        # the connection survived all that
        reply, fds = r.call(Renew(buffer_id=bid, ttl_s=60))
        assert isinstance(reply, Error)
        assert reply.status == 404
        assert fds == []
    env.release(owner, bid)


def test_bad_key_answers_401_and_closes(env):
    with contextlib.closing(Raw(env.socket_path)) as r:
        reply, fds = r.call(Hello(api_key="not-a-key-" + uuid.uuid4().hex))
        assert isinstance(reply, Error)
        assert reply.status == 401
        assert fds == []
        assert r.closed_by_peer()


def test_first_frame_must_be_hello(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    with contextlib.closing(Raw(env.socket_path)) as r:
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Error)
        assert reply.status == 400
        assert fds == []
        assert r.closed_by_peer()
    env.release(tenant, bid)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a length of 0x47455420: oversize
        HEADER.pack(3) + b"\xc1\xc1\xc1",  # a frame of invalid msgpack
        HEADER.pack(MAX_FRAME + 1),  # oversize length, no body
        b"\xff\xff\xff\xff" + os.urandom(64),
        HEADER.pack(0),  # empty frame
    ],
    ids=["http", "bad-msgpack", "oversize", "ffff", "empty"],
)
def test_garbage_before_hello_closes_only_that_connection(env, garbage):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    with contextlib.closing(Raw(env.socket_path)) as good:
        good.hello(tenant[1])
        with contextlib.closing(Raw(env.socket_path)) as bad:
            bad.send_raw(garbage)
            reply, fds = bad.recv()
            assert fds == []
            if reply is not None:
                assert isinstance(reply, Error)
                assert reply.status == 400
            assert bad.closed_by_peer()
        assert env.healthy()
        reply, fds = good.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        assert len(fds) == 1
        os.close(fds[0])
    env.release(tenant, bid)


def test_oversize_after_hello_errors_then_closes(env):
    tenant = env.new_tenant()
    with contextlib.closing(Raw(env.socket_path)) as other:
        other.hello(tenant[1])
        with contextlib.closing(Raw(env.socket_path)) as r:
            r.hello(tenant[1])
            r.send_raw(HEADER.pack(MAX_FRAME + 1) + b"\x00" * 1024)
            reply, fds = r.recv()
            assert isinstance(reply, Error)
            assert reply.status == 400
            assert fds == []
            assert r.closed_by_peer()
        assert env.healthy()
        reply, _ = other.call(Renew(buffer_id=uuid.uuid4().hex, ttl_s=60))
        assert isinstance(reply, Error)
        assert reply.status == 404


def test_bad_frames_after_hello_leave_the_connection_usable(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(tenant[1])
        bad_bodies = [
            b"\xc1",
            msgspec.msgpack.encode({"op": "attach"}),
            msgspec.msgpack.encode({"op": "attach", "buffer_id": 7}),
            msgspec.msgpack.encode({"op": "nope"}),
            msgspec.msgpack.encode({"op": "attach", "buffer_id": bid, "x": 1}),
            msgspec.msgpack.encode({"op": "welcome", "tenant_id": "t"}),
            msgspec.msgpack.encode([1, 2]),
            b"",
        ]
        for body in bad_bodies:
            r.send_raw(HEADER.pack(len(body)) + body)
            reply, fds = r.recv()
            assert isinstance(reply, Error), (body, reply)
            assert reply.status == 400, (body, reply)
            assert reply.detail
            assert fds == []
        reply, _ = r.call(Hello(api_key=tenant[1]))  # a second hello is a bad frame too
        assert isinstance(reply, Error)
        assert reply.status == 400
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        assert len(fds) == 1
        os.close(fds[0])
    env.release(tenant, bid)


def test_renew_and_detach(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(tenant[1])
        assert r.call(Renew(buffer_id=bid, ttl_s=120)) == (Ok(), [])
        reply, _ = r.call(Renew(buffer_id=bid, ttl_s=0))
        assert isinstance(reply, Error)
        assert reply.status == 400
        reply, fds = r.call(Attach(buffer_id=bid))
        os.close(fds[0])
        assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
        reply, _ = r.call(Detach(buffer_id=bid))  # no longer attached here
        assert isinstance(reply, Error)
        assert reply.status == 404
    env.release(tenant, bid)


def test_revoked_key_while_connected_answers_401_and_closes(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    key, revoke = env.revocable_key(tenant[0])
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(key)
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])
        revoke()
        reply, fds = r.call_racing_close(Renew(buffer_id=bid, ttl_s=60))
        assert isinstance(reply, Error)
        assert reply.status == 401
        assert fds == []
        assert r.closed_by_peer()
    wait_until(lambda: env.attached(tenant[0]) == 0, message="the attachment it held is dropped")
    env.release(tenant, bid)


def test_an_idle_connection_of_a_revoked_key_is_closed_without_a_request(env):
    """A revoked key answers 401 at once on the socket too — a worker that only
    holds its mapping (sends nothing) is told and cut off, and its attachment dropped."""
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    key, revoke = env.revocable_key(tenant[0])
    other = Raw(env.socket_path)  # another key of the same tenant: not affected
    with contextlib.closing(Raw(env.socket_path)) as r, contextlib.closing(other):
        r.hello(key)
        other.hello(tenant[1])
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])
        revoke()
        reply, fds = r.recv()  # nothing sent: the daemon speaks first
        assert isinstance(reply, Error)
        assert reply.status == 401
        assert fds == []
        assert r.closed_by_peer()
        reply, fds = other.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])
    wait_until(lambda: env.attached(tenant[0]) == 0, message="the attachments are dropped")
    env.release(tenant, bid)


def test_closing_a_connection_drops_its_attachments(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    base = env.attached(tenant[0])
    r = Raw(env.socket_path)
    r.hello(tenant[1])
    for _ in range(3):
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])
    assert env.attached(tenant[0]) == base + 3
    assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
    assert env.attached(tenant[0]) == base + 2
    r.close()
    wait_until(lambda: env.attached(tenant[0]) == base, message="closing drops its attachments")
    env.release(tenant, bid)


def test_many_concurrent_connections(env):
    tenant = env.new_tenant()
    bid = env.reserve(tenant)
    failures: list[BaseException] = []

    def one() -> None:
        try:
            with contextlib.closing(Raw(env.socket_path, timeout=20)) as r:
                r.hello(tenant[1])
                for _ in range(5):
                    reply, fds = r.call(Attach(buffer_id=bid))
                    assert isinstance(reply, Attached)
                    assert len(fds) == 1
                    os.close(fds[0])
        except BaseException as exc:  # collected for the main thread
            failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    wait_until(lambda: env.attached(tenant[0]) == 0, message="every attachment is dropped")
    env.release(tenant, bid)


# --- the broker itself (fake service) -----------------------------------------------------


def test_unexpected_exception_is_500_and_the_connection_survives(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    with contextlib.closing(Raw(fake.socket_path)) as r:
        r.hello(tenant[1])
        reply, fds = r.call(Attach(buffer_id="boom"))
        assert isinstance(reply, Error)
        assert reply.status == 500
        assert fds == []
        assert "simulated" not in reply.detail  # internals stay in the log
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])


def test_the_key_is_checked_at_hello_and_again_only_after_a_revocation(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    checks: list[str] = []
    authenticate = fake.svc.authenticate

    def counting(token: str):
        checks.append(token)
        return authenticate(token)

    fake.svc.authenticate = counting
    key, revoke = fake.revocable_key(tenant[0])
    with contextlib.closing(Raw(fake.socket_path)) as r:
        r.hello(key)
        for _ in range(20):
            reply, fds = r.call(Attach(buffer_id=bid))
            assert isinstance(reply, Attached)
            os.close(fds[0])
            assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
        assert checks == [key]  # once, at hello: no ledger read per op
        _other, revoke_other = fake.revocable_key(tenant[0])
        revoke_other()  # any revocation moves the generation: the next op checks again
        reply, fds = r.call(Attach(buffer_id=bid))
        assert isinstance(reply, Attached)
        os.close(fds[0])
        assert checks == [key, key]
        reply, fds = r.call(Attach(buffer_id=bid))
        os.close(fds[0])
        assert checks == [key, key]
        revoke()
        reply, fds = r.call(Detach(buffer_id=bid))  # an inline op, refused at once
        assert isinstance(reply, Error)
        assert reply.status == 401
        assert r.closed_by_peer()


def test_a_connection_forgets_the_entries_released_without_it(fake):
    """An entry released behind its writer's back (its lease ended, a DELETE) is forgotten
    at the writer's next put: what a connection remembers is bounded by what it holds."""
    tenant = fake.new_tenant()
    with contextlib.closing(Raw(fake.socket_path)) as r:
        r.hello(tenant[1])
        gone, fds = r.call(Put(key="a", size_bytes=4096))
        assert isinstance(gone, Reserved)
        os.close(fds[0])
        fake.svc.abandon_entry(fake.svc.authenticate(tenant[1]), gone.buffer_id)  # released
        kept, fds = r.call(Put(key="b", size_bytes=4096))
        assert isinstance(kept, Reserved)
        os.close(fds[0])
        assert fake.svc.entry_staged(kept.buffer_id)
        assert not fake.svc.entry_staged(gone.buffer_id)
        (conn,) = fake.broker._loop.table.conns
        # (the reply went from the slow pool's thread; the loop applies the rest after it)
        wait_until(lambda: conn.staged == {kept.buffer_id}, message="the put applied")
        reply, _ = r.call(Commit(buffer_id=gone.buffer_id))  # no longer this connection's
        assert isinstance(reply, Error)
        assert reply.status == 404
        assert r.call(Commit(buffer_id=kept.buffer_id)) == (Ok(), [])
        assert not fake.svc.entry_staged(kept.buffer_id)  # committed


def test_a_connection_that_closes_abandons_the_entries_it_did_not_commit(fake):
    tenant = fake.new_tenant()
    r = Raw(fake.socket_path)
    r.hello(tenant[1])
    staged, fds = r.call(Put(key="a", size_bytes=4096))
    assert isinstance(staged, Reserved)
    os.close(fds[0])
    kept, fds = r.call(Put(key="b", size_bytes=4096))
    assert isinstance(kept, Reserved)
    os.close(fds[0])
    assert r.call(Commit(buffer_id=kept.buffer_id)) == (Ok(), [])
    aborted, fds = r.call(Put(key="c", size_bytes=4096))
    os.close(fds[0])
    assert r.call(Abort(buffer_id=aborted.buffer_id)) == (Ok(), [])
    r.close()
    wait_until(lambda: staged.buffer_id in fake.svc.abandoned, message="abandoned on close")
    assert fake.svc.abandoned == [aborted.buffer_id, staged.buffer_id]
    with contextlib.closing(Raw(fake.socket_path)) as r2:
        r2.hello(tenant[1])
        found, fds = r2.call(Lookup(keys=["a", "b", "c"]))
        assert isinstance(found, Found)
        assert found.buffer_id == kept.buffer_id
        os.close(fds[0])


def test_stop_closes_connections_drops_attachments_and_unlinks(tmp_path):
    e = FakeEnv(tmp_path)
    tenant = e.new_tenant()
    bid = e.reserve(tenant)
    r = Raw(e.socket_path)
    r.hello(tenant[1])
    _, fds = r.call(Attach(buffer_id=bid))
    os.close(fds[0])
    assert e.broker.connections == 1
    e.broker.stop()
    assert not os.path.exists(e.socket_path)
    assert r.closed_by_peer()
    assert e.svc.attached[tenant[0]] == 0
    assert e.broker.connections == 0
    r.close()
    e.broker.stop()  # idempotent


def test_stale_socket_is_replaced_but_a_live_one_is_not(tmp_path):
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # file left behind, nobody listening
    svc = FakeService().use_cases()
    with Broker(svc, path) as b:
        assert os.path.exists(path)
        with pytest.raises(FileExistsError):
            Broker(svc, path).start()
        wait_until(lambda: b.connections == 0, message="the refused broker's probe is closed")
    assert not os.path.exists(path)


def test_idle_connection_without_hello_is_closed(tmp_path):
    e = FakeEnv(tmp_path, Limits(hello_timeout_s=0.2))
    try:
        with contextlib.closing(Raw(e.socket_path)) as r:
            reply, _ = r.recv()
            assert isinstance(reply, Error)
            assert reply.status == 400
            assert "no hello within 0.2 s" in reply.detail
            assert r.closed_by_peer()
    finally:
        e.close()


# --- Worker against the in-process broker ---------------------------------------------------


def test_worker_attach_maps_the_memfd_zero_copy(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant, 2 * MiB)
    with Worker(fake.socket_path, tenant[1], renew_interval_s=0) as w:
        assert w.tenant_id == tenant[0]
        m = w.attach(bid)
        assert m.size == 2 * MiB
        assert m.numa_node == 0
        assert m.buffer_id == bid
        assert m.array.dtype == np.uint8
        assert m.array.shape == (2 * MiB,)
        assert m.array.flags.writeable
        assert not m.array.flags.owndata
        m.array[:3] = [1, 2, 3]
        m.array[-1] = 9
        _t, fd, _s = fake.svc.buffers[bid]
        assert os.pread(fd, 3, 0) == b"\x01\x02\x03"
        assert os.pread(fd, 1, 2 * MiB - 1) == b"\x09"
        assert fake.attached(tenant[0]) == 1
        assert w.attached == [bid]
    assert m.closed
    with pytest.raises(ValueError, match="is closed"):
        _ = m.array
    wait_until(lambda: fake.attached(tenant[0]) == 0, message="leaving the worker detaches")


def test_worker_detach_and_mapping_close_tell_the_daemon(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    with Worker(fake.socket_path, tenant[1], renew_interval_s=0) as w:
        m1, m2 = w.attach(bid), w.attach(bid)
        assert fake.attached(tenant[0]) == 2
        m1.close()
        m1.close()  # idempotent
        assert fake.attached(tenant[0]) == 1
        w.detach(bid)
        assert m2.closed
        assert fake.attached(tenant[0]) == 0
        with pytest.raises(NotFound):
            w.detach(bid)
        with pytest.raises(NotFound):
            w.attach(uuid.uuid4().hex)


def test_mapping_close_tolerates_live_numpy_views(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    with Worker(fake.socket_path, tenant[1], renew_interval_s=0) as w:
        m = w.attach(bid)
        view = m.array[10:20]
        view[:] = 5
        fd = m.fd
        m.close()  # must not raise although `view` still exports the mmap
        assert m.closed
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
        assert int(view.sum()) == 50  # still mapped until the view dies
        del view


def test_worker_renews_attached_leases_in_the_background(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    with Worker(fake.socket_path, tenant[1], ttl_s=30, renew_interval_s=0.05) as w:
        w.attach(bid)
        wait_until(lambda: len(fake.svc.renewals) >= 3, timeout=5, message="three renewals")
        assert set(fake.svc.renewals) == {(bid, 30)}
    time.sleep(0.2)  # a renew already sent when the worker closed may still land
    n = len(fake.svc.renewals)
    time.sleep(0.2)
    assert len(fake.svc.renewals) == n  # the thread stopped with the worker


def test_worker_with_a_revoked_key(fake):
    tenant = fake.new_tenant()
    bid = fake.reserve(tenant)
    key, revoke = fake.revocable_key(tenant[0])
    w = Worker(fake.socket_path, key, renew_interval_s=0)
    m = w.attach(bid)
    revoke()
    with pytest.raises(Unauthorized) as info:
        w.renew(bid)
    assert info.value.status == 401
    assert info.value.problem["status"] == 401
    with pytest.raises(ConnectionFailed):
        w.attach(bid)
    m.array[0] = 1  # the mapping itself stays valid
    w.close()
    assert m.closed
    with pytest.raises(Unauthorized):
        Worker(fake.socket_path, key)


def test_worker_on_a_missing_socket(tmp_path):
    with pytest.raises(ConnectionFailed):
        Worker(str(tmp_path / "nothing.sock"), "k")


def test_worker_is_thread_safe(fake):
    tenant = fake.new_tenant()
    bids = [fake.reserve(tenant, 64 * 1024) for _ in range(4)]
    failures: list[BaseException] = []
    with Worker(fake.socket_path, tenant[1], renew_interval_s=0.01) as w:

        def loop(bid: str) -> None:
            try:
                for _ in range(25):
                    with w.attach(bid) as m:
                        m.array[0] = 1
                    w.renew(bid, 60)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=loop, args=(b,)) for b in bids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert failures == []
    wait_until(lambda: fake.attached(tenant[0]) == 0, message="every attachment is dropped")


def test_an_attach_answers_the_lease_the_buffer_was_reserved_with(daemon):
    """What a worker renews the buffer to while it is attached (``Attached.ttl_s``)."""
    env = DaemonEnv(daemon)
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant)  # leased 300 s
        with contextlib.closing(Raw(env.socket_path)) as r:
            r.hello(tenant[1])
            reply, fds = r.call(Attach(buffer_id=bid))
            for fd in fds:
                os.close(fd)
            assert reply == Attached(buffer_id=bid, size_bytes=MiB, numa_node=0, ttl_s=300)
        env.release(tenant, bid)
    finally:
        env.close()


@pytest.mark.parametrize("ttl_s", [2**31 + 1, 2**62, -1])
def test_a_renew_with_an_absurd_ttl_is_refused_and_changes_nothing(daemon, ttl_s):
    """``ttl_s`` on the socket is bounded as REST's is (``maasd.bounds.TtlS``): a 400 that
    names the field, the lease as it was, the connection and the daemon still serving."""
    env = DaemonEnv(daemon)
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant)
        before = env._client(tenant[1]).buffer(bid).expires_at
        with contextlib.closing(Raw(env.socket_path)) as r:
            r.hello(tenant[1])
            reply, fds = r.call(Renew(buffer_id=bid, ttl_s=ttl_s))
            assert fds == []
            assert isinstance(reply, Error)
            assert reply.status == 400
            assert "$.ttl_s" in reply.detail
            assert env._client(tenant[1]).buffer(bid).expires_at == before
            assert r.call(Renew(buffer_id=bid, ttl_s=60)) == (Ok(), [])  # still served
        assert env.healthy()
        env.release(tenant, bid)
    finally:
        env.close()


def test_the_broker_is_wired_by_its_constructor_and_its_service_protocol(tmp_path):
    """``events`` reaches the connection table through the constructors, and the broker
    subscribes to revocations and releases through its use cases (``auth``, ``entries``):
    a revocation wakes the loop, which cuts the key's idle connection with a 401."""
    svc = FakeService()
    events: list[str] = []
    path = str(tmp_path / "s.sock")
    with Broker(svc.use_cases(), path, limits=Limits(max_per_uid=1), events=events.append):
        assert len(svc.revocation_watchers) == 1
        assert len(svc.release_watchers) == 1
        key = svc.add_key("t1")
        with contextlib.closing(Raw(path)) as r:
            r.hello(key)
            with contextlib.closing(Raw(path)) as second:  # over max_per_uid: refused, counted
                reply, _ = second.recv()
                assert isinstance(reply, Error)
                assert reply.status == 429
            wait_until(lambda: "refused" in events, message="the refusal is counted")
            svc.revoke(key)
            reply, _ = r.recv()
            assert isinstance(reply, Error)
            assert reply.status == 401
