"""The daemon's lifecycle (serve, migrate, stop), as an operator sees it.

* SIGTERM/SIGINT: finish, checkpoint persistent buffers (their *latest*
  content, not only what was last checkpointed by hand), exit 0;
* a second ``maasd serve`` on the same data dir fails at once, with a clear
  message and a non-zero exit, while the first keeps serving;
* the admin key is generated on first start when none is given (0600, printed once);
* volatile buffers do not outlive a graceful stop either.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from maasd.client import Worker
from maasd.store.engine import REVISIONS

MiB = 1 << 20

PERSISTENT_POOL = """
[[pools]]
name = "keep"
numa_node = 0
capacity_bytes = {cap}
persistence = "persistent"
scrub = "punch"
"""


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(PERSISTENT_POOL.format(cap=32 * MiB))
    return cfg


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_stop_checkpoints_the_latest_content(fresh_daemon, tmp_path: Path, sig) -> None:
    d = fresh_daemon
    d.env["MAASD_CONFIG"] = str(_config(tmp_path))
    d.start()
    _, key = d.tenant("graceful", 64 * MiB)
    user = d.client(key)
    pers = user.post("/v1/pools/keep/reserve", json={"size_bytes": 3 * MiB, "ttl_s": 3600}).json()
    never = user.post("/v1/pools/keep/reserve", json={"size_bytes": MiB, "ttl_s": 3600}).json()
    vol = d.admin.post(
        "/v1/pools", json={"name": "scratch", "numa_node": 0, "capacity_bytes": 8 * MiB}
    )
    assert vol.status_code == 201, vol.text
    scratch = user.post("/v1/pools/scratch/reserve", json={"size_bytes": MiB}).json()
    rng = np.random.default_rng(1)
    first, latest = (
        rng.integers(0, 256, 3 * MiB, dtype=np.uint8),
        rng.integers(0, 256, 3 * MiB, dtype=np.uint8),
    )
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(pers["id"])
        m.array[:] = first
        assert user.post(f"/v1/buffers/{pers['id']}/checkpoint").status_code == 200
        m.array[:] = latest  # only the shutdown checkpoint can save this
        n = w.attach(never["id"])
        n.array[:] = 42  # never checkpointed by hand
    user.close()
    assert d.stop(sig) == 0, d.log()
    assert "stopped" in d.log()

    d.start()
    user = d.client(key)
    got = user.get(f"/v1/buffers/{pers['id']}")
    assert got.status_code == 200, d.log()
    assert got.json()["checksum"] == hashlib.sha256(latest.tobytes()).hexdigest()
    assert user.get(f"/v1/buffers/{never['id']}").status_code == 200
    assert user.get(f"/v1/buffers/{scratch['id']}").status_code == 404  # volatile: gone
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        assert np.array_equal(w.attach(pers["id"]).array, latest)
        assert np.all(w.attach(never["id"]).array == 42)
    pools = {p["name"]: p for p in d.admin.get("/v1/pools").json()}
    assert pools["keep"]["used_bytes"] == 4 * MiB
    assert pools["scratch"]["used_bytes"] == 0  # the POSTed pool survived the restart, empty
    usage = user.get("/v1/usage").json()
    assert usage["used_bytes"] == 4 * MiB
    assert usage["buffers"] == 2
    user.close()
    assert d.stop() == 0


def test_a_second_daemon_on_the_same_data_dir_fails_at_once(fresh_daemon) -> None:
    d = fresh_daemon.start()
    env = {**d.env, "MAASD_PORT": str(d.port + 1 if d.port < 65535 else d.port - 1)}
    started = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert time.monotonic() - started < 15
    assert "already serving" in second.stderr, second.stderr
    assert str(d.data_dir) in second.stderr, second.stderr
    assert f"pid {d.proc.pid}" in second.stderr, second.stderr
    # The first daemon is untouched: still serving, socket still there.
    assert d.healthy()
    assert os.path.exists(d.socket_path)
    _, key = d.tenant("still", 8 * MiB)
    with d.client(key) as c:
        assert c.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201
    assert d.stop() == 0


def test_a_stale_lock_file_does_not_block_a_restart(fresh_daemon) -> None:
    d = fresh_daemon.start()
    d.kill()
    assert (d.data_dir / "maasd.lock").exists()  # left behind by SIGKILL; flock died with it
    d.start()
    assert d.healthy()
    assert d.stop() == 0


def test_admin_key_is_generated_once_with_mode_0600(tmp_path: Path) -> None:
    from conftest import Daemon

    d = Daemon(tmp_path / "gen")
    del d.env["MAASD_ADMIN_KEY"]
    try:
        d.start()
        path = d.data_dir / "admin.key"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        key = path.read_text().strip()
        assert key in d.log()  # printed once, on first start
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {key}"}) as admin:
            assert admin.get("/v1/tenants").status_code == 200
        assert d.stop() == 0
        log_len = len(d.log_path.read_text())
        d.start()
        assert path.read_text().strip() == key
        assert key not in d.log_path.read_text()[log_len:]  # not printed again
        assert d.stop() == 0
    finally:
        d.close()


def test_sigterm_with_a_worker_attached(fresh_daemon) -> None:
    d = fresh_daemon.start()
    _, key = d.tenant("busy", 64 * MiB)
    with d.client(key) as user:
        buf = user.post("/v1/reserve", json={"size_bytes": 16 * MiB}).json()
        w = Worker(d.socket_path, key, renew_interval_s=0)
        m = w.attach(buf["id"])
        m.array[:] = 9
        assert d.stop() == 0, d.log()
        assert not np.any(m.array)  # volatile buffers are scrubbed on the way out
        w.close()
    assert not os.path.exists(d.socket_path)


def test_admin_key_from_a_systemd_credential(tmp_path: Path) -> None:
    # LoadCredential=admin-key:/etc/maasd/admin.key puts it in $CREDENTIALS_DIRECTORY.
    from conftest import Daemon

    creds = tmp_path / "creds"
    creds.mkdir()
    key = "maasd_cred_" + "k" * 32
    (creds / "admin-key").write_text(key + "\n")
    (creds / "admin-key").chmod(0o400)
    d = Daemon(tmp_path / "cred", env={"CREDENTIALS_DIRECTORY": str(creds)})
    del d.env["MAASD_ADMIN_KEY"]
    try:
        d.start()
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {key}"}) as admin:
            assert admin.get("/v1/tenants").status_code == 200
        assert not (d.data_dir / "admin.key").exists()  # nothing generated
        assert key not in d.log()
        assert d.stop() == 0
        (creds / "admin-key").chmod(0o600)
        (creds / "admin-key").write_text("\n")
        d.proc = None
        with pytest.raises(RuntimeError, match="admin-key credential"):
            d.start()
    finally:
        d.close()


def test_a_deleted_default_pool_stays_deleted_across_restarts(fresh_daemon) -> None:
    d = fresh_daemon.start()
    _, key = d.tenant("drained", 64 * MiB)
    with d.client(key) as user:
        assert user.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201
    assert d.admin.delete("/v1/pools/node0", params={"drain": "true"}).status_code == 204
    d.restart()
    assert "node0" not in [p["name"] for p in d.admin.get("/v1/pools").json()]
    assert "default pool node0 was deleted" in d.log()
    # made again by hand, it is the ledger's like any other pool and survives a restart
    r = d.admin.post(
        "/v1/pools", json={"name": "node0", "numa_node": 0, "capacity_bytes": 64 * MiB}
    )
    assert r.status_code == 201, r.text
    d.restart()
    (node0,) = [p for p in d.admin.get("/v1/pools").json() if p["name"] == "node0"]
    assert node0["capacity_bytes"] == 64 * MiB
    assert d.stop() == 0


@pytest.mark.parametrize("migrated", [False, True], ids=["empty-data-dir", "seeded-ledger"])
def test_a_first_start_migrates_the_ledger_and_a_restart_only_reads_its_revision(
    tmp_path: Path, migrated: bool
) -> None:
    """A first start in an empty data dir runs the migrations (Alembic's log lines); the
    suite's daemons start on a copy of a ledger those same migrations made (conftest's
    ``migrated_ledger``), which serves the same. A restart of either finds the ledger at
    the head from its version table and never runs Alembic."""
    from conftest import Daemon

    d = Daemon(tmp_path / "data", migrated=migrated)
    try:
        d.start()
        first = d.log_path.read_text(errors="replace")
        assert ("Running upgrade" in first) is not migrated, first
        assert "msg=starting" in first
        _, key = d.tenant("first", 8 * MiB)
        with d.client(key) as c:
            assert c.post("/v1/pools/node0/reserve", json={"size_bytes": MiB}).status_code == 201
        assert d.stop() == 0, d.log()
        offset = len(d.log_path.read_text(errors="replace"))
        d.start()
        again = d.log_path.read_text(errors="replace")[offset:]
        assert "msg=starting" in again
        assert "alembic" not in again, again
        with sqlite3.connect(d.data_dir / "maasd.db") as conn:
            rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        assert rows == [(REVISIONS[-1],)]
    finally:
        d.close()
