"""Fds a peer sent, closed without a thread of the daemon ever waiting on the close.

The last close of a file can wait, for as long as its owner chose. A TCP socket with
``SO_LINGER`` and bytes its peer never takes waits out the linger (any number of
seconds); a unix socket, closed, closes whatever fds are still queued in it — a
lingering TCP socket among them, nested as deep as one likes. The kernel runs that last
close in the thread that drops the last reference, and a worker that sends the daemon
such an fd (with any frame, with a frame it never finishes, or queued in its connection
when the daemon closes it) and keeps no copy makes the daemon's close the last: the
event loop or a slow-pool thread would wait, and every worker of the host with it
(invariant 9).

And a shmem or hugetlbfs file (a memfd: a publish's source, or the daemon's own copy
of an entry a reply never delivered) may be the last reference to its pages: its close
frees them all, in the closing thread, about 0.2 s a GiB — a worker that sends a
populated memfd with any frame, or an entry released behind a reply it never read,
would stall the event loop for as long.

So :func:`discard` closes nothing a peer could have made costly itself: every fd goes
to the **sink**, a child process that closes them there — a shmem file, a pipe or any
other file at once, a socket other than a unix one once its lingering is turned off
(``SO_LINGER`` off: the close returns at once, the kernel sends what is left in the
background) — and holds a unix socket (a peer's, or a connection's own socket whose
receive queue still holds bytes: fds may ride with them), letting go of it by exiting
(a process that exits closes its files without lingering, and so does every close
those closes lead to). Every :data:`RECYCLE_HELD` sockets (or :data:`RECYCLE_AFTER_S`)
it forks: one half closes its copies — not the last ones, they return at once — and
goes on; the other, holding the last ones, exits. The daemon's own copy is never the
last: it closes it only once the sink has one (in flight or received), and the sink
closes a file only once the daemon has said so (a byte after its copies are closed; or
:data:`RECYCLE_AFTER_S` later, when the word never came). The daemon's thread spends
one ``sendmsg`` per :data:`SCM_MAX_FD` fds, a close of each copy and a ``send``. When
no sink can be had, the daemon closes what cannot wait itself (as the sink would) and
keeps the unix sockets for the next one.

Reading is part of it: a read with room for fewer fds than came makes the kernel close
the rest inside the ``recvmsg``, in the reading thread. :func:`recv_discarding` (and
:meth:`~maasd.broker.connection.Connection.receive`) make room for :data:`SCM_MAX_FD`,
the most one message can carry.

Not covered: a file whose every close waits on its server — FUSE, NFS — waits in
whichever process closes it, the daemon's first (its receive installs it). The kernel's
``fs.fuse.max_request_timeout`` bounds that wait; docs/operations.md.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import fcntl
import logging
import os
import select
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
#: Unix sockets the sink holds before it lets go of them (by a half that exits).
RECYCLE_HELD = 256
#: Seconds the sink holds a unix socket at most.
RECYCLE_AFTER_S = 30.0
#: Seconds between two starts of a sink (one that died is replaced no faster).
RESPAWN_S = 1.0
#: Unix sockets the daemon keeps for a sink that takes no more now (then closes them).
OVERFLOW = SCM_MAX_FD
#: Seconds between two warnings of the sink's troubles.
LOG_EVERY_S = 60.0
_INT = struct.Struct("i")
_LINGER_OFF = struct.pack("ii", 0, 0)

#: The sink (see the module docstring); it ends with the daemon (its socket's EOF, or
#: PR_SET_PDEATHSIG).
_CHILD = """
import array, errno, fcntl, os, signal, socket, struct, sys, time
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL
except Exception:
    pass
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the halves that let go reap themselves
s = socket.socket(fileno=int(sys.argv[1]))
most, after = int(sys.argv[2]), float(sys.argv[3])
s.settimeout(after / 3)
room = socket.CMSG_SPACE(253 * 4)
held, since = {}, 0.0
linger_off = struct.pack("ii", 0, 0)

def unix_socket(fd):
    try:
        fcntl.fcntl(fd, 1034)  # F_GET_SEALS: a shmem or hugetlbfs file
        return False
    except OSError:
        pass
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket
    try:
        if sock.family == socket.AF_UNIX:
            return True
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_off)
    except OSError:
        pass
    finally:
        sock.detach()
    return False

def let_go():
    global held
    r, w = os.pipe()
    if os.fork() == 0:  # this half holds the last copies: it exits once the other let go
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    for fd in held.values():
        os.close(fd)
    held = {}
    os.close(w)

closing, closing_since = [], 0.0  # closed once the daemon closed its copies

def close_all():
    global closing
    for fd in closing:
        os.close(fd)  # the last copy: a memfd's pages are freed here, not in the daemon
    closing = []

while True:
    try:
        data, anc, _flags, _addr = s.recvmsg(1, room)
    except TimeoutError:
        data, anc = None, []
    if data == b"":
        break
    if data == b"\1":  # the daemon closed its copies of all it sent before
        close_all()
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for fd in array.array("i", payload[: len(payload) - len(payload) % 4]):
                if not unix_socket(fd):
                    closing_since = closing_since if closing else time.monotonic()
                    closing.append(fd)
                    continue
                try:
                    ino = os.fstat(fd).st_ino
                except OSError:
                    ino = None
                if ino is None or ino in held:
                    os.close(fd)  # a copy of one held: not the last
                else:
                    held[ino] = fd
                    since = since if len(held) > 1 else time.monotonic()
    if held and (len(held) >= most or time.monotonic() - since > after):
        let_go()
    if closing and time.monotonic() - closing_since > after:  # no word: long closed
        close_all()
"""


class FdSink:
    """The child process that holds a peer's unix sockets until it can let go of them
    without waiting (module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = -RESPAWN_S
        self._retired: list[subprocess.Popen[bytes]] = []
        #: unix sockets not sent yet (the sink took no more): sent with the next ones
        self._overflow: collections.deque[int] = collections.deque()
        self._said_at = -LOG_EVERY_S
        #: fds were sent since the sink last heard that the daemon's copies are closed
        self._owe_word = False
        self._feeding = False  # a thread waits for room in the sink's queue (_feed)

    def drop(self, fds: Iterable[int]) -> None:
        """Close each of ``fds`` (the caller's no more) by the sink (module docstring);
        without one, at once what cannot wait and the rest later."""
        fds = list(fds)
        if fds:
            with self._lock:
                self._send(fds)

    def _send(self, fds: list[int]) -> None:
        if self._retired:  # reap the sinks that died
            self._retired = [p for p in self._retired if p.poll() is None]
        if self._sock is None and time.monotonic() - self._started_at >= RESPAWN_S:
            self._start()
        if self._sock is None:  # none to be had now: what cannot wait is closed here
            fds = [fd for fd in fds if not _closed_here(fd)]
        self._overflow.extend(fds)
        while self._sock is not None and self._overflow:
            batch = [self._overflow.popleft() for _ in range(min(SCM_MAX_FD, len(self._overflow)))]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch).tobytes())]
            try:
                self._sock.sendmsg([b"\0"], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                self._overflow.extendleft(reversed(batch))
                break
            except OSError as exc:
                self._overflow.extendleft(reversed(batch))
                self._say(f"is gone ({exc.strerror}): starting another")
                self._retire()
                if time.monotonic() - self._started_at >= RESPAWN_S:
                    self._start()
                continue
            _close_all(batch)  # the sink has them (in flight): ours are not the last
            self._owe_word = True
        if self._owe_word and self._sock is not None:
            # Ours are closed: the sink may close its copies, the last ones, now (before
            # this word it keeps them, else ours could be the last: the module docstring).
            with contextlib.suppress(OSError):  # full, or gone: said with the next ones
                self._sock.send(b"\1", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                self._owe_word = False
        if len(self._overflow) > OVERFLOW:
            self._say(f"takes no more: {len(self._overflow)} fds of peers closed by the daemon")
            _close_all(self._overflow)
            self._overflow.clear()
        if (self._overflow or self._owe_word) and not self._feeding:
            # The sink's queue is full now: a thread of its own hands on the rest once it
            # has room (the caller, the event loop say, never waits for it).
            self._feeding = True
            threading.Thread(target=self._feed, name="maasd-fd-sink", daemon=True).start()

    def _feed(self) -> None:
        """Send what waits once the sink has room (:meth:`_send`), until nothing waits;
        without a sink, start one again (at most every :data:`RESPAWN_S`)."""
        while True:
            with self._lock:
                if not (self._overflow or self._owe_word):
                    self._feeding = False
                    return
                sock = self._sock
            if sock is None:
                time.sleep(RESPAWN_S)
            else:
                with contextlib.suppress(OSError, ValueError):  # retired meanwhile
                    select.select([], [sock], [], 1.0)
            with self._lock:
                self._send([])  # starts no other feeder: this one is (_feeding)

    def _say(self, what: str) -> None:
        now = time.monotonic()
        if now - self._said_at >= LOG_EVERY_S:
            self._said_at = now
            logger.warning("fd sink %s", what)

    def _start(self) -> None:
        self._started_at = time.monotonic()
        try:
            ours, theirs = socket.socketpair()
        except OSError as exc:  # out of fds, say: what cannot wait is closed here
            self._say(f"cannot be started ({exc})")
            return
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD]
                + [str(theirs.fileno()), str(RECYCLE_HELD), str(RECYCLE_AFTER_S)],
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
        """Let the sink go (it exits, closing what it held without waiting)."""
        sock, proc = self._sock, self._proc
        self._sock = self._proc = None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            self._retired.append(proc)
        if sock is not None:
            sock.close()  # the sink sends nothing: its queue is empty


def _closed_here(fd: int) -> bool:
    """Close ``fd`` now if that cannot wait (module docstring); False: a unix socket, for
    the sink."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # a shmem or hugetlbfs file
    except OSError as exc:
        if exc.errno == errno.EBADF:
            return True
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            pass  # not a socket: a pipe, an eventfd, a file …
        else:
            try:
                if sock.family == socket.AF_UNIX:
                    return False
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
            except OSError:
                pass
            finally:
                sock.detach()
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
