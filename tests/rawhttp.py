"""Writing an HTTP/1.1 request and reading its answer on a raw socket, for tests that
speak HTTP by hand."""

from __future__ import annotations

import select
import socket
import time

__all__ = ["answer", "closed_by_peer", "request"]


def answer(s: socket.socket, head_only: bool = False) -> tuple[int, bytes]:
    """One whole HTTP answer read from ``s``: its status and body."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed after {got!r}"
        got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if head_only:
        return status, b""
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, f"closed after {got!r}"
        body += chunk
    return status, body


def request(
    method: str, path: str, key: str | None = None, body: bytes = b"", extra: str = ""
) -> bytes:
    """A request's bytes: ``key`` as a bearer key, a ``Content-Length`` for a body or a POST."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    length = f"Content-Length: {len(body)}\r\n" if body or method in ("POST", "PUT") else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: maasd\r\n{auth}{length}{extra}\r\n").encode() + body


def closed_by_peer(s: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether the peer closed ``s`` (within ``wait_s``); what it sent meanwhile is dropped."""
    deadline = time.monotonic() + wait_s
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            if not select.select([s], [], [], left)[0]:
                return False
            chunk = s.recv(65536)
        except OSError:  # a reset, above all
            return True
        if not chunk:
            return True


def survivors(
    port: int, conns: list[socket.socket], cap: int, share: int, timeout: float
) -> list[bool]:
    """Which of ``conns`` (idle) are still open after a flood of anonymous idle connections
    (twice the ``cap``) has shed every idle connection it could: the kept ones. ``share``:
    what one caller may keep (the flood's oldest half sheds itself but for that twice)."""
    from waiting import wait_until

    flood: list[socket.socket] = []
    try:
        for _ in range(cap * 2):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=timeout))
            time.sleep(0.005)
        wait_until(
            lambda: sum(closed_by_peer(s) for s in flood[:cap]) >= cap - share * 2,
            timeout,
            message="the flood shed itself",
        )
        return [not closed_by_peer(s, 0.2) for s in conns]
    finally:
        for s in flood:
            s.close()
