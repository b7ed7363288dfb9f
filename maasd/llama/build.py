"""Does the installed llama-cpp-python build run on this machine?

llama-cpp-python's default build (``GGML_NATIVE=ON``) compiles ggml for every ISA
extension the build host's cpuid advertises. A VM can advertise AMX without the
kernel or hypervisor enabling it for the process: the first quantized matrix
multiplication then dies of SIGILL — the whole worker, not a Python exception.
``scripts/llama-wheel`` builds with explicit ISA flags instead (AVX2/FMA/F16C/BMI2,
no AMX, no AVX-512 by default); this module checks that the installed build is such
a one, and explains a worker's death by a signal:

* :func:`amx_instructions` disassembles the installed ``libggml-cpu*.so`` with
  ``objdump`` and lists AMX instructions in it (there must be none);
* :func:`wheel_cmake_args` reads the ``CMAKE_ARGS`` that ``scripts/llama-wheel`` keeps
  beside the wheel the installed build came from;
* :func:`run_isolated` / :func:`probe_eval` run llama.cpp in a child process, so an
  illegal instruction fails with :func:`describe_exit`'s explanation instead of
  killing the caller;
* :func:`describe_exit` names the signal a process died of, and for SIGILL says what
  to do.

Why disassemble rather than scan bytes for AMX opcodes: AMX instructions are VEX
encoded (``C4 E2 …`` then opcode 0x49, 0x4B, 0x5C or 0x5E), byte sequences that also
occur inside other instructions' immediates and displacements and in data. A
disassembler walks instruction boundaries through the code sections only, so a
mnemonic it prints is an instruction that is really there.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = [
    "REBUILD_HINT",
    "BuildProbeFailed",
    "ProbeResult",
    "amx_instructions",
    "cpu_backend_libs",
    "describe_exit",
    "probe_eval",
    "run_isolated",
    "wheel_cmake_args",
]

REBUILD_HINT = (
    "the llama-cpp-python build uses an instruction this CPU/VM does not enable — rebuild "
    "it portable with scripts/llama-wheel (see docs/llama.md, 'Building llama-cpp-python')"
)

# The AMX mnemonics (tile config, loads/stores, dot products, complex matmuls).
_AMX = re.compile(
    r"(ldtilecfg|sttilecfg|tileload\w*|tilestore\w*|tilerelease|tilezero|tdp\w+|tcmm\w+)"
)


class BuildProbeFailed(RuntimeError):
    """A child running llama.cpp did not finish: died of a signal, failed, or timed out."""


def describe_exit(code: int) -> str:
    """How a process ended, from its ``returncode``/``exitcode`` (< 0: killed by a signal).

    >>> describe_exit(-4).startswith("SIGILL (Illegal instruction): the llama-cpp-python")
    True
    """
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    text = f"{name} ({signal.strsignal(-code) or 'unknown signal'})"
    return f"{text}: {REBUILD_HINT}" if -code == signal.SIGILL else text


# --------------------------------------------------------------------------- the binary


def _llama_cpp_dir() -> Path | None:
    # Found without importing llama_cpp: importing loads the libraries.
    spec = importlib.util.find_spec("llama_cpp")
    return Path(spec.origin).parent if spec and spec.origin else None


def cpu_backend_libs() -> list[Path]:
    """The installed llama_cpp package's ggml CPU backends, one path per distinct file.

    Wheels carry no symlinks, so ``libggml-cpu.so``, ``.so.0`` and ``.so.0.x.y`` are often
    three copies of one file: each content is listed once.
    """
    pkg = _llama_cpp_dir()
    if pkg is None:
        return []
    seen: dict[str, Path] = {}
    for lib in sorted((pkg / "lib").glob("libggml-cpu*.so*"), key=lambda p: len(p.name)):
        digest = hashlib.blake2b(lib.read_bytes(), digest_size=16).hexdigest()
        seen.setdefault(digest, lib)
    return list(seen.values())


def amx_instructions(lib: Path, objdump: str = "objdump", limit: int = 10) -> list[str]:
    """Up to ``limit`` disassembly lines of ``lib`` whose instruction is an AMX one.

    Matches the mnemonic column only, so a called function's name that contains
    ``tileloadd`` (``call <…_tile_loadd…>``) is not taken for the instruction.
    """
    out = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(lib)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: list[str] = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[1].strip():
            mnemonic = parts[1].split()[0]
            if _AMX.fullmatch(mnemonic):
                found.append(line.strip())
                if len(found) >= limit:
                    break
    return found


def wheel_cmake_args() -> tuple[Path | None, str | None]:
    """(the CMAKE_ARGS file, its text) of the wheel the installed llama-cpp-python came from.

    pip records a wheel installed from a file in the distribution's ``direct_url.json``;
    ``scripts/llama-wheel`` keeps ``CMAKE_ARGS`` beside the wheel. (None, None) when the
    build did not come from a local wheel; (path, None) when that wheel has no such file.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        raw = importlib.metadata.distribution("llama-cpp-python").read_text("direct_url.json")
        url = urlparse(json.loads(raw)["url"]) if raw else None
        if url is not None and url.scheme == "file":
            path = Path(unquote(url.path)).parent / "CMAKE_ARGS"
            return path, path.read_text().strip() if path.is_file() else None
    return None, None


# --------------------------------------------------------------------------- a real eval, isolated


@dataclass
class ProbeResult:
    """What one greedy continuation in the child produced."""

    prompt: str
    n_prompt_tokens: int
    text: str  # the continuation, detokenized
    finite: bool  # every logit of every step was finite
    p_top: float  # probability of the first generated token
    p_second: float  # … and of the runner-up
    extra: dict[str, Any] = field(default_factory=dict)


_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
from maasd.llama.adapter import LlamaSeqAdapter

a = json.load(sys.stdin)
llm = llama_cpp.Llama(a["model"], n_ctx=a["n_ctx"], n_batch=a["n_ctx"], n_threads=a["threads"],
                      n_threads_batch=a["threads"], verbose=False)
seq = LlamaSeqAdapter(llm)
out = []
for prompt in a["prompts"]:
    llm.reset()
    toks = llm.tokenize(prompt.encode(), add_bos=True)
    llm.eval(toks)  # the whole prompt as one batch: ggml's quantized matmul kernels
    gen, finite, probs = [], True, None
    for _ in range(a["n_predict"]):
        lg = seq.last_logits().astype(np.float64)
        finite = finite and bool(np.isfinite(lg).all())
        if probs is None:
            e = np.exp(lg - lg.max())
            probs = np.sort(e / e.sum())[::-1]
        gen.append(int(np.argmax(lg)))
        llm.eval(gen[-1:])
    out.append({"prompt": prompt, "n_prompt_tokens": len(toks), "finite": finite,
                "text": llm.detokenize(gen).decode(errors="replace"),
                "p_top": float(probs[0]), "p_second": float(probs[1])})
print(json.dumps({"results": out, "system_info": llama_cpp.llama_print_system_info().decode()}))
"""


def run_isolated(code: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with ``payload`` as JSON on stdin → its last
    stdout line, parsed as JSON. Raises :class:`BuildProbeFailed` saying how it ended
    (:func:`describe_exit`) and the end of its stderr when it does not exit 0."""
    try:
        p = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildProbeFailed(f"llama.cpp child still running after {timeout:.0f} s") from exc
    if p.returncode != 0:
        raise BuildProbeFailed(
            f"llama.cpp child died of {describe_exit(p.returncode)}\n"
            f"--- its stderr (end) ---\n{p.stderr[-2000:]}"
        )
    lines = p.stdout.strip().splitlines()
    if not lines:
        raise BuildProbeFailed(f"llama.cpp child printed nothing; stderr: {p.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def probe_eval(
    model: str | os.PathLike[str],
    prompts: list[str],
    *,
    n_predict: int = 4,
    threads: int = 1,
    n_ctx: int = 512,
    timeout: float = 300.0,
) -> list[ProbeResult]:
    """Greedy-continue each prompt with ``model`` in a child process (see :func:`run_isolated`).

    Each prompt is evaluated as one batch, then ``n_predict`` tokens one at a time, so
    both the batched and the single-row kernels run.
    """
    out = run_isolated(
        _CHILD,
        {
            "model": str(model),
            "prompts": prompts,
            "n_predict": n_predict,
            "threads": threads,
            "n_ctx": n_ctx,
        },
        timeout,
    )
    info = {"system_info": out.get("system_info", "")}
    return [ProbeResult(**r, extra=info) for r in out["results"]]
