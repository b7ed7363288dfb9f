"""The Unix-socket handle server: hands workers their buffers' memfds (SPEC §5).

One listener thread accepts connections; each connection gets a daemon thread
of its own that reads frames, calls the (synchronous, thread-safe) service and
answers. A connection's failure — garbage, an oversized frame, a peer that
vanishes mid-``sendmsg``, an unexpected exception — ends at most that
connection; the listener and every other connection carry on.

Life of a connection::

    accept ─ SO_PEERCRED recorded (pid, uid, gid)
      │
      ├─ first frame must be hello{api_key} ── else error 400 + close
      │     wrong / revoked key ──────────────── error 401 + close
      │     ok → welcome{tenant_id, pid}
      │
      ├─ attach{buffer_id}  → attached{…} + memfd in the same sendmsg (SCM_RIGHTS)
      │                       foreign / unknown → error 404 and no fd
      ├─ detach{buffer_id}  → ok        (drops one attachment of this connection)
      ├─ renew{buffer_id, ttl_s} → ok
      │     every op re-authenticates the hello key: revoked → error 401 + close
      │     a bad frame → error 400, the connection survives
      │     a length prefix over 64 KiB → error 400 + close
      │
      └─ close (EOF, crash, stop()) → drop_handle for every attachment still held

Example::

    broker = Broker(service, "/var/lib/maasd/maasd.sock")
    broker.start()
    ...
    broker.stop()
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from typing import Protocol

import msgspec

from maasd import errors
from maasd.models import BufferInfo, Principal
from maasd.problems import PROBLEM_BASE, status_of
from maasd.protocol import (
    Attach,
    Attached,
    Detach,
    Error,
    FrameReader,
    FrameTooLarge,
    Hello,
    Ok,
    Renew,
    Reply,
    Request,
    Welcome,
    decode_request,
    send_message,
)

__all__ = ["PROBLEM_TYPE_BASE", "Broker", "status_for"]

logger = logging.getLogger(__name__)

#: Prefix of the ``type`` of error frames; the last segment is ``MaasdError.code``.
PROBLEM_TYPE_BASE = PROBLEM_BASE

#: A connection that has not said hello within this many seconds is closed, so
#: idle or hostile peers cannot pin connection threads forever.
HELLO_TIMEOUT_S = 10.0
#: How long stop() waits for connection threads to finish their cleanup.
STOP_JOIN_S = 5.0

_PEERCRED = struct.Struct("3i")


def status_for(exc: BaseException) -> int:
    """Return the error-frame status for ``exc`` (500 if it is not an expected error)."""
    return status_of(exc)


class Handle(Protocol):
    @property
    def fd(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def numa_node(self) -> int: ...


class HandleService(Protocol):
    """The part of :class:`maasd.core.Service` the broker calls."""

    def authenticate(self, token: str, /) -> Principal: ...
    def open_handle(self, principal: Principal, buffer_id: str, /) -> Handle: ...
    def drop_handle(self, principal: Principal, buffer_id: str, /) -> None: ...
    def renew(self, principal: Principal, buffer_id: str, ttl_s: int, /) -> BufferInfo: ...


class _Close(Exception):
    """Internal: the reply has been sent (or could not be); end the connection."""


class _Connection:
    __slots__ = (
        "api_key",
        "attachments",
        "gid",
        "name",
        "pid",
        "principal",
        "reader",
        "sock",
        "uid",
    )

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self.reader = FrameReader()
        self.principal: Principal | None = None
        self.api_key: str | None = None
        #: buffer_id -> number of successful open_handle calls not yet dropped
        self.attachments: collections.Counter[str] = collections.Counter()
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            self.pid, self.uid, self.gid = _PEERCRED.unpack(raw)
        except OSError:  # pragma: no cover - always available on Linux AF_UNIX
            self.pid = self.uid = self.gid = -1

    @property
    def tenant(self) -> str:
        p = self.principal
        if p is None:
            return "-"
        return "admin" if p.is_admin else str(p.tenant_id)

    def fields(self, **more: object) -> dict[str, object]:
        """Structured-logging fields (``extra=``) that identify this connection."""
        return {
            "conn": self.name,
            "peer_pid": self.pid,
            "peer_uid": self.uid,
            "tenant": self.tenant,
            **more,
        }


class Broker:
    """Serve worker handles on a Unix stream socket at ``path``.

    ``service`` is the daemon's :class:`maasd.core.Service` (or anything with
    the same four methods). ``mode`` (and ``group``, a gid, when given) is applied
    to the socket file before it accepts connections. ``max_connections`` caps the
    connections served at once (each holds a file and a thread of the daemon); one
    more is answered a 507 ``resource-limit`` error frame and closed.
    """

    def __init__(
        self,
        service: HandleService,
        path: str,
        mode: int = 0o660,
        group: int | None = None,
        max_connections: int | None = None,
    ) -> None:
        self.service = service
        self.path = os.fspath(path)
        self.mode = mode
        self.group = group
        self.max_connections = max_connections
        self._refused = 0
        self._refused_logged = -10.0
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._lock = threading.Lock()
        self._conns: dict[_Connection, threading.Thread] = {}
        self._stopping = threading.Event()
        self._ids = itertools.count(1)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Bind the socket, set its mode, start accepting in a daemon thread."""
        if self._listener is not None:
            raise RuntimeError("broker already started")
        self._remove_stale_socket()
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            # chmod before listen(): until listen() nobody can connect, so there
            # is no window in which the umask's mode is the effective one.
            os.chmod(self.path, self.mode)
            if self.group is not None:  # the workers' group: they connect through it (0660)
                os.chown(self.path, -1, self.group)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._stopping.clear()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(
            target=self._accept_loop, name="maasd-broker-accept", daemon=True
        )
        self._thread.start()
        logger.info("broker listening", extra={"path": self.path, "mode": f"{self.mode:o}"})

    def stop(self) -> None:
        """Stop accepting, close every connection (dropping its attachments), unlink the socket."""
        if self._listener is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)
        self._listener.close()
        self._listener = None
        with self._lock:
            conns = list(self._conns.items())
        for conn, _thread in conns:
            # shutdown() wakes the connection thread blocked in recv/send; the
            # thread itself drops the attachments and closes the socket.
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for _conn, thread in conns:
            thread.join(STOP_JOIN_S)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._unlink_own_socket()
        logger.info("broker stopped", extra={"path": self.path})

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connections(self) -> int:
        """Number of open connections (for metrics and tests)."""
        with self._lock:
            return len(self._conns)

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(self.path)
        except OSError:
            # Nobody listening: left behind by a crashed daemon.
            logger.info("removing stale socket", extra={"path": self.path})
            os.unlink(self.path)
            return
        finally:
            probe.close()
        raise FileExistsError(f"another process is serving {self.path}")

    def _unlink_own_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # --- accepting -----------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.fileobj is not listener or self._stopping.is_set():
                        continue
                    try:
                        sock, _addr = listener.accept()
                    except OSError as exc:
                        # EMFILE and friends: log, keep serving the others.
                        logger.warning(
                            "accept failed", extra={"path": self.path, "error": str(exc)}
                        )
                        continue
                    if self.max_connections is not None and self.connections >= (
                        self.max_connections
                    ):
                        self._refuse(sock)
                        continue
                    self._spawn(sock)
        except Exception:  # pragma: no cover - defensive: never die silently
            logger.exception("broker accept loop crashed", extra={"path": self.path})
        finally:
            sel.close()

    def _refuse(self, sock: socket.socket) -> None:
        """One connection past ``max_connections``: a 507 error frame, then closed."""
        error = errors.ResourceLimit(
            f"the daemon serves {self.max_connections} worker connections at once, a limit "
            "derived from its open files; close idle connections or retry shortly"
        )
        try:
            sock.settimeout(1.0)
            send_message(
                sock,
                Error(
                    status=507,
                    title=error.title,
                    detail=error.detail,
                    type=PROBLEM_TYPE_BASE + error.code,
                ),
            )
        except OSError:
            pass
        finally:
            sock.close()
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= 10:  # at most one line per 10 s under a flood
            self._refused_logged = now
            logger.warning(
                "worker connections refused: at the cap",
                extra={"path": self.path, "cap": self.max_connections, "refused": self._refused},
            )

    def _spawn(self, sock: socket.socket) -> None:
        conn = _Connection(sock, str(next(self._ids)))
        thread = threading.Thread(
            target=self._serve, args=(conn,), name=f"maasd-broker-conn-{conn.name}", daemon=True
        )
        with self._lock:
            self._conns[conn] = thread
        logger.debug("socket accepted", extra=conn.fields(peer_gid=conn.gid))
        thread.start()

    # --- one connection --------------------------------------------------------

    def _serve(self, conn: _Connection) -> None:
        sock = conn.sock
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            while not self._stopping.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    self._send(
                        conn,
                        Error(
                            status=400,
                            title="Hello expected",
                            detail=f"no hello within {HELLO_TIMEOUT_S:g} s",
                        ),
                    )
                    break
                except OSError:
                    break
                if not data:
                    break
                try:
                    frames = conn.reader.feed(data)
                except FrameTooLarge as exc:
                    logger.warning("frame too large", extra=conn.fields(length=exc.length))
                    self._send(
                        conn,
                        Error(
                            status=400,
                            title="Frame too large",
                            detail=str(exc),
                            type=PROBLEM_TYPE_BASE + "frame-too-large",
                        ),
                    )
                    break
                for body in frames:
                    self._handle_frame(conn, body)
        except _Close:
            pass
        except Exception:
            logger.exception("connection failed", extra=conn.fields())
        finally:
            self._cleanup(conn)

    def _cleanup(self, conn: _Connection) -> None:
        principal = conn.principal
        if principal is not None:
            for buffer_id, count in conn.attachments.items():
                for _ in range(count):
                    try:
                        self.service.drop_handle(principal, buffer_id)
                    except Exception:
                        logger.exception(
                            "drop_handle failed", extra=conn.fields(buffer_id=buffer_id)
                        )
            if conn.attachments:
                logger.info(
                    "attachments dropped on close",
                    extra=conn.fields(count=sum(conn.attachments.values())),
                )
        conn.attachments.clear()
        with contextlib.suppress(OSError):
            conn.sock.close()
        with self._lock:
            self._conns.pop(conn, None)
        logger.debug("socket closed", extra=conn.fields())

    def _send(self, conn: _Connection, reply: Reply, fds: tuple[int, ...] = ()) -> None:
        """Send a reply; a peer that is gone ends the connection (raises _Close)."""
        try:
            send_message(conn.sock, reply, fds)
        except OSError as exc:
            logger.debug("send failed", extra=conn.fields(error=str(exc)))
            raise _Close from exc

    def _error(self, conn: _Connection, exc: BaseException) -> None:
        status = status_for(exc)
        if isinstance(exc, errors.MaasdError) and status != 500:
            self._send(
                conn,
                Error(
                    status=status,
                    title=exc.title,
                    detail=exc.detail,
                    type=PROBLEM_TYPE_BASE + exc.code,
                ),
            )
        else:
            logger.error("unexpected error", exc_info=exc, extra=conn.fields())
            self._send(
                conn,
                Error(
                    status=500,
                    title="Internal error",
                    detail="the daemon failed to handle this request; see its log",
                    type=PROBLEM_TYPE_BASE + "internal",
                ),
            )
        if status == 401:
            raise _Close

    def _handle_frame(self, conn: _Connection, body: bytes) -> None:
        try:
            req = decode_request(body)
        except msgspec.DecodeError as exc:
            self._send(
                conn,
                Error(
                    status=400,
                    title="Invalid frame",
                    detail=str(exc),
                    type=PROBLEM_TYPE_BASE + "invalid-request",
                ),
            )
            if conn.principal is None:
                raise _Close from None
            return
        if conn.principal is None:
            self._hello(conn, req)
            return
        if isinstance(req, Hello):
            self._send(
                conn,
                Error(
                    status=400,
                    title="Invalid frame",
                    detail="already authenticated: hello is only valid first",
                    type=PROBLEM_TYPE_BASE + "invalid-request",
                ),
            )
            return
        try:
            # Re-validate the key on every op: a key revoked while connected
            # must stop working at once (SPEC §4, keys).
            assert conn.api_key is not None
            principal = self.service.authenticate(conn.api_key)
            self._dispatch(conn, principal, req)
        except _Close:
            raise
        except Exception as exc:
            if isinstance(exc, errors.Unauthorized):
                logger.info("key no longer valid, closing", extra=conn.fields())
            self._error(conn, exc)

    def _hello(self, conn: _Connection, req: Request) -> None:
        if not isinstance(req, Hello):
            self._send(
                conn,
                Error(
                    status=400,
                    title="Hello expected",
                    detail=f"the first frame must be hello, got {type(req).__name__.lower()}",
                    type=PROBLEM_TYPE_BASE + "invalid-request",
                ),
            )
            raise _Close
        try:
            principal = self.service.authenticate(req.api_key)
        except errors.Unauthorized as exc:
            logger.info("hello refused", extra=conn.fields())
            self._send(
                conn,
                Error(
                    status=401,
                    title=exc.title,
                    detail=exc.detail,
                    type=PROBLEM_TYPE_BASE + exc.code,
                ),
            )
            raise _Close from None
        except Exception as exc:
            self._error(conn, exc)
            raise _Close from None
        conn.principal = principal
        conn.api_key = req.api_key
        conn.sock.settimeout(None)
        logger.info("hello", extra=conn.fields())
        self._send(conn, Welcome(tenant_id=principal.tenant_id, pid=conn.pid))

    def _dispatch(self, conn: _Connection, principal: Principal, req: Request) -> None:
        if isinstance(req, Attach):
            handle = self.service.open_handle(principal, req.buffer_id)
            try:
                # Count it before sending: if the peer is gone the send fails,
                # and _cleanup still owes the service one drop_handle.
                conn.attachments[req.buffer_id] += 1
                self._send(
                    conn,
                    Attached(
                        buffer_id=req.buffer_id,
                        size_bytes=handle.size_bytes,
                        numa_node=handle.numa_node,
                    ),
                    (handle.fd,),
                )
            finally:
                os.close(handle.fd)
            logger.debug(
                "attach", extra=conn.fields(buffer_id=req.buffer_id, size_bytes=handle.size_bytes)
            )
        elif isinstance(req, Detach):
            if conn.attachments[req.buffer_id] <= 0:
                del conn.attachments[req.buffer_id]
                raise errors.NotFound(f"buffer {req.buffer_id} is not attached on this connection")
            conn.attachments[req.buffer_id] -= 1
            if conn.attachments[req.buffer_id] == 0:
                del conn.attachments[req.buffer_id]
            self.service.drop_handle(principal, req.buffer_id)
            logger.debug("detach", extra=conn.fields(buffer_id=req.buffer_id))
            self._send(conn, Ok())
        elif isinstance(req, Renew):
            self.service.renew(principal, req.buffer_id, req.ttl_s)
            logger.debug("renew", extra=conn.fields(buffer_id=req.buffer_id, ttl_s=req.ttl_s))
            self._send(conn, Ok())
        else:  # pragma: no cover - Hello is handled by the caller
            raise errors.InvalidRequest(f"unexpected op {type(req).__name__.lower()}")
