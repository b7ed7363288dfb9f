"""A connection flood for the socket tests: N connections from this process, held open.

    python tests/sockflood.py PATH N [--key KEY] [--euid UID --egid GID]

Connects N times (sending ``hello`` on each when ``--key`` is given), waits
until the daemon has answered what it is going to answer, prints one JSON line::

    {"connected": 10, "unconnected": 0, "welcome": 4, "open": 4, "closed": 6,
     "errors": [[429, "peer uid 65534 has 4 connections waiting for hello, ..."], ...]}

and holds every connection until its standard input closes. ``--euid``/``--egid``
make the connections come from another uid (SO_PEERCRED reports the effective
ids): the process starts as root, so the interpreter loads, then drops them.

Use :func:`flood` from a test: it returns the process and the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from maasd.protocol import Error, FrameReader, Hello, Welcome, decode_reply, encode_frame

#: After the last answer, how long nothing more arriving means the daemon is done.
QUIET_S = 0.5
#: The longest the flood waits for answers at all.
MAX_WAIT_S = 15.0


@contextlib.contextmanager
def flood(
    path: str,
    n: int,
    *,
    key: str | None = None,
    euid: int | None = None,
    egid: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Run the flood in a child process; yield its summary; close its connections on exit."""
    cmd = [sys.executable, __file__, path, str(n)]
    if key is not None:
        cmd += ["--key", key]
    if euid is not None:
        cmd += ["--euid", str(euid)]
    if egid is not None:
        cmd += ["--egid", str(egid)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"flood failed: {proc.communicate(timeout=10)[1].decode()}")
        yield json.loads(line)
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _connect_all(path: str, n: int, hello: bytes | None) -> tuple[list[socket.socket], int]:
    socks, unconnected = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        if not _connect(s, path):
            unconnected += 1
            s.close()
            continue
        if hello is not None:
            with contextlib.suppress(OSError):  # refused at once: the 429 is still readable
                s.sendall(hello)
        s.setblocking(False)
        socks.append(s)
    return socks, unconnected


def _connect(s: socket.socket, path: str) -> bool:
    """Connect, waiting while the listen queue is full (EAGAIN on a Unix socket)."""
    deadline = time.monotonic() + MAX_WAIT_S
    while True:
        try:
            s.connect(path)
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        except OSError:
            return False
        else:
            return True


def _read_answers(socks: list[socket.socket]) -> dict[socket.socket, tuple[bytes, bool]]:
    """Everything each socket received, and whether it ended (EOF or reset)."""
    got = {s: (b"", False) for s in socks}
    deadline = time.monotonic() + MAX_WAIT_S
    quiet_until = time.monotonic() + QUIET_S
    while time.monotonic() < min(deadline, quiet_until):
        pending = [s for s in socks if not got[s][1]]
        if not pending:
            break
        readable, _, _ = select.select(pending, [], [], 0.05)
        for s in readable:
            data = got[s][0]
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            got[s] = (data + chunk, not chunk)
            quiet_until = time.monotonic() + QUIET_S
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("n", type=int)
    ap.add_argument("--key")
    ap.add_argument("--euid", type=int)
    ap.add_argument("--egid", type=int)
    args = ap.parse_args()
    if args.egid is not None:
        os.setegid(args.egid)
    if args.euid is not None:
        os.seteuid(args.euid)
    hello = encode_frame(Hello(api_key=args.key)) if args.key else None
    socks, unconnected = _connect_all(args.path, args.n, hello)
    summary: dict[str, Any] = {
        "connected": len(socks),
        "unconnected": unconnected,
        "welcome": 0,
        "open": 0,
        "closed": 0,
        "errors": [],
    }
    for data, ended in _read_answers(socks).values():
        for body in FrameReader().feed(data):
            reply = decode_reply(body)
            if isinstance(reply, Welcome):
                summary["welcome"] += 1
            elif isinstance(reply, Error):
                summary["errors"].append([reply.status, reply.detail])
        summary["closed" if ended else "open"] += 1
    print(json.dumps(summary), flush=True)
    sys.stdin.read()
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
