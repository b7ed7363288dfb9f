"""The socket's bounds in the real daemon, and the process limits it must survive.

- floods of one tenant and, before hello, of one uid: capped with a 429 that
  names the cap, while another tenant's worker attaches and ``/healthz`` is ok;
- a thread limit (RLIMIT_NPROC, daemon under an unprivileged real uid): hundreds
  of connections are served without a thread each, and accepting goes on;
- the open-files limit (RLIMIT_NOFILE): the accept loop backs off instead of
  spinning (CPU measured from /proc), logs a bounded number of lines, and a
  worker attaches again once the flood is gone; ``Broker.healthy()`` turns
  false while it cannot accept and true again after.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from conftest import Daemon
from maasd.client import Client, Worker
from maasd.protocol import (
    Attach,
    Attached,
    FrameReader,
    Hello,
    Welcome,
    decode_reply,
    encode_frame,
    recv_message,
)
from sockflood import flood
from waiting import wait_until

NOBODY = 65534
MiB = 1 << 20
TESTS = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running(data_dir: Path, env: dict[str, str], wrapper: list[str] | None = None):
    d = Daemon(data_dir, env=env, wrapper=wrapper)
    try:
        yield d.start()
    finally:
        d.close()


def worker_attaches(d: Daemon) -> bool:
    """A new tenant reserves over REST and its worker attaches over the socket."""
    _tid, key = d.tenant("ok", 16 * MiB)
    with Client(d.url, key) as c:
        buf = c.reserve(size_bytes=MiB, ttl_s=300)
    with Worker(d.socket_path, key, renew_interval_s=0) as w, w.attach(buf.id) as m:
        m.array[0] = 1
        return m.size == MiB


def healthz_ok(d: Daemon) -> bool:
    r = httpx.get(d.url + "/healthz", timeout=10)
    return r.status_code == 200 and r.json() == {"status": "ok"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def threads_of_real_uid(uid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{entry}/status").read_text().splitlines()
            ruid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
            if ruid == uid:
                total += next(
                    int(line.split()[1]) for line in status if line.startswith("Threads:")
                )
    return total


# --- floods ----------------------------------------------------------------------------------


def test_floods_hold_their_caps_and_the_daemon_keeps_serving(
    tmp_path: Path, open_dir: Path
) -> None:
    env = {
        "MAASD_SOCKET": str(open_dir / "maasd.sock"),
        "MAASD_SOCKET_GROUP": str(NOBODY),
        "MAASD_SOCKET_MAX_PER_TENANT": "4",
        "MAASD_SOCKET_MAX_UNAUTHENTICATED": "16",
    }
    with running(tmp_path / "d", env) as d:
        _tid, hog = d.tenant("hog")
        with flood(d.socket_path, 8, key=hog) as got:
            assert got["welcome"] == 4
            refused = [x for s, x in got["errors"] if s == 429]
            assert len(refused) == 4
            assert all("(socket_max_per_tenant = 4)" in x for x in refused)
            with flood(d.socket_path, 12, euid=NOBODY, egid=NOBODY) as pre:
                assert pre["open"] == 8  # half of the unauthenticated slots
                assert len(pre["errors"]) == 4
                assert all(s == 429 for s, _ in pre["errors"])
                assert worker_attaches(d)
                assert healthz_ok(d)
        assert d.proc is not None
        assert d.proc.poll() is None
        assert worker_attaches(d)


def test_at_a_small_open_files_limit_one_tenant_holds_its_share_of_the_connections(
    tmp_path: Path,
) -> None:
    """At RLIMIT_NOFILE 1024 the socket holds 85 connections: one tenant gets a quarter
    (its tenant_region_share), not all of them, and another tenant's worker still works."""
    env = {"MAASD_SOCKET_MAX_UNAUTHENTICATED": "128"}  # the flood's 40 wait for hello at once
    with running(tmp_path / "d", env, wrapper=["prlimit", "--nofile=1024:1024", "--"]) as d:
        _tid, hog = d.tenant("hog")
        with flood(d.socket_path, 30, key=hog) as got:
            assert got["welcome"] == 21
            refused = [x for s, x in got["errors"] if s == 429]
            assert len(refused) == 9
            assert all("(socket_max_per_tenant = 21, lowered from 128 to" in x for x in refused)
            assert worker_attaches(d)
            assert healthz_ok(d)


# --- a thread limit -----------------------------------------------------------------------------


def test_at_its_thread_limit_the_broker_serves_hundreds_of_connections(tmp_path: Path) -> None:
    many = {"max_connections": 2000, "max_unauthenticated": 2000, "max_per_tenant": 2000}
    with broker_process(tmp_path, **many) as (info, proc):
        assert ask(proc, f"drop {NOBODY}") == [NOBODY, NOBODY]  # unprivileged from here on
        limit = ask(proc, "nproc")
        assert isinstance(limit, dict)
        assert limit["probe"] == "refused: can't start new thread"  # the limit bites
        before = ask(proc, "threads")
        with flood(info["socket"], 300, key=info["key"]) as got:
            assert got["welcome"] == 300, got
            assert ask(proc, "threads") == before  # no thread per connection
            with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
                s.connect(info["socket"])  # and accepting goes on
                reader = FrameReader()
                s.sendall(encode_frame(Hello(api_key=info["key"])))
                body, _ = recv_message(s, reader)
                assert isinstance(decode_reply(body or b""), Welcome)
                s.sendall(encode_frame(Attach(buffer_id=info["buffer"])))
                body, fds = recv_message(s, reader)
                assert isinstance(decode_reply(body or b""), Attached)
                assert len(fds) == 1
                os.close(fds[0])
            assert ask(proc, "health")[0]
        assert proc.poll() is None


# --- the open-files limit -------------------------------------------------------------------------


def test_out_of_fds_the_daemon_backs_off_quietly_and_recovers(tmp_path: Path) -> None:
    env = {"MAASD_SOCKET_MAX_PER_TENANT": "400", "MAASD_SOCKET_MAX_UNAUTHENTICATED": "800"}
    with running(tmp_path / "d", env) as d:
        assert d.proc is not None
        pid = d.proc.pid
        _tid, key = d.tenant("fds", 16 * MiB)
        # The key welcomed once, so that the flood's hellos are answered from memory: a
        # hello whose key must be read from the ledger needs a file of its own (a ledger
        # connection), which the accepts below may have taken first.
        Worker(d.socket_path, key, renew_interval_s=0).close()
        open_now = len(os.listdir(f"/proc/{pid}/fd"))
        hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_now + 24, hard))
        log_before = d.log_path.read_text(errors="replace").count("accept failed")
        with flood(d.socket_path, 100, key=key) as got:
            assert 0 < got["welcome"] < 100, got  # the rest wait in the listen queue
            t0, c0 = time.monotonic(), cpu_seconds(pid)
            time.sleep(3.0)
            busy = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            assert busy < 0.3, f"the daemon used {busy:.0%} of a CPU while out of fds"
            assert d.proc.poll() is None
        logged = d.log_path.read_text(errors="replace").count("accept failed") - log_before
        assert 1 <= logged <= 3, f"{logged} 'accept failed' lines"
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        wait_until(lambda: worker_attaches(d), timeout=20, message="a worker attaches again")


@contextlib.contextmanager
def broker_process(directory: Path, **limits: int) -> Iterator[tuple[dict, subprocess.Popen[str]]]:
    """A real Broker over the fake service in a process of its own (tests/sockpeer.py)."""
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "sockpeer.py"), str(directory), json.dumps(limits)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.getcwd()])},
    )
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline()), proc
    finally:
        proc.kill()
        proc.wait()


def ask(proc: subprocess.Popen[str], command: str) -> Any:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_health_is_false_while_out_of_fds_and_true_again_after(tmp_path: Path) -> None:
    with broker_process(tmp_path) as (info, proc):
        assert ask(proc, "health") == [True, "serving 0 connections on " + info["socket"]]
        fds = ask(proc, "fds")
        assert isinstance(fds, int)
        ask(proc, f"nofile {fds + 8}")
        with flood(info["socket"], 40, key=info["key"]) as got:
            assert 0 < got["welcome"] < 40
            wait_until(
                lambda: not ask(proc, "health")[0],
                timeout=20,
                message="health turns false while accepts fail",
            )
            _ok, why = ask(proc, "health")
            assert "has not accepted a connection" in why
            assert "Too many open files" in why
        wait_until(
            lambda: ask(proc, "health")[0],
            timeout=20,
            message="health is true again once the fds are back",
        )


def test_sigterm_ends_the_daemon_whatever_its_peers_do(tmp_path: Path) -> None:
    with running(tmp_path / "d", {}) as d:
        _tid, key = d.tenant("term", 16 * MiB)
        with Client(d.url, key) as c:
            buf = c.reserve(size_bytes=MiB, ttl_s=300)
        peers = [socket.socket(socket.AF_UNIX) for _ in range(3)]
        for s in peers:
            s.connect(d.socket_path)
        deaf, mute, half = peers
        deaf.sendall(encode_frame(Hello(api_key=key)))
        deaf.sendall(encode_frame(Attach(buffer_id=buf.id)) * 2000)  # never reads
        half.sendall(encode_frame(Hello(api_key=key))[:5])  # half a frame; mute says nothing
        try:
            assert d.stop() == 0  # Daemon.stop fails the test if it takes over 30 s
            assert not os.path.exists(d.socket_path)
        finally:
            for s in peers:
                s.close()
