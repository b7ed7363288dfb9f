"""Prefix KV-cache sharing for llama.cpp workers through maasd buffers.

``KVStore`` saves the KV state of one llama.cpp sequence into a keyed, evictable
maasd buffer and restores the longest saved prefix of a prompt from it, so a
worker that sees a prompt another worker of the same tenant (and model) already
evaluated skips recomputing it::

    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    with Worker(socket_path, api_key) as w:
        kv = KVStore(Client(url, api_key), w, llm)      # llm: llama_cpp.Llama
        n = kv.restore(0, prompt, max_tokens=len(prompt) - 1)  # 0 on a miss
        llm.eval(prompt[n:])                            # only the rest
        kv.save(0, prompt)                              # share it (409 → existing)

Both paths are zero-copy: llama.cpp writes the state straight into the worker's
mapping of the buffer (``llama_state_seq_get_data`` on a pointer into the mmap)
and reads it straight from there (``llama_state_seq_set_data``).

Buffer layout (little-endian)::

    offset 0   fixed header (HEADER_FIXED bytes, see ``_FIXED``)
                 magic "MAASDKV\\0", format version, header_len, model fingerprint
                 (16 raw bytes), n_tokens, chunk, state_len, state checksum (XXH3-64, low
                 32 bits), header crc32
    offset 64  n_tokens × int32: the tokens whose state follows
    header_len llama.cpp sequence state (state_len bytes), header_len 64-aligned

The magic is written last, so a reader never accepts a half-written entry, and a
buffer scrubbed by the daemon (zeros) never parses.

Keys are ``"<fingerprint>:<chained hash>"``: the hash chains blake2b over the
prompt's chunks of ``chunk`` tokens, so the key of a prefix is a function of
that prefix only. A save is keyed at the longest chunk boundary of its tokens
(or at its whole length if shorter than one chunk) and stores *all* its tokens
in the header; a restore looks up every chunk boundary of its prompt (plus its
whole length) in one call, takes the longest live one, and keeps the longest
common prefix of the stored tokens and its prompt — trimming the rest with
``llama_memory_seq_rm``. So a prompt that extends a saved one restores all the
saved tokens, and an identical prompt restores everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK",
    "FORMAT_VERSION",
    "MAGIC",
    "Header",
    "HeaderError",
    "KVStore",
    "chunk_keys",
    "fingerprint_of",
    "header_len_for",
    "model_fingerprint",
    "pack_header",
    "parse_header",
    "save_prefix_len",
]

MAGIC = b"MAASDKV\x00"
FORMAT_VERSION = 2  # 2: state checksum is XXH3-64's low 32 bits (1: crc32)
DEFAULT_CHUNK = 64
ALIGN = 64
EDGE_BYTES = 1 << 20  # the file identity hashes the first and the last MiB

# magic, version, header_len, fingerprint(16), n_tokens, chunk, state_len, state_crc, header_crc
_FIXED = struct.Struct("<8sII16sIIQII")
HEADER_FIXED = ALIGN  # tokens start here
assert _FIXED.size <= HEADER_FIXED
_CRC_OFFSET = _FIXED.size - 4


class HeaderError(ValueError):
    """An entry whose header does not describe a usable state (why is in the message)."""


# --------------------------------------------------------------------------- pure parts


def _as_tokens(tokens: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int32]:
    arr = np.ascontiguousarray(np.asarray(tokens), dtype="<i4")
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of token ids")
    return arr


def save_prefix_len(n_tokens: int, chunk: int = DEFAULT_CHUNK) -> int:
    """The prefix length a save of ``n_tokens`` tokens is keyed at.

    The longest chunk boundary, so that longer prompts find it; a save shorter
    than one chunk is keyed at its whole length (found by identical prompts only).
    """
    if chunk <= 0:
        raise ValueError("chunk must be > 0")
    return n_tokens if n_tokens < chunk else n_tokens - n_tokens % chunk


def chunk_keys(
    fingerprint: str, tokens: Sequence[int] | npt.NDArray[Any], chunk: int = DEFAULT_CHUNK
) -> list[tuple[int, str]]:
    """``[(prefix_len, key), …]`` for every chunk boundary of ``tokens`` and its full length.

    Ordered short → long (the order ``Client.lookup`` wants). The hash is chained:
    ``h0 = H(version, chunk, fingerprint)``, ``h_i = H(h_{i-1} || chunk_i)`` with the
    tokens as little-endian int32, so equal prefixes give equal keys, whoever computes them.

    >>> [n for n, _ in chunk_keys("ab" * 16, range(130), 64)]
    [64, 128, 130]
    """
    if chunk <= 0:
        raise ValueError("chunk must be > 0")
    arr = _as_tokens(tokens)
    h = hashlib.blake2b(
        b"maasd-kv:%d:%d:%s" % (FORMAT_VERSION, chunk, fingerprint.encode()), digest_size=16
    ).digest()
    out: list[tuple[int, str]] = []
    n = len(arr)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h = hashlib.blake2b(h + arr[start:end].tobytes(), digest_size=16).digest()
        out.append((end, f"{fingerprint}:{h.hex()}"))
    return out


def header_len_for(n_tokens: int) -> int:
    """Bytes before the state: the fixed part plus the tokens, 64-byte aligned."""
    raw = HEADER_FIXED + 4 * n_tokens
    return (raw + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Header:
    """A parsed entry header."""

    version: int
    header_len: int
    fingerprint: str
    n_tokens: int
    chunk: int
    state_len: int
    state_crc: int
    tokens: npt.NDArray[np.int32]


def _header_crc(fixed_wo_magic_crc: bytes | memoryview, tokens: Any) -> int:
    return zlib.crc32(memoryview(tokens).cast("B"), zlib.crc32(fixed_wo_magic_crc)) & 0xFFFFFFFF


def pack_header(
    fingerprint: str,
    tokens: Sequence[int] | npt.NDArray[Any],
    state_len: int,
    state_crc: int,
    chunk: int = DEFAULT_CHUNK,
) -> bytes:
    """The header bytes (``header_len_for(len(tokens))`` long) for an entry.

    Small (64 B + 4 B per token); the state itself is never copied.
    """
    arr = _as_tokens(tokens)
    hlen = header_len_for(len(arr))
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        hlen,
        bytes.fromhex(fingerprint),
        len(arr),
        chunk,
        state_len,
        state_crc & 0xFFFFFFFF,
        0,
    )
    crc = _header_crc(fixed[len(MAGIC) : _CRC_OFFSET], arr)
    out = bytearray(hlen)
    out[: _FIXED.size] = fixed[:_CRC_OFFSET] + struct.pack("<I", crc)
    out[HEADER_FIXED : HEADER_FIXED + 4 * len(arr)] = arr.tobytes()
    return bytes(out)


def _write_header(dst: npt.NDArray[np.uint8], header: bytes) -> None:
    """Copy ``header`` into ``dst`` with the magic last: a reader sees it whole or not at all."""
    m = len(MAGIC)
    dst[m : len(header)] = np.frombuffer(header, dtype=np.uint8, offset=m)
    dst[:m] = np.frombuffer(header, dtype=np.uint8, count=m)


def parse_header(
    buf: npt.NDArray[np.uint8] | bytes | memoryview, size: int | None = None
) -> Header:
    """Parse and check an entry header; raise :class:`HeaderError` if it is not a usable one.

    Checks magic, version, header checksum and that the state lies within ``size``
    (default: the length of ``buf``). It does not check the state checksum or the
    fingerprint: see :func:`verify_state` and the caller.
    """
    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf).cast("B")
    size = len(view) if size is None else min(size, len(view))
    if size < HEADER_FIXED:
        raise HeaderError(f"entry too small for a header ({size} bytes)")
    magic, version, hlen, fp, n_tokens, chunk, state_len, state_crc, hcrc = _FIXED.unpack_from(
        view, 0
    )
    if magic != MAGIC:
        raise HeaderError("bad magic (not a maasd KV entry, unfinished, or scrubbed)")
    if version != FORMAT_VERSION:
        raise HeaderError(f"format version {version}, expected {FORMAT_VERSION}")
    if hlen != header_len_for(n_tokens) or hlen > size:
        raise HeaderError(f"header length {hlen} inconsistent with {n_tokens} tokens / {size} B")
    if state_len == 0 or hlen + state_len > size:
        raise HeaderError(f"state of {state_len} B does not fit in the {size} B entry")
    if chunk == 0:
        raise HeaderError("chunk size 0")
    toks = np.frombuffer(view, dtype="<i4", count=n_tokens, offset=HEADER_FIXED)
    if _header_crc(view[len(MAGIC) : _CRC_OFFSET], toks) != hcrc:
        raise HeaderError("header checksum mismatch")
    return Header(
        version=version,
        header_len=hlen,
        fingerprint=fp.hex(),
        n_tokens=n_tokens,
        chunk=chunk,
        state_len=state_len,
        state_crc=state_crc,
        tokens=toks.copy(),
    )


def state_checksum(data: bytes | memoryview) -> int:
    """The checksum a header keeps of the state: the low 32 bits of XXH3-64.

    XXH3 runs at ~60 GB/s here against crc32's ~4 GB/s — 0.16 vs 2.4 ms for a
    9 MiB Gemma state, on every restore.
    """
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


def state_crc(buf: npt.NDArray[np.uint8], header: Header) -> int:
    """:func:`state_checksum` of the entry's state bytes, computed in place (no copy)."""
    return state_checksum(buf[header.header_len : header.header_len + header.state_len].data)


def _lease_left(buf: Any) -> float:
    """Seconds left on a buffer's lease, from its RFC 3339 ``expires_at`` (0 if unknown)."""
    try:
        return datetime.fromisoformat(buf.expires_at).timestamp() - time.time()
    except (AttributeError, TypeError, ValueError):
        return 0.0


def fingerprint_of(parts: dict[str, Any]) -> str:
    """128-bit hex digest of a JSON-able description of a model (see ``model_fingerprint``)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def file_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Size and a hash of the first and last MiB of a model file (cheap even for GBs)."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if st.st_size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    return {"size": st.st_size, "edges": h.hexdigest()}


def model_fingerprint(model: Any) -> str:
    """Fingerprint of what makes KV states of ``model`` (a ``llama_cpp.Llama``) incompatible.

    Architecture and shape (layers, embedding, heads, KV heads, vocab), the KV cache
    types, the GGUF metadata, the model file's identity and the llama.cpp build —
    but not ``n_ctx``: states move between contexts of different sizes.
    """
    import llama_cpp

    mp = model._model.model
    vocab = llama_cpp.llama_model_get_vocab(mp)
    cparams = getattr(model, "context_params", None)
    path = getattr(model, "model_path", None)
    parts: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "llama_cpp": getattr(llama_cpp, "__version__", "?"),
        "arch": model.metadata.get("general.architecture"),
        "n_layer": llama_cpp.llama_model_n_layer(mp),
        "n_embd": llama_cpp.llama_model_n_embd(mp),
        "n_head": llama_cpp.llama_model_n_head(mp),
        "n_head_kv": llama_cpp.llama_model_n_head_kv(mp),
        "n_vocab": llama_cpp.llama_vocab_n_tokens(vocab),
        "n_params": llama_cpp.llama_model_n_params(mp),
        "type_k": getattr(cparams, "type_k", None),
        "type_v": getattr(cparams, "type_v", None),
        "metadata": dict(model.metadata),
        "file": file_identity(path) if path and os.path.exists(path) else None,
    }
    return fingerprint_of(parts)


# --------------------------------------------------------------------------- interfaces


class _BufferLike(Protocol):
    id: str
    size_bytes: int
    key: str | None


class _MappingLike(Protocol):
    array: npt.NDArray[np.uint8]
    size: int

    def close(self) -> None: ...


class _ClientLike(Protocol):
    def reserve(self, *, size_bytes: int, key: str | None, evictable: bool, ttl_s: int) -> Any: ...

    def lookup(self, keys: list[str]) -> Any: ...

    def release(self, buffer_id: str) -> Any: ...


class _WorkerLike(Protocol):
    def attach(self, buffer_id: str) -> Any: ...

    def detach(self, buffer_id: str) -> Any: ...

    def renew(self, buffer_id: str, ttl_s: int | None = ...) -> Any: ...


def _client_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(duplicate-key classes, every error a lookup/attach may raise).

    The client has its own exception tree (``maasd.client.errors``); the server's
    (``maasd.errors``) is accepted too, so in-process fakes can raise either.
    """
    from maasd import errors as se

    dup: tuple[type[BaseException], ...] = (se.DuplicateKey,)
    errs: tuple[type[BaseException], ...] = (se.MaasdError, OSError)
    try:
        from maasd.client import errors as ce
    except ImportError:  # pragma: no cover - the client is part of the package
        return dup, errs
    return dup + (ce.DuplicateKey,), errs + (ce.MaasdClientError,)


# --------------------------------------------------------------------------- the store


class KVStore:
    """Save and restore llama.cpp sequence states in maasd buffers (see the module doc).

    ``model`` is a ``llama_cpp.Llama``; ``client`` a ``maasd.client.Client`` and
    ``worker`` an open ``maasd.client.Worker`` of the same tenant. ``chunk`` is the
    key granularity in tokens (all workers sharing entries must use the same);
    ``ttl_s`` the lease of saved entries, renewed on every hit when
    ``renew_on_hit``; ``fingerprint`` overrides :func:`model_fingerprint` (tests).
    Not thread-safe (neither is a llama.cpp context).
    """

    def __init__(
        self,
        client: _ClientLike,
        worker: _WorkerLike,
        model: Any,
        *,
        chunk: int = DEFAULT_CHUNK,
        ttl_s: int = 600,
        renew_on_hit: bool = True,
        fingerprint: str | None = None,
    ) -> None:
        import llama_cpp

        if chunk <= 0:
            raise ValueError("chunk must be > 0")
        self._ll = llama_cpp
        self.client = client
        self.worker = worker
        self.model = model
        self.chunk = chunk
        self.ttl_s = ttl_s
        self.renew_on_hit = renew_on_hit
        self.fingerprint = fingerprint or model_fingerprint(model)
        if len(bytes.fromhex(self.fingerprint)) != 16:
            raise ValueError("fingerprint must be 32 hex digits")

    # -- llama.cpp plumbing

    @property
    def _ctx(self) -> Any:
        return self.model._ctx.ctx

    def _check_seq(self, seq_id: int) -> None:
        # llama.cpp GGML_ASSERTs (aborts the process) on an out-of-range seq_id.
        n_seq = self._ll.llama_n_seq_max(self._ctx)
        if not 0 <= seq_id < n_seq:
            raise ValueError(f"seq_id {seq_id} outside 0..{n_seq - 1} (n_seq_max)")

    def _seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        ll = self._ll
        if hasattr(ll, "llama_memory_seq_rm"):
            return bool(ll.llama_memory_seq_rm(ll.llama_get_memory(self._ctx), seq_id, p0, p1))
        return bool(ll.llama_kv_self_seq_rm(self._ctx, seq_id, p0, p1))  # llama-cpp-python < 0.3.10

    def _seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        ll = self._ll
        if hasattr(ll, "llama_memory_seq_pos_max"):
            mem = ll.llama_get_memory(self._ctx)
            return ll.llama_memory_seq_pos_min(mem, seq_id), ll.llama_memory_seq_pos_max(
                mem, seq_id
            )
        return ll.llama_kv_self_seq_pos_min(self._ctx, seq_id), ll.llama_kv_self_seq_pos_max(
            self._ctx, seq_id
        )

    def _set_model_tokens(self, seq_id: int, tokens: npt.NDArray[np.int32], n: int) -> None:
        # Llama.eval()/generate() track sequence 0 in n_tokens/input_ids.
        if seq_id == 0 and hasattr(self.model, "input_ids"):
            self.model.n_tokens = n
            self.model.input_ids[:n] = tokens[:n]

    def _clear(self, seq_id: int) -> None:
        self._seq_rm(seq_id, -1, -1)
        self._set_model_tokens(seq_id, np.empty(0, np.int32), 0)

    @staticmethod
    def _ptr(arr: npt.NDArray[np.uint8], offset: int) -> Any:
        return ctypes.cast(arr.ctypes.data + offset, ctypes.POINTER(ctypes.c_uint8))

    @staticmethod
    def _close(mapping: Any) -> None:
        # maasd.client's Mapping.close() unmaps and tells the daemon (detach).
        # Callers drop their numpy views first, so the unmap is not deferred.
        with contextlib.suppress(Exception):
            mapping.close()

    # -- public API

    def key(self, tokens: Sequence[int] | npt.NDArray[Any]) -> str:
        """The key a ``save`` of ``tokens`` is stored under."""
        arr = _as_tokens(tokens)
        if len(arr) == 0:
            raise ValueError("no tokens")
        want = save_prefix_len(len(arr), self.chunk)
        return next(k for n, k in chunk_keys(self.fingerprint, arr[:want], self.chunk) if n == want)

    def save(self, seq_id: int, tokens: Sequence[int] | npt.NDArray[Any]) -> Any:
        """Save sequence ``seq_id`` (which must hold exactly ``tokens``) → the Buffer.

        The buffer is keyed, evictable and leased for ``ttl_s``. If another worker
        saved the same prefix first (409 duplicate key), its buffer is returned.
        """
        ll = self._ll
        arr = _as_tokens(tokens)
        n = len(arr)
        if n == 0:
            raise ValueError("no tokens to save")
        self._check_seq(seq_id)
        _pmin, pmax = self._seq_pos_range(seq_id)  # pmin > 0 with a sliding-window cache
        if pmax != n - 1:
            raise ValueError(
                f"sequence {seq_id} holds positions up to {pmax}, but {n} tokens were given"
            )
        state_len = int(ll.llama_state_seq_get_size(self._ctx, seq_id))
        if state_len == 0:
            raise RuntimeError(f"llama.cpp reports an empty state for sequence {seq_id}")
        hlen = header_len_for(n)
        key = self.key(arr)
        duplicate, _errs = _client_errors()

        buf: Any = None
        for _ in range(3):
            try:
                buf = self.client.reserve(
                    size_bytes=hlen + state_len, key=key, evictable=True, ttl_s=self.ttl_s
                )
                break
            except duplicate:
                existing = self.client.lookup([key])
                if existing is not None:
                    return existing
                # released between the 409 and the lookup: try again
        if buf is None:
            raise RuntimeError(f"could not reserve or find key {key}")

        mapping = None
        ok = False
        try:
            mapping = self.worker.attach(buf.id)
            self._write_entry(mapping, seq_id, arr, hlen, state_len)
            ok = True
            return buf
        finally:
            if mapping is not None:
                self._close(mapping)
            if not ok:  # never leave a keyed entry that can't be used
                with contextlib.suppress(Exception):
                    self.client.release(buf.id)

    def _write_entry(
        self, mapping: Any, seq_id: int, arr: npt.NDArray[np.int32], hlen: int, state_len: int
    ) -> None:
        view: npt.NDArray[np.uint8] = mapping.array
        if mapping.size < hlen + state_len:
            raise RuntimeError(f"buffer of {mapping.size} B, need {hlen + state_len}")
        # llama.cpp writes the state straight into the shared mapping.
        written = int(
            self._ll.llama_state_seq_get_data(self._ctx, self._ptr(view, hlen), state_len, seq_id)
        )
        if written == 0 or written > state_len:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {state_len} bytes")
        crc = state_checksum(view[hlen : hlen + written].data)
        _write_header(view, pack_header(self.fingerprint, arr, written, crc, self.chunk))

    def restore(
        self,
        seq_id: int,
        tokens: Sequence[int] | npt.NDArray[Any],
        *,
        max_tokens: int | None = None,
    ) -> int:
        """Restore the longest saved prefix of ``tokens`` into ``seq_id`` → its length (0: miss).

        The sequence is cleared first and stays cleared on any miss or refusal
        (unknown key, other model, bad header, bad checksum, llama.cpp refusal).
        ``max_tokens`` caps the result — pass ``len(tokens) - 1`` when the caller
        needs the logits of the prompt's last token (a state carries no logits).
        For ``seq_id`` 0 the ``Llama`` object's ``n_tokens``/``input_ids`` are set,
        so ``model.eval(tokens[n:])`` and ``model.generate`` continue from there.
        """
        arr = _as_tokens(tokens)
        self._check_seq(seq_id)
        self._clear(seq_id)
        cap = len(arr) if max_tokens is None else max(0, min(max_tokens, len(arr)))
        if cap == 0:
            return 0
        keys = chunk_keys(self.fingerprint, arr, self.chunk)
        by_key = {k: n for n, k in keys}
        _dup, errors = _client_errors()
        try:
            buf = self.client.lookup([k for _, k in keys])
        except errors as exc:
            logger.warning("kv lookup failed: %s", exc)
            return 0
        if buf is None or getattr(buf, "key", None) not in by_key:
            return 0
        matched = by_key[buf.key]
        try:
            mapping = self.worker.attach(buf.id)
        except errors as exc:  # evicted or expired since the lookup
            logger.info("kv entry %s gone before attach: %s", buf.id, exc)
            return 0
        try:
            n = self._restore_from(seq_id, arr, mapping, matched, cap)
        except Exception:  # a restore is an optimisation: it must not take the worker down
            logger.exception("kv restore from %s failed", buf.id)
            n = 0
        finally:
            self._close(mapping)
        if n == 0:
            self._clear(seq_id)
            return 0
        self._set_model_tokens(seq_id, arr, n)
        if self.renew_on_hit and _lease_left(buf) < self.ttl_s / 2:
            # A prefix in use keeps its lease (one socket round trip, best effort) —
            # only once half of it is gone, so a hot prefix costs no write per hit.
            with contextlib.suppress(Exception):
                self.worker.renew(buf.id, self.ttl_s)
        return n

    def _restore_from(
        self, seq_id: int, arr: npt.NDArray[np.int32], mapping: Any, matched: int, cap: int
    ) -> int:
        ll = self._ll
        view: npt.NDArray[np.uint8] = mapping.array
        try:
            hdr = parse_header(view, mapping.size)
        except HeaderError as exc:
            logger.warning("kv entry refused: %s", exc)
            return 0
        if hdr.fingerprint != self.fingerprint:
            logger.warning("kv entry refused: saved by another model (%s)", hdr.fingerprint)
            return 0
        if hdr.n_tokens < matched or not np.array_equal(hdr.tokens[:matched], arr[:matched]):
            logger.warning("kv entry refused: its tokens do not match its key")
            return 0
        if state_crc(view, hdr) != hdr.state_crc:
            logger.warning("kv entry refused: state checksum mismatch")
            return 0
        common = int(np.argmin(np.append(hdr.tokens[: len(arr)] == arr[: hdr.n_tokens], False)))
        n = min(common, cap)
        got = int(
            ll.llama_state_seq_set_data(
                self._ctx, self._ptr(view, hdr.header_len), hdr.state_len, seq_id
            )
        )
        if got == 0:
            logger.warning("kv entry refused by llama.cpp (llama_state_seq_set_data returned 0)")
            return 0
        # The daemon may have evicted (scrubbed) the buffer while llama.cpp read it. A
        # scrub runs from the first page to the last (memset, or a hole punched in page
        # order), so if any byte read had been scrubbed, the header — first — no longer
        # parses. Re-checking it costs microseconds; a second state checksum cost 2 ms.
        try:
            again = parse_header(view, mapping.size)
        except HeaderError:
            again = None
        if again is None or again.state_crc != hdr.state_crc:
            logger.warning("kv entry changed while it was read (evicted?)")
            return 0
        pmin, pmax = self._seq_pos_range(seq_id)
        if pmax != hdr.n_tokens - 1:
            logger.warning("kv entry refused: restored positions do not match its header")
            return 0
        # A sliding-window (SWA) cache keeps only the last n_swa positions. The token at
        # position n attends to positions > n - n_swa (llama.cpp's standard SWA mask;
        # a chunked window needs less), so they must all be there.
        mp = self.model._model.model
        n_swa = int(ll.llama_model_n_swa(mp)) if hasattr(ll, "llama_model_n_swa") else 0
        if pmin > (max(0, n - n_swa + 1) if n_swa > 0 else 0):
            logger.info("kv entry: window cache starts at %d, cannot continue at %d", pmin, n)
            return 0
        if n < hdr.n_tokens and not self._seq_rm(seq_id, n, -1):
            logger.warning("kv entry: could not trim the sequence to %d tokens", n)
            return 0
        return n
