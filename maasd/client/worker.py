"""``Worker``: the local data plane (SPEC §5) — buffers' memfds mapped as numpy arrays.

Example::

    from maasd.client import Client, Worker

    buf = Client(url, key).reserve(size_bytes=64 << 20)
    with Worker("/var/lib/maasd/maasd.sock", key) as w:
        m = w.attach(buf.id)          # the memfd arrives over SCM_RIGHTS, mapped MAP_SHARED
        m.array[:5] = [1, 2, 3, 4, 5]  # numpy uint8, zero-copy, writable
        ...                            # leases of attached buffers renew in the background
    # leaving the block closes every mapping and the connection

Every process that attaches the same buffer maps the same pages: a write by
one is seen by all. One lock serialises request/response on the socket, so a
``Worker`` may be shared by threads (the renewal thread is one of them).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from maasd import protocol
from maasd.client.errors import (
    ConnectionFailed,
    MaasdClientError,
    NotFound,
    ProtocolError,
    Unauthorized,
    error_from_problem,
)

__all__ = ["Mapping", "Worker"]

logger = logging.getLogger(__name__)


def _check_memfd_size(fd: int, size_bytes: int) -> None:
    """Mapping past the end of the file would SIGBUS on first touch: refuse a short memfd."""
    st_size = os.fstat(fd).st_size
    if st_size < size_bytes:
        raise ProtocolError(f"memfd is {st_size} bytes, daemon said {size_bytes}")


class Mapping:
    """One attachment of a buffer: its memfd, mapped read-write and shared.

    ``array`` is a writable ``numpy.uint8`` view of the whole buffer (no copy);
    ``size`` its length in bytes; ``numa_node`` where its pages live; ``fd`` the
    sealed memfd (owned by the mapping: closed by :meth:`close`).
    """

    def __init__(
        self, worker: Worker | None, buffer_id: str, fd: int, size: int, numa_node: int
    ) -> None:
        self.buffer_id = buffer_id
        self.fd = fd
        self.size = size
        self.numa_node = numa_node
        self._worker = worker
        self._mmap: mmap.mmap | None = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The buffer as a writable numpy ``uint8`` array (zero-copy)."""
        if self._array is None:
            raise ValueError(f"mapping of buffer {self.buffer_id} is closed")
        return self._array

    @property
    def mmap(self) -> mmap.mmap:
        """The underlying ``mmap`` object (a writable buffer, e.g. for ctypes/llama.cpp)."""
        if self._mmap is None:
            raise ValueError(f"mapping of buffer {self.buffer_id} is closed")
        return self._mmap

    def _close_local(self) -> bool:
        """Drop the view, unmap, close the fd; return False if it was already closed."""
        mm = self._mmap
        if mm is None:
            return False
        # Drop our array first: it holds a buffer export on the mmap, and
        # mmap.close() refuses while exports exist.
        self._array = None
        self._mmap = None
        try:
            mm.close()
        except BufferError:
            # The caller still holds a numpy view (or memoryview) of it. The
            # pages stay mapped until the last view dies; the fd can go now
            # (mmap keeps its own reference to the file).
            logger.debug("buffer %s: views still alive, unmapping deferred", self.buffer_id)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        return True

    def close(self) -> None:
        """Unmap and close the fd, then tell the daemon this attachment is over. Idempotent."""
        if self._close_local() and self._worker is not None:
            self._worker._mapping_closed(self)

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fd}"
        return (
            f"Mapping(buffer_id={self.buffer_id!r}, size={self.size}, "
            f"numa_node={self.numa_node}, {state})"
        )


class Worker:
    """A connection to the daemon's handle socket, authenticated with ``api_key``.

    ``ttl_s`` is the lease the background thread renews attached buffers to,
    every ``renew_interval_s`` seconds (default ``ttl_s / 3``; ``0`` disables
    renewal). ``timeout`` bounds each request/response on the socket.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        api_key: str,
        *,
        renew_interval_s: float | None = None,
        ttl_s: int = 600,
        timeout: float = 30.0,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.ttl_s = ttl_s
        self.renew_interval_s = ttl_s / 3 if renew_interval_s is None else renew_interval_s
        self._lock = threading.Lock()
        self._reader = protocol.FrameReader()
        self._mappings: dict[str, list[Mapping]] = {}
        self._maps_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ConnectionFailed(f"cannot connect to {self.socket_path}: {exc}") from exc
        self._sock = sock
        try:
            reply, _ = self._request(protocol.Hello(api_key=api_key))
        except BaseException:
            self._shutdown_socket()
            raise
        if not isinstance(reply, protocol.Welcome):
            self._shutdown_socket()
            raise ProtocolError(f"expected welcome, got {type(reply).__name__.lower()}")
        self.tenant_id: str | None = reply.tenant_id
        #: This process's pid as the daemon recorded it (SO_PEERCRED).
        self.peer_pid: int | None = reply.pid
        if self.renew_interval_s > 0:
            self._renewer = threading.Thread(
                target=self._renew_loop, name="maasd-worker-renew", daemon=True
            )
            self._renewer.start()

    # --- public API --------------------------------------------------------------

    def attach(self, buffer_id: str) -> Mapping:
        """Receive the buffer's memfd and map it (MAP_SHARED, read-write).

        Raises :class:`~maasd.client.errors.NotFound` for an unknown or foreign id.
        """
        reply, fds = self._request(protocol.Attach(buffer_id=buffer_id))
        if not isinstance(reply, protocol.Attached) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._detach_quietly(buffer_id, isinstance(reply, protocol.Attached))
            raise ProtocolError(
                f"expected attached with one fd, got {type(reply).__name__.lower()} "
                f"with {len(fds)} fds"
            )
        fd = fds[0]
        try:
            _check_memfd_size(fd, reply.size_bytes)
            m = Mapping(self, reply.buffer_id, fd, reply.size_bytes, reply.numa_node)
        except BaseException:
            os.close(fd)
            self._detach_quietly(buffer_id, True)
            raise
        with self._maps_lock:
            self._mappings.setdefault(buffer_id, []).append(m)
        return m

    def detach(self, buffer_id: str) -> None:
        """Close this worker's mappings of the buffer and tell the daemon.

        With no mapping of it here, the daemon answers 404 (``NotFound``).
        """
        with self._maps_lock:
            maps = self._mappings.pop(buffer_id, [])
        for m in maps:
            m._close_local()
        for _ in range(max(len(maps), 1)):
            self._request(protocol.Detach(buffer_id=buffer_id))

    def renew(self, buffer_id: str, ttl_s: int | None = None) -> None:
        """Extend the buffer's lease to ``ttl_s`` (default: the worker's ``ttl_s``) from now."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        self._request(protocol.Renew(buffer_id=buffer_id, ttl_s=ttl))

    @property
    def attached(self) -> list[str]:
        """Ids of the buffers this worker currently maps."""
        with self._maps_lock:
            return [bid for bid, maps in self._mappings.items() if maps]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop renewing, close every mapping made by this worker, close the connection."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        # Wake a renewal blocked in recv, then wait for it to leave the lock.
        self._shutdown_socket()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(5.0)
        with self._maps_lock:
            maps = [m for ms in self._mappings.values() for m in ms]
            self._mappings.clear()
        for m in maps:
            # The daemon drops the attachments of a closed connection itself.
            m._close_local()
        with self._lock:
            self._sock.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------

    def _shutdown_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _fail(self, why: str) -> ConnectionFailed:
        """Mark the connection unusable (the stream may be out of sync) and build the error."""
        self._broken = why
        self._shutdown_socket()
        return ConnectionFailed(why)

    def _request(self, msg: protocol.Request) -> tuple[protocol.Reply, list[int]]:
        with self._lock:
            if self._broken is not None:
                raise ConnectionFailed(f"connection unusable: {self._broken}")
            if self._closed and not isinstance(msg, protocol.Hello):
                raise ConnectionFailed("worker is closed")
            try:
                protocol.send_message(self._sock, msg)
                body, fds = protocol.recv_message(self._sock, self._reader)
            except TimeoutError as exc:
                raise self._fail(f"no answer from {self.socket_path} in time") from exc
            except protocol.ProtocolError as exc:
                raise self._fail(f"bad frame from daemon: {exc}") from exc
            except OSError as exc:
                raise self._fail(f"socket error: {exc}") from exc
            if body is None:
                for fd in fds:
                    os.close(fd)
                raise self._fail("the daemon closed the connection")
            try:
                reply = protocol.decode_reply(body)
            except msgspec.DecodeError as exc:
                for fd in fds:
                    os.close(fd)
                raise self._fail(f"undecodable frame from daemon: {exc}") from exc
            if isinstance(reply, protocol.Error):
                for fd in fds:
                    os.close(fd)
                problem: dict[str, Any] = {
                    "type": reply.type or "about:blank",
                    "title": reply.title,
                    "status": reply.status,
                    "detail": reply.detail,
                }
                err = error_from_problem(reply.status, problem)
                if isinstance(err, Unauthorized):
                    # The daemon closes the connection after a 401.
                    self._broken = f"{reply.status} {reply.title}: {reply.detail}"
                    self._shutdown_socket()
                raise err
            return reply, fds

    def _detach_quietly(self, buffer_id: str, attached: bool) -> None:
        if not attached:
            return
        try:
            self._request(protocol.Detach(buffer_id=buffer_id))
        except MaasdClientError as exc:
            logger.debug("detach of %s failed: %s", buffer_id, exc)

    def _mapping_closed(self, m: Mapping) -> None:
        with self._maps_lock:
            maps = self._mappings.get(m.buffer_id)
            if maps is None or m not in maps:
                return
            maps.remove(m)
            if not maps:
                del self._mappings[m.buffer_id]
        if not self._closed and self._broken is None:
            self._detach_quietly(m.buffer_id, True)

    def _renew_loop(self) -> None:
        gone: set[str] = set()
        while not self._stop.wait(self.renew_interval_s):
            for buffer_id in self.attached:
                if buffer_id in gone or self._stop.is_set():
                    continue
                try:
                    self.renew(buffer_id)
                except NotFound:
                    # Released or expired: a stale mapping now reads zeros.
                    logger.warning("lease renewal: buffer %s is gone", buffer_id)
                    gone.add(buffer_id)
                except (ConnectionFailed, Unauthorized) as exc:
                    if not self._closed:
                        logger.warning("lease renewal stopped: %s", exc)
                    return
                except MaasdClientError as exc:
                    logger.warning("lease renewal of %s failed: %s", buffer_id, exc)
