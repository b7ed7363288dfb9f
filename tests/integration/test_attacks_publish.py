"""Attacks on the socket's ``publish``: the writer's own fd, sent with the frame, read by
the daemon into a sealed entry.

Each test drives a real daemon (``conftest.Daemon``) as a hostile tenant would — with
fds of every kind, frames and fds split and stalled, and the client library misused —
and checks what SPEC.md promises: bad input is a 4xx that changes nothing (invariant 7),
nothing a worker sends harms the daemon or another tenant (invariant 9), and the
ledger, the usage and the daemon's open files are left as they were.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon
from hardening import after_attack, daemon_fds, tenant_usage
from maasd.client import ConnectionFailed, Scratch, Worker
from maasd.protocol import Error, Lookup, Publish, Published, encode_frame
from rawentries import connect, pattern
from sockpeer import Raw
from waiting import wait_until

PAGE = mmap.PAGESIZE
MiB = 1 << 20


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("attack-publish", os.MFD_CLOEXEC)
    os.pwrite(fd, data, 0)
    return fd


# --- fds the daemon cannot read ----------------------------------------------------------


def test_a_memfd_reopened_with_no_read_access_is_a_400_never_a_500(daemon: Any) -> None:
    """``open(…, O_WRONLY | O_RDWR)`` (access mode 3: neither read nor write, Linux's
    mode for ioctls) of the writer's memfd: a shmem file that answers ``F_GET_SEALS``,
    long enough, not write-only — but ``pread`` fails on it (EBADF).

    Must hold (invariant 7): a 400 that says the fd is not open for reading, nothing
    reserved or left behind, no error logged as a daemon fault."""
    _, key = daemon.tenant("no-access", 16 * MiB)
    memfd = _memfd(pattern(PAGE, seed=1))
    neither = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY | os.O_RDWR)
    r = connect(daemon, key)
    try:
        before = tenant_usage(daemon, key)
        reply, fds = r.call_fds(Publish(key="neither:a", size_bytes=PAGE), [neither])
        assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status == 400, reply
        assert "reading" in reply.detail, reply.detail
        assert tenant_usage(daemon, key) == before
        miss, _ = r.call(Lookup(keys=["neither:a"]))
        assert isinstance(miss, Error)
        assert miss.status == 404
        # the connection is fine: the same memfd open for reading publishes
        reply, _ = r.call_fds(Publish(key="neither:b", size_bytes=PAGE), [memfd])
        assert isinstance(reply, Published), reply
    finally:
        r.close()
        os.close(neither)
        os.close(memfd)
    assert "unexpected error" not in daemon.log()
    after_attack(daemon)


# --- the client, misused -------------------------------------------------------------------


def test_publishing_a_closed_scratch_or_fd_leaves_the_worker_connected(daemon: Any) -> None:
    """``Worker.publish`` of a :class:`Scratch` already closed, or of an fd number that is
    not open (a writer's bookkeeping bug): nothing can be sent.

    Must hold: the call raises at once (``ValueError``), the worker's connection stays
    usable (no ``ConnectionFailed``, no wait for an answer that never comes) and the
    next publish of a good scratch works; a bool is no fd (``TypeError``)."""
    _, key = daemon.tenant("client-misuse", 16 * MiB)
    closed = Scratch(PAGE)
    closed.close()
    spare = 1 << 20  # an fd number nobody holds (over any RLIMIT_NOFILE of a test run)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(spare)
    with Worker(daemon.socket_path, key) as w, Scratch(PAGE) as good:
        for source in (closed, spare, -1):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="closed|not open"):
                w.publish("misuse:a", source, PAGE)
            assert time.monotonic() - t0 < 0.5
        with pytest.raises(TypeError):
            w.publish("misuse:a", True, PAGE)
        try:
            assert w.lookup(["misuse:a"]) is None
            entry = w.publish("misuse:a", good, PAGE)
        except ConnectionFailed as exc:  # pragma: no cover - the failure this test is about
            pytest.fail(f"the worker's connection broke: {exc}")
        assert entry.size_bytes == PAGE


# --- fds whose last close waits --------------------------------------------------------------

#: How long the last close of the attacker's TCP socket would wait (SO_LINGER).
LINGER_S = 60
#: The slowest answer a bystander may get while the attack runs.
PROMPT_S = 1.5


@contextlib.contextmanager
def _lingering_tcp() -> Iterator[socket.socket]:
    """A loopback TCP socket whose peer never reads, its send queue full, ``SO_LINGER``
    on: the last close of it waits up to :data:`LINGER_S` for the peer to take the bytes
    (in whichever thread drops the last reference). On exit its peer goes (a reset
    ends any wait)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the peer's: taken at accept
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    client.connect(server.getsockname())
    peer, _ = server.accept()
    try:
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                client.send(b"x" * 65536)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
        yield client
    finally:
        client.close()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # unread bytes: a reset, which ends the linger of a close under way
        server.close()


def _nested(inner: socket.socket) -> socket.socket:
    """A unix socket whose receive queue holds ``inner`` (sent, never read): its last close
    closes ``inner`` too."""
    a, b = socket.socketpair()
    b.sendmsg([b"z"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", inner.fileno()))])
    b.close()
    return a


def _stuck_replies(r: Raw) -> None:
    """Fill ``r``'s connection with answers it never reads: the daemon reads nothing more
    from it (a reply waits) until its send deadline closes it."""
    r.sock.setblocking(False)
    frame = encode_frame(Lookup(keys=["nothing-" + "y" * 200]))
    with contextlib.suppress(BlockingIOError):
        for _ in range(2000):
            r.sock.send(frame)
    time.sleep(0.5)  # the daemon answers until its send buffer is full
    r.sock.setblocking(True)


def _send(r: Raw, how: str, fd: int) -> None:
    """Hand the daemon ``fd`` on ``r``, one way or another (``how``)."""
    publish = encode_frame(Publish(key="linger:a", size_bytes=PAGE))
    if how == "on a lookup":  # closed by the event loop
        r.send_fds(encode_frame(Lookup(keys=["linger:a"])), [fd])
    elif how == "as a publish's source":  # refused (no memfd) on a slow-pool thread
        r.send_fds(publish, [fd])
    elif how == "with a frame left unfinished":  # closed with the connection
        r.send_fds(publish[:3], [fd])
        r.sock.shutdown(socket.SHUT_WR)
    elif how == "queued when the daemon closes":  # never read: in the socket it closes
        _stuck_replies(r)
        # On a loaded machine the send deadline (1 s) may pass before this: the daemon
        # closed the connection already, and no fd reaches it this time.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            r.send_fds(b"\0", [fd])
    else:
        raise AssertionError(how)


def _prompt_meanwhile(r: Raw, seconds: float) -> list[float]:
    """Lookups of another tenant's worker ``r`` for ``seconds``: how long each took."""
    took: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        reply, _ = r.call(Lookup(keys=["bystander:none"]))
        took.append(time.monotonic() - t0)
        assert isinstance(reply, Error), reply
        time.sleep(0.05)
    return took


@pytest.fixture
def quick_deadline(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of this test that closes a connection whose answers wait unread for 1 s."""
    d = Daemon(tmp_path / "d", env={"MAASD_SOCKET_SEND_TIMEOUT_S": "1"}).start()
    yield d
    d.close()


HOW = [
    "on a lookup",
    "as a publish's source",
    "with a frame left unfinished",
    "queued when the daemon closes",
]


@pytest.mark.parametrize("nest", [False, True], ids=["tcp", "tcp-in-a-unix-socket"])
def test_an_fd_whose_last_close_waits_never_stalls_the_daemon(
    quick_deadline: Daemon, nest: bool
) -> None:
    """A tenant sends the daemon a TCP socket whose last close lingers for a minute (its
    peer reads nothing, ``SO_LINGER`` 60 s) — or a unix socket holding one in its queue —
    and keeps no copy: the daemon's close of it is the last. Sent on a lookup, as a
    publish's source, with a frame it never finishes, and left queued in a connection
    the daemon closes (its send deadline).

    Must hold (invariant 9): every time, another tenant's lookups are answered at once
    (no thread of the event loop or the slow pool waits on the close), the attacker's own
    publish is refused promptly, and nothing is left behind."""
    d = quick_deadline
    _, key = d.tenant("lingerer", 16 * MiB)
    _, other = d.tenant("bystander", 16 * MiB)
    bystander = connect(d, other)
    bystander.sock.settimeout(LINGER_S + 30)
    for how in HOW:
        with _lingering_tcp() as tcp:
            r = Raw(d.socket_path, timeout=LINGER_S + 30)
            r.hello(key)
            fd = _nested(tcp) if nest else tcp
            _send(r, how, fd.fileno())
            fd.close()
            if nest:
                tcp.close()  # the unix socket holds the last reference now
            if how == "as a publish's source":
                t0 = time.monotonic()
                reply, _ = r.recv()
                assert isinstance(reply, Error), reply
                assert reply.status == 400, reply
                assert time.monotonic() - t0 < PROMPT_S, (how, time.monotonic() - t0)
            took = _prompt_meanwhile(bystander, 2.5)
            assert max(took) < PROMPT_S, (how, f"a bystander's lookup took {max(took):.1f} s")
            r.close()
    bystander.close()
    after_attack(d)


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            out.extend(int(c) for c in f.read().split())
    return out


def test_a_stream_of_lingering_fds_never_stalls_the_daemon_nor_piles_up(
    quick_deadline: Daemon,
) -> None:
    """A tenant sends lingering TCP sockets (as above) again and again, a few on each
    lookup, for longer than a close of the daemon's may take: whatever closes them for
    the daemon is stuck in the first.

    Must hold: another tenant's lookups are answered at once throughout; once the attack
    ends, the daemon holds none of the attacker's fds and no more child processes than
    before it, beyond one."""
    d = quick_deadline
    assert d.proc is not None
    pid = d.proc.pid
    _, key = d.tenant("lingerer", 16 * MiB)
    _, other = d.tenant("bystander", 16 * MiB)
    bystander = connect(d, other)
    bystander.sock.settimeout(LINGER_S + 30)
    r = connect(d, key)  # its own answers in 5 s, or a TimeoutError: the daemon waited
    baseline = len(daemon_fds(pid))
    before = len(_children(pid))
    took: list[float] = []
    with contextlib.ExitStack() as stack:
        for _ in range(12):
            socks = [stack.enter_context(_lingering_tcp()) for _ in range(3)]
            r.send_fds(encode_frame(Lookup(keys=["linger:b"])), [s.fileno() for s in socks])
            for s in socks:
                s.close()
            reply, _ = r.recv()
            assert isinstance(reply, Error), reply
            took += _prompt_meanwhile(bystander, 0.3)
    assert max(took) < PROMPT_S, f"a bystander's lookup took {max(took):.1f} s"
    r.close()
    bystander.close()
    wait_until(lambda: len(daemon_fds(pid)) <= baseline - 1, timeout=60)  # - r's socket
    wait_until(lambda: len(_children(pid)) <= before + 1, timeout=10)
    after_attack(d)


# --- fds parked for a frame that never ends ---------------------------------------------------


def test_a_stalled_frame_parks_at_most_one_fd_of_its_peer(daemon: Any) -> None:
    """Many connections each send the start of a publish frame with a batch of memfds,
    then nothing more: the daemon keeps each batch until the frame is whole (it may be a
    publish's). A publish takes one fd, and the open-files budget counts a connection as
    its socket and one fd more.

    Must hold: each stalled connection makes the daemon hold its socket and at most one
    fd of its peer's (a batch of more is of no use to any frame: discarded at once); a
    lone fd still reaches the publish it came with; closing the connections gives all
    of them back."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    _, key = daemon.tenant("parker", 16 * MiB)
    memfds = [_memfd(pattern(PAGE, seed=i)) for i in range(4)]
    frame = encode_frame(Publish(key="parked:a", size_bytes=PAGE))
    conns: list[Raw] = []
    try:
        baseline = len(daemon_fds(pid))
        for _ in range(30):
            r = connect(daemon, key)
            r.send_fds(frame[:5], memfds)  # 4 fds with a frame that never ends
            conns.append(r)
        lone = connect(daemon, key)
        lone.send_fds(frame[:5], memfds[:1])
        time.sleep(0.5)  # the daemon reads what was sent
        held = len(daemon_fds(pid)) - baseline
        assert held <= 2 * (len(conns) + 1), f"{held} files for {len(conns) + 1} connections"
        lone.send_raw(frame[5:])
        reply, _ = lone.recv()
        assert isinstance(reply, Published), reply
        lone.close()
    finally:
        for r in conns:
            r.close()
        for fd in memfds:
            os.close(fd)
    # A hang guard: the discarded fds leave through the sink child, which a loaded CI
    # host may not schedule for seconds (it once took over 10).
    wait_until(lambda: len(daemon_fds(pid)) <= baseline, timeout=60)
    after_attack(daemon)


def _flood(r: Raw, stop: threading.Event, sent: list[int], fds_of: tuple[int, int]) -> None:
    """Lookups on ``r`` without waiting for the answers, each with 200 fds: dups of a
    pipe's end, dups of a unix socket (``fds_of``), 100 fresh socket pairs."""
    frame = encode_frame(Lookup(keys=["flood:none"]))
    for i in itertools.count():
        if stop.is_set():
            return
        pairs = [socket.socketpair() for _ in range(100)] if i % 3 == 2 else []
        fds = [s.fileno() for pair in pairs for s in pair] or [fds_of[i % 3]] * 200
        r.send_fds(frame, fds)
        sent.append(len(fds))
        for pair in pairs:
            for s in pair:
                s.close()


def _drain(r: Raw) -> None:
    """Read ``r``'s answers until the daemon closes it."""
    with contextlib.suppress(OSError):
        while r.recv()[0] is not None:
            pass


def test_a_flood_of_fds_costs_the_daemon_no_process_per_batch(daemon: Any) -> None:
    """A tenant pipelines lookups as fast as it can, each with 200 fds: dups of a pipe,
    dups of one unix socket, 100 fresh socket pairs. Closing them must not wait (above),
    and must not cost more than closing them.

    Must hold: the daemon never has more than one child process (what holds the unix
    sockets for it), another tenant's lookups stay prompt, and once the flood stops the
    daemon holds none of the fds."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    _, key = daemon.tenant("flooder", 16 * MiB)
    _, other = daemon.tenant("bystander", 16 * MiB)
    bystander = connect(daemon, other)
    r = connect(daemon, key)
    r.sock.settimeout(60)
    baseline = len(daemon_fds(pid))
    pipe_r, pipe_w = os.pipe()
    unix_a, unix_b = socket.socketpair()
    stop = threading.Event()
    sent: list[int] = []
    most_children: list[int] = [0]

    def watch() -> None:
        while not stop.is_set():
            most_children[0] = max(most_children[0], len(_children(pid)))
            time.sleep(0.002)

    replies = threading.Thread(target=_drain, args=(r,))
    flood = threading.Thread(target=_flood, args=(r, stop, sent, (pipe_r, unix_a.fileno())))
    threads = [flood, threading.Thread(target=watch)]
    for t in threads:
        t.start()
    replies.start()
    try:
        took = _prompt_meanwhile(bystander, 3.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    r.sock.shutdown(socket.SHUT_WR)
    replies.join(timeout=30)
    assert len(sent) > 100, "the flood did not get going"
    assert most_children[0] <= 1, f"the daemon had {most_children[0]} child processes at once"
    assert max(took) < PROMPT_S, f"a bystander's lookup took {max(took):.1f} s"
    r.close()
    bystander.close()
    for fd in (pipe_r, pipe_w):
        os.close(fd)
    unix_a.close()
    unix_b.close()
    wait_until(lambda: len(daemon_fds(pid)) <= baseline - 1, timeout=60)
    after_attack(daemon)
