"""OpenAI-compatible servers as subprocesses: ``maasd worker`` and ``python -m llama_cpp.server``.

``Served(cmd, port, env=…).start()`` runs ``cmd`` with its output in a log file and waits
until ``GET /v1/models`` answers; ``stop()`` sends SIGTERM and returns the exit code.
Used by ``tests/integration/test_llama_worker.py`` and ``tests/bench/bench_serving.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from processes import signal_and_wait

#: llama-cpp-python server settings every server of a comparison gets
COMMON = ["--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]


def worker_cmd(model: Path | str, port: int, *args: str) -> list[str]:
    """``maasd worker`` (through this interpreter) on ``model`` and ``port``."""
    cmd = [sys.executable, "-m", "maasd.cli.daemon", "worker", "--model", str(model)]
    return [*cmd, "--port", str(port), *args]


def llama_server_cmd(model: Path | str, port: int, *args: str) -> list[str]:
    """llama-cpp-python's own server (``python -m llama_cpp.server``) on ``model`` and ``port``."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model)]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port), *COMMON, *args]


class Served:
    """A server subprocess and its base URL."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        log: Path,
        env: dict[str, str] | None = None,
        *,
        new_session: bool = False,
    ) -> None:
        """``new_session``: the server and its children in a session (and process group) of
        their own, as a terminal's job is — to be signalled as a group (``os.killpg``)."""
        self.cmd = cmd
        self.new_session = new_session
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> Served:
        out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=self.new_session,
        )
        out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.cmd[:5]} exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.cmd[:5]} did not serve in {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait → the exit code (killed after ``timeout``: an error)."""
        assert self.proc is not None
        return signal_and_wait(self.proc, signal.SIGTERM, timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """``GET /metrics`` → {sample name: [(labels, value), …]}."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        text = httpx.get(f"{self.url}/metrics", timeout=30.0).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return out

    def chat(self, messages: list[dict[str, str]], **body: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"messages": messages, "temperature": 0, **body},
            timeout=300.0,
        )
