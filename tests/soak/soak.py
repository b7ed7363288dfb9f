"""A soak test: a real daemon under every attack at once, with normal tenants working throughout.

    .venv/bin/python tests/soak/soak.py --minutes 5

Not run by CI (minutes long, and it wants the machine). Against one ``maasd serve``
on loopback (started here, in a temporary data dir, with a lowered open-files limit
so that the limits bite), for ``--minutes``:

* normal tenants reserve, attach over the socket, write and read back a pattern,
  look up keyed evictable buffers, renew, detach and release, all the time;
* attackers, each in a loop with pauses: a tenant flooding 4 KiB buffers to its
  ``max_buffers``, another to the daemon's region budget; tenant deletes and pool
  drains during reserve bursts; REST and worker-socket connection floods; slow
  clients that never finish a request; hostile bodies and labels; a worker that
  writes through the fd of a buffer released under it;
* a monitor samples the daemon's RSS, its open files and ``/healthz`` every second.

It prints what it saw — operations and statuses by actor, every 5xx, health
failures, RSS and open files over time, the shutdown's duration — and exits 1 on any
invariant breach: a 5xx other than 507, data read back wrong, a delete that did not
answer 204, the ledger not equal to the daemon's memfds once quiet, the daemon dead,
or a ``SIGTERM`` that did not end in exit 0 within 30 s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]  # tests/ helpers, the package

import httpx  # noqa: E402

from conftest import Daemon  # noqa: E402
from hardening import healthz, ledger_matches_memfds  # noqa: E402
from maasd.client import ConnectionFailed, Worker  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


class Record:
    """What every actor saw, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.statuses: Counter[tuple[str, str, int]] = Counter()
        self.breaches: list[str] = []
        self.server_errors: list[str] = []
        self.health: list[tuple[float, int, int, int, str]] = []  # t, rss, fds, status, why

    def saw(self, actor: str, op: str, status: int, detail: str = "") -> None:
        with self._lock:
            self.statuses[(actor, op, status)] += 1
            if status >= 500 and status != 507:
                self.server_errors.append(f"{actor} {op}: {status} {detail[:200]}")
                self.breaches.append(f"{actor} {op} answered {status}")

    def breach(self, what: str) -> None:
        with self._lock:
            self.breaches.append(what)

    def call(
        self, actor: str, op: str, send: Callable[..., httpx.Response], *args: Any, **kw: Any
    ) -> httpx.Response | None:
        """``send(*args, **kw)``, one request; its status recorded (0: a transport failure,
        e.g. refused at a cap)."""
        try:
            r = send(*args, **kw)
        except httpx.HTTPError:
            self.saw(actor, op, 0)
            return None
        self.saw(actor, op, r.status_code, r.text if r.status_code >= 500 else "")
        return r


class Clock:
    """What every actor shares: the daemon, the deadline, the record, a random source."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        #: The daemon's connection caps, REST and socket (both set here).
        self.cap = self.sockets = 128
        self.record = Record()
        self.deadline = 0.0
        self.dir = Path(tempfile.mkdtemp(prefix="maasd-soak-"))
        self.daemon = Daemon(
            self.dir / "data",
            wrapper=["prlimit", f"--nofile={args.files}:{args.files}", "--"],
            env={
                "MAASD_HTTP_MAX_CONNECTIONS": str(self.cap),
                "MAASD_HTTP_HEAD_TIMEOUT_S": "2",
                "MAASD_HTTP_BODY_TIMEOUT_S": "2",
                "MAASD_MAX_BUFFERS_PER_TENANT": "512",
                "MAASD_SOCKET_MAX_CONNECTIONS": str(self.sockets),
            },
        )

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def pause(self, seconds: float) -> None:
        time.sleep(min(seconds, max(0.0, self.deadline - time.monotonic())))

    def tenant(self, actor: str, quota: int) -> tuple[str, str]:
        """A new tenant ``(id, key)``; retried while floods keep the REST connections full."""
        while True:
            name = f"{actor}-{secrets.token_hex(3)}"
            body = {"name": name, "quota_bytes": quota}
            r = self.record.call(
                actor, "create-tenant", self.daemon.admin.post, "/v1/tenants", json=body
            )
            if r is not None and r.status_code == 201:
                return r.json()["id"], r.json()["api_key"]
            time.sleep(0.2)


class Workload(Clock):
    """Tenants at work: normal ones, flooders, and the deletes and drains under load."""

    def normal_tenant(self, n: int) -> None:
        actor = f"normal{n}"
        _, key = self.tenant(actor, 256 * MiB)
        with self.daemon.client(key) as c:
            while self.running():
                try:
                    w = Worker(self.daemon.socket_path, key)
                except Exception as e:  # the socket at its cap (a flood): 507, or refused
                    self.record.saw(actor, f"connect:{type(e).__name__}", 0)
                    self.pause(0.5)
                    continue
                with w:
                    while self.running() and self.one_buffer(actor, c, w):
                        pass

    def one_buffer(self, actor: str, c: httpx.Client, w: Worker) -> bool:
        """One buffer's life; ``False`` when the worker connection is gone (reconnect)."""
        size = self.rng.choice([4 * KiB, 64 * KiB, MiB, 2 * MiB])
        key = f"k{self.rng.randrange(50)}" if self.rng.random() < 0.3 else None
        body: dict[str, Any] = {"size_bytes": size, "ttl_s": 60, "label": "soak ✓ ünïcode"}
        if key:
            body |= {"key": key, "evictable": True}
        r = self.record.call(actor, "reserve", c.post, "/v1/reserve", json=body)
        if r is None or r.status_code != 201:
            self.pause(0.05)
            return True
        buf = r.json()
        alive = True
        try:
            m = w.attach(buf["id"])
        except Exception as e:  # evicted meanwhile (404), or the connection is gone
            self.record.saw(actor, f"attach:{type(e).__name__}", 0)
            alive = not isinstance(e, (ConnectionFailed, OSError))
        else:
            pattern = self.rng.randrange(1, 255)
            m.array[:] = pattern
            if int(m.array[self.rng.randrange(size)]) != pattern or not bool(m.array.all()):
                self.record.breach(f"{actor}: read back wrong bytes from {buf['id']}")
            m.close()
            self.record.saw(actor, "attach", 200)
        if key:
            self.record.call(actor, "lookup", c.post, "/v1/buffers/lookup", json={"keys": [key]})
        renew = f"/v1/buffers/{buf['id']}/renew"
        self.record.call(actor, "renew", c.post, renew, json={"ttl_s": 60})
        self.record.call(actor, "release", c.delete, f"/v1/buffers/{buf['id']}")
        return alive

    def flood(self, actor: str, max_buffers: int) -> None:
        """4 KiB buffers until refused (409 at the cap, 507 at the budget), then release all."""
        tid, key = self.tenant(actor, 1 << 40)
        cap = {"max_buffers": max_buffers}
        self.record.call(actor, "set-cap", self.daemon.admin.patch, f"/v1/tenants/{tid}", json=cap)
        with self.daemon.client(key) as c:
            while self.running():
                held: list[str] = []
                while self.running() and len(held) < max_buffers + 1:
                    r = self.record.call(
                        actor, "reserve", c.post, "/v1/reserve", json={"size_bytes": 4096}
                    )
                    if r is None or r.status_code != 201:
                        break
                    held.append(r.json()["id"])
                self.pause(0.5)
                for buffer_id in held:
                    self.record.call(actor, "release", c.delete, f"/v1/buffers/{buffer_id}")
                self.pause(2)

    def burst(self, key: str, path: str, size: int, stop: threading.Event, actor: str) -> None:
        with self.daemon.client(key) as c:
            while not stop.is_set():
                r = self.record.call(actor, "burst", c.post, path, json={"size_bytes": size})
                if r is not None and r.status_code == 201:
                    c.delete(f"/v1/buffers/{r.json()['id']}")

    def under_burst(self, actor: str, key: str, path: str, size: int, delete: str) -> None:
        """Reserve at ``path`` from 2 threads; after a while ``DELETE delete``: must be 204."""
        stop = threading.Event()
        threads = [
            threading.Thread(target=self.burst, args=(key, path, size, stop, actor))
            for _ in range(2)
        ]
        for th in threads:
            th.start()
        self.pause(self.rng.uniform(0.2, 1.0))
        for _ in range(100):  # a request refused unread at the connection cap is retried
            r = self.record.call(actor, "delete", self.daemon.admin.delete, delete)
            if r is not None and r.status_code != 507:
                break
            time.sleep(0.3)
        stop.set()
        for th in threads:
            th.join(60)
        if r is None or r.status_code != 204:
            self.record.breach(f"{actor}: DELETE {delete} answered {r and r.status_code}")

    def deleter(self) -> None:
        while self.running():
            tid, key = self.tenant("deleter", 1 << 30)
            self.under_burst("deleter", key, "/v1/reserve", 16 * MiB, f"/v1/tenants/{tid}")
            self.pause(1)

    def drainer(self) -> None:
        _, key = self.tenant("drainer", 1 << 30)
        while self.running():
            name = f"soak-{secrets.token_hex(3)}"
            spec = {"name": name, "numa_node": 0, "capacity_bytes": 32 * MiB}
            r = self.record.call(
                "drainer", "create-pool", self.daemon.admin.post, "/v1/pools", json=spec
            )
            if r is not None and r.status_code == 201:
                pool = r.json()["id"]
                path = f"/v1/pools/{pool}/reserve"
                self.under_burst("drainer", key, path, 4 * MiB, f"/v1/pools/{pool}?drain=true")
            self.pause(1)

    def kept_fd(self) -> None:
        _, key = self.tenant("keeper", 64 * MiB)
        with self.daemon.client(key) as c:
            while self.running():
                r = self.record.call(
                    "keeper", "reserve", c.post, "/v1/reserve", json={"size_bytes": MiB}
                )
                if r is None or r.status_code != 201:
                    self.pause(1)
                    continue
                buffer_id = r.json()["id"]
                try:
                    with Worker(self.daemon.socket_path, key) as w:
                        m = w.attach(buffer_id)
                        m.array[:] = 7
                        self.record.call("keeper", "release", c.delete, f"/v1/buffers/{buffer_id}")
                        if m.array.any():
                            self.record.breach("keeper: a released buffer did not read zero")
                        m.array[:] = 9  # memory its own cgroup pays for
                        m.close()
                except Exception as e:
                    self.record.saw("keeper", f"attach:{type(e).__name__}", 0)
                    c.delete(f"/v1/buffers/{buffer_id}")
                self.pause(1)


class Attacks(Clock):
    """Connections, slow clients, hostile bodies, and the monitor that watches."""

    def connection_flood(self) -> None:
        """Twice the REST cap in connections that say nothing, held 1.5 s, again and again."""
        self.flood_connections("connflood", 2 * self.cap, self.rest_connection)

    def socket_flood(self) -> None:
        """Twice the socket's cap in connections that never say hello."""
        self.flood_connections("sockflood", 2 * self.sockets, self.socket_connection)

    def rest_connection(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.daemon.port), 5)

    def socket_connection(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.daemon.socket_path)
        except OSError:
            s.close()
            raise
        return s

    def flood_connections(self, actor: str, n: int, connect: Callable[[], socket.socket]) -> None:
        while self.running():
            held = []
            for _ in range(n):
                try:
                    held.append(connect())
                except OSError:
                    self.record.saw(actor, "connect", 0)
            self.record.saw(actor, "flood", len(held))
            self.pause(1.5)
            for s in held:
                s.close()
            self.pause(5)

    def slow_clients(self) -> None:
        """Requests whose body never comes: the daemon closes them (head and body deadlines
        of 2 s here; 8 s allowed for a loaded machine)."""
        while self.running():
            held = []
            for _ in range(10):
                try:
                    s = self.rest_connection()
                    s.sendall(
                        b"POST /v1/reserve HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"
                    )
                    held.append(s)
                except OSError:
                    self.record.saw("slow", "connect", 0)
            time.sleep(8)
            for s in held:
                s.settimeout(0.1)
                closed = False
                try:
                    while s.recv(4096):  # an answer (401: no key) may come first
                        pass
                    closed = True
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
                s.close()
                self.record.saw("slow", "closed-by-daemon" if closed else "still-open", 0)
                if not closed:
                    self.record.breach("slow: a request without its body was not closed in 8 s")
            self.pause(2)

    def hostile(self) -> None:
        _, key = self.tenant("hostile", 64 * MiB)
        bodies: list[Any] = [
            {"size_bytes": 4096, "label": "x" * 129},
            {"size_bytes": 4096, "label": "\x00\x01\x1b[2J"},
            {"size_bytes": 4096, "label": "🦀" * 128},
            {"size_bytes": 4096, "key": "a\x00b"},
            {"size_bytes": "4096"},
            {"size_bytes": -1},
            {"size_bytes": 2**64},
            {"size_gb": 1e308},
            {"size_bytes": 4096, "size_gb": 1},
            {"size_bytes": 4096, "extra": 1},
            {"size_bytes": 4096, "ttl_s": 2**40},
            [1, 2, 3],
            "x" * (70 * KiB),
        ]
        with self.daemon.client(key) as c:
            while self.running():
                body = self.rng.choice(bodies)
                r = self.record.call("hostile", "reserve", c.post, "/v1/reserve", json=body)
                if r is not None and r.status_code == 201:
                    c.delete(f"/v1/buffers/{r.json()['id']}")
                raw = b'{"size_bytes": 4096, "label": "' + os.urandom(64) + b'"}'
                headers = {"Content-Type": "application/json"}
                self.record.call(
                    "hostile", "raw", c.post, "/v1/reserve", content=raw, headers=headers
                )
                pool = {
                    "name": f"h{secrets.token_hex(3)}",
                    "numa_node": 0,
                    "capacity_bytes": MiB,
                    "persistence": "persistent",
                    "spill_dir": "/tmp/\x00",
                }
                self.record.call(
                    "hostile", "spill-dir", self.daemon.admin.post, "/v1/pools", json=pool
                )
                self.pause(0.2)

    def monitor(self) -> None:
        assert self.daemon.proc is not None
        pid, started = self.daemon.proc.pid, time.monotonic()
        while self.running():
            if self.daemon.proc.poll() is not None:
                self.record.breach(f"the daemon died (exit {self.daemon.proc.returncode})")
                return
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                status, body = healthz(self.daemon)
                why = "" if status == 200 else json.dumps(body)[:300]
            except (OSError, httpx.HTTPError, ValueError, StopIteration) as e:
                rss, fds, status, why = 0, 0, 0, f"{type(e).__name__}: {e}"
            self.record.health.append((time.monotonic() - started, rss, fds, status, why))
            self.pause(1)


class Soak(Workload, Attacks):
    """Every actor at once until the deadline, then the checks and the report."""

    def actors(self) -> dict[str, Callable[[], None]]:
        normal: dict[str, Callable[[], None]] = {
            f"normal{n}": functools.partial(self.normal_tenant, n) for n in range(3)
        }
        return normal | {
            "capped": functools.partial(self.flood, "capped", 300),
            "budget": functools.partial(self.flood, "budget", 100_000),
            "deleter": self.deleter,
            "drainer": self.drainer,
            "connflood": self.connection_flood,
            "sockflood": self.socket_flood,
            "slow": self.slow_clients,
            "hostile": self.hostile,
            "keeper": self.kept_fd,
            "monitor": self.monitor,
        }

    def guarded(self, name: str, actor: Callable[[], None]) -> Callable[[], None]:
        """Run ``actor`` until the deadline; an actor that fails (a refused connection
        where it did not expect one, say) is counted and started again."""

        def run() -> None:
            while self.running():
                try:
                    actor()
                except Exception as e:
                    self.record.saw(name, f"crashed:{type(e).__name__}", 0)
                    self.pause(1)

        return run

    def run(self) -> int:
        self.daemon.start()
        self.deadline = time.monotonic() + self.args.minutes * 60
        threads = [
            threading.Thread(target=self.guarded(name, fn), name=name, daemon=True)
            for name, fn in self.actors().items()
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(1.0, self.deadline - time.monotonic()) + 120)
        stuck = [th.name for th in threads if th.is_alive()]
        if stuck:
            self.record.breach(f"actors still running 2 min after the deadline: {stuck}")
        shutdown = self.finish()
        self.report(shutdown)
        return 1 if self.record.breaches else 0

    def finish(self) -> float:
        """Quiet now: the ledger must equal the memfds, the daemon live, SIGTERM clean."""
        proc = self.daemon.proc
        assert proc is not None
        if proc.poll() is not None:
            self.record.breach(f"the daemon died (exit {proc.returncode})")
            return float("nan")
        ok, why = ledger_matches_memfds(self.daemon)
        for _ in range(300):
            if ok:
                break
            time.sleep(0.1)
            ok, why = ledger_matches_memfds(self.daemon)
        if not ok:
            self.record.breach(f"ledger != memfds once quiet: {why}")
        started = time.monotonic()
        code = self.daemon.stop(timeout=120)
        took = time.monotonic() - started
        if code != 0 or took >= 30:
            self.record.breach(f"SIGTERM: exit {code} after {took:.1f} s")
        return took

    def report(self, shutdown_s: float) -> None:
        r = self.record
        print(
            f"maasd soak: {self.args.minutes:g} min, RLIMIT_NOFILE {self.args.files}, "
            f"connection caps {self.cap}, seed {self.args.seed}"
        )
        print(f"operations: {sum(n for (_, _, s), n in r.statuses.items() if s >= 0)}")
        by_op: dict[tuple[str, str], Counter[int]] = {}
        for (actor, op, status), n in r.statuses.items():
            by_op.setdefault((actor, op), Counter())[status] += n
        for (actor, op), statuses in sorted(by_op.items()):
            shown = "  ".join(f"{s}×{n}" for s, n in sorted(statuses.items()))
            print(f"  {actor:<10} {op:<22} {shown}")
        print(f"5xx other than 507: {len(r.server_errors) or 'none'}")
        for line in r.server_errors[:20]:
            print(f"  {line}")
        failures = [h for h in r.health if h[3] != 200]
        print(f"/healthz: {len(r.health)} samples, {len(failures)} not 200")
        for t, _rss, _fds, status, why in failures[:10]:
            print(f"  at {t:.0f} s: {status} {why}")
        if r.health:
            rss = [h[1] // 1024 for h in r.health if h[1]]
            fds = [h[2] for h in r.health if h[2]]
            if rss and fds:
                print(
                    f"daemon RSS MiB: start {rss[0]}, max {max(rss)}, end {rss[-1]}; "
                    f"open files: start {fds[0]}, max {max(fds)}, end {fds[-1]}"
                )
            step = max(1, len(r.health) // 10)
            print("  t(s)  RSS(MiB)  files  health")
            for t, rss_kib, nfd, status, _ in r.health[::step]:
                print(f"  {t:5.0f}  {rss_kib // 1024:8d}  {nfd:5d}  {status}")
        print(f"shutdown: {shutdown_s:.1f} s")
        print(f"breaches: {len(r.breaches) or 'none'}")
        for b in r.breaches[:50]:
            print(f"  {b}")
        if self.args.json:
            Path(self.args.json).write_text(
                json.dumps(
                    {
                        "statuses": [[*k, n] for k, n in r.statuses.items()],
                        "server_errors": r.server_errors,
                        "health": r.health,
                        "breaches": r.breaches,
                        "shutdown_s": shutdown_s,
                    }
                )
            )

    def close(self) -> None:
        self.daemon.close()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"data dir and daemon log kept in {self.dir}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long (default 5)")
    p.add_argument(
        "--files", type=int, default=2048, help="the daemon's RLIMIT_NOFILE (default 2048)"
    )
    p.add_argument("--seed", type=int, default=secrets.randbelow(1 << 30))
    p.add_argument("--json", help="also write what was seen to this file")
    p.add_argument("--keep", action="store_true", help="keep the data dir and daemon log")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        p.error("--minutes must be in (0, 1440]")
    soak = Soak(args)
    try:
        return soak.run()
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
