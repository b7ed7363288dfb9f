"""The worker socket as a request/response channel: one frame out, one frame (and its
fds) back, under a lock, with the daemon's error frames raised as typed exceptions.

A ``Worker`` (:mod:`maasd.client.worker`) sends every request through one
:class:`Channel`. When the stream can no longer be trusted (a timeout, a bad frame,
the daemon gone, a 401 after which the daemon closes) the channel is *broken*:
later requests raise :class:`~maasd.client.errors.ConnectionFailed` at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from maasd import protocol
from maasd.client.errors import (
    ConnectionFailed,
    MaasdClientError,
    ProtocolError,
    Unauthorized,
    error_from_problem,
)

__all__ = ["PENDING_ERROR_S", "Channel", "close_fds"]

logger = logging.getLogger(__name__)

#: A reply that carries one fd.
R = TypeVar("R", protocol.Attached, protocol.Found, protocol.Reserved)
#: A reply that carries none.
_T = TypeVar("_T", bound=protocol.Reply)

#: How long a request whose send failed waits for the error frame the daemon sent first.
PENDING_ERROR_S = 1.0
#: How often an idle channel reads the frames the daemon pushed (``released``): an idle
#: worker lets go of a released entry within this, well inside a reserve's wait for it.
IDLE_READ_S = 0.1


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def error_of(reply: protocol.Error) -> MaasdClientError:
    """The typed exception of an error frame."""
    problem: dict[str, Any] = {
        "type": reply.type or "about:blank",
        "title": reply.title,
        "status": reply.status,
        "detail": reply.detail,
    }
    return error_from_problem(reply.status, problem)


class Channel:
    """A connected Unix stream socket to the daemon; thread-safe (one request at a time)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._reader = protocol.FrameReader()
        #: why the stream is unusable, once it is
        self.broken: str | None = None
        #: told the id of each ``released`` frame the daemon pushes (under the lock: it
        #: must not make a request)
        self.on_released: Callable[[str], None] | None = None
        #: a frame read while looking for pushed ones that is not one (the next answer)
        self._early: bytes | None = None
        self._idle_stop = threading.Event()
        self._idle: threading.Thread | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except OSError as exc:
            sock.close()
            raise ConnectionFailed(f"cannot connect to {socket_path}: {exc}") from exc
        self._sock = sock
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)

    def request(
        self,
        msg: protocol.Request,
        meanwhile: Callable[[], object] | None = None,
        fds: tuple[int, ...] = (),
    ) -> tuple[protocol.Reply, list[int]]:
        """Send ``msg`` (``fds`` with its first byte: a publish's memfd, still the caller's);
        its reply and the fds that came with it (the caller owns them).

        ``meanwhile`` runs once ``msg`` is sent, before the reply is read: work of the
        caller's that overlaps the daemon's (a commit's unmap). An error frame is raised
        as its typed exception (its fds closed). A send that fails because the daemon
        refused the connection (429 at a cap) and closed it raises that refusal, read
        from the frame it sent before closing.
        """
        with self._lock:
            if self.broken is not None:
                raise ConnectionFailed(f"connection unusable: {self.broken}")
            self._drain_pushed()
            try:
                protocol.send_message(self._sock, msg, fds)
            except OSError as exc:
                pending = self._pending_error()
                if pending is not None:
                    raise pending from exc
                raise self._fail(f"socket error: {exc}") from exc
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    close_fds(self._receive()[1])  # read all the same: the stream stays in step
                    raise
            return self._receive()

    def hello(self, api_key: str) -> protocol.Welcome:
        """Say ``hello``: the daemon's welcome. On any failure the socket is shut down."""
        try:
            reply, _ = self.request(protocol.Hello(api_key=api_key))
        except BaseException:
            self.shutdown()
            raise
        if not isinstance(reply, protocol.Welcome):
            self.shutdown()
            raise ProtocolError(f"expected welcome, got {type(reply).__name__.lower()}")
        return reply

    def request_reply(
        self, msg: protocol.Request, kind: type[_T], *, fds: tuple[int, ...] = ()
    ) -> _T:
        """Send ``msg`` (with ``fds``, still the caller's); its reply, of type ``kind``."""
        reply, got = self.request(msg, fds=fds)
        close_fds(got)  # none comes with such a reply
        if not isinstance(reply, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
        return reply

    def request_fd(self, msg: protocol.Request, kind: type[R]) -> tuple[R, int]:
        """Send ``msg``; the reply of type ``kind`` and the one fd that came with it.

        Anything else is a :class:`ProtocolError`; what the daemon handed out with it
        is given back (detach, abort) and its fds are closed.
        """
        reply, fds = self.request(msg)
        if isinstance(reply, kind) and len(fds) == 1:
            return reply, fds[0]
        close_fds(fds)
        undo: protocol.Request | None = None
        if isinstance(reply, protocol.Attached | protocol.Found):
            undo = protocol.Detach(buffer_id=reply.buffer_id)
        elif isinstance(reply, protocol.Reserved):
            undo = protocol.Abort(buffer_id=reply.buffer_id)
        if undo is not None:
            with contextlib.suppress(MaasdClientError):
                self.request(undo)
        raise ProtocolError(
            f"expected {kind.__name__.lower()} with one fd, got "
            f"{type(reply).__name__.lower()} with {len(fds)} fds"
        )

    def read_when_idle(
        self, on_released: Callable[[str], None], interval_s: float = IDLE_READ_S
    ) -> None:
        """Call ``on_released(buffer_id)`` for each ``released`` frame the daemon pushes: as
        each request reads them, and from a thread every ``interval_s`` while none is in
        flight."""
        self.on_released = on_released
        self._idle = threading.Thread(
            target=self._idle_loop, args=(interval_s,), name="maasd-worker-pushed", daemon=True
        )
        self._idle.start()

    def _idle_loop(self, interval_s: float) -> None:
        while not self._idle_stop.wait(interval_s):
            if self.broken is not None:
                return
            if not self._lock.acquire(blocking=False):
                continue  # a request is in flight: it reads them
            try:
                self._drain_pushed()
            except MaasdClientError:
                return  # the stream broke: the next request says so
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        """Wake a request blocked in recv (from any thread); the channel stays open."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket, after any request in progress."""
        self._idle_stop.set()
        if self._idle is not None and self._idle is not threading.current_thread():
            self._idle.join(5.0)
        self.shutdown()
        with self._lock:
            self._sock.close()

    def _fail(self, why: str) -> ConnectionFailed:
        """Mark the stream unusable (it may be out of sync) and build the error."""
        self.broken = why
        self.shutdown()
        return ConnectionFailed(why)

    def _receive(self) -> tuple[protocol.Reply, list[int]]:
        """One reply (the lock held): the reply, or its error raised; fds closed on error.
        Frames the daemon pushed before it are handled on the way (:meth:`_pushed`)."""
        while True:
            reply, fds = self._receive_frame()
            if not isinstance(reply, protocol.Released):
                return reply, fds
            close_fds(fds)
            self._pushed(reply)

    def _pushed(self, frame: protocol.Released) -> None:
        if self.on_released is not None:
            try:
                self.on_released(frame.buffer_id)
            except Exception:  # the cache's bookkeeping must not break the stream
                logger.exception("dropping released entry %s failed", frame.buffer_id)

    def _drain_pushed(self) -> None:
        """(lock held) Before a request: handle the frames the daemon pushed since the last
        reply (``released``), so that what they ask happens before this request's answer."""
        while True:
            data = b""
            if not self._reader.has_frame:
                # (a socket with a timeout waits for data before any recv: poll first)
                if not self._readable.poll(0):
                    return
                try:
                    data, anc, _flags, _addr = self._sock.recvmsg(
                        65536,
                        socket.CMSG_SPACE(4 * protocol.MAX_FD_PER_MESSAGE),
                    )
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return  # the request's send or receive will say what is wrong
                close_fds([fd for _l, _t, p in anc for fd in struct.unpack(f"{len(p) // 4}i", p)])
                if not data:
                    return  # EOF: the request's receive reports it
            try:
                body = self._reader.next_frame(data)
            except protocol.FrameError as exc:
                raise self._fail(f"bad frame from daemon: {exc}") from exc
            if body is None:
                return
            try:
                frame = protocol.decode_reply(body)
            except msgspec.DecodeError as exc:
                raise self._fail(f"undecodable frame from daemon: {exc}") from exc
            if not isinstance(frame, protocol.Released):
                self._early = body  # an error the daemon sent before closing: the answer
                return
            self._pushed(frame)

    def _receive_frame(self) -> tuple[protocol.Reply, list[int]]:
        body: bytes | None
        fds: list[int] = []
        try:
            if self._early is not None:
                body, self._early = self._early, None
            else:
                body, fds = protocol.recv_message(self._sock, self._reader)
        except TimeoutError as exc:
            raise self._fail(f"no answer from {self.socket_path} in time") from exc
        except protocol.FrameError as exc:
            raise self._fail(f"bad frame from daemon: {exc}") from exc
        except OSError as exc:
            raise self._fail(f"socket error: {exc}") from exc
        if body is None:
            close_fds(fds)
            raise self._fail("the daemon closed the connection")
        try:
            reply = protocol.decode_reply(body)
        except msgspec.DecodeError as exc:
            close_fds(fds)
            raise self._fail(f"undecodable frame from daemon: {exc}") from exc
        if isinstance(reply, protocol.Error):
            close_fds(fds)
            err = error_of(reply)
            if isinstance(err, Unauthorized):
                # The daemon closes the connection after a 401.
                self.broken = f"{reply.status} {reply.title}: {reply.detail}"
                self.shutdown()
            raise err
        return reply, fds

    def _pending_error(self) -> MaasdClientError | None:
        """After a failed send: the error frame the daemon sent before closing, if any."""
        with contextlib.suppress(OSError):
            self._sock.settimeout(PENDING_ERROR_S)
        try:
            self._receive()
        except MaasdClientError as exc:
            if not isinstance(exc, ConnectionFailed):
                self.broken = self.broken or f"{exc.status} {exc.title}: {exc.detail}"
                return exc
        except OSError:
            pass
        return None
