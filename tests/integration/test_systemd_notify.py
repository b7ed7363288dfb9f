"""``maasd serve`` under ``Type=notify``: READY=1, WATCHDOG=1 and STOPPING=1 from a real daemon.

The test plays systemd: it binds the datagram socket that ``$NOTIFY_SOCKET`` names,
sets ``$WATCHDOG_USEC``, starts ``maasd serve`` and reads what arrives.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import Daemon


def test_ready_after_healthz_watchdog_pings_then_stopping(tmp_path: Path) -> None:
    notify_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    d = Daemon(
        tmp_path / "maasd",
        env={
            "NOTIFY_SOCKET": notify_path,
            "WATCHDOG_USEC": "400000",  # a ping every 0.2 s
        },
    )
    d.data_dir.mkdir(parents=True)
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(
            [sys.executable, "-m", "maasd.cli.daemon", "serve"],
            env=d.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        listener.settimeout(60)
        first = listener.recv(4096).decode().split("\n")
        # The first message is READY=1, and by then REST answers and the socket exists.
        assert first[0] == "READY=1", (first, d.log())
        assert f"STATUS=serving on {d.url}" in first, first
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
        assert os.path.exists(d.socket_path)
        # and the person watching is told where things are
        assert f"maasd ready: REST {d.url}, worker socket {d.socket_path}" in d.log()

        listener.settimeout(5)
        for _ in range(5):  # one at start, then one per interval
            assert listener.recv(4096) == b"WATCHDOG=1"

        d.proc.send_signal(signal.SIGTERM)
        while (msg := listener.recv(4096).decode()) == "WATCHDOG=1":
            pass
        assert msg.split("\n")[0] == "STOPPING=1", msg
        assert d.proc.wait(30) == 0, d.log()
    finally:
        listener.close()
        d.close()
