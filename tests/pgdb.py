"""PostgreSQL for the ledger tests: the server from MAASD_TEST_PG_URL, a fresh database each time.

``BACKENDS`` parametrises a test over SQLite (always) and PostgreSQL (when
``MAASD_TEST_PG_URL`` is set — ``scripts/test`` starts a throw-away server for it).
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from maasd.store import normalize_url

PG_URL = os.environ.get("MAASD_TEST_PG_URL")

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgres",
        id="postgres",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(
                not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"
            ),
        ],
    ),
]


@contextlib.contextmanager
def fresh_pg_database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped afterwards."""
    assert PG_URL
    admin = sa.create_engine(normalize_url(PG_URL), isolation_level="AUTOCOMMIT")
    name = f"maasd_test_{secrets.token_hex(6)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield normalize_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


class PrivatePostgres:
    """A PostgreSQL cluster of one test's own (``scripts/pg-test-server`` on a free port),
    which the test may stop (``pg_ctl stop -m fast``: every connection is closed, new
    ones are refused) and start again on the same port and data — an outage as an
    operator makes one. :meth:`remove` deletes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = ""
        self._script = str(Path(__file__).resolve().parent.parent / "scripts" / "pg-test-server")

    def create(self) -> PrivatePostgres:
        out = subprocess.run(
            [self._script, "start", str(self.port)], check=True, capture_output=True, text=True
        )
        self.url = out.stdout.strip().splitlines()[-1]
        return self

    @property
    def _datadir(self) -> str:
        return Path(f"/tmp/maasd-pg-{self.port}.dir").read_text().strip()

    def _pg_ctl(self, *args: str, wrap: tuple[str, ...] = ()) -> None:
        bindir = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1]
        cmd = [f"{bindir}/pg_ctl", "-D", f"{self._datadir}/data", *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run([*wrap, *cmd], check=True, capture_output=True)

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "-w", "stop")

    def start(self, host: str = "127.0.0.1", wrap: tuple[str, ...] = ()) -> None:
        """Start again; ``host``: the address to listen on (a client of another address
        is trusted too), ``wrap``: the command to run pg_ctl under (``ip netns exec …``)."""
        datadir = self._datadir
        if host != "127.0.0.1":
            with open(f"{datadir}/data/pg_hba.conf", "a") as hba:
                hba.write(f"host all all {host}/16 trust\n")
        options = f"-p {self.port} -h {host} -k {datadir} -c fsync=off -c max_connections=200"
        self._pg_ctl(
            "-l", f"{datadir}/server.log", "-w", "-t", "60", "-o", options, "start", wrap=wrap
        )

    def remove(self) -> None:
        subprocess.run([self._script, "stop", str(self.port)], check=False, capture_output=True)

    def pids(self) -> list[int]:
        """The postmaster and every process it forked (backends, walwriter …)."""
        postmaster = int(Path(f"{self._datadir}/data/postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == postmaster:
                children.append(int(Path(stat).parent.name))
        return [postmaster, *children]

    def freeze(self) -> list[int]:
        """SIGSTOP the whole cluster: connections stay open, the kernel still acknowledges
        every packet, and nothing answers (no statement timeout fires: it is frozen too)."""
        pids = self.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def has_pg_server() -> bool:
    """Whether this machine has PostgreSQL's server binaries (a private cluster can start)."""
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
