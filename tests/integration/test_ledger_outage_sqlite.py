"""The embedded SQLite ledger stops taking writes under a running daemon (SPEC §9,
docs/scale-out.md "Failure modes").

Real faults on a real file, in a daemon of each test's own whose ledger lives on a small
tmpfs this test mounts (root: CAP_SYS_ADMIN; skipped, saying why, without it):

* **full**: the WAL checkpointed to nothing, then the file system filled to ``ENOSPC``
  (SQLITE_FULL, "database or disk is full");
* **locked**: another process holds the write lock (``BEGIN EXCLUSIVE``) — SQLITE_BUSY,
  "database is locked", once a writer waited out the busy timeout.

(Read-only cannot be made under a live daemon: the kernel refuses ``mount -o remount,ro``
with EBUSY while a file on it is open for writing, which the daemon's ledger is;
SQLITE_READONLY is classified like the two above, tests/unit/test_ledger_circuit.py.)

Checked, for each, while the file cannot be written: socket ``lookup`` of committed
entries, ``attach`` and ``detach`` of a live buffer keep working, without one failure, for
longer than a lease; what needs a new row (``put``, reserve, a new tenant) answers 507
``ledger-unavailable`` — after the first writer waited out the busy timeout, each at once
(within a client timeout shorter than that busy timeout); the reads still read the file
(fresh, not stale); ``/healthz`` is 200 ``degraded`` naming the ledger. Then writable
again: no restart, reserves work, the lease a hit extended meanwhile is written, the
entry whose lease ended unused is reaped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_ledger_outage_dataplane import commit, expires_at, healthy, hit

from conftest import Daemon
from maasd.client import Worker
from maasd.client.errors import LedgerUnavailable, MaasdClientError
from maasd.store.engine import BUSY_TIMEOUT_MS
from waiting import wait_until

MiB = 1 << 20
#: Leases shorter than the fault lasts: without the hits' extensions they would end in it.
#: Longer than the busy timeout the first writer of a locked ledger waits out before the
#: data plane is exercised: a lease that ended before its first hit is over (a lookup
#: misses it), and the hits must begin while it runs.
LEASE_S = BUSY_TIMEOUT_MS // 1000 + 2
#: A request answered "at once" is answered well within this; one that waited out the
#: busy timeout (10 s) is not. A hang guard with a margin, not a measurement.
AT_ONCE_S = BUSY_TIMEOUT_MS / 1000 * 0.6


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; why not, if it cannot be."""
    if os.geteuid() != 0:
        return "mounting a small file system for the ledger needs root (CAP_SYS_ADMIN)"
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"mount -t tmpfs failed here: {done.stderr.strip() or done.returncode}"
    return None


@pytest.fixture
def sqlite_host(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    fs = tmp_path / "ledgerfs"
    why = _mount_tmpfs(fs, "24m")
    if why:
        pytest.skip(why)
    db = fs / "maasd.db"
    d = Daemon(tmp_path / "maasd", env={"MAASD_DB_URL": f"sqlite:///{db}"})
    try:
        d.start()
        yield d, db
    finally:
        with contextlib.suppress(Exception):
            (fs / "filler").unlink(missing_ok=True)
        d.close()
        subprocess.run(["umount", "-l", str(fs)], check=False)


def _fill(path: Path) -> int:
    """Write ``path`` until its file system is full (``ENOSPC``); the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            while True:
                try:
                    n = f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n or 0
                if not n:
                    break
    return written


def _checkpoint_to_nothing(db: Path) -> None:
    """Empty the WAL into the database file and truncate it to 0 bytes, so that the
    daemon's next commit must grow it (the file system's space is then what it lacks)."""
    conn = sqlite3.connect(db, isolation_level=None, timeout=10)
    try:
        wait_until(
            lambda: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0,
            timeout=30,
            message="the WAL checkpointed and truncated",
        )
    finally:
        conn.close()


class Setup:
    """What the daemon holds before the fault: entries, a live buffer, last reads."""

    def __init__(self, d: Daemon) -> None:
        self.tenant_id, self.key = d.tenant("sqlite-outage", quota_bytes=64 * MiB)
        self.worker = Worker(d.socket_path, self.key, renew_interval_s=0)
        self.data = np.random.default_rng(7).bytes(MiB + 17)
        self.entry = commit(self.worker, "prefix:1", self.data)
        self.short = commit(self.worker, "prefix:short", b"s" * 4096, ttl_s=LEASE_S)
        self.unused = commit(self.worker, "prefix:unused", b"u" * 4096, ttl_s=LEASE_S)
        self.buf = d.client(self.key).post("/v1/reserve", json={"size_bytes": MiB}).json()["id"]
        self.last_hit = 0.0


def _data_plane_through(s: Setup, seconds: float) -> list[str]:
    """Lookups, attaches and detaches for ``seconds``; the failures."""
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        try:
            with hit(s.worker, ["prefix:0", "prefix:1"]) as m:
                assert bytes(m.array[: len(s.data)]) == s.data
            with hit(s.worker, ["prefix:short"]) as m:
                assert m.buffer_id == s.short
            s.last_hit = time.time()
            s.worker.attach(s.buf).array[:4] = 7
            s.worker.detach(s.buf)
        except MaasdClientError as exc:
            failures.append(repr(exc))
        time.sleep(0.05)
    assert rounds > 10
    return failures


def _is_507(r: httpx.Response) -> bool:
    return r.status_code == 507 and r.json()["type"].endswith("/ledger-unavailable")


def _while_unwritable(d: Daemon, s: Setup) -> None:
    c = d.client(s.key)
    # The first writer may wait out the busy timeout (locked); it trips the circuit.
    first = c.post("/v1/reserve", json={"size_bytes": MiB}, timeout=BUSY_TIMEOUT_MS / 1000 * 3)
    assert _is_507(first), (first.status_code, first.text)
    wait_until(
        lambda: d.admin.get("/healthz").json()["status"] == "degraded",
        timeout=30,
        message="/healthz degraded",
    )
    # Every write now: 507 at once, never 500 — a reserve, a new tenant, a socket put.
    for _ in range(5):
        r = c.post("/v1/reserve", json={"size_bytes": 4096}, timeout=AT_ONCE_S)
        assert _is_507(r), (r.status_code, r.text)
    r = d.admin.post("/v1/tenants", json={"name": "during", "quota_bytes": MiB}, timeout=AT_ONCE_S)
    assert _is_507(r), (r.status_code, r.text)
    with pytest.raises(LedgerUnavailable):
        s.worker.put("prefix:new", MiB)
    # The data plane goes on, past the short leases.
    failures = _data_plane_through(s, LEASE_S + 1.0)
    assert not failures, failures[:5]
    # The file can still be read: the reads are fresh.
    for path in ("/v1/usage", "/v1/buffers", "/v1/pools"):
        r = c.get(path, timeout=AT_ONCE_S)
        assert r.status_code == 200, (path, r.text)
        assert "maasd-stale" not in r.headers, path
    h = d.admin.get("/healthz")
    assert h.status_code == 200, h.text
    assert h.json()["status"] == "degraded"
    assert h.json()["components"]["ledger"]["ok"] is False
    assert d.proc is not None
    assert d.proc.poll() is None


def _after(d: Daemon, s: Setup) -> None:
    c = d.client(s.key)

    def reserves_again() -> bool:
        return c.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201

    wait_until(reserves_again, timeout=30, message="reserves work again, without a restart")
    wait_until(lambda: healthy(d), timeout=10, message="healthz ok again")
    # Reaped as the reaper would have: the entry left unused (watched over REST: a hit
    # would extend its lease); the hit one's lease, extended meanwhile, was written.
    wait_until(lambda: c.get(f"/v1/buffers/{s.unused}").status_code == 404, timeout=30)
    assert s.worker.lookup(["prefix:unused"]) is None
    assert expires_at(d, s.key, s.short) >= s.last_hit + LEASE_S - 1.0
    with hit(s.worker, ["prefix:1"]) as m:
        assert m.buffer_id == s.entry
    assert d.proc is not None
    assert d.proc.poll() is None


def _through_a_fault(d: Daemon, start: Callable[[], None], end: Callable[[], None]) -> None:
    s = Setup(d)
    try:
        start()
        try:
            _while_unwritable(d, s)
        finally:
            end()
        _after(d, s)
    finally:
        s.worker.close()


def test_a_full_disk_under_the_sqlite_ledger(sqlite_host: tuple[Daemon, Path]) -> None:
    d, db = sqlite_host
    filler = db.parent / "filler"

    def full() -> None:
        _checkpoint_to_nothing(db)
        assert _fill(filler) > 0

    _through_a_fault(d, full, lambda: filler.unlink())
    assert "disk is full" in d.log()


def test_a_sqlite_ledger_locked_by_another_process(sqlite_host: tuple[Daemon, Path]) -> None:
    d, db = sqlite_host
    other = sqlite3.connect(db, isolation_level=None, timeout=30)

    def lock() -> None:
        other.execute("BEGIN EXCLUSIVE")

    def unlock() -> None:
        other.execute("ROLLBACK")

    try:
        _through_a_fault(d, lock, unlock)
    finally:
        other.close()
