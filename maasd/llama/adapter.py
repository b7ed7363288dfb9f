"""Every access maasd makes to llama-cpp-python's internals, in one place.

``Llama`` exposes neither its ``llama_context *`` nor its ``llama_model *`` publicly,
and llama.cpp renamed the sequence-memory calls (``llama_kv_self_seq_*`` →
``llama_memory_seq_*``, llama-cpp-python 0.3.10). :class:`LlamaSeqAdapter` wraps one
``llama_cpp.Llama`` and is the only code in maasd that reads ``model._ctx.ctx``,
``model._model.model``, ``input_ids``/``n_tokens`` or calls the ``llama_state_seq_*``
bindings, so a new llama-cpp-python release is adapted here and nowhere else.
maasd pins llama-cpp-python (``scripts/llama-version``) for that reason.

Example::

    seq = LlamaSeqAdapter(llm)
    n = seq.state_size(0)
    written = seq.state_get(0, buf, offset=4096, size=n)   # into a numpy uint8 array
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from maasd.llama.format import FORMAT_VERSION, file_identity, fingerprint_of

__all__ = ["LlamaContextAdapter", "LlamaSeqAdapter", "model_fingerprint", "value_settings"]


class LlamaSeqAdapter:
    """The sequence-level llama.cpp calls maasd needs, for one ``llama_cpp.Llama``.

    Not thread-safe (neither is the llama.cpp context).
    """

    def __init__(self, model: Any) -> None:
        import llama_cpp

        self._ll = llama_cpp
        self.model = model
        # Sequence memory calls: llama_memory_seq_* on a llama_memory_t since 0.3.10,
        # llama_kv_self_seq_* on the context before.
        self._memory_api = hasattr(llama_cpp, "llama_memory_seq_rm")

    @property
    def _ctx(self) -> Any:
        return self.model._ctx.ctx

    @property
    def _model(self) -> Any:
        return self.model._model.model

    # -- sequences

    def n_seq_max(self) -> int:
        return int(self._ll.llama_n_seq_max(self._ctx))

    def check_seq(self, seq_id: int) -> None:
        """Raise ``ValueError`` for a ``seq_id`` llama.cpp would GGML_ASSERT (abort) on."""
        n_seq = self.n_seq_max()
        if not 0 <= seq_id < n_seq:
            raise ValueError(f"seq_id {seq_id} outside 0..{n_seq - 1} (n_seq_max)")

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Drop positions ``[p0, p1)`` of ``seq_id`` (-1: open end) → whether llama.cpp could."""
        ll = self._ll
        if self._memory_api:
            return bool(ll.llama_memory_seq_rm(ll.llama_get_memory(self._ctx), seq_id, p0, p1))
        return bool(ll.llama_kv_self_seq_rm(self._ctx, seq_id, p0, p1))

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """(first, last) position ``seq_id`` holds; (-1, -1) when empty.

        The first is > 0 when a sliding-window cache has dropped the start.
        """
        ll = self._ll
        if self._memory_api:
            mem = ll.llama_get_memory(self._ctx)
            return int(ll.llama_memory_seq_pos_min(mem, seq_id)), int(
                ll.llama_memory_seq_pos_max(mem, seq_id)
            )
        return int(ll.llama_kv_self_seq_pos_min(self._ctx, seq_id)), int(
            ll.llama_kv_self_seq_pos_max(self._ctx, seq_id)
        )

    def n_ctx(self) -> int:
        """The context's size in tokens: the ``n_ctx`` the ``Llama`` was made with (the size
        of its ``input_ids``), which llama.cpp may pad (to 256 tokens): a state of more
        tokens than the ``Llama`` holds can load into llama.cpp's cache all the same."""
        n = int(self._ll.llama_n_ctx(self._ctx))
        ids = getattr(self.model, "input_ids", None)
        return n if ids is None else min(n, len(ids))

    def n_swa(self) -> int:
        """The model's sliding-window size (0: no sliding window)."""
        if not hasattr(self._ll, "llama_model_n_swa"):
            return 0
        return int(self._ll.llama_model_n_swa(self._model))

    # -- state, straight from and into caller memory

    def state_size(self, seq_id: int) -> int:
        return int(self._ll.llama_state_seq_get_size(self._ctx, seq_id))

    def state_get(self, seq_id: int, dst: npt.NDArray[np.uint8], offset: int, size: int) -> int:
        """llama.cpp writes ``seq_id``'s state into ``dst[offset:offset + size]`` → bytes written."""
        ptr = self._ptr(dst, offset, size)
        return int(self._ll.llama_state_seq_get_data(self._ctx, ptr, size, seq_id))

    def state_set(self, seq_id: int, src: npt.NDArray[np.uint8], offset: int, size: int) -> int:
        """llama.cpp reads a state from ``src[offset:offset + size]`` → bytes read (0: refused)."""
        ptr = self._ptr(src, offset, size)
        return int(self._ll.llama_state_seq_set_data(self._ctx, ptr, size, seq_id))

    @staticmethod
    def _ptr(arr: npt.NDArray[np.uint8], offset: int, size: int) -> Any:
        # llama.cpp trusts the size it is given: a range past the array would be a segfault.
        if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError("state memory must be a contiguous 1-d uint8 array")
        if offset < 0 or size < 0 or offset + size > arr.size:
            raise ValueError(f"[{offset}, {offset + size}) outside an array of {arr.size} B")
        return ctypes.cast(arr.ctypes.data + offset, ctypes.POINTER(ctypes.c_uint8))

    # -- the Llama object's own bookkeeping

    def set_tokens(self, seq_id: int, tokens: npt.NDArray[np.int32], n: int) -> None:
        """Tell the ``Llama`` object that sequence 0 holds ``tokens[:n]``.

        ``Llama.eval()``/``generate()`` track sequence 0 in ``n_tokens``/``input_ids``;
        other sequences have no such bookkeeping.
        """
        if seq_id == 0 and hasattr(self.model, "input_ids"):
            self.model.n_tokens = n
            self.model.input_ids[:n] = tokens[:n]

    def clear(self, seq_id: int) -> None:
        """Empty ``seq_id`` (cache and bookkeeping)."""
        self.seq_rm(seq_id, -1, -1)
        self.set_tokens(seq_id, np.empty(0, np.int32), 0)

    def last_logits(self) -> npt.NDArray[np.float32]:
        """A copy of the logits of the last evaluated token."""
        ptr = self._ll.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab(),)).copy()

    # -- identity

    def fingerprint_parts(self) -> dict[str, Any]:
        """What makes KV states of this model incompatible (see :func:`model_fingerprint`)."""
        ll, mp, model = self._ll, self._model, self.model
        vocab = ll.llama_model_get_vocab(mp)
        cparams = getattr(model, "context_params", None)
        path = getattr(model, "model_path", None)
        return {
            "format": FORMAT_VERSION,
            "llama_cpp": getattr(ll, "__version__", "?"),
            "arch": model.metadata.get("general.architecture"),
            "n_layer": ll.llama_model_n_layer(mp),
            "n_embd": ll.llama_model_n_embd(mp),
            "n_head": ll.llama_model_n_head(mp),
            "n_head_kv": ll.llama_model_n_head_kv(mp),
            "n_vocab": ll.llama_vocab_n_tokens(vocab),
            "n_params": ll.llama_model_n_params(mp),
            "type_k": getattr(cparams, "type_k", None),
            "type_v": getattr(cparams, "type_v", None),
            "metadata": dict(model.metadata),
            "file": file_identity(path) if path and os.path.exists(path) else None,
            **value_settings(model),
        }


#: ``Llama`` settings that change the values a KV state holds (K is stored rotated by RoPE;
#: a LoRA adapter changes K and V), with llama-cpp-python's defaults for them
VALUE_DEFAULTS: dict[str, Any] = {
    "rope_scaling_type": -1,
    "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0,
    "yarn_attn_factor": 1.0,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_orig_ctx": 0,
    "lora_base": None,
    "lora_path": None,
    "lora_scale": 1.0,
}


def value_settings(model: Any) -> dict[str, Any]:
    """The settings of :data:`VALUE_DEFAULTS` that ``model`` does not have at their default
    (context parameters, else ``Llama`` attributes) → ``{"values": {...}}``, or ``{}`` when
    all are: so two workers that differ in them never restore each other's states (the
    answers would be wrong, silently), and a plain model keeps its fingerprint."""
    cparams = getattr(model, "context_params", None)
    changed: dict[str, Any] = {}
    for name, default in VALUE_DEFAULTS.items():
        value: Any = getattr(cparams, name, None) if name.startswith(("rope", "yarn")) else None
        if value is None:
            value = getattr(model, name, default)
        if isinstance(default, float) and value is not None:
            value = float(value)
        if value != default:
            if name == "lora_path" and value and os.path.exists(value):
                value = file_identity(value)  # the adapter's content, not only its name
            changed[name] = value
    return {"values": changed} if changed else {}


class LlamaContextAdapter(LlamaSeqAdapter):
    """The whole llama.cpp context (``llama_state_*``) and ``Llama``'s bookkeeping of it.

    What :class:`~maasd.llama.cache.MaasdCache` needs: the context state that
    ``Llama.save_state``/``load_state`` move, read and written straight from and into
    caller memory; the tokens ``Llama`` believes the context holds (``input_ids``,
    ``n_tokens``) and its ``_requires_eval`` flag; the ``save_state`` of one instance;
    and whether a frame is ``Llama._create_completion``'s.
    """

    # -- the context state

    def context_state_size(self) -> int:
        return int(self._ll.llama_state_get_size(self._ctx))

    def context_state_get(self, dst: npt.NDArray[np.uint8], offset: int, size: int) -> int:
        """llama.cpp writes the context state into ``dst[offset:offset + size]`` → bytes written."""
        return int(self._ll.llama_state_get_data(self._ctx, self._ptr(dst, offset, size), size))

    def context_state_set(self, src: npt.NDArray[np.uint8], offset: int, size: int) -> int:
        """llama.cpp reads a context state from ``src[offset:offset + size]`` → bytes read."""
        return int(self._ll.llama_state_set_data(self._ctx, self._ptr(src, offset, size), size))

    # -- what Llama believes the context holds

    @property
    def logits_all(self) -> bool:
        return bool(getattr(self.model, "_logits_all", False))

    def held_tokens(self) -> npt.NDArray[np.intc]:
        """The tokens the context holds, as ``Llama`` tracks them (a view)."""
        n: int = self.model.n_tokens
        held: npt.NDArray[np.intc] = self.model.input_ids[:n]
        return held

    def mark_held(self, tokens: npt.NDArray[np.int32], n: int) -> None:
        """Tell ``Llama`` the context holds ``tokens[:n]`` and its logits are stale (so the
        next ``generate`` evaluates at least one token before it samples)."""
        self.model.input_ids[:n] = tokens[:n]
        self.model.n_tokens = n
        self.model._requires_eval = True

    def forget_all(self) -> None:
        """Empty the context (every sequence) and ``Llama``'s record of it."""
        mem = self._ll.llama_get_memory(self._ctx) if self._memory_api else None
        if mem is not None:
            self._ll.llama_memory_clear(mem, True)
        else:
            self.seq_rm(0, -1, -1)
        self.model.n_tokens = 0
        self.model._requires_eval = True

    def padded_ids(self, tokens: npt.NDArray[np.int32], n: int) -> npt.NDArray[np.intc]:
        """``tokens[:n]`` in an ``input_ids``-shaped array, the rest -1 (no token matches it)."""
        out = np.full(self.model.input_ids.shape, -1, dtype=np.intc)
        out[:n] = tokens[:n]
        return out

    @property
    def seed(self) -> int:
        return int(getattr(self.model, "_seed", 0))

    # -- hooks into one Llama instance

    def instance_save_state(self) -> Any:
        """The ``save_state`` the class defines, bound to this model (whatever shadows it)."""
        return type(self.model).save_state.__get__(self.model)

    def hook_save_state(self, hook: Any) -> None:
        """Make ``model.save_state()`` call ``hook`` (an attribute of the instance only)."""
        self.model.save_state = hook

    def unhook_save_state(self) -> None:
        self.model.__dict__.pop("save_state", None)

    def called_by_completion(self, depth: int = 2) -> bool:
        """Whether the caller ``depth`` frames up is ``Llama._create_completion`` (the one
        place that saves a state into the cache right away: ``cache[...] = save_state()``)."""
        import sys

        code = self._ll.Llama._create_completion.__code__
        try:
            return sys._getframe(depth).f_code is code
        except ValueError:
            return False

    def cache_is(self, cache: Any) -> bool:
        return getattr(self.model, "cache", None) is cache


def model_fingerprint(model: Any) -> str:
    """Fingerprint of what makes KV states of ``model`` (a ``llama_cpp.Llama``) incompatible.

    Architecture and shape (layers, embedding, heads, KV heads, vocab), the KV cache
    types, the GGUF metadata, the model file's identity, the llama.cpp build and the
    settings that change the values a state holds (RoPE/YaRN, a LoRA adapter:
    :func:`value_settings`) — but not ``n_ctx``: states move between contexts of
    different sizes.
    """
    return fingerprint_of(LlamaSeqAdapter(model).fingerprint_parts())
