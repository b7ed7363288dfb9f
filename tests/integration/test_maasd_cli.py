"""`maasd info` and `maasd migrate` as a user runs them (subprocesses, real files)."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest

from maasd.cli.daemon import LogfmtFormatter, data_dir_lock


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_info_reports_the_real_topology_and_default_pools() -> None:
    r = run("info", "--json", env={"MAASD_DEFAULT_POOL_BYTES": str(64 << 20)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    node_ids = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    assert [n["id"] for n in out["topology"]["nodes"]] == (node_ids or [0])
    assert [p["name"] for p in out["pools"]] == [f"node{n}" for n in (node_ids or [0])]
    assert all(p["capacity_bytes"] == 64 << 20 for p in out["pools"])
    text = run("info")
    assert text.returncode == 0
    assert "node 0:" in text.stdout
    assert "pools to create" in text.stdout


def test_info_refuses_a_bad_setting_readably() -> None:
    r = run("info", env={"MAASD_PORT": "seventy"})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "port" in r.stderr


def test_migrate_creates_the_schema(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    r = run("migrate", "--data-dir", str(tmp_path), "--db", f"sqlite:///{db}")
    assert r.returncode == 0, r.stderr
    tables = {
        row[0]
        for row in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")
    }
    assert {"pools", "tenants", "api_keys", "buffers", "events", "alembic_version"} <= tables
    again = run("migrate", "--data-dir", str(tmp_path), "--db", f"sqlite:///{db}")
    assert again.returncode == 0, again.stderr


def test_data_dir_lock_is_exclusive(tmp_path: Path) -> None:
    def take_in_a_child() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from maasd.cli.daemon import data_dir_lock\n"
                "with data_dir_lock(sys.argv[1]): pass",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    refusal = f"another maasd (pid {os.getpid()}) is already serving data dir {tmp_path}"
    with data_dir_lock(str(tmp_path)):
        assert (tmp_path / "maasd.lock").read_text() == f"{os.getpid()}\n"
        # A second holder, in this process or another, is refused at once, naming the first.
        with (
            pytest.raises(click.ClickException, match=re.escape(refusal)),
            data_dir_lock(str(tmp_path)),
        ):
            pass
        holder = take_in_a_child()
        assert holder.returncode != 0
        assert refusal in holder.stderr
    released = take_in_a_child()  # released: can be taken again
    assert released.returncode == 0, released.stderr


@pytest.mark.parametrize(
    ("msg", "expect"), [("serving", "msg=serving"), ("two words", 'msg="two words"')]
)
def test_logfmt_lines(msg: str, expect: str) -> None:
    import logging

    record = logging.LogRecord("maasd", logging.INFO, __file__, 1, msg, (), None)
    record.url = "http://127.0.0.1:1"
    line = LogfmtFormatter().format(record)
    assert expect in line
    assert "level=info" in line
    assert "url=http://127.0.0.1:1" in line


def test_socket_group_owns_the_worker_socket(tmp_path: Path) -> None:
    import grp
    import stat

    from conftest import Daemon

    group = grp.getgrgid(65534).gr_name if 65534 in {g.gr_gid for g in grp.getgrall()} else None
    if group is None:
        pytest.skip("no group with gid 65534 on this host to hand the socket to")
    d = Daemon(
        tmp_path / "maasd",
        env={"MAASD_SOCKET": str(tmp_path / "run" / "maasd.sock"), "MAASD_SOCKET_GROUP": group},
    )
    d.socket_path = str(tmp_path / "run" / "maasd.sock")
    try:
        d.start()
        st = os.stat(d.socket_path)
        assert st.st_gid == 65534
        assert stat.S_IMODE(st.st_mode) == 0o660
    finally:
        d.close()


def test_unknown_socket_group_is_refused_before_starting(tmp_path: Path) -> None:
    r = run("serve", "--data-dir", str(tmp_path), "--socket-group", "no-such-group-maasd")
    assert r.returncode != 0
    assert "no-such-group-maasd" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "maasd.db").exists()


@pytest.mark.parametrize("url", ["mysql://u@db/x", "sqlite:///:memory:", "not a url"])
def test_a_bad_database_url_is_one_line_not_a_traceback(tmp_path: Path, url: str) -> None:
    for command in ("migrate", "serve"):
        r = run(command, "--data-dir", str(tmp_path), "--db", url)
        assert r.returncode != 0, command
        assert "Traceback" not in r.stderr, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(lines) == 1, r.stderr
        assert "database" in lines[0].lower() or "sqlite" in lines[0].lower(), lines[0]


def test_an_admin_key_file_others_can_read_stops_serve(tmp_path: Path) -> None:
    key = tmp_path / "admin.key"
    key.write_text("maasd_admin_key\n")
    key.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if k != "MAASD_ADMIN_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "MAASD_DEFAULT_POOL_BYTES": str(4 << 20)},
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "chmod 600" in r.stderr
    assert str(key) in r.stderr
