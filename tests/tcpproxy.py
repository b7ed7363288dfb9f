"""A TCP proxy on loopback between the daemon and its PostgreSQL ledger, which a test
cuts (a ledger outage), slows, or filters connection by connection.

Used by the ledger outage tests (``tests/integration/test_ledger_outage*.py``) and by
``test_attacks_round5.py``, whose gate lets only some connections through
(:meth:`Proxy._connect`). Import as ``from tcpproxy import Proxy`` (``tests/`` is on
the path).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

__all__ = ["Proxy"]


class Proxy:
    """A TCP proxy on loopback to ``upstream``; :meth:`cut` drops every connection and
    refuses new ones until :meth:`resume`. ``delay_s``: each chunk it forwards, either
    way, waits this long first (a slow ledger: every round trip twice that longer)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.delay_s = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.socks: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                server = self._connect(client)
            except OSError:
                server = None
            if server is None:
                client.close()
                continue
            with self.lock:
                self.socks |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _connect(self, client: socket.socket) -> socket.socket | None:  # noqa: ARG002
        """The upstream connection for a ``client`` just accepted while open, or ``None``
        to refuse it (closed). A subclass may read from ``client`` first, and must then
        send upstream what it read."""
        return socket.create_connection(self.upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            socks, self.socks = self.socks, set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def resume(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()
