"""The worker data plane's p99 with a slow ledger vs a normal one, in one run.

    scripts/pg-test-server start 55432   # prints the URL
    MAASD_TEST_PG_URL=postgresql+psycopg://postgres@127.0.0.1:55432/postgres \\
        .venv/bin/python tests/bench/bench_ledger_p99.py [--samples 1000] [--rounds 3] \\
        [--delay-ms 20] [--no-hellos]

A throw-away ``maasd serve`` whose ledger is a fresh database on that server, reached
through a TCP proxy on loopback (tests/integration/test_ledger_outage.py's ``Proxy``)
that can delay every chunk it forwards, either way, by ``--delay-ms`` (a round trip is
then twice that slower). A load on other connections keeps the ledger busy the whole
time: REST reserve + delete and socket put + commit in one thread, and — unless
``--no-hellos`` — in another a new socket connection every 50 ms saying hello with a key
issued before and never used (its check reads the ledger). Measured, on one connection
opened before: ``lookup`` of a committed 1 MiB entry, and ``attach`` + ``detach`` of a
live 1 MiB buffer, ``--samples`` each per phase.

The phases alternate ``--rounds`` times: normal (no delay), then slow. Printed: each
phase's p99 (and median), the load's operations, and per round the slow/normal p99 ratio
— the result, since absolute times drift with the machine's load. The promise
(docs/scale-out.md, "Failure modes") is a ratio within 2×. CI never runs this; the
structural check that the data plane makes no ledger call is
tests/integration/test_ledger_frozen.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "integration")]

import sqlalchemy as sa  # noqa: E402
from test_ledger_outage import Proxy  # noqa: E402

from conftest import Daemon  # noqa: E402
from maasd.client import Worker  # noqa: E402
from pgdb import fresh_pg_database  # noqa: E402

MiB = 1 << 20
#: Keys issued for the hello load, and how often one says hello.
HELLO_KEYS, HELLO_EVERY_S = 400, 0.05


def _commit(w: Worker, key: str, data: bytes) -> None:
    m = w.put(key, len(data))
    m.array[: len(data)] = np.frombuffer(data, np.uint8)
    w.commit(m)


class Load:
    """What keeps the ledger busy on other connections: threads of their own."""

    def __init__(self, d: Daemon, tenant_id: str, key: str, hellos: bool) -> None:
        self.d, self.key = d, key
        self.ops = self.hellos = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._writes, daemon=True)]
        self.keys: list[str] = []
        if hellos:  # issued now, used one each: every hello is of a key never seen
            for _ in range(HELLO_KEYS):
                r = d.admin.post(f"/v1/tenants/{tenant_id}/keys")
                assert r.status_code == 201, r.text
                self.keys.append(r.json()["api_key"])
            self.threads.append(threading.Thread(target=self._hellos, daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _writes(self) -> None:
        try:
            with (
                Worker(self.d.socket_path, self.key, renew_interval_s=0) as w,
                self.d.client(self.key) as c,
            ):
                while not self.stop.is_set():
                    r = c.post("/v1/reserve", json={"size_bytes": 4096})
                    assert r.status_code == 201, r.text
                    assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
                    _commit(w, f"load:{time.monotonic_ns()}", b"l" * 4096)
                    self.ops += 1
        except BaseException as exc:
            self.errors.append(exc)

    def _hellos(self) -> None:
        try:
            while self.keys and not self.stop.wait(HELLO_EVERY_S):
                Worker(self.d.socket_path, self.keys.pop(), renew_interval_s=0).close()
                self.hellos += 1
        except BaseException as exc:
            self.errors.append(exc)


def _phase(w: Worker, buffer_id: str, n: int) -> tuple[list[float], list[float]]:
    lookups, attaches = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        found = w.lookup(["bench:1"])
        assert found is not None
        found.close()
        t1 = time.perf_counter()
        w.attach(buffer_id)
        w.detach(buffer_id)
        t2 = time.perf_counter()
        lookups.append(t1 - t0)
        attaches.append(t2 - t1)
        time.sleep(0.001)  # a worker between requests: the load's threads run too
    return lookups, attaches


def _p(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--no-hellos", action="store_true")
    args = ap.parse_args()
    if not os.environ.get("MAASD_TEST_PG_URL"):
        sys.exit("set MAASD_TEST_PG_URL (scripts/pg-test-server start PORT prints it)")
    with fresh_pg_database() as url, tempfile.TemporaryDirectory() as tmp:
        u = sa.engine.make_url(url)
        proxy = Proxy((u.host or "127.0.0.1", u.port or 5432))
        via = u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        d = Daemon(Path(tmp) / "maasd", env={"MAASD_DB_URL": via, "MAASD_NODE_NAME": "p99"})
        try:
            d.start()
            _run(d, proxy, args)
        finally:
            proxy.delay_s = 0.0
            d.close()
            proxy.close()


def _run(d: Daemon, proxy: Proxy, args: argparse.Namespace) -> None:
    _tid, key = d.tenant("p99", quota_bytes=64 * MiB)
    load_tid, load_key = d.tenant("p99-load", quota_bytes=64 * MiB)
    load = Load(d, load_tid, load_key, hellos=not args.no_hellos)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        _commit(w, "bench:1", b"x" * MiB)
        buffer_id = d.client(key).post("/v1/reserve", json={"size_bytes": MiB}).json()["id"]
        load.start()
        _phase(w, buffer_id, 100)  # warm-up
        ratios: list[tuple[float, float]] = []
        print(
            f"delay +{args.delay_ms:g} ms per forwarded chunk (round trip +{2 * args.delay_ms:g})"
        )
        for r in range(args.rounds):
            result = {}
            for name, delay in (("normal", 0.0), ("slow", args.delay_ms / 1000)):
                proxy.delay_s = delay
                time.sleep(0.5)
                begun, hellos = load.ops, load.hellos
                result[name] = _phase(w, buffer_id, args.samples)
                lk, at = result[name]
                print(
                    f"round {r} {name:6}: lookup p99 {_p(lk, 99):6.3f} ms (p50 {_p(lk, 50):.3f}),"
                    f" attach+detach p99 {_p(at, 99):6.3f} ms (p50 {_p(at, 50):.3f});"
                    f" load: {load.ops - begun} writes, {load.hellos - hellos} hellos"
                )
            ratio = tuple(_p(result["slow"][i], 99) / _p(result["normal"][i], 99) for i in (0, 1))
            ratios.append((ratio[0], ratio[1]))
            print(f"round {r} slow/normal p99: lookup {ratio[0]:.2f}x, attach {ratio[1]:.2f}x")
        load.join()
    if load.errors:
        sys.exit(f"the load failed: {load.errors[0]!r}")
    med = [statistics.median(r[i] for r in ratios) for i in (0, 1)]
    print(
        f"median over {args.rounds} rounds, slow/normal p99: lookup {med[0]:.2f}x, "
        f"attach+detach {med[1]:.2f}x (promise: within 2x)"
    )


if __name__ == "__main__":
    main()
