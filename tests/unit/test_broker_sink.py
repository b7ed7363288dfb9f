"""The fd sink closes what peers send outside the daemon's threads.

A memfd a peer sent (with any frame) and no longer holds, or the daemon's own copy of an
entry released behind a reply its peer never read, is the last reference to its pages:
its close frees them, about 0.2 s a GiB, in the closing thread. Closed on the broker's
event loop, that stalled every tenant's attach and lookup for as long. The sink (a child
process) closes them now; the daemon's thread only sends them on and closes its copy.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from maasd.broker.sink import FdSink
from waiting import wait_until

MiB = 1 << 20
SIZE = 256 * MiB


def _populated_memfd() -> int:
    fd = os.memfd_create("sink-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    os.posix_fallocate(fd, 0, SIZE)  # every page allocated: the last close frees them
    return fd


def _thread_cpu(action: Callable[[], object]) -> float:
    before = time.thread_time()
    action()
    return time.thread_time() - before


@pytest.fixture
def sink() -> Iterator[FdSink]:
    s = FdSink()
    r, w = os.pipe()
    s.drop([r, w])  # starts it
    assert s._sock is not None, "no sink process could be started"
    yield s
    s._retire()


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def test_a_populated_memfd_is_freed_by_the_sink_not_the_dropping_thread(sink: FdSink) -> None:
    direct = min(_thread_cpu(lambda: os.close(_populated_memfd())) for _ in range(2))
    fd = _populated_memfd()
    dropped = _thread_cpu(lambda: sink.drop([fd]))
    # CPU time of this thread, not wall time: freeing 256 MiB of pages is tens of ms of
    # system time wherever it happens; handing the fd on is a sendmsg and a close.
    assert dropped < direct / 4, (dropped, direct)
    assert not _is_open(fd)  # the daemon's copy is closed at once


def test_unix_sockets_are_held_and_everything_else_closed(sink: FdSink) -> None:
    """A unix socket may carry more fds (nested): the sink holds it (module docstring);
    a TCP socket, a pipe or a memfd is closed in the sink at once."""
    assert sink._proc is not None
    pid = sink._proc.pid

    def sink_fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    wait_until(lambda: sink_fds() <= 4, timeout=10, message="the warm-up pipe was kept")
    base = sink_fds()
    a, b = socket.socketpair()
    tcp = socket.socket()
    r, w = os.pipe()
    memfd = os.memfd_create("sink-test", os.MFD_CLOEXEC)
    sink.drop([a.detach(), tcp.detach(), r, w, memfd])
    wait_until(lambda: sink_fds() == base + 1, timeout=10, message="not only the unix socket held")
    b.close()


def test_without_a_sink_what_cannot_wait_is_closed_here() -> None:
    s = FdSink()
    s._started_at = time.monotonic() + 3600  # no sink may be started now
    memfd = os.memfd_create("sink-test", os.MFD_CLOEXEC)
    r, w = os.pipe()
    a, b = socket.socketpair()
    unix = a.detach()
    s.drop([memfd, r, w, unix])
    assert not any(_is_open(fd) for fd in (memfd, r, w))
    assert _is_open(unix)  # kept for a sink to come
    assert list(s._overflow) == [unix]
    os.close(unix)
    b.close()


def test_a_sink_that_cannot_start_for_want_of_fds_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the open-files limit the sink's socketpair fails: the drop still closes what
    cannot wait, here, and raises nothing (its caller is giving back a refused reply)."""

    def no_fds() -> tuple[socket.socket, socket.socket]:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket, "socketpair", no_fds)
    s = FdSink()
    memfd = os.memfd_create("sink-test", os.MFD_CLOEXEC)
    s.drop([memfd])
    assert not _is_open(memfd)
    assert s._sock is None


def test_what_waits_for_room_in_the_sink_is_handed_on_later(sink: FdSink) -> None:
    """A sink that takes nothing for a while (stopped here) fills its queue: what is left
    waits in the daemon, and a thread of the sink hands it on once there is room — not
    only at the next drop, which may never come."""
    assert sink._proc is not None
    r, w = os.pipe()
    os.kill(sink._proc.pid, signal.SIGSTOP)
    try:
        for _ in range(10_000):
            sink.drop([os.dup(r) for _ in range(8)])
            if sink._overflow:
                break
        assert sink._overflow, "the sink's queue never filled"
        waiting = list(sink._overflow)
        assert all(_is_open(fd) for fd in waiting)
    finally:
        os.kill(sink._proc.pid, signal.SIGCONT)
    wait_until(lambda: not sink._overflow, timeout=20, message="nothing handed on")
    assert not any(_is_open(fd) for fd in waiting)
    os.close(r)
    os.close(w)
