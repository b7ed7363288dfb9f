"""Attach and lookup round trips through the broker and the daemon vs bare SCM_RIGHTS, in one run.

    .venv/bin/python tests/bench/bench_attach.py [-n 5000] [--pg URL]
    .venv/bin/python tests/bench/bench_attach.py --socket PATH --key KEY --buffer ID

Without ``--socket`` it starts a throw-away ``maasd serve`` (temp data dir,
free port; with ``--pg URL`` its ledger is a fresh database on that PostgreSQL
server, e.g. ``scripts/pg-test-server``), creates a tenant, a 1 MiB buffer and
a 1 MiB committed entry. It then times, each N times:

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
  ``Mapping.close()`` (munmap, close, detach: a second round trip);
* raw lookup — ``lookup`` + recvmsg + close fd (the entry fast path's one round
  trip), and the same plus mmap + munmap (what the floor does);
* Worker.lookup — with a mapping-cache hit (the fd is closed, the mapping reused)
  and with the cache off (``cache_bytes=0``: mmap, and on close munmap + detach);
* hello — connect, ``hello`` (the key checked once per connection: with
  PostgreSQL a ledger read), close.

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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import broker_designs
import httpx

from maasd.client import Client, Worker
from maasd.protocol import (
    Attach,
    Attached,
    Found,
    FrameReader,
    Hello,
    Lookup,
    Welcome,
    decode_reply,
    encode_frame,
)

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


def bench_raw(
    socket_path: str, key: str, request: Attach | Lookup, n: int, *, mmap_it: bool = False
) -> float:
    """One connection, hello once, then ``request`` + recvmsg (+ mmap/munmap) + close fd."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        reader = FrameReader()
        sock.sendall(encode_frame(Hello(api_key=key)))
        body, _ = _recv(sock, reader)
        assert isinstance(decode_reply(body), Welcome), decode_reply(body)
        frame = encode_frame(request)
        t0 = time.perf_counter()
        for _ in range(n):
            sock.sendall(frame)
            body, fds = _recv(sock, reader)
            for fd in fds:
                if mmap_it:
                    mmap.mmap(fd, MiB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
                os.close(fd)
        elapsed = time.perf_counter() - t0
        assert isinstance(decode_reply(body), Attached | Found), decode_reply(body)
        assert len(fds) == 1
        return elapsed / n


def bench_hello(socket_path: str, key: str, n: int) -> float:
    """connect + hello + welcome + close: what checking the key once per connection costs."""
    frame = encode_frame(Hello(api_key=key))
    t0 = time.perf_counter()
    for _ in range(n):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(socket_path)
            sock.sendall(frame)
            body, _ = _recv(sock, FrameReader())
    elapsed = time.perf_counter() - t0
    assert isinstance(decode_reply(body), Welcome)
    return elapsed / n


def bench_worker_lookup(
    socket_path: str, key: str, entry_key: str, n: int, *, cache: bool
) -> float:
    """Worker.lookup + close: a cache hit reuses the mapping; without a cache every lookup
    maps the fd, and its close unmaps it and detaches (a second round trip)."""
    cache_bytes = 64 * MiB if cache else 0
    with Worker(socket_path, key, renew_interval_s=0, cache_bytes=cache_bytes) as w:
        w.lookup([entry_key]).close()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        for _ in range(n):
            hit = w.lookup([entry_key])
            assert hit is not None
            hit.close()
        return (time.perf_counter() - t0) / n


def bench_worker(socket_path: str, key: str, buffer_id: str, n: int) -> float:
    with Worker(socket_path, key, renew_interval_s=0) as w:
        t0 = time.perf_counter()
        for _ in range(n):
            m = w.attach(buffer_id)
            m.close()
        return (time.perf_counter() - t0) / n


ENTRY_KEY = "bench:entry"


def make_entry(socket_path: str, key: str) -> None:
    with (
        Worker(socket_path, key, renew_interval_s=0) as w,
        w.entry(ENTRY_KEY, MiB, ttl_s=3600) as m,
    ):
        m.array[:] = 1


@contextlib.contextmanager
def throwaway_daemon(db_url: str | None = None) -> Iterator[tuple[str, str, str]]:
    """Start ``maasd serve`` in a temp dir (ledger: SQLite there, or ``db_url``); yield
    (socket_path, tenant key, buffer id). The tenant also has a committed entry."""
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
            **({"MAASD_DB_URL": db_url} if db_url else {}),
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
            make_entry(sock_path, tenant.api_key)
            yield sock_path, tenant.api_key, buf.id
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


@contextlib.contextmanager
def fresh_pg_database(server_url: str) -> Iterator[str]:
    """A new database on the PostgreSQL server at ``server_url``, dropped afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ["MAASD_TEST_PG_URL"] = server_url
    import pgdb

    pgdb.PG_URL = server_url
    with pgdb.fresh_pg_database() as url:
        yield url


ROUNDS = 10


def measure(sock_path: str, key: str, bid: str, n: int, designs: bool) -> dict[str, float]:
    """Each measurement, and the floor next to it, in ``ROUNDS`` interleaved rounds of
    ``n / ROUNDS`` ops: per op, the median over the rounds; as a ratio, the median of
    each round's ratio to the floor measured in that round (load drifts cancel out)."""
    bench_raw(sock_path, key, Attach(buffer_id=bid), min(200, n))  # warm up
    attach, lookup = Attach(buffer_id=bid), Lookup(keys=[ENTRY_KEY])
    kinds: dict[str, Callable[[int], float]] = {
        "base": bench_baseline,
        "attach": lambda k: bench_raw(sock_path, key, attach, k),
        "worker_attach": lambda k: bench_worker(sock_path, key, bid, k),
        "lookup": lambda k: bench_raw(sock_path, key, lookup, k),
        "lookup_mmap": lambda k: bench_raw(sock_path, key, lookup, k, mmap_it=True),
        "worker_lookup_hit": lambda k: bench_worker_lookup(
            sock_path, key, ENTRY_KEY, k, cache=True
        ),
        "worker_lookup_nocache": lambda k: bench_worker_lookup(
            sock_path, key, ENTRY_KEY, k, cache=False
        ),
        "hello": lambda k: bench_hello(sock_path, key, max(1, k // 10)),
    }
    chunk = max(1, n // ROUNDS)
    floors: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(ROUNDS):
        floors.append(bench_baseline(chunk, mmap_it=True))
        for name, fn in kinds.items():
            times[name].append(fn(chunk))
    out = {"floor": statistics.median(floors)}
    for name, ts in times.items():
        out[name] = statistics.median(ts)
        out[f"{name}_ratio"] = statistics.median(t / f for t, f in zip(ts, floors, strict=True))
    if designs:
        for d in ("loop", "threaded"):
            for k, v in broker_designs.measure(d, n).items():
                out[f"{d}_{k}"] = v
    return out


def report(label: str, m: dict[str, float], n: int) -> None:
    floor = m["floor"]
    print(f"== {label}, n = {n} in {ROUNDS} interleaved rounds")
    print(f"bare SCM_RIGHTS round trip (socketpair, forked peer):   {m['base'] * 1e6:8.1f} us")
    print(f"bare SCM_RIGHTS + mmap/munmap round trip (the floor):   {floor * 1e6:8.1f} us")
    for name, text in (("loop", "event loop (kept)"), ("threaded", "thread/connection")):
        if f"{name}_rt" in m:
            print(
                f"broker alone, {text:<18} 1 conn round trip:    {m[name + '_rt'] * 1e6:8.1f} us"
                f"   ratio {m[name + '_rt'] / floor:5.2f}x floor"
                f"   server CPU {m[name + '_cpu1'] * 1e6:5.1f} us/op"
            )
            print(
                f"broker alone, {text:<18} 8 conns:        {m[name + '_ops']:10.0f} ops/s"
                f"                      server CPU {m[name + '_cpun'] * 1e6:5.1f} us/op"
            )
    rows = [
        ("attach round trip via maasd (raw frames)", "attach"),
        ("Worker.attach + Mapping.close (mmap, detach)", "worker_attach"),
        ("lookup + fd via maasd (raw frames)", "lookup"),
        ("lookup + fd + mmap/munmap (raw frames)", "lookup_mmap"),
        ("Worker.lookup + close, mapping-cache hit", "worker_lookup_hit"),
        ("Worker.lookup + close, no cache (mmap, detach)", "worker_lookup_nocache"),
        ("connect + hello (key checked) + close", "hello"),
    ]
    for text, k in rows:
        print(f"{text + ':':<56}{m[k] * 1e6:8.1f} us   ratio {m[k + '_ratio']:5.2f}x floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=5000, help="round trips per measurement")
    ap.add_argument("--socket", help="a running daemon's socket (else start one)")
    ap.add_argument("--key", help="tenant key (with --socket; it needs an entry 'bench:entry')")
    ap.add_argument("--buffer", help="buffer id of that tenant (with --socket)")
    ap.add_argument("--pg", help="also run a daemon whose ledger is on this PostgreSQL server")
    args = ap.parse_args()

    if args.socket:
        if not (args.key and args.buffer):
            ap.error("--socket needs --key and --buffer")
        report(
            "the given daemon", measure(args.socket, args.key, args.buffer, args.n, True), args.n
        )
        return
    with throwaway_daemon() as (sock_path, key, bid):
        report("ledger: SQLite", measure(sock_path, key, bid, args.n, True), args.n)
    if args.pg:
        with fresh_pg_database(args.pg) as url, throwaway_daemon(url) as (sock_path, key, bid):
            report("ledger: PostgreSQL", measure(sock_path, key, bid, args.n, False), args.n)


if __name__ == "__main__":
    main()
