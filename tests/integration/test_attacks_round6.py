"""A hostile peer of the handle socket against the broker split by owner: admission
(caps, shedding, the hello deadline), holdings (taken before a reply is sent, given
back at close), the outbox (queued replies, the send deadline, fds in flight) and
frames (one in flight, the slow pool).

Each test is a real daemon of its own with small socket limits. Each ends with the
daemon healthy (:func:`hardening.after_attack`), the tenant's usage exactly what it
was before the attack, and the daemon's open fds and memfds back to what they were.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from hardening import after_attack, daemon_fds, ledger_ids, tenant_usage
from maasd.client import Worker
from maasd.protocol import (
    Abort,
    Attach,
    Commit,
    Error,
    Found,
    Hello,
    Lookup,
    Ok,
    Put,
    Renew,
    Reserved,
    Welcome,
    encode_frame,
)
from sockflood import flood
from sockpeer import Raw, lookup, miss
from waiting import wait_until

MiB = 1 << 20
PER_TENANT = 4
#: one uid's share of it (half) is above the per-tenant floods: they are not shed
UNAUTHENTICATED = 16

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reads the daemon's /proc/PID/fd")


@pytest.fixture
def d(tmp_path: Path) -> Iterator[Daemon]:
    env = {
        "MAASD_SOCKET_SEND_TIMEOUT_S": "1",
        "MAASD_SOCKET_HELLO_TIMEOUT_S": "1",
        "MAASD_SOCKET_MAX_PER_TENANT": str(PER_TENANT),
        "MAASD_SOCKET_MAX_UNAUTHENTICATED": str(UNAUTHENTICATED),
    }
    daemon = Daemon(tmp_path / "maasd", env=env)
    daemon.start()
    yield daemon
    daemon.close()


def _fds(d: Daemon) -> int:
    """The daemon's open fds, but for its ledger's files: the SQLite pool opens a
    connection (the database and its WAL) per thread that first needs one, up to its
    size, and keeps it — that is not what a connection of the socket leaves behind."""
    assert d.proc is not None
    return sum(1 for link in daemon_fds(d.proc.pid) if not _LEDGER.search(link))


_LEDGER = re.compile(r"/maasd\.db(-wal|-shm)?$")


def _memfds(d: Daemon) -> list[str]:
    """The daemon's open memfds, by name (sorted)."""
    assert d.proc is not None
    names = []
    for fd in Path(f"/proc/{d.proc.pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("/memfd:"):
                names.append(link)
    return sorted(names)


def _usage_now(d: Daemon, key: str) -> dict[str, object] | None:
    """The usage, or ``None`` while the daemon cannot read its ledger (it probes it back)."""
    with d.client(key) as c:
        r = c.get("/v1/usage")
        return dict(r.json()) if r.status_code == 200 and "maasd-stale" not in r.headers else None


class Baseline:
    """What must be exactly back after the attack: usage, open fds, memfds."""

    def __init__(self, d: Daemon, key: str) -> None:
        self.d, self.key = d, key
        self.usage = tenant_usage(d, key)
        self.fds = _fds(d)
        self.memfds = _memfds(d)
        self.rows = sorted(ledger_ids(d))
        assert d.proc is not None
        self.links = collections.Counter(x for x in daemon_fds(d.proc.pid) if not _LEDGER.search(x))

    def check(self) -> None:
        with contextlib.suppress(AssertionError):
            wait_until(lambda: tenant_usage(self.d, self.key) == self.usage, timeout=15)
        assert tenant_usage(self.d, self.key) == self.usage
        with contextlib.suppress(AssertionError):
            wait_until(lambda: _memfds(self.d) == self.memfds, timeout=15)
        assert _memfds(self.d) == self.memfds, "a memfd leaked (or one is missing)"
        with contextlib.suppress(AssertionError):
            wait_until(lambda: _fds(self.d) <= self.fds, timeout=15)
        assert self.d.proc is not None
        links = (x for x in daemon_fds(self.d.proc.pid) if not _LEDGER.search(x))
        extra = collections.Counter(links) - self.links
        assert _fds(self.d) <= self.fds, f"fds leaked: {extra}"
        wait_until(
            lambda: sorted(ledger_ids(self.d)) == self.rows, timeout=15, message="ledger rows back"
        )
        after_attack(self.d)  # alive, healthy, others served, the ledger = the memfds


def _committed(d: Daemon, key: str, entry: str, size: int = 4096) -> None:
    """Commit ``entry``, then look it up once: the daemon keeps a read-only fd of the
    entries last looked up (maasd.core.rofds), which the baseline must include."""
    w = Worker(d.socket_path, key, renew_interval_s=0)
    try:
        w.commit(w.put(entry, size))
    finally:
        w.close()
    peer = Raw(d.socket_path)
    try:
        peer.hello(key)
        _, fd = lookup(peer, [entry])
        os.close(fd)
    finally:
        peer.close()


def _settled(d: Daemon, fds: int) -> None:
    """The daemon has closed the connections a test closed (their counts given back)."""
    wait_until(lambda: _fds(d) <= fds, timeout=15, message="connections closed")


# --- 1. a peer that never reads its replies ---------------------------------------------


def test_a_peer_that_never_reads_puts_and_lookups_gives_everything_back(d: Daemon):
    """A peer pipelines puts and lookups (each reply carries an fd) and never reads one.
    The first fd reply waits in its queue; the rest wait in the daemon (one in flight).
    The send deadline ends the connection (drained while its fd is unread); once the
    peer hangs up, every staged entry is abandoned and every attachment dropped: usage,
    fds and memfds are exactly what they were."""
    _, key = d.tenant("never-reads", 64 * MiB)
    _committed(d, key, "hot")
    base = Baseline(d, key)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(d.socket_path)
    frames = encode_frame(Hello(api_key=key))
    for i in range(40):
        frames += encode_frame(Put(key=f"unread-{i}", size_bytes=64 << 10))
        frames += encode_frame(Lookup(keys=["hot"]))
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        s.sendall(frames)
    time.sleep(3)  # past the send deadline (1 s): the daemon gave up on this peer
    assert d.proc is not None
    assert d.proc.poll() is None
    s.close()
    base.check()
    # the same tenant, on a fresh connection, can use its whole quota again
    w = Worker(d.socket_path, key, renew_interval_s=0)
    try:
        w.commit(w.put("unread-0", 60 * MiB))
    finally:
        w.close()


def test_replies_queued_for_a_stalled_peer_do_not_leak_when_it_reads_late(d: Daemon):
    """A peer stalls long enough for the send deadline, then reads everything it can:
    what it reads is well-formed, and the daemon gives back what it did not deliver."""
    _, key = d.tenant("reads-late", 64 * MiB)
    _committed(d, key, "hot")
    base = Baseline(d, key)
    peer = Raw(d.socket_path, timeout=5)
    peer.hello(key)
    peer.send_raw(b"".join(encode_frame(Lookup(keys=["hot"])) for _ in range(30)))
    time.sleep(2.5)
    got = 0
    with contextlib.suppress(ConnectionResetError, BrokenPipeError, TimeoutError):
        while True:
            reply, fds = peer.recv()
            for fd in fds:
                os.close(fd)
            if reply is None:
                break
            assert isinstance(reply, (Found, Error)), reply
            got += 1
    peer.close()
    assert got >= 1
    base.check()


# --- 2. closing right after a put: the staged entry is given back ---------------------


def test_abrupt_close_after_put_gives_the_entry_back_and_another_tenant_reuses_the_key(
    d: Daemon,
):
    """Hello and a put in one write, then a hang-up before the reply is read (and, half
    the time, before it is sent). Every staged entry is abandoned: usage is exact, no
    memfd is left, nobody finds the key; another tenant puts and commits the same key
    and finds its own entry, not the first tenant's."""
    _, key = d.tenant("hangs-up", 16 * MiB)
    _, other = d.tenant("reuser", 16 * MiB)
    base = Baseline(d, key)
    for i in range(20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket_path)
        s.sendall(encode_frame(Hello(api_key=key)) + encode_frame(Put(key="k", size_bytes=MiB)))
        if i % 2:
            time.sleep(0.05)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # a reset: the reply, if sent, is never read
    base.check()
    probe = Raw(d.socket_path)
    try:
        probe.hello(key)
        miss(probe, ["k"])
    finally:
        probe.close()
    peer = Raw(d.socket_path)
    try:
        peer.hello(other)
        reply, fds = peer.call(Put(key="k", size_bytes=4096))
        assert isinstance(reply, Reserved), reply
        os.pwrite(fds[0], b"\x77" * 4096, 0)
        os.close(fds[0])
        assert peer.call(Commit(buffer_id=reply.buffer_id))[0] == Ok()
        found, fd = lookup(peer, ["k"])
        assert found.buffer_id == reply.buffer_id
        assert os.pread(fd, 4, 0) == b"\x77" * 4
        os.close(fd)
    finally:
        peer.close()
    assert tenant_usage(d, key) == base.usage


def test_close_with_many_staged_entries_and_attachments_gives_them_all_back(d: Daemon):
    """A connection stages entries to its whole quota and attaches a buffer many times,
    then hangs up without commit, abort or detach: all of it is given back at once."""
    _, key = d.tenant("hoarder", 8 * MiB)
    with d.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB})
        assert r.status_code == 201, r.text
        buf = r.json()["id"]
    base = Baseline(d, key)
    peer = Raw(d.socket_path)
    peer.hello(key)
    staged = 0
    while True:
        reply, fds = peer.call(Put(key=f"s-{staged}", size_bytes=MiB))
        for fd in fds:
            os.close(fd)
        if not isinstance(reply, Reserved):
            assert isinstance(reply, Error), reply
            assert reply.status == 409, reply
            break
        staged += 1
    assert staged == 7  # the reserved buffer holds the eighth MiB
    peer.send_raw(b"".join(encode_frame(Renew(buffer_id=buf, ttl_s=60)) for _ in range(10)))
    for _ in range(10):
        reply, fds = peer.call(Attach(buffer_id=buf))
        for fd in fds:
            os.close(fd)
    peer.close()
    base.check()


# --- 3. frames before hello, hello deadline, shedding ---------------------------------


def test_frames_before_hello_and_a_trickled_hello_are_refused_and_counted_back(d: Daemon):
    """Frames sent before any hello are refused; a hello trickled a byte at a time past
    the hello deadline is closed; a flood of silent connections past the cap on
    unauthenticated ones sheds the oldest. Afterwards the counts are all given back: as
    many silent connections as one uid's share of the cap are accepted again, and a tenant is served."""
    _, key = d.tenant("early", 8 * MiB)
    _committed(d, key, "hot")
    base = Baseline(d, key)
    early = Raw(d.socket_path)
    try:
        reply, fds = early.call_racing_close(Lookup(keys=["hot"]))
        assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status in (400, 401), reply
    finally:
        early.close()
    slow = Raw(d.socket_path, timeout=10)
    try:
        frame = encode_frame(Hello(api_key=key))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for b in frame[:-1]:
                slow.send_raw(bytes([b]))
                time.sleep(0.15)
        assert slow.closed_by_peer()
    finally:
        slow.close()
    for _ in range(2):
        with flood(d.socket_path, UNAUTHENTICATED * 3) as summary:
            assert summary["connected"] == UNAUTHENTICATED * 3, summary
            assert summary["welcome"] == 0, summary
            assert any(status == 429 for status, _ in summary["errors"]), summary
        assert d.healthy()
        _settled(d, base.fds)
    with flood(d.socket_path, UNAUTHENTICATED // 2) as summary:
        # one uid's share (half the cap), none shed: the counts of the floods before
        # were given back (the hello deadline may close some meanwhile, and says so)
        assert all(status != 429 for status, _ in summary["errors"]), summary
    base.check()


def test_per_tenant_cap_refuses_past_it_and_gives_back_its_counts(d: Daemon):
    """A tenant opens connections past its cap: exactly the cap is welcomed, the rest
    refused. Once they close, the cap is whole again (three times over)."""
    _, key = d.tenant("crowd", 8 * MiB)
    base = Baseline(d, key)
    for _ in range(3):
        with flood(d.socket_path, PER_TENANT + 3, key=key) as summary:
            assert summary["welcome"] == PER_TENANT, summary
            assert len(summary["errors"]) == 3, summary
            assert all(status == 429 for status, _ in summary["errors"]), summary
        _settled(d, base.fds)
        # the flood's process closed its connections: the cap is whole again
        ok = []
        try:
            for _ in range(PER_TENANT):
                r = Raw(d.socket_path)
                ok.append(r)
                assert isinstance(r.call(Hello(api_key=key))[0], Welcome)
        finally:
            for r in ok:
                r.close()
        _settled(d, base.fds)
    base.check()


# --- 4. pipelining behind a frame on the slow pool ------------------------------------


def test_frames_pipelined_behind_a_slow_pool_frame_are_answered_in_order(d: Daemon):
    """A renew (on the slow pool) with many lookups and puts behind it in one write: the
    replies come in the order of the frames, each put's staged entry is given back when
    the peer hangs up mid-stream."""
    _, key = d.tenant("pipeliner", 32 * MiB)
    _committed(d, key, "hot")
    with d.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB})
        buf = r.json()["id"]
    base = Baseline(d, key)
    peer = Raw(d.socket_path, timeout=10)
    peer.hello(key)
    frames, want = b"", list[type]()
    for i in range(20):
        frames += encode_frame(Renew(buffer_id=buf, ttl_s=300))
        want.append(Ok)
        frames += encode_frame(Lookup(keys=["hot"]))
        want.append(Found)
        frames += encode_frame(Put(key=f"p-{i}", size_bytes=4096))
        want.append(Reserved)
    peer.send_raw(frames)
    for i, kind in enumerate(want[:30]):
        reply, fds = peer.recv()
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, kind), (i, reply)
    peer.close()  # mid-stream: ten puts staged, thirty frames unanswered
    base.check()


# --- 5. the daemon out of fds ---------------------------------------------------------


def test_a_daemon_out_of_fds_answers_errors_and_recovers_exactly(d: Daemon):
    """The daemon's open-files limit is lowered to what it has open now, plus 0 to 3:
    lookups and puts (each needs new fds: a put one for its memfd, one for the writer's
    handle) fail with an error frame, not a crash or a hang, and take nothing — in
    particular a put whose memfd was made but whose writer's fd was refused leaves no
    ledger row, memfd or usage behind. Once the limit is back, the same connection is
    served and everything is exactly as before."""
    assert d.proc is not None
    _, key = d.tenant("starved", 16 * MiB)
    _committed(d, key, "hot")
    peer = Raw(d.socket_path, timeout=15)
    peer.hello(key)
    _, fd = lookup(peer, ["hot"])
    os.close(fd)
    base = Baseline(d, key)
    pid = str(d.proc.pid)
    old = subprocess.run(
        ["prlimit", "--pid", pid, "--nofile", "--raw", "--noheadings", "--output=SOFT,HARD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    refused = 0
    for slack in range(4):
        subprocess.run(
            ["prlimit", "--pid", pid, f"--nofile={_fds(d) + slack}:{old[1]}"], check=True
        )
        try:
            for i in range(3):
                reply, fds = peer.call(Lookup(keys=["hot"]))
                for f in fds:
                    os.close(f)
                assert isinstance(reply, (Found, Error)), reply
                reply, fds = peer.call(Put(key=f"starved-{slack}-{i}", size_bytes=4096))
                for f in fds:
                    os.close(f)
                assert isinstance(reply, (Reserved, Error)), reply
                if isinstance(reply, Error):
                    assert reply.status == 507, reply
                    refused += 1
                else:  # it went through: abort it
                    assert isinstance(peer.call(Abort(buffer_id=reply.buffer_id))[0], Ok)
        finally:
            subprocess.run(["prlimit", "--pid", pid, f"--nofile={old[0]}:{old[1]}"], check=True)
        # A refused put's release, and a ledger connection refused meanwhile (its circuit
        # then probes it back), may finish just after the reply: the usage must settle back.
        wait_until(
            lambda: _usage_now(d, key) == base.usage,
            timeout=30,
            message=f"a refused put took something (slack {slack})",
        )
    assert refused
    try:
        _, fd = lookup(peer, ["hot"])
        os.close(fd)
    finally:
        peer.close()
    base.check()
