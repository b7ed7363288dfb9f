"""Reading an HTTP/1.1 answer off a raw socket, for tests that speak HTTP by hand."""

from __future__ import annotations

import socket

__all__ = ["answer"]


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
