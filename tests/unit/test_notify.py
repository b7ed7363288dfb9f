"""sd_notify's datagrams, the watchdog's interval and its health gate (maasd.notify).

Every test binds a real ``AF_UNIX`` datagram socket (a path, or a name in the abstract
namespace) and reads what was sent to it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from maasd.notify import Notifier, Systemd, Watchdog, loop_answers, watchdog_interval


def recv(sock: socket.socket, timeout: float = 5.0) -> str:
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    yield s, path
    s.close()


def test_a_datagram_to_a_path(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier(path)
    assert n.send("READY=1", "STATUS=serving")
    assert recv(sock) == "READY=1\nSTATUS=serving"
    n.close()


def test_a_datagram_to_the_abstract_namespace() -> None:
    name = f"maasd-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.enabled
        assert n.send("WATCHDOG=1")
        assert recv(sock) == "WATCHDOG=1"
        n.close()


def test_no_socket_no_op_and_a_vanished_socket_is_not_fatal(tmp_path: Path) -> None:
    assert not Notifier.from_env({}).send("READY=1")
    assert not Notifier("relative/path").enabled  # neither a path nor @abstract
    assert not Notifier(str(tmp_path / "nobody-listens")).send("READY=1")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # watches another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(
    env: dict[str, str], expected: float | None
) -> None:
    assert watchdog_interval(env) == expected


def test_the_watchdog_pings_only_while_healthy(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    state = {"ok": True}
    dog = Watchdog(Notifier(path), 0.05, lambda: (state["ok"], "" if state["ok"] else "broken"))
    dog.start()
    try:
        assert recv(sock) == "WATCHDOG=1"
        assert recv(sock) == "WATCHDOG=1"
        state["ok"] = False
        time.sleep(0.2)  # let a tick see it, then drain what was sent before
        sock.setblocking(False)
        while True:
            try:
                sock.recv(4096)
            except BlockingIOError:
                break
        with pytest.raises(TimeoutError):
            recv(sock, timeout=0.5)  # ten intervals, no ping
        state["ok"] = True
        assert recv(sock) == "WATCHDOG=1"
    finally:
        dog.stop()


def test_a_check_that_raises_counts_as_unhealthy(listener: tuple[socket.socket, str]) -> None:
    def boom() -> tuple[bool, str]:
        raise RuntimeError("no")

    assert not Watchdog(Notifier(listener[1]), 1.0, boom).tick()


def test_a_stuck_event_loop_is_unhealthy() -> None:
    loop = asyncio.new_event_loop()
    release = threading.Event()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert loop_answers(loop, 2.0) == (True, "")
        loop.call_soon_threadsafe(release.wait)  # the loop blocks in a callback
        ok, why = loop_answers(loop, 0.2)
        assert not ok
        assert "event loop" in why
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_systemd_health_names_the_failing_component() -> None:
    sd = Systemd(
        Notifier(None), lambda: {"broker": (False, "accept thread died"), "db": (True, "")}, 1.0
    )
    assert sd.healthy() == (False, "broker: accept thread died")
    assert Systemd(Notifier(None), lambda: {"broker": (True, "")}, 1.0).healthy() == (True, "")


def test_ready_starts_the_watchdog_and_stopping_is_said(
    listener: tuple[socket.socket, str],
) -> None:
    sock, path = listener
    sd = Systemd(Notifier(path), lambda: {"broker": (True, "")}, 0.05)
    sd.ready(status="serving on test")
    try:
        assert recv(sock) == "READY=1\nSTATUS=serving on test"
        assert recv(sock) == "WATCHDOG=1"
        sd.stopping()
        got = recv(sock)
        while got == "WATCHDOG=1":
            got = recv(sock)
        assert got.startswith("STOPPING=1\n")
    finally:
        sd.close()
