"""Synthetic llama.cpp sequence states, byte for byte in the layout
``llama_kv_cache::state_write`` writes (see ``maasd.llama.views``), for tests of the
views and the router's checks without a model. The real ones come from Gemma
(``tests/integration/test_gemma_state_views.py``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

IO_MAGIC = 0xAF143CD8
F16 = 1


@dataclass
class Cache:
    n_cells: int = 4
    n_layer: int = 2
    n_embd_k: int = 8
    n_embd_v: int = 8
    v_trans: bool = True
    ggml_type: int = F16  # f16: 2 bytes an element
    has_v: bool = True
    cell_ext: bool = False
    n_stream: int = 1
    positions: list[int] = field(default_factory=list)


def memory(*caches: Cache, seed: int = 0) -> bytes:
    """The memory state of ``caches`` (one after the other, as iSWA writes them), with
    random K/V bytes."""
    rng = np.random.default_rng(seed)
    out = bytearray()
    for c in caches:
        out += struct.pack("<I", c.n_stream)
        for s in range(c.n_stream):
            n = c.n_cells if s == 0 else 0  # a sequence lives in one stream
            out += struct.pack("<I", n)
            if n == 0:
                continue
            pos = c.positions or list(range(n))
            for p in pos:
                out += struct.pack("<iI", p, 1)
                if c.cell_ext:
                    out += struct.pack("<iii", 0, 0, -1)
                out += struct.pack("<i", 0)
            out += struct.pack("<II", int(c.v_trans), c.n_layer)
            el = 2 if c.ggml_type == F16 else 4
            for _ in range(c.n_layer):
                out += struct.pack("<iQ", c.ggml_type, c.n_embd_k * el)
                out += rng.integers(0, 256, n * c.n_embd_k * el, dtype=np.uint8).tobytes()
            if not c.has_v:
                continue
            for _ in range(c.n_layer):
                if c.v_trans:
                    out += struct.pack("<iII", c.ggml_type, el, c.n_embd_v)
                else:
                    out += struct.pack("<iQ", c.ggml_type, c.n_embd_v * el)
                out += rng.integers(0, 256, n * c.n_embd_v * el, dtype=np.uint8).tobytes()
    return bytes(out)


def get_data(*caches: Cache, seq_id: int = 0, seed: int = 0) -> bytes:
    """What ``llama_state_seq_get_data`` returns for ``caches``."""
    return struct.pack("<Ii", IO_MAGIC, seq_id) + memory(*caches, seed=seed)
