"""A frozen PostgreSQL ledger (SIGSTOP of the postmaster and every backend) cannot hold up
the worker data plane: the structural half of "a slow ledger leaves the data plane as
fast" (docs/scale-out.md, "Failure modes"; the ratio itself is a benchmark,
tests/bench/bench_ledger_p99.py).

A frozen server is the worst slow one: its connections stay open, the kernel acknowledges
every packet, and nothing answers — no timeout of the client's or the server's fires. So
any data-plane operation that waited on the ledger would wait until the thaw. Checked,
with the cluster frozen:

* socket ``lookup`` of committed entries, ``attach`` and ``detach`` of a live buffer on
  connections opened before, and a new connection of a key the daemon already checked,
  all complete (a deadline of a minute guards against a hang; nothing is timed);
* meanwhile a hello with a key this daemon never saw — whose check must read the ledger,
  and so waits for the thaw — holds up no one else: it is checked off the event loop;
* a REST reserve made meanwhile waits for the thaw too, and is then answered (201 or 507,
  never 500);
* ``maasd_ledger_calls_on_hot_path_total`` (ledger calls made on the socket's event loop)
  is 0 after all of it, including that hello, before the freeze and after the thaw.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_ledger_outage_dataplane import _daemon, commit, hit

from conftest import Daemon, free_port
from maasd.client import Worker
from maasd.client.errors import LedgerUnavailable
from pgdb import PG_URL, PrivatePostgres, has_pg_server
from waiting import wait_until

MiB = 1 << 20
#: A hang guard, not a measurement: the frozen-ledger phase's work takes well under it.
HANG_GUARD_S = 60.0
HOT_PATH = "maasd_ledger_calls_on_hot_path_total"

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"),
    pytest.mark.skipif(not has_pg_server(), reason="no PostgreSQL server binaries (initdb)"),
]


@pytest.fixture
def frozen_host(tmp_path: Path) -> Iterator[tuple[Daemon, PrivatePostgres]]:
    pg = PrivatePostgres(free_port()).create()
    d = _daemon(tmp_path / "frozen", pg.url, "frozen")
    try:
        d.start()
        yield d, pg
    finally:
        d.close()
        pg.remove()


def _in_thread(work, name: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, errors


def _refused_507(errors: list[BaseException]) -> bool:
    return len(errors) == 1 and isinstance(errors[0], LedgerUnavailable)


def test_a_frozen_ledger_holds_up_no_lookup_attach_or_detach(
    frozen_host: tuple[Daemon, PrivatePostgres],
) -> None:
    d, pg = frozen_host
    _tid, key = d.tenant("frozen", quota_bytes=64 * MiB)
    _tid2, unseen = d.tenant("frozen-unseen", quota_bytes=MiB)  # never said hello here
    data = np.random.default_rng(3).bytes(MiB + 5)
    workers = [Worker(d.socket_path, key, renew_interval_s=0) for _ in range(2)]
    try:
        entry = commit(workers[0], "frozen:1", data)
        buf = d.client(key).post("/v1/reserve", json={"size_bytes": MiB}).json()["id"]
        with hit(workers[1], ["frozen:1"]):
            pass
        assert d.metric(HOT_PATH) == 0  # hellos, puts, commits, lookups: none on the loop

        pids = pg.freeze()
        try:
            late: list[Worker] = []
            hello, hello_errors = _in_thread(
                lambda: late.append(Worker(d.socket_path, unseen, renew_interval_s=0)),
                "unseen-hello",
            )
            # A write meanwhile needs the ledger: it waits (nothing times out against a
            # frozen server — docs/scale-out.md), and is answered once it thaws, never 500.
            reserved: list[int] = []
            writer, writer_errors = _in_thread(
                lambda: reserved.append(
                    d.client(key).post("/v1/reserve", json={"size_bytes": 4096}).status_code
                ),
                "reserve",
            )
            rounds = [0]

            def data_plane() -> None:
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline or rounds[0] < 20:
                    for w in workers:
                        with hit(w, ["frozen:0", "frozen:1"]) as m:
                            assert m.buffer_id == entry
                            assert bytes(m.array[: len(data)]) == data
                        w.attach(buf).array[:8] = 1
                        w.detach(buf)
                    # A new connection of a key checked before: told from memory.
                    with Worker(d.socket_path, key, renew_interval_s=0) as fresh:
                        assert hit(fresh, ["frozen:1"]).buffer_id == entry
                    rounds[0] += 1

            plane, plane_errors = _in_thread(data_plane, "data-plane")
            plane.join(HANG_GUARD_S)
            assert not plane.is_alive(), "the data plane waited on the frozen ledger"
            assert plane_errors == [], repr(plane_errors)
            assert rounds[0] >= 20
            # The unseen key's check waits for the ledger, alone — until the thaw, or until
            # the store's watchdog cuts its connection (23 s here): then it is a 507.
            assert hello.is_alive() or _refused_507(hello_errors), repr(hello_errors)
            # (The pool had no idle connection: a new one met the connect timeout, 507.)
            print(f"a reserve during the freeze: {'waiting' if writer.is_alive() else reserved}")
        finally:
            pg.thaw(pids)
        writer.join(HANG_GUARD_S)
        assert writer_errors == [], repr(writer_errors)
        assert len(reserved) == 1
        assert reserved[0] in (201, 507), reserved
        hello.join(HANG_GUARD_S)
        assert not hello.is_alive()
        if hello_errors:
            assert _refused_507(hello_errors), repr(hello_errors)
        else:
            assert late[0].lookup(["frozen:1"]) is None  # welcomed; another tenant's entry
            late[0].close()
        assert d.metric(HOT_PATH) == 0
        assert d.client(key).post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201
    finally:
        for w in workers:
            w.close()


@pytest.fixture
def frozen_backends_host(tmp_path: Path) -> Iterator[tuple[Daemon, PrivatePostgres]]:
    pg = PrivatePostgres(free_port()).create()
    d = Daemon(
        tmp_path / "backends",
        env={
            "MAASD_DB_URL": pg.url,
            "MAASD_NODE_NAME": "frozen-backends",
            "MAASD_DB_POOL_SIZE": "4",
            "MAASD_DB_CONNECT_TIMEOUT_S": "2",
            "MAASD_DB_STATEMENT_TIMEOUT_S": "2",  # the watchdog's limit: 2 × 2 + 2 + 1 s
        },
    )
    try:
        d.start()
        yield d, pg
    finally:
        d.close()
        pg.remove()


class BackendFreezer:
    """SIGSTOPs every backend of ``pg`` (not the postmaster) at once, then, until
    :meth:`stop`, every backend forked since. Without the watch, a connection the daemon
    opened while the list was read (its background work had the pooled one checked out)
    served every request of the freeze, fresh and unfrozen: on a loaded CI host, three
    201s and no cut to see."""

    def __init__(self, pg: PrivatePostgres) -> None:
        self.pg, self.frozen = pg, list[int]()
        self._stop = threading.Event()
        self._freeze_new()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _freeze_new(self) -> None:
        for pid in self.pg.pids()[1:]:
            if pid not in self.frozen:
                os.kill(pid, signal.SIGSTOP)
                self.frozen.append(pid)

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self._freeze_new()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_write_on_a_frozen_backend_is_cut_not_left_waiting(
    frozen_backends_host: tuple[Daemon, PrivatePostgres],
) -> None:
    """Only the backends frozen (not the postmaster): a pooled connection's statement
    would wait for the thaw — no server or kernel timeout fires — so the store's watchdog
    cuts the connection held past its limit, the request answers 507, and a new
    connection (a fresh backend) serves the next. Never a hang, never a 500."""
    d, pg = frozen_backends_host
    _tid, key = d.tenant("frozen-backends", quota_bytes=64 * MiB)
    c = d.client(key)
    for _ in range(4):  # pooled connections, each with a backend of its own
        assert c.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201
    statuses: list[int] = []
    freezer = BackendFreezer(pg)
    try:
        for _ in range(3):
            r = c.post("/v1/reserve", json={"size_bytes": 4096}, timeout=HANG_GUARD_S)
            freezer.stop()  # from the first answer on, a fresh backend may serve
            statuses.append(r.status_code)
            if r.status_code == 507:
                assert r.json()["type"].endswith("/ledger-unavailable"), r.text
    finally:
        freezer.stop()
        pg.thaw(freezer.frozen)
    assert set(statuses) <= {201, 507}, statuses
    assert 507 in statuses, statuses  # at least one met a frozen backend and was cut
    assert "past every bound of a serving database" in d.log()

    def reserves() -> bool:
        return c.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201

    wait_until(reserves, timeout=30, message="reserves work after the thaw, no restart")
