"""SPEC §1/§3/§4/§7 acceptance checks (round 10): statements no other test checked
through the real entry points — ``maasd serve`` with its flags alone, the config file's
pool fields end to end, the default SQLite ledger, SIGTERM with a request in flight,
the metrics SPEC names, the buffer cap's eviction, the strict bodies, maasctl's default
URL.

Each test quotes the SPEC sentence it checks. Daemons are real ``maasd serve``
subprocesses (``tests/conftest.py``); maasctl runs as a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from test_api_routes import BUFFER_FIELDS, POOL_FIELDS, problem

from conftest import DEFAULT_POOL_BYTES, Daemon, free_port
from maasd.client import Worker

if TYPE_CHECKING:
    from collections.abc import Iterator

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096
REPO = Path(__file__).resolve().parents[2]


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _bare_env(**extra: str) -> dict[str, str]:
    """The environment without any MAASD_* variable (so only flags configure serve),
    plus the test tunings that have no flag."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(
        MAASD_DEFAULT_WARM_BYTES="0",
        MAASD_LATENCY_PROBE="false",
        MAASD_DEFAULT_POOL_BYTES=str(DEFAULT_POOL_BYTES),
    )
    env.update(extra)
    return env


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + float(os.environ.get("MAASD_TEST_START_TIMEOUT", timeout))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"maasd exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"maasd not healthy:\n{log.read_text()[-4000:]}")


CONFIG = """
[[pools]]
name = "fastcfg"
numa_node = 0
backing = "memfd"
persistence = "volatile"
latency_us = 3
capacity_bytes = {cap_a}
prefault = false
scrub = "punch"

[[pools]]
name = "keepcfg"
numa_node = 0
persistence = "persistent"
latency_us = 7
capacity_bytes = {cap_b}
spill_dir = "{spill}"
"""


@pytest.fixture
def serve_with_flags(tmp_path: Path) -> Iterator[dict]:
    """``maasd serve`` configured by its six flags alone (no MAASD_HOST/PORT/SOCKET/
    DATA_DIR/DB_URL/CONFIG in its environment); env vars pointing elsewhere are set for
    PORT and SOCKET to check that the flags win."""
    data = tmp_path / "data"
    spill = tmp_path / "spill"
    spill.mkdir()
    db = tmp_path / "elsewhere" / "ledger.db"
    db.parent.mkdir()
    sock = tmp_path / "w.sock"
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(CONFIG.format(cap_a=8 * MiB + 1, cap_b=4 * MiB, spill=spill))
    port, decoy_port = free_port(), free_port()
    admin = "maasd_admin_" + secrets.token_urlsafe(24)
    log = tmp_path / "serve.log"
    env = _bare_env(
        MAASD_ADMIN_KEY=admin,
        # decoys: a flag beats its environment variable
        MAASD_PORT=str(decoy_port),
        MAASD_SOCKET=str(tmp_path / "decoy.sock"),
    )
    argv = [
        sys.executable, "-m", "maasd.cli.daemon", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--socket", str(sock),
        "--data-dir", str(data), "--db", f"sqlite:///{db}", "--config", str(cfg),
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        yield {
            "proc": proc, "url": url, "admin": admin, "sock": sock, "db": db, "data": data,
            "spill": spill, "decoy_port": decoy_port, "decoy_sock": tmp_path / "decoy.sock",
            "log": log,
        }  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- §3 running it ----------------------------------------------------------------------------


def test_serve_flags_alone_configure_host_port_socket_data_dir_db_and_config(
    serve_with_flags: dict,
) -> None:
    """§3: ``maasd serve [--host] [--port] [--socket PATH] [--data-dir DIR] [--db URL]
    [--config FILE]``; "Every flag has an environment variable" (a flag given wins)."""
    s = serve_with_flags
    assert s["sock"].exists(), "--socket PATH is where the worker socket is"
    assert not s["decoy_sock"].exists(), "MAASD_SOCKET beat --socket"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{s['decoy_port']}/healthz", timeout=2)
    assert s["db"].exists(), "--db sqlite:///… is the ledger"
    assert s["data"].is_dir()
    with httpx.Client(
        base_url=s["url"], headers={"Authorization": f"Bearer {s['admin']}"}, timeout=30
    ) as admin:
        pools = {p["name"]: p for p in admin.get("/v1/pools").json()}
        # a config file given: its pools, not the default node<N> ones
        assert set(pools) == {"fastcfg", "keepcfg"}, pools.keys()


def test_config_pools_carry_every_field_of_section_1(serve_with_flags: dict) -> None:
    """§3: "Config file (TOML): ``[[pools]]`` tables with the pool fields of §1, plus
    ``spill_dir`` for persistent pools"; §1 sizes "rounded up to the pool's page";
    §4 checkpoint writes "to the pool's spill dir"."""
    s = serve_with_flags
    with httpx.Client(
        base_url=s["url"], headers={"Authorization": f"Bearer {s['admin']}"}, timeout=30
    ) as admin:
        pools = {p["name"]: p for p in admin.get("/v1/pools").json()}
        fast, keep = pools["fastcfg"], pools["keepcfg"]
        assert fast.keys() >= POOL_FIELDS
        assert (
            fast["numa_node"], fast["backing"], fast["persistence"], fast["latency_us"],
            fast["capacity_bytes"], fast["prefault"], fast["scrub"], fast["page_bytes"],
        ) == (0, "memfd", "volatile", 3, 8 * MiB + PAGE, False, "punch", PAGE)  # fmt: skip
        assert (keep["persistence"], keep["latency_us"], keep["capacity_bytes"]) == (
            "persistent",
            7,
            4 * MiB,
        )
        r = admin.post("/v1/tenants", json={"name": uniq("cfg"), "quota_bytes": 16 * MiB})
        assert r.status_code == 201, r.text
        key = r.json()["api_key"]
    with httpx.Client(
        base_url=s["url"], headers={"Authorization": f"Bearer {key}"}, timeout=30
    ) as t:
        b = t.post("/v1/reserve", json={"size_bytes": 64 * KiB, "persistence": "persistent"})
        assert b.status_code == 201, b.text
        assert b.json()["pool_id"] == keep["id"]
        ck = t.post(f"/v1/buffers/{b.json()['id']}/checkpoint")
        assert ck.status_code == 200, ck.text
        assert ck.json()["bytes"] == 64 * KiB
        written = [p for p in s["spill"].rglob("*") if p.is_file()]
        assert written, "checkpoint wrote nothing into the config's spill_dir"
        # QoS from the config's latency classes: ≤ 3 µs picks fastcfg only
        q = t.post("/v1/reserve", json={"size_bytes": PAGE, "latency_us": 3})
        assert q.status_code == 201, q.text
        assert q.json()["pool_id"] == fast["id"]


def test_sigint_exits_0_after_the_flags_daemon(serve_with_flags: dict) -> None:
    """§3: "SIGTERM/SIGINT: … close the database, exit 0" (the flag-configured daemon;
    the ledger is left consistent: a clean SQLite file)."""
    s = serve_with_flags
    proc = s["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0, s["log"].read_text()[-4000:]
    assert not s["sock"].exists()
    with sqlite3.connect(s["db"]) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_default_ledger_is_sqlite_in_the_data_dir_in_wal_mode(fresh_daemon: Daemon) -> None:
    """§3: "Embedded default: SQLite file in the data dir (WAL)"."""
    d = fresh_daemon.start()
    dbs = [
        p
        for p in d.data_dir.iterdir()
        if p.is_file() and p.read_bytes()[:16] == b"SQLite format 3\x00"
    ]
    assert dbs, f"no SQLite file in {d.data_dir}: {list(d.data_dir.iterdir())}"
    conn = sqlite3.connect(dbs[0])
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        conn.close()
    # "close the database": after SIGTERM the WAL is checkpointed and gone
    assert d.stop() == 0
    assert not Path(f"{dbs[0]}-wal").exists()


def test_default_pool_size_is_a_quarter_of_free_memory_at_most_8_gib(tmp_path: Path) -> None:
    """§3: "MAASD_DEFAULT_POOL_BYTES (default: a quarter of that node's free memory, at
    most 8 GiB)" — a daemon started without the variable."""
    d = Daemon(tmp_path / "sized")
    del d.env["MAASD_DEFAULT_POOL_BYTES"]
    try:
        d.start()
        topo = d.admin.get("/v1/topology").json()
        free = {n["id"]: n["mem_free_bytes"] for n in topo["nodes"]}
        for p in d.admin.get("/v1/pools").json():
            want = min(free[p["numa_node"]] // 4, 8 << 30)
            assert 0.8 * want <= p["capacity_bytes"] <= 1.2 * want, (p, free)
            assert p["capacity_bytes"] <= 8 << 30
    finally:
        d.close()


def test_default_pools_have_the_default_fields(fresh_daemon: Daemon) -> None:
    """§3: "With no config file, the daemon creates one volatile memfd pool per NUMA
    node, named node<N>, of MAASD_DEFAULT_POOL_BYTES …, latency_us = 1,
    prefault = true, scrub = "zero"."""
    d = fresh_daemon.start()
    nodes = [n["id"] for n in d.admin.get("/v1/topology").json()["nodes"]]
    pools = d.admin.get("/v1/pools").json()
    assert sorted(p["name"] for p in pools) == sorted(f"node{n}" for n in nodes)
    for p in pools:
        assert (
            p["numa_node"], p["backing"], p["persistence"], p["capacity_bytes"],
            p["latency_us"], p["prefault"], p["scrub"],
        ) == (
            int(p["name"][4:]), "memfd", "volatile", DEFAULT_POOL_BYTES, 1, True, "zero",
        )  # fmt: skip


def test_sigterm_finishes_a_request_in_flight_and_stops_accepting(fresh_daemon: Daemon) -> None:
    """§3: "SIGTERM/SIGINT: stop accepting, finish in-flight requests, …, exit 0"."""
    d = fresh_daemon.start()
    _, key = d.tenant("inflight", 16 * MiB)
    body = b'{"size_bytes": 4096, "label": "in flight"}'
    conn = socket.create_connection(("127.0.0.1", d.port), timeout=30)
    try:
        conn.sendall(
            b"POST /v1/reserve HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + key.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body[:10]
        )
        time.sleep(0.3)  # the headers are in: the request is in flight
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        # stop accepting: new connections are refused soon after the signal
        deadline = time.monotonic() + 10
        refused = False
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", d.port), timeout=1).close()
            except OSError:
                refused = True
                break
            time.sleep(0.05)
        assert refused, "still accepting connections 10 s after SIGTERM"
        conn.sendall(body[10:])
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
        status_line = answer.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 201"), (answer[:300], d.log())
    finally:
        conn.close()
    assert d.proc.wait(30) == 0, d.log()


# -- §4 metrics ------------------------------------------------------------------------------


def test_metrics_attached_handles_scrub_seconds_and_release_latency(daemon: Daemon) -> None:
    """§4 GET /metrics: "Prometheus text: … reserve/release counts and latency histograms,
    scrub bytes and seconds, evictions, attached handles"."""
    tid, key = daemon.tenant("metrics", 16 * MiB)
    with daemon.client(key) as c:
        buf = c.post("/v1/reserve", json={"size_bytes": 4 * MiB}).json()
        released = daemon.metric("maasd_release_seconds_count")
        scrub_s = daemon.metric("maasd_scrub_seconds_total")
        scrub_b = daemon.metric("maasd_scrub_bytes_total")
        w = Worker(daemon.socket_path, key, renew_interval_s=0)
        try:
            w.attach(buf["id"])
            assert daemon.metric("maasd_attached_handles", tenant=tid) == 1
            w.detach(buf["id"])
            assert daemon.metric("maasd_attached_handles", tenant=tid) == 0
        finally:
            w.close()
        assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and daemon.metric("maasd_scrub_bytes_total") < scrub_b:
        time.sleep(0.1)
    assert daemon.metric("maasd_release_seconds_count") >= released + 1
    assert daemon.metric("maasd_scrub_bytes_total") >= scrub_b + 4 * MiB
    assert daemon.metric("maasd_scrub_seconds_total") > scrub_s
    text = daemon.admin.get("/metrics").text
    assert "maasd_evictions_total" in text
    assert "maasd_attached_handles" in text


# -- §4 max_buffers --------------------------------------------------------------------------


def test_at_the_buffer_cap_a_reserve_evicts_own_entries_then_409(daemon: Daemon) -> None:
    """§4 PATCH /v1/tenants/{id}: "max_buffers caps a tenant's live buffers …; at the cap
    a reserve first evicts that tenant's evictable entries, then answers 409 (type ends
    in buffer-count-exceeded)"."""
    tid, key = daemon.tenant("capped", 64 * MiB)
    oid, okey = daemon.tenant("bystander", 64 * MiB)
    try:
        r = daemon.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 3})
        assert r.status_code == 200, r.text
        with daemon.client(key) as c, daemon.client(okey) as other:
            theirs = other.post("/v1/reserve", json={"size_bytes": PAGE, "evictable": True})
            assert theirs.status_code == 201
            fixed = c.post("/v1/reserve", json={"size_bytes": PAGE}).json()
            e1 = c.post("/v1/reserve", json={"size_bytes": PAGE, "evictable": True}).json()
            e2 = c.post("/v1/reserve", json={"size_bytes": PAGE, "evictable": True}).json()
            # at the cap (3 live): the least recently used evictable one (e1) makes room
            new = c.post("/v1/reserve", json={"size_bytes": PAGE})
            assert new.status_code == 201, new.text
            assert c.get(f"/v1/buffers/{e1['id']}").status_code == 404
            assert c.get(f"/v1/buffers/{e2['id']}").status_code == 200
            assert c.get(f"/v1/buffers/{fixed['id']}").status_code == 200
            new2 = c.post("/v1/reserve", json={"size_bytes": PAGE})
            assert new2.status_code == 201, new2.text
            assert c.get(f"/v1/buffers/{e2['id']}").status_code == 404
            # only non-evictable buffers left: 409 buffer-count-exceeded
            problem(c.post("/v1/reserve", json={"size_bytes": PAGE}), 409, "buffer-count-exceeded")
            assert c.get("/v1/usage").json()["buffers"] == 3
            # the other tenant's evictable buffer was never touched
            assert other.get(f"/v1/buffers/{theirs.json()['id']}").status_code == 200
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")
        daemon.admin.delete(f"/v1/tenants/{oid}")


# -- §4 strict bodies ------------------------------------------------------------------------


def test_key_issue_refuses_a_body_with_unknown_fields(daemon: Daemon) -> None:
    """§4: "Unknown fields in a body are rejected with 400" — also on
    POST /v1/tenants/{id}/keys, whose body has no fields at all."""
    tid, _ = daemon.tenant("keybody", MiB)
    try:
        r = daemon.admin.post(f"/v1/tenants/{tid}/keys", json={"tenant_id": "other"})
        problem(r, 400, "invalid-request")
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


def test_checkpoint_refuses_a_body_with_unknown_fields(daemon: Daemon) -> None:
    """§4: "Unknown fields in a body are rejected with 400" — on POST …/checkpoint of a
    persistent buffer (which otherwise answers 200)."""
    name = uniq("ckbody")
    assert (
        daemon.admin.post(
            "/v1/pools",
            json={"name": name, "numa_node": 0, "capacity_bytes": MiB, "persistence": "persistent"},
        ).status_code
        == 201
    )
    tid, key = daemon.tenant("ckbody", MiB)
    try:
        with daemon.client(key) as c:
            b = c.post(f"/v1/pools/{name}/reserve", json={"size_bytes": PAGE}).json()
            problem(
                c.post(f"/v1/buffers/{b['id']}/checkpoint", json={"fsync": False}),
                400,
                "invalid-request",
            )
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")
        daemon.admin.delete(f"/v1/pools/{name}", params={"drain": "true"})


def test_pool_reserve_body_has_no_numa_node(daemon: Daemon) -> None:
    """§4: ``POST /v1/reserve`` takes "same body plus optional numa_node"; the Reserve body
    of ``POST /v1/pools/{pool_id}/reserve`` is a "msgspec Struct, unknown fields
    forbidden" without it → 400."""
    tid, key = daemon.tenant("poolnode", MiB)
    try:
        with daemon.client(key) as c:
            r = c.post("/v1/pools/node0/reserve", json={"size_bytes": PAGE, "numa_node": 0})
            if r.status_code == 201:
                c.delete(f"/v1/buffers/{r.json()['id']}")
            problem(r, 400, "invalid-request")
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


def test_reserve_latency_us_is_a_number(daemon: Daemon) -> None:
    """§4 Reserve body: "latency_us: int | None": an int is taken; what is not a number is
    a bad field (400). A fraction is taken too — docs/api.md: measured latency classes are
    sub-µs, so the ceiling may be (a superset of SPEC's int)."""
    tid, key = daemon.tenant("latint", MiB)
    try:
        with daemon.client(key) as c:
            for ok in (1, 1.5):
                r = c.post("/v1/reserve", json={"size_bytes": PAGE, "latency_us": ok})
                assert r.status_code == 201, r.text
                assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
            for bad in ("1", True, [1]):
                problem(
                    c.post("/v1/reserve", json={"size_bytes": PAGE, "latency_us": bad}),
                    400,
                    "invalid-request",
                )
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


def test_buffer_ids_are_unguessable_and_timestamps_sort_as_text(daemon: Daemon) -> None:
    """§4: "Ids are random and unguessable (≥ 122 bits). Timestamps are RFC 3339 strings in
    UTC with a fixed format, so they also sort as text"."""
    tid, key = daemon.tenant("ids", 16 * MiB)
    try:
        with daemon.client(key) as c:
            bufs: list[dict[str, Any]] = []
            for _ in range(20):
                r = c.post("/v1/reserve", json={"size_bytes": PAGE, "ttl_s": 1 + len(bufs)})
                assert r.status_code == 201
                bufs.append(r.json())
            assert all(b.keys() >= BUFFER_FIELDS for b in bufs)
            ids = [b["id"] for b in bufs]
            assert len(set(ids)) == len(ids)
            for i in ids:
                assert len(i) * 4 >= 122, i
                assert int(i, 16) >= 0, i
            # not sequential: the ids share no long common prefix
            assert len(os.path.commonprefix(ids)) < 8
            created = [b["created_at"] for b in bufs]
            assert len({len(x) for x in created}) == 1
            assert created == sorted(created)
            expires = [b["expires_at"] for b in bufs]
            assert len({len(x) for x in expires + created}) == 1
            assert all(x.endswith("Z") for x in expires + created)
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


# -- §7 maasctl ------------------------------------------------------------------------------


@contextlib.contextmanager
def _port_7878() -> Iterator[socket.socket]:
    """A socket bound to 127.0.0.1:7878, the defaults' address (skip if it is taken)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", 7878))
        except OSError:
            pytest.skip("port 7878 is in use on this host")
        yield probe


def test_maasctl_default_url_is_127_0_0_1_7878() -> None:
    """§7: "--url / MAASD_URL (default http://127.0.0.1:7878)"."""
    with _port_7878() as probe:
        probe.listen(1)
        env = _bare_env(MAASD_ADMIN_KEY="x" * 20)
        proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.maasctl", "--timeout", "3", "status"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        probe.settimeout(30)
        conn, _ = probe.accept()  # maasctl connected to 127.0.0.1:7878
        conn.settimeout(10)
        request = conn.recv(4096)
        proc.communicate(timeout=60)  # maasctl gives up first: no TIME_WAIT on 7878 here
        conn.close()
    assert request.split(b"\r\n", 1)[0].endswith(b"HTTP/1.1"), request[:200]
    assert proc.returncode != 0


# -- §3 environment variables alone ---------------------------------------------------------


def test_serve_env_vars_alone_configure_host_port_socket_data_dir_db_and_config(
    tmp_path: Path,
) -> None:
    """§3: "Every flag has an environment variable: MAASD_HOST, MAASD_PORT, MAASD_SOCKET,
    MAASD_DATA_DIR, MAASD_DB_URL, MAASD_CONFIG, and MAASD_ADMIN_KEY" — a bare
    ``maasd serve`` configured by them alone (listening on 127.0.0.2, not 127.0.0.1)."""
    spill = tmp_path / "spill"
    spill.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(cap_a=8 * MiB, cap_b=4 * MiB, spill=spill))
    db = tmp_path / "l" / "ledger.db"
    db.parent.mkdir()
    port = free_port()
    admin = "maasd_admin_" + secrets.token_urlsafe(24)
    env = _bare_env(
        MAASD_HOST="127.0.0.2",
        MAASD_PORT=str(port),
        MAASD_SOCKET=str(tmp_path / "env.sock"),
        MAASD_DATA_DIR=str(tmp_path / "envdata"),
        MAASD_DB_URL=f"sqlite:///{db}",
        MAASD_CONFIG=str(cfg),
        MAASD_ADMIN_KEY=admin,
    )
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.daemon", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.2:{port}"
    try:
        _wait_healthy(proc, url, log)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        assert (tmp_path / "env.sock").exists()
        assert (tmp_path / "envdata").is_dir()
        assert db.exists()
        r = httpx.get(f"{url}/v1/pools", headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200, r.text
        assert {p["name"] for p in r.json()} == {"fastcfg", "keepcfg"}
        assert not (tmp_path / "envdata" / "admin.key").exists()  # the env key was used
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-4000:]


def test_metrics_public_flag(tmp_path: Path) -> None:
    """§4 GET /metrics: "… or anyone with --metrics-public" (the flag, not only its env)."""
    port = free_port()
    env = _bare_env(MAASD_ADMIN_KEY="maasd_admin_" + secrets.token_urlsafe(24))
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "maasd.cli.daemon", "serve", "--metrics-public",
                "--port", str(port), "--data-dir", str(tmp_path / "d"),
            ],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        r = httpx.get(f"{url}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        assert "maasd_pool_capacity_bytes" in r.text
        problem(httpx.get(f"{url}/v1/topology"), 401, "unauthorized")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_max_ttl_bounds_reserve_and_renew(tmp_path: Path) -> None:
    """§4 Reserve body: "ttl_s: int = 600 (1 … MAASD_MAX_TTL_S)" on a running daemon."""
    d = Daemon(tmp_path / "ttl", env={"MAASD_MAX_TTL_S": "60"})
    try:
        d.start()
        tid, key = d.tenant("ttl", MiB)
        with d.client(key) as c:
            ok = c.post("/v1/reserve", json={"size_bytes": PAGE, "ttl_s": 60})
            assert ok.status_code == 201, ok.text
            problem(c.post("/v1/reserve", json={"size_bytes": PAGE, "ttl_s": 61}), 400)
            problem(c.post(f"/v1/buffers/{ok.json()['id']}/renew", json={"ttl_s": 61}), 400)
            assert (
                c.post(f"/v1/buffers/{ok.json()['id']}/renew", json={"ttl_s": 60}).status_code
                == 200
            )
    finally:
        d.close()


# -- §4 pools --------------------------------------------------------------------------------


def test_pool_drain_scrubs_what_a_mapping_sees(daemon: Daemon) -> None:
    """§4 DELETE /v1/pools/{pool_id}: "?drain=true (releases them all, scrubbed)"."""
    import numpy as np

    name = uniq("drainscrub")
    assert (
        daemon.admin.post(
            "/v1/pools", json={"name": name, "numa_node": 0, "capacity_bytes": 4 * MiB}
        ).status_code
        == 201
    )
    tid, key = daemon.tenant("drainscrub", 8 * MiB)
    try:
        with daemon.client(key) as c:
            buf = c.post(f"/v1/pools/{name}/reserve", json={"size_bytes": MiB}).json()
            w = Worker(daemon.socket_path, key, renew_interval_s=0)
            try:
                m = w.attach(buf["id"])
                m.array[:] = 0x5A
                r = daemon.admin.delete(f"/v1/pools/{name}", params={"drain": "true"})
                assert r.status_code == 204, r.text
                assert not np.any(m.array), "a drained buffer must read zeros"
            finally:
                w.close()
            problem(c.get(f"/v1/buffers/{buf['id']}"), 404)
            assert c.get("/v1/usage").json()["used_bytes"] == 0
        assert name not in {p["name"] for p in daemon.admin.get("/v1/pools").json()}
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


# -- §4 lookup -------------------------------------------------------------------------------


def test_lookup_answers_the_longest_key_of_the_prefix_chain(daemon: Daemon) -> None:
    """§4 POST /v1/buffers/lookup: ``{"keys":[...]}`` "(ordered short → long prefix) → 200
    {"key","buffer"} of the longest key that has a live buffer": the longest *prefix*, the
    last of the keys given that has one — a prefix's keys are chained hashes of equal
    length (docs/llama.md), so the caller's order is what says which prefix is longer."""
    tid, key = daemon.tenant("longest", MiB)
    try:
        with daemon.client(key) as c:
            for k in ("m:a", "m:a:b:c"):
                assert c.post("/v1/reserve", json={"size_bytes": PAGE, "key": k}).status_code == 201
            r = c.post("/v1/buffers/lookup", json={"keys": ["m:a", "m:a:b", "m:a:b:c", "m:x"]})
            assert r.status_code == 200, r.text
            assert r.json()["key"] == "m:a:b:c", r.json()
            r = c.post("/v1/buffers/lookup", json={"keys": ["h0", "m:a", "h2"]})
            assert r.status_code == 200, r.text
            assert r.json()["key"] == "m:a", r.json()
    finally:
        daemon.admin.delete(f"/v1/tenants/{tid}")


def test_an_expired_lease_is_not_live_before_the_reaper_runs(tmp_path: Path) -> None:
    """§1 buffer: "with a lease (expires_at)"; §4 lookup finds "a live buffer" — a buffer
    whose lease ended is not found, even while the reaper has not run yet."""
    d = Daemon(
        tmp_path / "lease", env={"MAASD_REAPER_INTERVAL_S": "20", "MAASD_HOST_TIMEOUT_S": "600"}
    )
    try:
        d.start()
        tid, key = d.tenant("lapsed", MiB)
        with d.client(key) as c:
            b = c.post("/v1/reserve", json={"size_bytes": PAGE, "key": "gone", "ttl_s": 1})
            assert b.status_code == 201, b.text
            time.sleep(2.5)
            r = c.post("/v1/buffers/lookup", json={"keys": ["gone"]})
            renew = c.post(f"/v1/buffers/{b.json()['id']}/renew", json={"ttl_s": 60})
            assert (r.status_code, renew.status_code in (404, 409)) == (404, True), (
                f"lease ended {b.json()['expires_at']}: lookup {r.status_code} {r.text[:120]}; "
                f"renew {renew.status_code} {renew.text[:200]}"
            )
    finally:
        d.close()


# -- §7 maasctl flags and errors -------------------------------------------------------------


def _maasctl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", *args],
        env=_bare_env(COLUMNS="200", NO_COLOR="1", **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_maasctl_url_and_key_flags_beat_the_environment(daemon: Daemon) -> None:
    """§7: "--url / MAASD_URL …, --key / MAASD_ADMIN_KEY" — the flags work alone and win
    over the environment."""
    r = _maasctl(
        "--url", daemon.url, "--key", daemon.admin_key, "--json", "pools", "list",
        MAASD_URL="http://127.0.0.1:9", MAASD_ADMIN_KEY="maasd_wrong_" + "x" * 20,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "node0" in {p["name"] for p in __import__("json").loads(r.stdout)}


def test_maasctl_pools_create_backing_and_persistence_with_unit_sizes(daemon: Daemon) -> None:
    """§7: ``pools create NAME --node N --capacity SIZE [--backing memfd|hugetlb]
    [--persistence volatile|persistent] …``; "SIZE accepts bytes or units (512MiB, 8GiB,
    1.5GB)"; §1 sizes rounded up to the page (4 KiB or 2 MiB)."""
    import json

    env = {"MAASD_URL": daemon.url, "MAASD_ADMIN_KEY": daemon.admin_key}
    made = []
    try:
        name = uniq("ctlpers")
        r = _maasctl(
            "--json", "pools", "create", name, "--node", "0", "--capacity", "1.5GB",
            "--persistence", "persistent", "--backing", "memfd", **env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        made.append(name)
        p = json.loads(r.stdout)
        assert (p["persistence"], p["backing"]) == ("persistent", "memfd")
        assert p["capacity_bytes"] == -(-1_500_000_000 // PAGE) * PAGE
        name = uniq("ctlhuge")
        r = _maasctl(
            "--json", "pools", "create", name, "--node", "0", "--capacity", "3MiB",
            "--backing", "hugetlb", **env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        made.append(name)
        p = json.loads(r.stdout)
        assert (p["backing"], p["page_bytes"], p["capacity_bytes"]) == ("hugetlb", 2 * MiB, 4 * MiB)
    finally:
        for n in made:
            daemon.admin.delete(f"/v1/pools/{n}", params={"drain": "true"})


def test_maasctl_error_is_the_problems_title_and_detail(daemon: Daemon) -> None:
    """§7: "on any error it exits non-zero with the problem's title and detail on stderr"."""
    env = {"MAASD_URL": daemon.url, "MAASD_ADMIN_KEY": daemon.admin_key}
    want = daemon.admin.post(
        "/v1/pools", json={"name": "node0", "numa_node": 0, "capacity_bytes": MiB}
    ).json()
    r = _maasctl("pools", "create", "node0", "--node", "0", "--capacity", "1MiB", **env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert want["title"] in r.stderr, (want, r.stderr)
    assert want["detail"] in r.stderr, (want, r.stderr)
    assert r.stdout == ""
    # and with --json too
    r = _maasctl("--json", "pools", "create", "node0", "--node", "0", "--capacity", "1MiB", **env)
    assert r.returncode != 0
    assert want["title"] in r.stderr, (want, r.stderr)
    assert want["detail"] in r.stderr, (want, r.stderr)


def test_serve_defaults_to_127_0_0_1_port_7878(tmp_path: Path) -> None:
    """§3: ``maasd serve [--host 127.0.0.1] [--port 7878] …`` — the defaults, with neither
    flag nor environment variable."""
    with _port_7878():
        pass  # free: the daemon may take it
    env = _bare_env(MAASD_ADMIN_KEY="maasd_admin_" + secrets.token_urlsafe(24))
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.daemon", "serve", "--data-dir", str(tmp_path / "d")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(proc, "http://127.0.0.1:7878", log)
        assert (tmp_path / "d" / "maasd.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# -- §4 errors are problems, also for requests HTTP itself refuses ---------------------------


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            pass
    return out


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo colon in this header\r\n\r\n",
        b"POST /v1/reserve HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"NOT AN HTTP REQUEST\r\n\r\n",
    ],
    ids=["bad-header", "bad-content-length", "bad-request-line"],
)
def test_a_malformed_http_request_is_answered_with_a_problem(
    daemon: Daemon, request_bytes: bytes
) -> None:
    """§4: "Errors are RFC 9457 application/problem+json with type, title, status,
    detail" — also the 400 for a request that is not valid HTTP/1.1."""
    answer = _raw(daemon.port, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 400"), answer[:300]
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    assert headers.get("content-type", "").startswith("application/problem+json"), answer[:300]
    import json

    problem_body = json.loads(body)
    assert {"type", "title", "status", "detail"} <= problem_body.keys()
    assert problem_body["status"] == 400
