"""The broker's own cost, without the daemon's service: two designs over an in-memory service.

Used by ``bench_attach.py``. Each server runs in a forked process of its own, over
:class:`MemService` (authenticate and open_handle answer from memory: a dup of one
memfd), so what is measured is the socket server alone:

* ``loop``     — :class:`maasd.broker.Broker`, the design kept: one event-loop
  thread, attach inline, slow ops on a pool;
* ``threaded`` — :class:`ThreadedReference`, the design replaced: one blocking
  thread per connection, same dispatcher and op table, no caps or deadlines
  (kept here only as the point of comparison).

For each: the round trip of one connection, and the throughput of eight
connections at once, both with the server process's CPU per operation read from
``/proc/PID/stat`` (less sensitive than wall time to other load on the machine).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from maasd.broker import Broker, Limits
from maasd.broker.dispatch import Dispatcher, Outcome, Session
from maasd.broker.pacing import LogLimiter
from maasd.errors import InvalidRequest
from maasd.models import Principal
from maasd.protocol import (
    Attach,
    FrameReader,
    Hello,
    decode_reply,
    encode_frame,
    recv_message,
    send_message,
)

MiB = 1 << 20


@dataclass(frozen=True)
class _Handle:
    fd: int
    size_bytes: int
    numa_node: int
    buffer_id: str = "b"
    key: str = "k"
    ttl_s: int = 0


class MemService:
    """The use-case objects the broker calls, answered from memory (entries: lookup only):
    ``auth``, ``handles``, ``buffers``, ``lookups``, ``entries`` and ``publishes`` are all
    this object."""

    generation = 0

    def __init__(self) -> None:
        self.memfd = os.memfd_create("bench", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, MiB)
        self.principal = Principal(is_admin=False, tenant_id="bench", key_id="k")
        self.auth = self.handles = self.buffers = self.entries = self.lookups = self
        self.publishes = self

    def authenticate(self, _token: str) -> Principal:
        return self.principal

    def known_principal(self, _token: str | None) -> Principal | None:
        return self.principal

    def watch_revocations(self, _callback: object) -> None:
        return None  # nothing is ever revoked here

    def watch_releases(self, _callback: object) -> None:
        return None  # nothing is ever released here

    def open(self, _principal: Principal, _buffer_id: str) -> _Handle:
        return _Handle(os.dup(self.memfd), MiB, 0)

    def drop(self, _principal: Principal, _buffer_id: str) -> None:
        return None

    def renew(self, _principal: Principal, _buffer_id: str, _ttl_s: int) -> None:
        return None

    def find(
        self,
        _principal: Principal,
        keys: list[str],
        _held: object = (),
        *,
        may_wait: bool = True,  # noqa: ARG002
    ) -> _Handle:
        return _Handle(os.dup(self.memfd), MiB, 0, key=keys[-1])

    def put(self, *_args: object) -> _Handle:
        raise InvalidRequest("the bench service serves no put")

    def commit(self, _p: Principal, _b: str, *, owned: bool) -> None:  # noqa: ARG002
        raise InvalidRequest("the bench service serves no commit")

    def abort(self, _p: Principal, _b: str, *, owned: bool) -> None:  # noqa: ARG002
        raise InvalidRequest("the bench service serves no abort")

    def staged(self, _b: str) -> bool:
        return False  # it serves no put

    def publish(self, *_args: object) -> NoReturn:
        raise InvalidRequest("the bench service serves no publish")

    def abandon(self, _p: Principal, _b: str) -> None:
        return None


class ThreadedReference:
    """One blocking thread per connection over the same Dispatcher (the replaced design)."""

    def __init__(self, service: MemService, path: str) -> None:
        self.dispatcher = Dispatcher(service, LogLimiter(logging.getLogger("bench")))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(128)

    def serve_forever(self) -> None:
        while True:
            sock, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        reader, held = FrameReader(), collections.Counter[str]()
        session: Session | None = None
        while data := sock.recv(65536):
            for body in reader.feed(data):
                if session is None:
                    outcome, principal, key = self.dispatcher.hello(body, 0, {})
                    if principal is not None and key is not None:
                        session = Session(principal, key, outcome.authed or 0, held, frozenset())
                else:
                    decoded = self.dispatcher.decode(body, {})
                    if isinstance(decoded, Outcome):
                        outcome = decoded
                    else:
                        req, op = decoded
                        outcome = self.dispatcher.run(op, req, session, {})
                assert outcome.reply is not None
                send_message(sock, outcome.reply, outcome.fds)
                for fd in outcome.fds:
                    os.close(fd)
        sock.close()


def _serve(design: str, path: str) -> None:
    service = MemService()
    if design == "loop":
        Broker(service, path, limits=Limits()).start()
        signal.pause()
    else:
        ThreadedReference(service, path).serve_forever()


@contextlib.contextmanager
def server(design: str) -> Iterator[tuple[int, str]]:
    """Fork a server of ``design``; yield (pid, socket path)."""
    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        path = str(Path(tmp) / "s.sock")
        pid = os.fork()
        if pid == 0:
            try:
                _serve(design, path)
            finally:
                os._exit(0)
        try:
            while not os.path.exists(path):
                time.sleep(0.01)
            yield pid, path
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attach_loop(path: str, n: int) -> float:
    """``n`` attach round trips on one connection; seconds per round trip."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        reader = FrameReader()
        sock.sendall(encode_frame(Hello(api_key="k")))
        recv_message(sock, reader)
        frame = encode_frame(Attach(buffer_id="b"))
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(frame)
            body, fds = recv_message(sock, reader)
            for fd in fds:
                os.close(fd)
        elapsed = time.perf_counter() - t0
        assert body is not None
        assert type(decode_reply(body)).__name__ == "Attached"
        return elapsed / n


def measure(design: str, n: int, clients: int = 8) -> dict[str, float]:
    """Round trip and server CPU/op for one connection; ops/s and CPU/op for ``clients``."""
    with server(design) as (pid, path):
        attach_loop(path, min(n, 500))  # warm up
        c0 = cpu_seconds(pid)
        rt = attach_loop(path, n)
        cpu1 = (cpu_seconds(pid) - c0) / n
        per = max(1, n // clients)
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        kids = []
        for _ in range(clients):
            kid = os.fork()
            if kid == 0:
                try:
                    attach_loop(path, per)
                finally:
                    os._exit(0)
            kids.append(kid)
        for kid in kids:
            os.waitpid(kid, 0)
        wall = time.perf_counter() - t0
        total = per * clients
        return {
            "rt": rt,
            "cpu1": cpu1,
            "ops": total / wall,
            "cpun": (cpu_seconds(pid) - c0) / total,
        }
