"""A real ``redis-server`` for the L2 tests, on a free loopback port, started by the suite.

``RedisServer(dir).start()`` runs Debian's ``redis-server`` (``.ci/run`` installs it;
``valkey-server`` serves too) with a password, no persistence and no protected mode,
until :meth:`kill` (SIGKILL) or :meth:`stop`; :meth:`start` again brings it back on the
same port. ``REDIS_SERVER`` is the binary, or None: the tests then skip, saying why.
Import as ``from redisdb import RedisServer`` (``tests/`` is on pytest's pythonpath).
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One throw-away Redis: loopback only, a random password, nothing written to disk."""

    def __init__(self, workdir: Path) -> None:
        assert REDIS_SERVER is not None
        self.workdir = workdir
        self.port = _free_port()
        self.password = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "redis.log"

    @property
    def url(self) -> str:
        """What the daemon is given (the password included)."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--requirepass", self.password,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--maxmemory", "512mb",
            "--maxmemory-policy", "volatile-lru",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}: {self.log()}")
            try:
                self.client().ping()
            except Exception:
                time.sleep(0.05)
            else:
                return self
        raise RuntimeError(f"redis-server did not answer within {timeout}s: {self.log()}")

    def client(self):  # -> redis.Redis (the l2 extra may be missing where this is imported)
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )

    def kill(self) -> None:
        """SIGKILL: the abrupt end the tests are about."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""
