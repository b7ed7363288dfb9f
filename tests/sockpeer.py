"""Peers of the handle socket for tests: a raw frame client and a fake service.

``Raw`` is the test's own socket code (not ``maasd.client``): frames in, (reply,
fds) out. ``FakeService`` is enough of the daemon's service for the broker —
keys, real sealed memfds, an attachment gauge — so broker tests need no ledger.
Import as ``from sockpeer import Raw, FakeService`` (``tests/`` is on the path).
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import mmap
import os
import socket
import threading
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass

from maasd import errors
from maasd.broker import Broker, Limits
from maasd.core.publish import check_source
from maasd.core.tiers import LATER, Later
from maasd.models import BufferInfo, Principal
from maasd.protocol import (
    Error,
    Found,
    FrameReader,
    Hello,
    Lookup,
    Released,
    Welcome,
    decode_reply,
    encode_frame,
)

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MiB = 1 << 20


# --- a raw client: the test's own socket code, not maasd.client -------------------


class Raw:
    """A bare connection to the handle socket: frames in, (reply, fds) out."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.reader = FrameReader()
        #: ids of the entries the daemon said were released (pushed ``released`` frames)
        self.pushed: list[str] = []

    def send(self, msg) -> None:
        self.sock.sendall(encode_frame(msg))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_fds(self, data: bytes, fds: list[int]) -> None:
        """``data`` in one ``sendmsg`` with ``fds`` (SCM_RIGHTS) on its first byte."""
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = self.sock.sendmsg([data], anc)
        if sent < len(data):
            self.sock.sendall(data[sent:])

    def call_fds(self, msg, fds: list[int]):
        """``call`` with ``fds`` sent on the frame's first byte (a publish's memfd)."""
        self.send_fds(encode_frame(msg), fds)
        return self.recv()

    def recv(self):
        """Next reply and the fds that came with it; (None, fds) at EOF. Pushed
        ``released`` frames are not replies: their ids go to :attr:`pushed`."""
        while True:
            reply, fds = self._recv_frame()
            if not isinstance(reply, Released):
                return reply, fds
            self.pushed.append(reply.buffer_id)
            assert fds == []

    def _recv_frame(self):
        fds: list[int] = []
        while True:
            body = self.reader.next_frame()
            if body is not None:
                return decode_reply(body), fds
            data, anc, flags, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
            assert not flags & socket.MSG_CTRUNC
            for level, kind, payload in anc:
                assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
                fds.extend(array.array("i", payload))
            if not data:
                return None, fds
            body = self.reader.next_frame(data)
            if body is not None:
                return decode_reply(body), fds

    def call(self, msg):
        self.send(msg)
        return self.recv()

    def call_racing_close(self, msg):
        """``call`` for a connection the daemon may be closing: if it was quicker (it told
        an idle connection something, e.g. a 401 for a revoked key, and closed it before
        ``msg`` went out), the frame it sent is still there to read."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send(msg)
        return self.recv()

    def hello(self, key: str) -> Welcome:
        reply, fds = self.call(Hello(api_key=key))
        assert fds == []
        assert isinstance(reply, Welcome), reply
        return reply

    def closed_by_peer(self) -> bool:
        """True once the daemon has closed its end (EOF, or a reset)."""
        try:
            while True:
                reply, fds = self.recv()
                for fd in fds:
                    os.close(fd)
                if reply is None:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def lookup(r: Raw, keys: list[str]) -> tuple[Found, int]:
    """A lookup that must hit: the answer and its one fd."""
    reply, fds = r.call(Lookup(keys=keys))
    assert isinstance(reply, Found), reply
    assert len(fds) == 1
    return reply, fds[0]


def miss(r: Raw, keys: list[str]) -> None:
    """A lookup that must miss: a 404 frame and no fd."""
    reply, fds = r.call(Lookup(keys=keys))
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == 404, reply


# --- the fake service ---------------------------------------------------------------


@dataclass(frozen=True)
class FakeHandle:
    fd: int
    buffer_id: str
    size_bytes: int
    numa_node: int
    key: str = ""
    ttl_s: int = 0


class FakeService:
    """Enough of the core for the broker: keys, sealed memfds, a gauge, and entries kept
    in dicts (a put is a memfd; a commit files it under its key). The broker is built
    with :meth:`use_cases`: the same methods, in the shape of the core's use-case objects
    (maasd.broker.dispatch.UseCases)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.auth_generation = 0
        self.keys: dict[str, Principal] = {}
        #: entry id -> (tenant, key, fd, size); committed ones are also in ``by_key``
        self.entries: dict[str, tuple[str, str, int, int]] = {}
        self.by_key: dict[tuple[str, str], str] = {}
        self.abandoned: list[str] = []
        #: (key, bytes) of each publish the fake served
        self.published: list[tuple[str, bytes]] = []
        self.buffers: dict[str, tuple[str, int, int]] = {}  # id -> (tenant, fd, size)
        self.attached: collections.Counter[str] = collections.Counter()
        self.renewals: list[tuple[str, int]] = []
        #: tenant_id -> an event its renews wait for (a slow ledger, for the slow-pool tests)
        self.renew_gates: dict[str, threading.Event] = {}
        #: tenant_id -> an event its attaches wait for (an inline call that blocks the loop)
        self.attach_gates: dict[str, threading.Event] = {}
        #: a shared tier in a dict: (tenant, key) -> size; None: no tier (a miss is final)
        self.remote: dict[tuple[str, str], int] | None = None
        #: what a fill waits for (a slow L2), and the threads fills ran on
        self.fill_gate: threading.Event | None = None
        self.fill_threads: list[str] = []
        #: who is told of a revocation (the broker's loop wakes)
        self.revocation_watchers: list[Callable[[], None]] = []
        #: who is told of a released entry someone holds (the broker's pushes)
        self.release_watchers: list[Callable[[str], None]] = []

    def use_cases(self) -> FakeUseCases:
        return FakeUseCases(self)

    def add_key(self, tenant_id: str) -> str:
        key = uuid.uuid4().hex
        self.keys[key] = Principal(is_admin=False, tenant_id=tenant_id, key_id=key[:8])
        return key

    def revoke(self, key: str) -> None:
        self.keys.pop(key, None)
        self.auth_generation += 1
        for watcher in self.revocation_watchers:
            watcher()

    def reserve(self, tenant_id: str, size: int) -> str:
        fd = os.memfd_create("fake", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        bid = uuid.uuid4().hex
        self.buffers[bid] = (tenant_id, fd, size)
        return bid

    def release(self, bid: str) -> None:
        _tenant, fd, size = self.buffers.pop(bid)
        with mmap.mmap(fd, size) as mm:
            mm[:] = bytes(size)
        os.close(fd)

    # the four methods the broker calls
    def authenticate(self, token: str) -> Principal:
        p = self.keys.get(token)
        if p is None:
            raise errors.Unauthorized("unknown or revoked API key")
        return p

    def open_handle(self, who: Principal, buffer_id: str) -> FakeHandle:
        if buffer_id == "boom":
            raise RuntimeError("simulated bug")
        gate = self.attach_gates.get(str(who.tenant_id))
        if gate is not None:
            gate.wait(60)
        with self.lock:
            b = self.buffers.get(buffer_id)
            if b is None or b[0] != who.tenant_id:
                raise errors.NotFound(f"no buffer {buffer_id!r}")
            self.attached[b[0]] += 1
            return FakeHandle(fd=os.dup(b[1]), buffer_id=buffer_id, size_bytes=b[2], numa_node=0)

    def drop_handle(self, who: Principal, _buffer_id: str) -> None:
        with self.lock:
            assert who.tenant_id is not None
            self.attached[who.tenant_id] -= 1

    def renew(self, who: Principal, buffer_id: str, ttl_s: int):
        b = self.buffers.get(buffer_id)
        if b is None or b[0] != who.tenant_id:
            raise errors.NotFound(f"no buffer {buffer_id!r}")
        if ttl_s <= 0:
            raise errors.InvalidRequest("ttl_s must be >= 1")
        gate = self.renew_gates.get(b[0])
        if gate is not None:
            gate.wait(60)
        self.renewals.append((buffer_id, ttl_s))
        return None

    # entries
    def lookup_entry(
        self, who: Principal, keys: list[str], attached: Container[str] = ()
    ) -> FakeHandle | None:
        with self.lock:
            for key in reversed(keys):
                bid = self.by_key.get((str(who.tenant_id), key))
                if bid is not None:
                    _t, _k, fd, size = self.entries[bid]
                    if bid not in attached:
                        self.attached[str(who.tenant_id)] += 1
                    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                    return FakeHandle(ro, bid, size, 0, key)
        return None

    def l2_ready(self) -> bool:
        return self.remote is not None

    def fill_ready(self, _principal: Principal, _keys: list[str]) -> bool:
        return self.l2_ready()

    def fill_entry(
        self, who: Principal, keys: list[str], attached: Container[str] = ()
    ) -> FakeHandle | None:
        """A miss asked of the fake tier: a hit becomes a committed local entry."""
        self.fill_threads.append(threading.current_thread().name)
        if self.fill_gate is not None:
            self.fill_gate.wait(60)
        tenant = str(who.tenant_id)
        for key in reversed(keys):
            size = (self.remote or {}).get((tenant, key))
            if size is not None:
                h = self.put_entry(who, key, size)
                os.close(h.fd)
                self.commit_entry(who, h.buffer_id, owned=True)
                return self.lookup_entry(who, keys, attached)
        return None

    def put_entry(
        self, who: Principal, key: str, size: int, _pool: str | None = None, _ttl: int | None = None
    ) -> FakeHandle:
        fd = os.memfd_create("fake-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        bid = uuid.uuid4().hex
        with self.lock:
            self.entries[bid] = (str(who.tenant_id), key, fd, size)
        return FakeHandle(os.dup(fd), bid, size, 0, key)

    def publish_entry(
        self,
        who: Principal,
        key: str,
        fd: int,
        size: int,
        pool: str | None = None,
        ttl: int | None = None,
    ) -> BufferInfo:
        """The daemon's check of the writer's fd, then its first ``size`` bytes in a put
        entry of the fake, committed (what the fake saw is in ``published``)."""
        check_source(fd, size)
        h = self.put_entry(who, key, size, pool, ttl)
        try:
            data = os.pread(fd, size, 0)
            os.pwrite(h.fd, data, 0)
        finally:
            os.close(h.fd)
        self.commit_entry(who, h.buffer_id, owned=True)
        self.published.append((key, data))
        return BufferInfo(
            id=h.buffer_id, tenant_id=str(who.tenant_id), pool_id="fake", size_bytes=size,
            numa_node=0, persistence="volatile", label=None, key=key, evictable=True,
            state="live", created_at="", expires_at="",
        )  # fmt: skip

    def commit_entry(self, who: Principal, bid: str, *, owned: bool) -> None:
        with self.lock:
            entry = self.entries.get(bid)
            if entry is None or entry[0] != who.tenant_id:
                raise errors.NotFound(f"no entry {bid!r}")
            if not owned:
                raise errors.StateConflict(f"entry {bid} was not put on this connection")
            self.by_key[(entry[0], entry[1])] = bid

    def abort_entry(self, who: Principal, bid: str, *, owned: bool) -> None:
        if not owned:
            raise errors.NotFound(f"no entry {bid!r}")
        self.abandon_entry(who, bid)

    def entry_staged(self, bid: str) -> bool:
        with self.lock:
            entry = self.entries.get(bid)
            return entry is not None and self.by_key.get((entry[0], entry[1])) != bid

    def abandon_entry(self, _who: Principal, bid: str) -> None:
        with self.lock:
            entry = self.entries.get(bid)
            if entry is None or self.by_key.get((entry[0], entry[1])) == bid:
                return  # gone, or committed
            del self.entries[bid]
            os.close(entry[2])
            self.abandoned.append(bid)


class FakeUseCases:
    """A :class:`FakeService` in the shape the broker is built with: ``auth``, ``handles``,
    ``buffers``, ``entries``, ``lookups``, ``publishes`` — each the fake's own methods, looked up at call
    time (a test may replace one on the fake)."""

    def __init__(self, svc: FakeService) -> None:
        self.auth = _FakeAuth(svc)
        self.handles = _FakeHandles(svc)
        self.buffers = _FakeLeases(svc)
        self.entries = _FakeEntries(svc)
        self.lookups = _FakeLookups(svc)
        self.publishes = _FakePublishes(svc)


@dataclass
class _FakeAuth:
    svc: FakeService

    @property
    def generation(self) -> int:
        return self.svc.auth_generation

    def authenticate(self, token: str) -> Principal:
        return self.svc.authenticate(token)

    def known_principal(self, token: str | None) -> Principal | None:
        return self.svc.keys.get(token or "")  # all in memory: nothing needs the slow pool

    def watch_revocations(self, callback: Callable[[], None]) -> None:
        self.svc.revocation_watchers.append(callback)


@dataclass
class _FakeHandles:
    svc: FakeService

    def open(self, who: Principal, buffer_id: str) -> FakeHandle:
        return self.svc.open_handle(who, buffer_id)

    def drop(self, who: Principal, buffer_id: str) -> None:
        self.svc.drop_handle(who, buffer_id)


@dataclass
class _FakeLeases:
    svc: FakeService

    def renew(self, who: Principal, buffer_id: str, ttl_s: int) -> None:
        return self.svc.renew(who, buffer_id, ttl_s)


@dataclass
class _FakeEntries:
    svc: FakeService

    def put(
        self, who: Principal, key: str, size: int, pool: str | None = None, ttl: int | None = None
    ) -> FakeHandle:
        return self.svc.put_entry(who, key, size, pool, ttl)

    def commit(self, who: Principal, bid: str, *, owned: bool) -> None:
        self.svc.commit_entry(who, bid, owned=owned)

    def abort(self, who: Principal, bid: str, *, owned: bool) -> None:
        self.svc.abort_entry(who, bid, owned=owned)

    def abandon(self, who: Principal, bid: str) -> None:
        self.svc.abandon_entry(who, bid)

    def staged(self, bid: str) -> bool:
        return self.svc.entry_staged(bid)

    def watch_releases(self, callback: Callable[[str], None]) -> None:
        self.svc.release_watchers.append(callback)  # the fake never releases a held entry


@dataclass
class _FakePublishes:
    svc: FakeService

    def publish(
        self,
        who: Principal,
        key: str,
        fd: int,
        size: int,
        pool: str | None = None,
        ttl: int | None = None,
    ) -> BufferInfo:
        return self.svc.publish_entry(who, key, fd, size, pool, ttl)


@dataclass
class _FakeLookups:
    """The core's lookup order (maasd.core.tiers) over the fake: memory, then its tier."""

    svc: FakeService

    def find(
        self,
        who: Principal,
        keys: list[str],
        attached: Container[str] = (),
        *,
        may_wait: bool = True,
    ) -> FakeHandle | Later | None:
        found = self.svc.lookup_entry(who, keys, attached)
        if found is not None or not self.svc.fill_ready(who, keys):
            return found
        if not may_wait:
            return LATER
        return self.svc.fill_entry(who, keys, attached)


class FakeEnv:
    """A real :class:`Broker` on a socket in ``tmp_path``, over a :class:`FakeService`."""

    kind = "fake"

    def __init__(self, tmp_path, limits: Limits | None = None, group: int | None = None) -> None:
        self.svc = FakeService()
        self.socket_path = str(tmp_path / "maasd.sock")
        self.broker = Broker(self.svc.use_cases(), self.socket_path, group=group, limits=limits)
        self.broker.start()

    def new_tenant(self) -> tuple[str, str]:
        tid = "t-" + uuid.uuid4().hex[:8]
        return tid, self.svc.add_key(tid)

    def revocable_key(self, tenant_id: str) -> tuple[str, object]:
        key = self.svc.add_key(tenant_id)
        return key, lambda: self.svc.revoke(key)

    def reserve(self, tenant: tuple[str, str], size: int = MiB) -> str:
        return self.svc.reserve(tenant[0], size)

    def release(self, _tenant: tuple[str, str], bid: str) -> None:
        self.svc.release(bid)

    def healthy(self) -> bool:
        with contextlib.closing(Raw(self.socket_path)) as r:
            tid, key = self.new_tenant()
            return isinstance(r.call(Hello(api_key=key))[0], Welcome)

    def attached(self, tenant_id: str) -> float:
        with self.svc.lock:
            return float(self.svc.attached[tenant_id])

    def close(self) -> None:
        self.broker.stop()
        # The fake's memfds live in the test process: a test that reserves in a loop
        # (thousands) would otherwise leave them to the garbage collector, and a later
        # test's select() (pexpect) fails on fd numbers above 1024.
        with self.svc.lock:
            buffers, self.svc.buffers = self.svc.buffers, {}
        for _tenant, fd, _size in buffers.values():
            os.close(fd)


def serve_main(directory: str, limits: str = "{}") -> None:
    """Run a :class:`FakeEnv` broker in this process, driven over stdin/stdout (JSON lines).

    ``limits`` is a JSON object of :class:`Limits` fields. Prints
    ``{"socket", "key", "buffer"}`` once serving, then answers each command:
    ``nofile N`` (lower this process's soft open-files limit to N), ``fds`` (open
    fds now), ``health`` (``Broker.healthy()``), ``drop UID`` (become that user:
    real, effective and saved ids), ``nproc`` (lower RLIMIT_NPROC to the threads
    this real uid runs now, and show that a new thread is refused), ``threads``
    (threads of this process), ``quit``.
    """
    import json
    import resource
    import sys
    from pathlib import Path

    def threads_of_uid(uid: int) -> int:
        count = 0
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, ValueError, StopIteration):
                lines = Path(f"/proc/{entry}/status").read_text().splitlines()
                if int(next(x for x in lines if x.startswith("Uid:")).split()[1]) == uid:
                    count += int(next(x for x in lines if x.startswith("Threads:")).split()[1])
        return count

    def nproc() -> dict[str, object]:
        # Other processes of this uid may come and go meanwhile: count again until
        # the limit is exactly what runs now, so that one more thread is refused.
        probe = ""
        for _ in range(10):
            count = threads_of_uid(os.getuid())
            hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            resource.setrlimit(resource.RLIMIT_NPROC, (count, hard))
            try:
                t = threading.Thread(target=int)
                t.start()
                t.join()
                probe = "started"
            except RuntimeError as exc:
                return {"limit": count, "probe": f"refused: {exc}"}
        return {"limit": count, "probe": probe}

    env = FakeEnv(Path(directory), Limits(**json.loads(limits)))
    tenant = env.new_tenant()
    print(
        json.dumps({"socket": env.socket_path, "key": tenant[1], "buffer": env.reserve(tenant)}),
        flush=True,
    )
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "nofile":
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(args[0]), hard))
            answer: object = "ok"
        elif cmd == "fds":
            answer = len(os.listdir("/proc/self/fd"))
        elif cmd == "health":
            answer = list(env.broker.healthy())
        elif cmd == "drop":
            uid = int(args[0])
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            answer = [os.getuid(), os.geteuid()]
        elif cmd == "nproc":
            answer = nproc()
        elif cmd == "threads":
            answer = threading.active_count()
        else:
            break
        print(json.dumps(answer), flush=True)
    env.close()


if __name__ == "__main__":
    import sys

    serve_main(*sys.argv[1:])
