"""Where the fds a peer sent end: closed by a helper process, never by a thread that must not wait.

The last close of a file can wait, for as long as its owner chose: a TCP socket with
``SO_LINGER`` and bytes its peer never takes waits out the linger (any number of
seconds), a unix socket closes what is still queued in it (the same again, nested), a
FUSE or NFS file flushes to its server. The kernel runs that last close in the thread
that drops the last reference — and a worker that sends the daemon an fd (with any
frame, with a frame it never finishes, or queued in its connection when the daemon
closes it) and keeps no copy makes the daemon's close the last: the event loop or a
slow-pool thread would wait, and every worker of the host with it (invariant 9).

So the daemon closes at once only what cannot wait — a shmem or hugetlbfs file (a
memfd: a publish's source, every fd the daemon hands out), which has no flush, no
linger and no queue — and hands every other fd a peer sent to the **sink**: a child
process whose one job is to close what it receives: the daemon sends a batch, closes
its own copies (not the last: the batch in flight holds the files), then tells the
sink to close its copies — the last, so the sink's close is the one that may wait. A
connection's socket whose receive queue still holds bytes (fds may ride with them)
goes there too.

A sink that falls behind — more than :data:`BEHIND_FDS` fds unclosed, or an answer owed
for over :data:`PATIENCE_S` — is killed and replaced: a process killed in a close stops
waiting, and the files it still held are closed as it exits, without lingering. So the
fds in flight to the sink stay few (the kernel counts them against the daemon user's
``RLIMIT_NOFILE``, as the replies' own: :mod:`.inflight`). If no sink can be started
the daemon closes the fds itself (and says so), as before.

Reading is part of it: a read with room for fewer fds than came makes the kernel close
the rest inside the ``recvmsg``, in the reading thread. :func:`recv_discarding` (and
:meth:`~maasd.broker.connection.Connection.receive`) make room for
:data:`SCM_MAX_FD`, the most one message can carry.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterable

__all__ = ["RECV_ROOM", "SCM_MAX_FD", "FdSink", "discard", "discard_socket", "recv_discarding"]

logger = logging.getLogger(__name__)

#: The most fds one message can carry (the kernel's ``SCM_MAX_FD``).
SCM_MAX_FD = 253
#: Ancillary room for that many: a read never has to drop fds itself.
RECV_ROOM = socket.CMSG_SPACE(SCM_MAX_FD * 4)
#: Fds the sink may have been sent and not closed yet before it is replaced.
BEHIND_FDS = 256
#: Seconds the sink may take to close a batch before it is replaced.
PATIENCE_S = 2.0
#: Seconds between two warnings of the sink's troubles.
LOG_EVERY_S = 60.0
_INT = struct.Struct("i")

#: The sink. A message is one byte: with fds, a batch to hold; without, "go": the daemon
#: has closed its own copies, so closing the held batches now closes them for good (here,
#: not in the daemon) — one answer byte per batch. It dies with the daemon.
_CHILD = """
import array, os, socket, sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL
except Exception:
    pass  # it still ends when the daemon's end closes (unless a close of it waits)
s = socket.socket(fileno=int(sys.argv[1]))
room = socket.CMSG_SPACE(253 * 4)
held = []
while True:
    data, anc, _flags, _addr = s.recvmsg(1, room)
    if not data:
        break
    fds = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    if fds:
        held.append(fds)
        continue
    for batch in held:
        for fd in batch:
            try:
                os.close(fd)
            except OSError:
                pass
        s.send(b".")
    held = []
"""


class FdSink:
    """The helper process that closes the fds a peer sent (module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        #: per batch sent and not yet answered: (how many fds, when)
        self._owed: collections.deque[tuple[int, float]] = collections.deque()
        self._retired: list[subprocess.Popen[bytes]] = []
        self._said_at = -LOG_EVERY_S  # the last warning (one a minute at most)

    def drop(self, fds: Iterable[int]) -> None:
        """Close each of ``fds`` (the caller's no more): at once if that cannot wait,
        else by the sink."""
        risky = [fd for fd in fds if not _closed_at_once(fd)]
        if risky:
            with self._lock:
                self._send(risky)

    def _send(self, fds: list[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        if self._retired:  # reap the sinks killed before, once they are gone
            self._retired = [p for p in self._retired if p.poll() is None]
        for _ in range(2):
            if self._sock is None:
                self._replace()
            elif self._behind():
                self._say("fell behind (a close of a peer's fd waits): replacing it")
                self._replace()
            if self._sock is None:
                break
            try:
                self._sock.sendmsg([b"\0"], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError as exc:
                self._say(f"takes no more ({exc.strerror}): replacing it")
                self._retire()
                continue
            self._owed.append((len(fds), time.monotonic()))
            _close_all(fds)  # in flight to the sink: these are not the last references
            try:  # go: the sink's close is the last now, whoever is quicker
                self._sock.send(b"\1", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:  # killed, it closes what it holds as it exits, without waiting
                self._retire()
            return
        self._say(f"none runs: {len(fds)} fds of a peer closed by the daemon")
        _close_all(fds)

    def _say(self, what: str) -> None:
        now = time.monotonic()
        if now - self._said_at >= LOG_EVERY_S:
            self._said_at = now
            logger.warning("fd sink %s", what)

    def _behind(self) -> bool:
        """Take the sink's answers; whether it has fallen behind (or is gone)."""
        assert self._sock is not None
        try:
            answers = self._sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            answers = None
        except OSError:
            return True
        if answers == b"":
            return True  # it is gone
        for _ in range(min(len(answers or ()), len(self._owed))):
            self._owed.popleft()
        if not self._owed:
            return False
        owed = sum(n for n, _ in self._owed)
        return owed > BEHIND_FDS or time.monotonic() - self._owed[0][1] > PATIENCE_S

    def _replace(self) -> None:
        self._retire()
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self._say(f"cannot be started ({exc})")
            ours.close()
            return
        finally:
            theirs.close()
        self._sock, self._proc = ours, proc

    def _retire(self) -> None:
        """Kill the sink (its closes stop waiting; it closes the rest as it exits)."""
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        self._owed.clear()
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            self._retired.append(proc)
        if sock is not None:
            sock.close()  # its queue holds the sink's answers only


def _closed_at_once(fd: int) -> bool:
    """Close ``fd`` now if its close cannot wait (a shmem or hugetlbfs file: it answers
    ``F_GET_SEALS``; or not an fd at all); False: it is left for the sink."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        return exc.errno == errno.EBADF
    with contextlib.suppress(OSError):
        os.close(fd)
    return True


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


#: The daemon's sink (started when first needed).
SINK = FdSink()


def discard(fds: Iterable[int]) -> None:
    """Close fds a peer sent without waiting on any of them (:meth:`FdSink.drop`)."""
    if fds:
        SINK.drop(fds)


def discard_socket(sock: socket.socket) -> None:
    """Close a peer's connection socket. Once both directions are shut the peer can queue
    nothing more; bytes still queued (fds may come with them) go with the socket to the
    sink, else it is closed here."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    try:
        queued = _INT.unpack(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):  # closed already, or a listener (its pending connections)
        queued = sock.fileno() >= 0
    if not queued:
        sock.close()
        return
    discard([sock.detach()])


def recv_discarding(sock: socket.socket, nbytes: int) -> bytes:
    """Read up to ``nbytes`` of a peer's socket; any fds that came with them are discarded."""
    data, anc, _flags, _addr = sock.recvmsg(nbytes, RECV_ROOM, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            discard(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return data
