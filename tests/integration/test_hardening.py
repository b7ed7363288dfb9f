"""Attacks on a real daemon, each kept as a regression test.

After every attack :func:`hardening.after_attack` checks that the daemon is alive,
that ``/healthz`` tells the truth, that another tenant can still reserve and attach,
and that the ledger equals the daemon's live memfds (``/proc/PID/fd``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Daemon, MiB
from hardening import (
    after_attack,
    buffer_memfds,
    ledger_ids,
    ledger_matches_memfds,
    memfd_of,
    wait_ledger_matches_memfds,
)
from maasd.client import Worker
from maasd.store import Store
from nobody import NOBODY, as_nobody, require_reachable_checkout

KiB = 1 << 10


def low_files(n: int) -> list[str]:
    """Run the daemon with ``n`` open files at most (soft and hard)."""
    return ["prlimit", f"--nofile={n}:{n}", "--"]


#: At 1024 open files 64 socket connections leave 216 regions (maasd.core.limits).
FEW_SOCKETS = {"MAASD_SOCKET_MAX_CONNECTIONS": "64"}


def reserve_all(c: httpx.Client, n: int, **body: Any) -> Counter[int]:
    """``n`` reserves of 4 KiB (or ``body``); how many answered each status."""
    statuses: Counter[int] = Counter()
    for _ in range(n):
        statuses[c.post("/v1/reserve", json={"size_bytes": 4 * KiB, **body}).status_code] += 1
    return statuses


# -- 1. file descriptors ------------------------------------------------------------------------


def test_a_buffer_flood_at_a_low_open_files_limit_is_507_never_500(tmp_path: Path) -> None:
    # One tenant may take the whole budget here (tenant_region_share 1.0): the daemon-wide
    # budget is what this floods (a tenant's share: tests/integration/test_region_budget.py).
    env = {**FEW_SOCKETS, "MAASD_TENANT_REGION_SHARE": "1.0"}
    d = Daemon(tmp_path / "d", wrapper=low_files(1024), env=env).start()
    try:
        _, bystander_key = d.tenant("bystander", 16 * MiB)
        by = d.client(bystander_key)
        held = by.post("/v1/reserve", json={"size_bytes": 64 * KiB}).json()
        tid, key = d.tenant("flood", 256 * MiB)
        c = d.client(key)
        # The daemon's default cap (4096) is above its region budget at 1024 files (216):
        # the daemon-wide budget answers, with the limit named.
        first_refusal = None
        statuses: Counter[int] = Counter()
        for _ in range(800):
            r = c.post("/v1/reserve", json={"size_bytes": 4 * KiB})
            statuses[r.status_code] += 1
            if r.status_code != 201 and first_refusal is None:
                first_refusal = r.json()
        assert set(statuses) == {201, 507}, statuses
        assert first_refusal is not None
        assert first_refusal["type"].endswith("/resource-limit")
        assert "of its 1024 open files" in first_refusal["detail"]
        assert "RLIMIT_NOFILE 1024" in first_refusal["detail"]
        # at the budget everything but a new region still works
        assert d.admin.get("/v1/buffers").status_code == 200
        assert d.admin.get(f"/v1/tenants/{tid}").json()["buffers"] == statuses[201]
        with Worker(d.socket_path, bystander_key) as w:
            m = w.attach(held["id"])
            assert not m.array.any()
            m.close()
        assert by.post("/v1/reserve", json={"size_bytes": 4 * KiB}).status_code == 507
        assert d.healthy()
        # the flooder gives some back: everyone may reserve again
        mine = [b["id"] for b in c.get("/v1/buffers").json()]
        for buffer_id in mine[:20]:
            assert c.delete(f"/v1/buffers/{buffer_id}").status_code == 204
        after_attack(d)

        # 2nd wave, with a cap below the budget: the flooder stops at its own cap (409)
        # and the others keep reserving.
        r = d.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 100})
        assert r.json()["max_buffers"] == 100
        r = c.post("/v1/reserve", json={"size_bytes": 4 * KiB})
        assert r.status_code == 409
        assert r.json()["type"].endswith("/buffer-count-exceeded")
        assert "its max_buffers is 100" in r.json()["detail"]
        for buffer_id in mine[20:]:
            c.delete(f"/v1/buffers/{buffer_id}")
        assert reserve_all(c, 120) == Counter({201: 100, 409: 20})
        after_attack(d)
        assert d.stop() == 0
    finally:
        d.close()


def read_all(s: socket.socket) -> bytes:
    """Everything until the peer closes (a reset counts as closed)."""
    s.setblocking(True)
    s.settimeout(15)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(4096):
            out += chunk
    return out


def test_rest_connection_floods_and_slow_clients_leave_the_daemon_its_files(
    tmp_path: Path,
) -> None:
    """The REST server's cap and deadlines (maasd.api.server) hold the flood; the region
    budget kept their files apart, so reserves and the ledger carry on."""
    env = {
        **FEW_SOCKETS,
        "MAASD_HTTP_MAX_CONNECTIONS": "32",
        "MAASD_HTTP_HEAD_TIMEOUT_S": "2",
        "MAASD_HTTP_BODY_TIMEOUT_S": "2",
    }
    d = Daemon(tmp_path / "d", wrapper=low_files(1024), env=env).start()
    socks: list[socket.socket] = []
    try:
        assert d.proc is not None
        _, key = d.tenant("slow", 16 * MiB)
        socks = [socket.create_connection(("127.0.0.1", d.port), timeout=5) for _ in range(96)]
        # half of them send a head and a body that never arrive whole
        for s in socks[::2]:
            with contextlib.suppress(OSError):
                s.sendall(
                    b"POST /v1/reserve HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + key.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{"
                )
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < 1024 - 384
        with d.client(key) as c:  # a whole request still gets through, and is served
            r = c.post("/v1/reserve", json={"size_bytes": 4 * KiB})
            assert r.status_code in (201, 507), r.text
        answers = [read_all(s) for s in socks]  # every one is closed by the daemon
        assert not [a for a in answers if b" 201 " in a]  # no half request was run
        with d.client(key) as c:
            assert len(c.get("/v1/buffers").json()) <= 1
        after_attack(d)
    finally:
        for s in socks:
            s.close()
        d.close()


def test_a_worker_socket_flood_leaves_the_files_buffers_need(tmp_path: Path) -> None:
    """The socket's caps (maasd.broker) refuse the flood; the region budget kept the files
    for them apart, so REST, the ledger and reserves carry on."""
    d = Daemon(tmp_path / "d", wrapper=low_files(1024), env=FEW_SOCKETS).start()
    socks: list[socket.socket] = []
    try:
        assert d.proc is not None
        for _ in range(300):  # never saying hello
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.socket_path)
            socks.append(s)
        time.sleep(0.5)
        refused = 0
        for s in socks:
            s.settimeout(0.05)
            try:
                frame = s.recv(65536)
            except TimeoutError:
                continue
            assert b"limit-exceeded" in frame
            refused += 1
        assert refused >= 300 - 64
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < 1024 - 512
        assert d.healthy()
        with d.client(d.tenant("during", 16 * MiB)[1]) as c:  # REST is not starved
            assert c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).status_code == 201
        for s in socks:
            s.close()
        socks.clear()
        after_attack(d)
    finally:
        for s in socks:
            s.close()
        d.close()


def test_sigterm_with_thousands_of_live_buffers_and_connections_is_bounded(
    tmp_path: Path,
) -> None:
    d = Daemon(tmp_path / "d").start()
    try:
        keys = [d.tenant(f"many{i}", 64 * MiB)[1] for i in range(4)]

        def fill(key: str) -> None:
            with d.client(key) as c:
                assert reserve_all(c, 1000) == Counter({201: 1000})

        threads = [threading.Thread(target=fill, args=(k,)) for k in keys]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        assert len(ledger_ids(d)) == 4000
        assert d.proc is not None
        assert sum(buffer_memfds(d.proc.pid).values()) == 4000
        # connections in flight: a worker with attachments, idle REST connections and a
        # client that sent half a request
        w = Worker(d.socket_path, keys[0])
        with d.client(keys[0]) as c:
            for b in c.get("/v1/buffers").json()[:50]:
                w.attach(b["id"])
        idle = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(10)]
        slow = socket.create_connection(("127.0.0.1", d.port))
        slow.sendall(
            b"POST /v1/reserve HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + keys[1].encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        started = time.monotonic()
        assert d.stop(timeout=60) == 0
        took = time.monotonic() - started
        print(f"shutdown with 4000 buffers and connections in flight: {took:.1f} s")
        # The contract: SIGTERM finishes within 30 s whatever is live.
        assert took < 30, f"shutdown took {took:.1f} s"
        for s in [*idle, slow]:
            s.close()
        w.close()
        d.start()
        assert ledger_ids(d) == []
        events = d.admin.get("/v1/events", params={"limit": 1000}).json()
        assert any(e["kind"] == "shutdown" for e in events)
    finally:
        d.close()


# -- 2. deletes that never stop half-way --------------------------------------------------------


class Burst:
    """4 threads reserving ``size`` bytes at ``path`` until :meth:`stop`; ``seen`` counts
    the statuses (0: a transport failure)."""

    def __init__(self, d: Daemon, key: str, path: str, size: int = 4 * KiB) -> None:
        self.seen: Counter[int] = Counter()
        self.granted = threading.Event()  # set once a few reserves went through
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(d, key, path, size)) for _ in range(4)
        ]
        for th in self._threads:
            th.start()

    def _run(self, d: Daemon, key: str, path: str, size: int) -> None:
        with d.client(key) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(path, json={"size_bytes": size})
                    code = r.status_code
                    if code == 201:  # churn: the pool never fills, reserves keep coming
                        c.delete(f"/v1/buffers/{r.json()['id']}")
                except httpx.HTTPError:
                    code = 0  # counted: a transport failure is a failure too
                with self._lock:
                    self.seen[code] += 1
                    if self.seen[201] >= 8:
                        self.granted.set()

    def stop(self) -> Counter[int]:
        self._stop.set()
        for th in self._threads:
            th.join(60)
        return self.seen


@pytest.fixture(scope="module")
def victim_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("deletes")).start()
    yield d
    d.close()


def test_a_tenant_delete_during_a_reserve_burst_is_always_204(victim_daemon: Daemon) -> None:
    d = victim_daemon
    for trial in range(20):
        tid, key = d.tenant(f"burst{trial}", 1024 * MiB)
        # 16 MiB each: prefaulting takes long enough for the delete to meet reserves in
        # flight, which lose their compare-and-set (409) and scrub their own region.
        reserving = Burst(d, key, "/v1/reserve", 16 * MiB)
        assert reserving.granted.wait(30)
        time.sleep(0.01 * trial)
        r = d.admin.delete(f"/v1/tenants/{tid}")
        seen = reserving.stop()
        assert r.status_code == 204, (trial, r.text)
        assert seen[201] > 0, seen
        # racing reserves: 401 (keys revoked), 409 (lost to the delete: scrubbed their own
        # region), 404 (authenticated before the revocation, the tenant gone since)
        assert set(seen) <= {201, 401, 404, 409}, (trial, seen)  # never a 5xx
        assert d.admin.get(f"/v1/tenants/{tid}").status_code == 404
        with d.client(key) as c:
            assert c.get("/v1/usage").status_code == 401
        assert not [b for b in d.admin.get("/v1/buffers").json() if b["tenant_id"] == tid]
        wait_ledger_matches_memfds(d)
    after_attack(d)


def test_a_pool_drain_during_a_reserve_burst_is_always_204(victim_daemon: Daemon) -> None:
    d = victim_daemon
    _, key = d.tenant("drained", 256 * MiB)
    for trial in range(20):
        name = f"tmp{trial}-{secrets.token_hex(2)}"
        r = d.admin.post(
            "/v1/pools", json={"name": name, "numa_node": 0, "capacity_bytes": 32 * MiB}
        )
        assert r.status_code == 201, r.text
        pool_id = r.json()["id"]
        reserving = Burst(d, key, f"/v1/pools/{pool_id}/reserve", 4 * MiB)
        assert reserving.granted.wait(30)
        time.sleep(0.01 * trial)
        r = d.admin.delete(f"/v1/pools/{pool_id}", params={"drain": "true"})
        seen = reserving.stop()
        assert r.status_code == 204, (trial, r.text)
        assert seen[201] > 0, seen
        assert set(seen) <= {201, 404, 409, 507}, (trial, seen)  # 507: the pool was full
        assert d.admin.get(f"/v1/pools/{pool_id}").status_code == 404
        assert not [b for b in d.admin.get("/v1/buffers").json() if b["pool_id"] == pool_id]
        wait_ledger_matches_memfds(d)
    after_attack(d)


def test_deletes_a_crash_cut_short_finish_at_the_next_start(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "d").start()
    try:
        tid, key = d.tenant("doomed", 64 * MiB)
        with d.client(key) as c:
            assert reserve_all(c, 5) == Counter({201: 5})
        r = d.admin.post(
            "/v1/pools", json={"name": "doomed", "numa_node": 0, "capacity_bytes": MiB}
        )
        pool_id = r.json()["id"]
        _, other = d.tenant("other", 64 * MiB)
        with d.client(other) as c:
            assert (
                c.post(f"/v1/pools/{pool_id}/reserve", json={"size_bytes": 4096}).status_code == 201
            )
        d.kill()
        # what a SIGKILL right after the marks leaves behind
        store = Store(f"sqlite:///{d.data_dir / 'maasd.db'}")
        store.tenants.mark_tenant_deleting(tid)
        store.pools.mark_pool_deleting(pool_id)
        store.dispose()
        d.start()
        assert d.admin.get(f"/v1/tenants/{tid}").status_code == 404
        assert d.admin.get(f"/v1/pools/{pool_id}").status_code == 404
        assert ledger_ids(d) == []
        after_attack(d)
    finally:
        d.close()


# -- 3. a process of the daemon's uid -----------------------------------------------------------


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory ``nobody`` owns, outside pytest's root-only tmp dirs."""
    require_reachable_checkout()
    base = Path(tempfile.mkdtemp(prefix="maasd-nobody-"))
    base.chmod(0o755)
    os.chown(base, NOBODY, NOBODY)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def try_as_nobody(pid: int, fd: str) -> dict[str, str]:
    """What a process of uid nobody gets when it reaches into ``pid``'s /proc entries."""
    code = f"""
import json, os
out = {{}}
for what, path in (("fd", "/proc/{pid}/fd/{fd}"), ("fds", "/proc/{pid}/fd"),
                   ("environ", "/proc/{pid}/environ"), ("mem", "/proc/{pid}/mem")):
    try:
        if what == "fds":
            os.listdir(path)
        else:
            os.close(os.open(path, os.O_RDONLY))
        out[what] = "opened"
    except OSError as e:
        out[what] = type(e).__name__
print(json.dumps(out))
"""
    r = subprocess.run(
        [*as_nobody(), sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    result: dict[str, str] = json.loads(r.stdout)
    return result


def test_a_process_of_the_daemons_uid_cannot_reach_its_fds_or_environ(
    nobody_dir: Path,
) -> None:
    # The control: an ordinary process of uid nobody holding a memfd is open to another
    # process of uid nobody — what the daemon was before it made itself non-dumpable.
    holder = subprocess.Popen(
        [
            *as_nobody(),
            sys.executable,
            "-c",
            "import os, time; os.memfd_create('secret'); print(flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        holder.stdout.readline()
        fd = next(
            n
            for n in os.listdir(f"/proc/{holder.pid}/fd")
            if "memfd" in os.readlink(f"/proc/{holder.pid}/fd/{n}")
        )
        assert try_as_nobody(holder.pid, fd) == {
            "fd": "opened",
            "fds": "opened",
            "environ": "opened",
            "mem": "opened",
        }
    finally:
        holder.kill()
        holder.wait()

    d = Daemon(nobody_dir / "data", wrapper=as_nobody())
    (nobody_dir / "data").mkdir()
    os.chown(nobody_dir / "data", NOBODY, NOBODY)
    d.start()
    try:
        _, key = d.tenant("secret", 16 * MiB)
        with d.client(key) as c:
            buf = c.post("/v1/reserve", json={"size_bytes": 64 * KiB}).json()
        assert d.proc is not None
        pid = d.proc.pid
        assert os.stat(f"/proc/{pid}").st_uid == NOBODY  # it does run as nobody
        memfd = memfd_of(pid, buf["id"])
        assert try_as_nobody(pid, memfd) == {
            "fd": "PermissionError",
            "fds": "PermissionError",
            "environ": "PermissionError",
            "mem": "PermissionError",
        }
        after_attack(d)
    finally:
        d.close()


def test_the_admin_key_from_a_file_or_a_systemd_credential(tmp_path: Path) -> None:
    key = "maasd_admin_" + secrets.token_urlsafe(24)
    key_file = tmp_path / "admin-key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    for env in (
        {"MAASD_ADMIN_KEY": "", "MAASD_ADMIN_KEY_FILE": str(key_file)},
        {"MAASD_ADMIN_KEY": "", "CREDENTIALS_DIRECTORY": str(tmp_path)},
    ):
        d = Daemon(tmp_path / f"d{len(env)}{secrets.token_hex(2)}", env=env)
        d.admin.headers["Authorization"] = f"Bearer {key}"
        d.start()
        try:
            assert d.admin.get("/v1/tenants").status_code == 200
            assert not (d.data_dir / "admin.key").exists()
        finally:
            d.close()
    key_file.chmod(0o644)
    refused = serve_refused(
        {"MAASD_DATA_DIR": str(tmp_path / "refused"), "MAASD_ADMIN_KEY_FILE": str(key_file)}
    )
    assert "readable by others" in refused


def serve_refused(env: dict[str, str], *args: str) -> str:
    """``maasd serve`` that must stop before serving: exit 1, one reason, no traceback."""
    r = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve", *args],
        env={**os.environ, "MAASD_ADMIN_KEY": "", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    return r.stderr


# -- 4. memory outside quota through kept fds ---------------------------------------------------


def test_a_worker_writing_through_a_released_buffers_fd_harms_nothing(daemon: Daemon) -> None:
    tid, key = daemon.tenant("keeper", 16 * MiB)
    with daemon.client(key) as c, Worker(daemon.socket_path, key) as w:
        buf = c.post("/v1/reserve", json={"size_bytes": MiB}).json()
        m = w.attach(buf["id"])
        m.array[:] = 0xAB
        assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
        assert not m.array.any()  # scrubbed under the worker's mapping
        labels = {"tenant": tid, "kind": "buffer"}
        assert daemon.metric("maasd_released_attached_bytes", **labels) == MiB
        m.array[:] = 1  # re-faults pages the worker's memory cgroup pays for
        os.pwrite(m.fd, b"x" * 4096, 0)
        assert c.get("/v1/usage").json()["used_bytes"] == 0
        after_attack(daemon)
        m.close()
    assert daemon.metric("maasd_released_attached_bytes", **labels) == 0


# -- 5. small ones ------------------------------------------------------------------------------


@pytest.mark.parametrize("spill_dir", ["/tmp/a\x00b", "relative/dir", "\x00"])
def test_a_bad_spill_dir_is_a_400(daemon: Daemon, spill_dir: str) -> None:
    r = daemon.admin.post(
        "/v1/pools",
        json={
            "name": f"p{secrets.token_hex(3)}",
            "numa_node": 0,
            "capacity_bytes": MiB,
            "persistence": "persistent",
            "spill_dir": spill_dir,
        },
    )
    assert r.status_code == 400, r.text
    assert "spill_dir" in r.json()["detail"]
    after_attack(daemon, bystander=False)


def test_a_nul_byte_in_the_config_file_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "maasd.toml"
    config.write_text(
        '[[pools]]\nname = "p"\nnuma_node = 0\ncapacity_bytes = 4096\n'
        'persistence = "persistent"\nspill_dir = "/tmp/x\\u0000y"\n'
    )
    refused = serve_refused({"MAASD_DATA_DIR": str(tmp_path / "d")}, "--config", str(config))
    assert "spill_dir" in refused
    config.write_text('data_dir = "/tmp/x\\u0000y"\n')
    assert "data_dir cannot hold a NUL byte" in serve_refused({}, "--config", str(config))


def test_sigkill_of_a_worker_mid_attach_leaves_nothing(daemon: Daemon) -> None:
    _, key = daemon.tenant("vanishing", 16 * MiB)
    with daemon.client(key) as c:
        buf = c.post("/v1/reserve", json={"size_bytes": 64 * KiB}).json()
    code = (
        "import sys; from maasd.client import Worker; "
        f"w = Worker({daemon.socket_path!r}, {key!r}); w.attach({buf['id']!r}); "
        "print(flush=True); import time; time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.readline()
    p.send_signal(signal.SIGKILL)
    p.wait()
    after_attack(daemon)


def test_the_ledger_check_reports_an_entry_open_without_its_row(fresh_daemon: Daemon) -> None:
    """The check after every attack knows an entry's memfds (its sealed copy, maasd-e-…,
    and the read-only fd a lookup keeps) as well as a buffer's: a committed entry whose
    row the ledger lost while the daemon still holds it is reported. (The row is taken
    out beside the daemon, and put back as it was.)"""
    d = fresh_daemon.start()
    _, key = d.tenant("lost-row", 16 * MiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        entry = w.commit(w.put("k", 64 * KiB))
        found = w.lookup(["k"])  # the daemon keeps a read-only fd of the entry
        assert found is not None
        found.close()
    wait_ledger_matches_memfds(d)
    with closing(sqlite3.connect(d.data_dir / "maasd.db", timeout=30)) as db:
        row = db.execute("SELECT * FROM buffers WHERE id = ?", (entry.id,)).fetchone()
        with db:
            db.execute("DELETE FROM buffers WHERE id = ?", (entry.id,))
        try:
            ok, why = ledger_matches_memfds(d)
        finally:
            with db:
                marks = ", ".join("?" * len(row))
                db.execute(f"INSERT INTO buffers VALUES ({marks})", row)
    assert not ok
    assert f"memfds without row (or more than one of a row): ['maasd-e-{entry.id[:8]}']" in why
    assert f"read-only memfds without row: ['maasd-e-{entry.id[:8]}']" in why
    after_attack(d)
