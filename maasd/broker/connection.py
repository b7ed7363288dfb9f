"""One accepted peer: its credentials, its input and output buffers, what it holds.

All methods are non-blocking and run on the broker's event loop thread, which
is the only thread that touches a :class:`Connection` — except :meth:`Connection.
try_send`: a slow operation's thread sends its reply itself when nothing is queued
(one thread hand-over less before the peer has its answer), and hands the outcome
back to the loop all the same. Everything that writes to the socket, closes it or
changes the output queue holds the connection's send lock, so that a reply sent
from another thread never meets a closed (or reused) fd, nor interleaves with a
frame the loop sends.

Output is a queue of ``[bytes-left, fds]`` messages. The broker reads no
further frame from a connection while its queue is non-empty or an operation
of it is in flight, so the queue holds at most one reply (≤ 64 KiB): what a
peer that never reads can make the daemon keep is bounded by that, and the
send deadline closes it.

A reply that carries fds is sent only once the peer has read everything sent
before (``SIOCOUTQ`` is 0): each fd the daemon sends stays *in flight* in the
peer's receive queue until the peer reads it, and the kernel counts those
against the daemon user's ``RLIMIT_NOFILE`` (past it, every ``sendmsg`` with an
fd fails with ``ETOOMANYREFS``, for every tenant). So one connection holds at
most one unread fd-carrying reply; the next waits (``awaiting_peer``) and the
loop retries it on a short timer, under the send deadline.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import socket
import struct
import termios
import threading

from maasd.models import Principal
from maasd.protocol import FrameReader, fds_from_ancillary

from .inbound import InboundFds, close_fds
from .sink import RECV_ROOM, discard, discard_socket

__all__ = ["Connection", "FdsRefused", "peer_credentials"]

_PEERCRED = struct.Struct("3i")
_INT = struct.Struct("i")
#: ioctl: for an AF_UNIX stream socket, the bytes it sent that the peer has not read yet.
SIOCOUTQ = termios.TIOCOUTQ
# Computed once (``int & IntFlag`` costs a Python call, on every read).
_RECV_FLAGS = int(socket.MSG_CMSG_CLOEXEC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)


class FdsRefused(Exception):
    """The kernel refused a reply's fds (ETOOMANYREFS): the daemon's user has as many
    fds in flight as its RLIMIT_NOFILE. The reply is still queued, fds and all."""


#: The kernel's send buffer per connection (it doubles what is asked). Replies are
#: small and a worker reads each before it asks again, so this only ever fills
#: for a peer that does not read; it bounds the bytes such a peer leaves unread
#: (the fds among them are one reply's, see the module docstring).
SEND_BUFFER_BYTES = 8 * 1024


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer of a Unix socket, from SO_PEERCRED."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:  # pragma: no cover - always available on Linux AF_UNIX
        return -1, -1, -1
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


class Connection:
    """A worker's connection, from accept to close."""

    __slots__ = (
        "api_key",
        "awaiting_peer",
        "busy",
        "closed",
        "draining",
        "events",
        "fds_sent",
        "generation",
        "gid",
        "held",
        "in_backlog",
        "inbound",
        "lingering",
        "name",
        "out",
        "pid",
        "principal",
        "reader",
        "send_lock",
        "sock",
        "staged",
        "uid",
    )

    def __init__(self, sock: socket.socket, name: str) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.sock = sock
        self.name = name
        self.pid, self.uid, self.gid = peer_credentials(sock)
        self.reader = FrameReader()
        #: set by a successful hello (and only then: the tenant count depends on it)
        self.principal: Principal | None = None
        self.api_key: str | None = None
        #: the auth generation the key was last checked at (hello, or a re-check)
        self.generation = 0
        #: buffer_id -> attachments handed to this peer and not yet dropped
        self.held: collections.Counter[str] = collections.Counter()
        #: entries this peer put and has not committed or aborted (released if it goes)
        self.staged: set[str] = set()
        self.out: collections.deque[_Outgoing] = collections.deque()
        self.busy = False  # an operation of this connection runs on the slow pool
        self.closed = False
        self.lingering = False  # refused: waits briefly for the peer's first bytes, then closes
        self.in_backlog = False
        #: fds the peer sent (a publish's memfd), waiting for their frame
        self.inbound = InboundFds()
        #: the head reply carries fds and waits until the peer reads what it was sent
        self.awaiting_peer = False
        #: fds were ever sent: closing may have to wait for the peer to read them
        self.fds_sent = False
        #: closed for the broker, but its peer has not read fds sent to it yet
        self.draining = False
        self.events = 0  # selector events registered now (0: not registered)
        #: held to write to the socket, close it, or change ``out`` (see the module docstring)
        self.send_lock = threading.Lock()

    @property
    def tenant(self) -> str | None:
        """The tenant this connection counts against ("admin" for the admin key), or None."""
        p = self.principal
        if p is None:
            return None
        return "admin" if p.is_admin else str(p.tenant_id)

    def fields(self, **more: object) -> dict[str, object]:
        """Structured-logging fields (``extra=``) that identify this connection."""
        return {
            "conn": self.name,
            "peer_pid": self.pid,
            "peer_uid": self.uid,
            "tenant": self.tenant or "-",
            **more,
        }

    @property
    def wants_read(self) -> bool:
        """Whether to read more: nothing in flight, nothing unsent, no whole frame waiting."""
        return not (self.busy or self.out or self.reader.has_frame)

    def receive(self, nbytes: int) -> bytes:
        """Read up to ``nbytes`` (``recvmsg``: raises what it raises, ``b""`` at EOF); fds
        that came with them wait in :attr:`inbound` for their frame (:mod:`.inbound`)."""
        # Room for every fd a message can carry: fds the kernel had no room for, it would
        # close itself in this thread (a close may wait: maasd.broker.sink).
        data, anc, flags, _addr = self.sock.recvmsg(nbytes, RECV_ROOM, _RECV_FLAGS)
        if anc:
            fds = tuple(fds_from_ancillary(anc))
            self.inbound.arrived(fds, self.reader.end_offset, len(data), bool(flags & _MSG_CTRUNC))
        return data

    def send(self, frame: bytes, fds: tuple[int, ...] = (), about: object = None) -> bool:
        """Send ``frame`` (``fds`` with its first byte) as far as the kernel takes it now.

        What is not taken is queued for :meth:`flush`. Returns True when nothing is
        left queued; raises ``OSError`` when the peer is gone, :class:`FdsRefused`
        (the reply left queued, see :meth:`take_refused`) when the kernel refuses the
        fds. The fds are owned from here on: closed once sent, or by :meth:`close`.
        ``about`` (the reply's outcome) is kept with a queued reply.
        """
        with self.send_lock:
            if self.out:
                self.out.append(_Outgoing(memoryview(frame), fds, about))
                return self._flush()
            self.awaiting_peer = False
            try:
                sent = self._send_once(frame, fds)
            except FdsRefused:
                self.out.append(_Outgoing(memoryview(frame), fds, about))
                raise
            except OSError:
                discard(fds)  # never queued: nobody else will close them (maybe the last)
                raise
            if sent == len(frame):
                return True
            self.out.append(_Outgoing(memoryview(frame)[sent:], () if sent else fds, about))
            return False

    def try_send(self, frame: bytes, fds: tuple[int, ...] = ()) -> bool | None:
        """From a slow operation's thread: send a reply now if that is simple — the
        connection open, nothing queued, the peer not owing a read of earlier fds.

        ``None``: nothing was sent, the fds are still the caller's (the loop sends the
        reply as usual). ``True``: all of it went; ``False``: the rest is queued for
        :meth:`flush` (the loop must watch for writing). Either way the fds are sent
        and closed here. A failure leaves the socket to the loop (its own send fails
        the same way and closes it).
        """
        with self.send_lock:
            if self.closed or self.out or (fds and self.fds_sent and self.unread()):
                return None
            try:
                sent = self._send_once(frame, fds)
            except (FdsRefused, OSError):
                return None
            if sent == 0:
                return None
            if sent < len(frame):
                self.out.append(_Outgoing(memoryview(frame)[sent:], ()))
                return False
            return True

    def flush(self) -> bool:
        """Send what is queued as far as the kernel takes it; True when the queue is empty.

        Raises ``OSError`` when the peer is gone (EPIPE, ECONNRESET, …), and
        :class:`FdsRefused` as :meth:`send` does.
        """
        with self.send_lock:
            return self._flush()

    def _flush(self) -> bool:
        """(the send lock held) :meth:`flush`."""
        self.awaiting_peer = False
        while self.out:
            msg = self.out[0]
            sent = self._send_once(msg.view, msg.fds)
            if sent:
                msg.fds = ()
            if sent < len(msg.view):
                msg.view = msg.view[sent:]
                return False
            self.out.popleft()
        return True

    def take_refused(self) -> object:
        """Drop the queued reply :class:`FdsRefused` was raised for (closing its fds);
        returns its ``about``."""
        with self.send_lock:
            msg = self.out.popleft()
        discard(msg.fds)
        return msg.about

    def unread(self) -> int:
        """Bytes sent on this connection that its peer has not read yet (0 if unknown)."""
        try:
            return int(_INT.unpack(fcntl.ioctl(self.sock.fileno(), SIOCOUTQ, b"\0\0\0\0"))[0])
        except (OSError, ValueError):  # closed: nothing of ours is in flight any more
            return 0

    def _send_once(self, data: bytes | memoryview, fds: tuple[int, ...]) -> int:
        """One non-blocking send; 0 when the kernel takes nothing now (or the peer has yet
        to read what came before a reply with fds). Sent fds are closed."""
        try:
            if fds:
                if self.fds_sent and self.unread():
                    self.awaiting_peer = True
                    return 0
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                sent = self.sock.sendmsg([data], anc, socket.MSG_NOSIGNAL)
            else:
                sent = self.sock.send(data, socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno == errno.ETOOMANYREFS:
                raise FdsRefused(exc.strerror) from exc
            raise
        if fds:  # they went with the first byte: the kernel holds its own references now
            self.fds_sent = True
            close_fds(fds)
        return sent

    def shut(self) -> None:
        """Closed for the broker, socket kept: drop unsent replies (closing their fds) and
        shut the write side, so that the peer reads what it was sent, then EOF."""
        with self.send_lock:
            self.closed = self.draining = True
            self.inbound.close()
            for msg in self.out:
                discard(msg.fds)  # an entry released since: the last copy (sink module)
            self.out.clear()
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Close the socket and every fd of a reply that was never sent."""
        with self.send_lock:
            self.closed = True
            self.draining = False
            self.inbound.close()
            for msg in self.out:
                discard(msg.fds)  # an entry released since: the last copy (sink module)
            self.out.clear()
            with contextlib.suppress(OSError):
                discard_socket(self.sock)  # fds may still be queued in it


class _Outgoing:
    """A reply not yet (wholly) sent: the bytes left, fds still to go with the first, and
    what it is about (the reply's outcome: the outbox undoes it if the kernel refuses the fds)."""

    __slots__ = ("about", "fds", "view")

    def __init__(self, view: memoryview, fds: tuple[int, ...], about: object = None) -> None:
        self.view = view
        self.fds = fds
        self.about = about
