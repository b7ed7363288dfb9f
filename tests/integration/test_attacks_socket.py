"""Attacks on the worker socket of a real daemon, each kept as a regression test (SPEC §2.9, §5).

Every test drives a ``maasd serve`` subprocess through its socket only, as a hostile
worker would, then checks that another tenant is still served and the daemon healthy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from hardening import after_attack, healthz
from maasd.protocol import Attach, Attached, Error, Hello, Welcome, encode_frame
from nobody import NOBODY, as_nobody, require_reachable_checkout
from sockpeer import Raw

KiB = 1 << 10
MiB = 1 << 20
#: The daemon's open-files limit in the in-flight test: small, so that the attack is quick.
OPEN_FILES = 1024


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A data directory ``nobody`` owns (the daemon must not run as root: root is exempt
    from the kernel's limit on fds in flight)."""
    require_reachable_checkout()
    base = Path(tempfile.mkdtemp(prefix="maasd-nobody-"))
    base.chmod(0o755)
    (base / "data").mkdir()
    os.chown(base / "data", NOBODY, NOBODY)
    yield base / "data"
    shutil.rmtree(base, ignore_errors=True)


def nobody_daemon(data_dir: Path, **env: str) -> Daemon:
    """A daemon running as nobody with :data:`OPEN_FILES` open files at most."""
    return Daemon(
        data_dir,
        env=env,
        wrapper=[
            "prlimit",
            f"--nofile={OPEN_FILES}:{OPEN_FILES}",
            "--",
            *as_nobody(),
        ],
    )


#: Run as nobody: puts more fds in flight than the daemon's RLIMIT_NOFILE (a socketpair
#: whose other end is never read), says so, and holds them until its stdin closes.
HOG = """
import os, socket, sys
a, b = socket.socketpair()
fd = os.open("/dev/null", os.O_RDONLY)
for _ in range(5):
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(fd.to_bytes(4, sys.byteorder)) * 250)])
print("ready", flush=True)
sys.stdin.read()
"""


def attach_once(path: str, key: str, buffer_id: str) -> object:
    """A fresh connection's attach: the reply (``None`` if the daemon closed it instead)
    and the fds that came with it are closed."""
    r = Raw(path)
    try:
        r.hello(key)
        reply, fds = r.call(Attach(buffer_id=buffer_id))
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        r.close()
    for fd in fds:
        os.close(fd)
    if isinstance(reply, Attached) and len(fds) != 1:
        return f"attached with {len(fds)} fds"
    return reply


def test_fds_left_unread_in_sockets_do_not_cut_other_tenants_off(nobody_dir: Path) -> None:
    # The kernel counts fds in flight over Unix sockets (sent, not yet received) per
    # sending user, and refuses more (ETOOMANYREFS) past the sender's RLIMIT_NOFILE,
    # unless it has CAP_SYS_RESOURCE: so the daemon runs as nobody here, as it does in
    # production. Each connection's send buffer lets ~20 replies (each with an fd) sit
    # unread in the attacker's socket.
    d = nobody_daemon(
        nobody_dir, MAASD_SOCKET_MAX_CONNECTIONS="128", MAASD_SOCKET_MAX_PER_TENANT="100"
    )
    d.start()
    attackers: list[Raw] = []
    try:
        _, evil = d.tenant("attacker", 16 * MiB)
        _, good = d.tenant("victim", 16 * MiB)
        with d.client(evil) as c:
            evil_buf = c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).json()["id"]
        with d.client(good) as c:
            good_buf = c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).json()["id"]
        assert isinstance(attach_once(d.socket_path, good, good_buf), Attached)

        # The attack: attaches pipelined on many connections, no reply ever read — as
        # many connections as the attacker is let open (its share of the socket's:
        # past it, its hello is a 429).
        frame = encode_frame(Attach(buffer_id=evil_buf)) * 200
        victim = None
        for _ in range(90):
            r = Raw(d.socket_path)
            attackers.append(r)
            welcome, _fds = r.call(Hello(api_key=evil))
            if isinstance(welcome, Error):
                assert welcome.status == 429, welcome
                assert "socket_max_per_tenant" in welcome.detail, welcome
                break
            assert isinstance(welcome, Welcome), welcome
            r.sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                r.sock.send(frame)
            victim = attach_once(d.socket_path, good, good_buf)
            if not isinstance(victim, Attached):
                break
        # Another tenant's attach is served however many fds the attacker leaves unread.
        assert isinstance(victim, Attached), victim
    finally:
        for r in attackers:
            r.close()
        try:
            after_attack(d)
        finally:
            d.close()


def test_fds_the_kernel_refuses_are_a_507_and_an_unhealthy_broker(nobody_dir: Path) -> None:
    # Another process of the daemon's user holds more fds in flight than the daemon's
    # RLIMIT_NOFILE: the kernel refuses every fd the daemon sends (ETOOMANYREFS).
    d = nobody_daemon(nobody_dir, MAASD_SOCKET_MAX_CONNECTIONS="64")
    d.start()
    hog = None
    try:
        tid, key = d.tenant("victim", 16 * MiB)
        with d.client(key) as c:
            buffer_id = c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).json()["id"]
        hog = subprocess.Popen(
            ["prlimit", "--nofile=4096:4096", "--", "setpriv", f"--reuid={NOBODY}"]
            + [f"--regid={NOBODY}", "--clear-groups", "--", sys.executable, "-c", HOG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert hog.stdout is not None
        assert hog.stdout.readline() == b"ready\n"
        r = Raw(d.socket_path)
        try:
            r.hello(key)
            for _ in range(2):  # a clear answer each time, and the connection stays
                reply, fds = r.call(Attach(buffer_id=buffer_id))
                assert fds == []
                assert isinstance(reply, Error), reply
                assert reply.status == 507
                assert reply.type is not None
                assert reply.type.endswith("/resource-limit")
                assert "ETOOMANYREFS" in reply.detail
            status, body = healthz(d)
            assert status == 503, body
            assert "ETOOMANYREFS" in str(body), body
            # The refused attaches were undone, and counted.
            assert d.metric("maasd_attached_handles", tenant=tid) == 0
            assert d.metric("maasd_socket_fds_refused_total") == 2
            assert hog.stdin is not None
            hog.stdin.close()
            hog.wait(10)
            reply, fds = r.call(Attach(buffer_id=buffer_id))  # fds pass again
            for fd in fds:
                os.close(fd)
            assert isinstance(reply, Attached), reply
            assert len(fds) == 1
        finally:
            r.close()
        after_attack(d)  # healthy again
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        d.close()


def test_connections_that_never_say_hello_do_not_lock_out_a_worker(daemon: Daemon) -> None:
    # No key needed: anyone who may connect to the socket opens connections and never
    # sends hello, re-opening each one the hello deadline closes. A worker of the same
    # uid (workers of several tenants often share one) connects and says hello at once.
    _, key = daemon.tenant("victim", 16 * MiB)
    with daemon.client(key) as c:
        buffer_id = c.post("/v1/reserve", json={"size_bytes": 4 * KiB}).json()["id"]
    shed = daemon.metric("maasd_socket_connections_closed_total", reason="shed")
    idle: list[socket.socket] = []
    try:
        for _ in range(70):  # more than socket_max_unauthenticated (64)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            idle.append(s)
            s.connect(daemon.socket_path)
        r = Raw(daemon.socket_path)
        try:
            reply, fds = r.call(Hello(api_key=key))
        finally:
            r.close()
        assert fds == []
        assert isinstance(reply, Welcome), reply
    finally:
        for s in idle:
            s.close()
    assert isinstance(attach_once(daemon.socket_path, key, buffer_id), Attached)
    # The oldest idle ones were shed for the newer (counted), never more than the cap waited.
    assert daemon.metric("maasd_socket_connections_closed_total", reason="shed") > shed
    after_attack(daemon)
