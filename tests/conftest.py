"""Shared fixtures: a real ``maasd serve`` on a free port, in a temp data dir.

``daemon`` is module-scoped (one daemon per test module, fast); tests that
kill or restart it use ``fresh_daemon``. Tenant names get a random suffix so
tests sharing a daemon never collide.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from processes import signal_and_wait

# Helper modules with asserts of their own: rewritten like test modules, so a failing
# assert in them says what it compared.
pytest.register_assert_rewrite("ledger")
# The placement suite's fixtures and its skip outside a multi-node host (tests/multinode);
# the L2 tests' Redis and ledger fixtures (two daemons on one ledger and one Redis).
# How scripts/test spreads modules over CPUs (pytest-xdist groups): tests/parallel.py.
pytest_plugins = ("placement", "l2hosts", "router_fleet", "parallel")

MiB = 1 << 20
DEFAULT_POOL_BYTES = 256 * MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The tests' clients drop an idle connection after 1 s, well before the daemon's server
#: closes it (``http_keepalive_s``, 20 s; it was uvicorn's 5 s): with both at 5 s, a request
#: sent on a connection the server is closing at that moment fails with "Server
#: disconnected" (seen in the slow TCG guest).
IDLE_SHORTER_THAN_THE_SERVER = httpx.Limits(keepalive_expiry=1.0)


_MIGRATED: Path | None = None


def migrated_ledger() -> Path:
    """An empty SQLite ledger at the newest schema, made once per test process by the
    daemon's own upgrade (the same Alembic migrations a first start runs). A
    :class:`Daemon` in a fresh data dir starts on a copy of it: the migrations and the
    import of Alembic were ~0.3 s of each start's CPU, over hundreds of starts
    (docs/performance.md, "The test suite's own time")."""
    global _MIGRATED
    if _MIGRATED is None:
        import atexit

        from maasd.store import Store

        where = Path(tempfile.mkdtemp(prefix="maasd-migrated-ledger-"))
        atexit.register(shutil.rmtree, where, True)
        store = Store(f"sqlite:///{where / 'maasd.db'}")
        try:
            store.upgrade()
        finally:
            store.dispose()  # the last connection: the WAL is folded into the file
        assert not (where / "maasd.db-wal").exists()
        _MIGRATED = where / "maasd.db"
    return _MIGRATED


class Daemon:
    """A ``maasd serve`` subprocess and what a test needs to talk to it.

    In a data dir without a ledger, with the default ledger URL and nothing that could
    name another (a config file, flags, a wrapper that may run it as another user), it
    starts on a copy of :func:`migrated_ledger` unless ``migrated=False``: a first start
    that migrates the ledger itself."""

    def __init__(
        self,
        data_dir: Path,
        *,
        env: dict[str, str] | None = None,
        config: Path | None = None,
        wrapper: list[str] | None = None,
        migrated: bool = True,
    ) -> None:
        """``wrapper`` runs the daemon under another command (``setpriv …``, ``prlimit …``)."""
        self.data_dir = data_dir
        self.wrapper = wrapper or []
        self.migrated = migrated
        self.args: list[str] = []  # after ``maasd serve`` (``--release-lost-checkpoints``)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = "maasd_admin_" + secrets.token_urlsafe(24)
        self.socket_path = (env or {}).get("MAASD_SOCKET") or str(data_dir / "maasd.sock")
        self.log_path = data_dir / "daemon.log"
        self.env = {
            **os.environ,
            "MAASD_DATA_DIR": str(data_dir),
            "MAASD_PORT": str(self.port),
            "MAASD_ADMIN_KEY": self.admin_key,
            "MAASD_DEFAULT_POOL_BYTES": str(DEFAULT_POOL_BYTES),
            "MAASD_REAPER_INTERVAL_S": "0.2",
            # A warm stock costs CPU at start (its refill): only the tests that want one.
            "MAASD_DEFAULT_WARM_BYTES": "0",
            # The latency probe too (a child measuring each node): only the tests that want it.
            "MAASD_LATENCY_PROBE": "false",
            "MAASD_LOG_LEVEL": "info",
            # An idle REST connection closes after 6 s, not 20: past httpx's pool expiry
            # (5 s) as the default is, and before the tests that count the daemon's fds
            # give up waiting (10-15 s) for one a client left idle in its pool.
            "MAASD_HTTP_KEEPALIVE_S": "6",
            **(env or {}),
        }
        if config is not None:
            self.env["MAASD_CONFIG"] = str(config)
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin = httpx.Client(
            base_url=self.url,
            timeout=30.0,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            limits=IDLE_SHORTER_THAN_THE_SERVER,
        )

    # -- process --------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Daemon:
        """Start and wait until healthy: ``timeout`` seconds, default 120 or
        ``MAASD_TEST_START_TIMEOUT`` (scripts/numa-guest sets it: imports take minutes there).
        A hang guard, not a measurement: on a loaded CI host a start has taken over 30 s
        (11 s from the broker's socket to the REST server's alone)."""
        if timeout is None:
            timeout = float(os.environ.get("MAASD_TEST_START_TIMEOUT", "120"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._seed_ledger()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "maasd.cli.daemon", "serve", *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"maasd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(
                    f"{self.url}/healthz", timeout=1.0
                ).status_code == 200 and os.path.exists(self.socket_path):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"maasd did not become healthy in {timeout}s:\n{self.log()}")

    def _seed_ledger(self) -> None:
        """A copy of :func:`migrated_ledger` where this start would create the ledger."""
        named_elsewhere = any(k in self.env for k in ("MAASD_DB_URL", "MAASD_CONFIG"))
        if (
            not self.migrated
            or named_elsewhere
            or self.args
            or self.wrapper
            or self.env.get("MAASD_DATA_DIR") != str(self.data_dir)
        ):
            return
        ledger = self.data_dir / "maasd.db"
        if not any(self.data_dir.glob("maasd.db*")):
            shutil.copyfile(migrated_ledger(), ledger)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and wait; returns its exit code."""
        assert self.proc is not None
        return signal_and_wait(self.proc, sig, timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> Daemon:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        return self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    # -- helpers --------------------------------------------------------------------------

    def tenant(self, name: str = "tenant", quota_bytes: int = 64 * MiB) -> tuple[str, str]:
        """Create a tenant (name made unique); returns ``(tenant_id, api_key)``."""
        r = self.admin.post(
            "/v1/tenants",
            json={"name": f"{name}-{secrets.token_hex(3)}", "quota_bytes": quota_bytes},
        )
        assert r.status_code == 201, r.text
        body = r.json()
        return body["id"], body["api_key"]

    def pool(self, name: str, capacity_bytes: int, **fields: Any) -> dict[str, Any]:
        """Create a pool on this daemon's host (NUMA node 0 unless ``numa_node`` is given,
        other fields as the API takes them); returns its record."""
        body = {"name": name, "numa_node": 0, "capacity_bytes": capacity_bytes, **fields}
        r = self.admin.post("/v1/pools", json=body)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def client(self, api_key: str) -> httpx.Client:
        """A raw httpx client with this key (for tests that check HTTP itself)."""
        return httpx.Client(
            base_url=self.url,
            timeout=30.0,
            headers={"Authorization": f"Bearer {api_key}"},
            limits=IDLE_SHORTER_THAN_THE_SERVER,
        )

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample in /metrics (0.0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.admin.get("/metrics", timeout=10.0).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
        finally:
            self.admin.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("maasd"))
    d.start()
    yield d
    d.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids can reach, for a socket they connect to (tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="maasd-sock-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fresh_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of this test alone (for kills, restarts, config files)."""
    d = Daemon(tmp_path / "maasd")
    yield d
    d.close()


@pytest.fixture
def disk_daemon(fresh_daemon: Daemon) -> Daemon:
    """A started daemon of this test alone, for disk-tier pools (``tier_pool``)."""
    return fresh_daemon.start()


@contextlib.contextmanager
def small_rest_daemon(data_dir: Path, env: dict[str, str]) -> Iterator[Daemon]:
    """A started daemon with ``env`` (the small REST limits of ``budgets.http_limits_env``),
    closed after: the gate attack modules' module-scoped daemons."""
    daemon = Daemon(data_dir, env=env)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.close()
