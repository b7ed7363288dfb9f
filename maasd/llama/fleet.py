"""The fingerprint a llama-cpp-python process shares with a ``llama-server`` fleet.

:func:`fleet_fingerprint` names everything that decides whether a sequence state
restores correctly (docs/llama-server.md); ``maasd router`` computes it for its
backends, and :func:`model_fleet_fingerprint` for a ``llama_cpp.Llama``, so a Python
worker that passes it to ``KVStore(fingerprint=…)`` shares entries with the fleet both
ways (a llama-server restores what it saved, and it restores what they saved) whenever
model file, build and cache settings agree. Pure, except for hashing the model file
(once per file: :func:`~maasd.llama.format.file_identity` keeps the digest).
"""

from __future__ import annotations

from typing import Any

from maasd.llama.format import FORMAT_VERSION, file_identity, fingerprint_of

__all__ = ["FILE_VERSION", "fleet_fingerprint", "ggml_type_name", "model_fleet_fingerprint"]

FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the pinned llama.cpp (the ggsq slot file)

_GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0"}
_GGML_TYPES.update({20: "iq4_nl", 30: "bf16"})


def ggml_type_name(t: int | str) -> str:
    """A K/V cache type as ``llama-server --cache-type-k`` names it (``1`` → ``"f16"``)."""
    if isinstance(t, str):
        return t.lower()
    return _GGML_TYPES.get(int(t), f"type{int(t)}")


def fleet_fingerprint(
    model_path: str,
    build: str,
    *,
    type_k: int | str = "f16",
    type_v: int | str = "f16",
    flash_attn: bool = False,
    swa_full: bool = True,
    n_stream: int = 1,
    model_args: tuple[str, ...] = (),
) -> str:
    """The fingerprint of everything that decides whether a sequence state restores right.

    The model file (size and SHA-256, :func:`~maasd.llama.format.file_identity`), the
    llama.cpp build (``build``: ``llama-cpp-python-0.3.36`` for the pinned one, whether
    it runs as llama-cpp-python or as the ``llama-server`` of ``scripts/llama-server``),
    the K and V cache types, flash attention (it decides whether V is stored
    transposed), the number of KV streams (1: ``--kv-unified`` or a single sequence),
    the sliding-window cache mode, and both state formats. Any difference gives
    another fingerprint, so nothing restores wrong. ``model_args``: what else changes
    the values a state holds (LoRA adapters, RoPE scaling, …), named only when there is
    any, so a plain fleet keeps the fingerprint of a plain Python worker.
    """
    parts = {
        "kind": "llama-seq-state",
        "entry_format": FORMAT_VERSION,
        "file_format": FILE_VERSION,
        "build": build,
        "model": file_identity(model_path),
        "type_k": ggml_type_name(type_k),
        "type_v": ggml_type_name(type_v),
        "flash_attn": bool(flash_attn),
        "swa_full": bool(swa_full),
        "n_stream": int(n_stream),
    }
    if model_args:
        parts["model_args"] = list(model_args)
    return fingerprint_of(parts)


def model_fleet_fingerprint(model: Any) -> str:
    """:func:`fleet_fingerprint` of a ``llama_cpp.Llama`` (its file, build and context
    parameters): equal to a router's when the fleet runs the same model and settings."""
    import llama_cpp

    p = model.context_params
    unified = bool(getattr(p, "kv_unified", False))
    n_seq = int(getattr(p, "n_seq_max", 1) or 1)
    return fleet_fingerprint(
        model.model_path,
        f"llama-cpp-python-{llama_cpp.__version__}",
        type_k=int(p.type_k),
        type_v=int(p.type_v),
        flash_attn=int(p.flash_attn_type) == int(llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
        swa_full=bool(p.swa_full),
        n_stream=1 if unified else n_seq,
    )
