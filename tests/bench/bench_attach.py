"""Attach round trip through the broker and the daemon vs bare SCM_RIGHTS round trips, in one run.

    .venv/bin/python tests/bench/bench_attach.py [-n 5000]
    .venv/bin/python tests/bench/bench_attach.py --socket PATH --key KEY --buffer ID

Without ``--socket`` it starts a throw-away ``maasd serve`` (temp data dir,
free port), creates a tenant and a 1 MiB buffer. It then times, each N times:

* floors — a forked child answers a 1-byte request with 1 byte plus a memfd
  over a socketpair: send + recvmsg + close fd (the kernel alone), and the same
  plus mmap + munmap of the fd (what a worker does with a handle);
* the broker alone (``broker_designs.py``): the event loop kept and the
  thread-per-connection design it replaced, over an in-memory service — one
  connection's round trip and eight connections' throughput, with the server's
  CPU per operation;
* raw attach — one connection to the daemon, ``hello`` once, then attach +
  recvmsg + close fd, frames written by hand (the broker and the service call);
* Worker.attach — the client library: attach, mmap, numpy view, then
  ``Mapping.close()`` (munmap, close, detach: a second round trip).

and prints per-op times and their ratio to the floors. Absolute numbers drift
on shared machines; the ratios are the result. CI never runs this.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import mmap
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import broker_designs
import httpx

from maasd.client import Client, Worker
from maasd.protocol import Attach, Attached, FrameReader, Hello, Welcome, decode_reply, encode_frame

MiB = 1 << 20


def _recv(sock: socket.socket, reader: FrameReader) -> tuple[bytes, list[int]]:
    fds: list[int] = []
    body = reader.next_frame()
    while body is None:
        data, anc, _f, _a = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
        for _lvl, _typ, payload in anc:
            fds.extend(array.array("i", payload))
        if not data:
            raise ConnectionError("daemon closed the connection")
        body = reader.next_frame(data)
    return body, fds


def bench_baseline(n: int, *, mmap_it: bool = False) -> float:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    memfd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(memfd, MiB)
    pid = os.fork()
    if pid == 0:  # child: echo one byte back with the memfd attached
        parent.close()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]).tobytes())]
        try:
            while child.recv(1):
                child.sendmsg([b"a"], anc)
        finally:
            os._exit(0)
    child.close()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            parent.send(b"r")
            _data, anc, _f, _a = parent.recvmsg(1, socket.CMSG_SPACE(4))
            fd = array.array("i", anc[0][2])[0]
            if mmap_it:
                mmap.mmap(fd, MiB, flags=mmap.MAP_SHARED).close()
            os.close(fd)
        return (time.perf_counter() - t0) / n
    finally:
        parent.close()
        os.waitpid(pid, 0)
        os.close(memfd)


def bench_raw_attach(socket_path: str, key: str, buffer_id: str, n: int) -> float:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        reader = FrameReader()
        sock.sendall(encode_frame(Hello(api_key=key)))
        body, _ = _recv(sock, reader)
        assert isinstance(decode_reply(body), Welcome), decode_reply(body)
        frame = encode_frame(Attach(buffer_id=buffer_id))
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(frame)
            body, fds = _recv(sock, reader)
            for fd in fds:
                os.close(fd)
        elapsed = time.perf_counter() - t0
        assert isinstance(decode_reply(body), Attached)
        assert len(fds) == 1
        return elapsed / n


def bench_worker(socket_path: str, key: str, buffer_id: str, n: int) -> float:
    with Worker(socket_path, key, renew_interval_s=0) as w:
        t0 = time.perf_counter()
        for _ in range(n):
            m = w.attach(buffer_id)
            m.close()
        return (time.perf_counter() - t0) / n


@contextlib.contextmanager
def throwaway_daemon() -> Iterator[tuple[str, str, str]]:
    """Start ``maasd serve`` in a temp dir; yield (socket_path, tenant key, buffer id)."""
    with tempfile.TemporaryDirectory(prefix="maasd-bench-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        admin_key = "bench_" + secrets.token_urlsafe(16)
        sock_path = str(Path(tmp) / "maasd.sock")
        env = {
            **os.environ,
            "MAASD_DATA_DIR": tmp,
            "MAASD_PORT": str(port),
            "MAASD_ADMIN_KEY": admin_key,
            "MAASD_DEFAULT_POOL_BYTES": str(64 * MiB),
            "MAASD_LOG_LEVEL": "warning",
        }
        url = f"http://127.0.0.1:{port}"
        log = open(Path(tmp) / "daemon.log", "wb")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.daemon", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("maasd exited: " + (Path(tmp) / "daemon.log").read_text())
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200 and os.path.exists(
                        sock_path
                    ):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("maasd did not start")
                time.sleep(0.05)
            with Client(url, admin_key) as admin:
                tenant = admin.create_tenant("bench-" + secrets.token_hex(3), 16 * MiB)
            with Client(url, tenant.api_key) as c:
                buf = c.reserve(MiB, ttl_s=3600)
            yield sock_path, tenant.api_key, buf.id
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=5000, help="round trips per measurement")
    ap.add_argument("--socket", help="a running daemon's socket (else start one)")
    ap.add_argument("--key", help="tenant key (with --socket)")
    ap.add_argument("--buffer", help="buffer id of that tenant (with --socket)")
    args = ap.parse_args()

    def run(sock_path: str, key: str, bid: str) -> None:
        bench_raw_attach(sock_path, key, bid, min(200, args.n))  # warm up
        base = bench_baseline(args.n)
        floor = bench_baseline(args.n, mmap_it=True)
        designs = {d: broker_designs.measure(d, args.n) for d in ("loop", "threaded")}
        raw = bench_raw_attach(sock_path, key, bid, args.n)
        wrk = bench_worker(sock_path, key, bid, args.n)
        print(f"n = {args.n}")
        print(f"bare SCM_RIGHTS round trip (socketpair, forked peer):   {base * 1e6:8.1f} us")
        print(f"bare SCM_RIGHTS + mmap/munmap round trip (the floor):   {floor * 1e6:8.1f} us")
        for name, label in (("loop", "event loop (kept)"), ("threaded", "thread/connection")):
            m = designs[name]
            print(
                f"broker alone, {label:<18} 1 conn round trip:    {m['rt'] * 1e6:8.1f} us"
                f"   ratio {m['rt'] / floor:5.2f}x floor   server CPU {m['cpu1'] * 1e6:5.1f} us/op"
            )
            print(
                f"broker alone, {label:<18} 8 conns:        {m['ops']:10.0f} ops/s"
                f"                      server CPU {m['cpun'] * 1e6:5.1f} us/op"
            )
        print(
            f"attach round trip via maasd (raw frames):               {raw * 1e6:8.1f} us"
            f"   ratio {raw / floor:5.2f}x floor"
        )
        print(
            f"Worker.attach + Mapping.close (mmap, detach):           {wrk * 1e6:8.1f} us"
            f"   ratio {wrk / floor:5.2f}x floor"
        )

    if args.socket:
        if not (args.key and args.buffer):
            ap.error("--socket needs --key and --buffer")
        run(args.socket, args.key, args.buffer)
    else:
        with throwaway_daemon() as (sock_path, key, bid):
            run(sock_path, key, bid)


if __name__ == "__main__":
    main()
