"""``KVStore``: llama.cpp sequence states saved into and restored from maasd entries.

Both paths are zero-copy: llama.cpp writes the state straight into the worker's
mapping of the buffer (``llama_state_seq_get_data`` on a pointer into the mmap) and
reads it straight from there (``llama_state_seq_set_data``). See ``docs/llama.md``.

A save is keyed at the longest chunk boundary of its tokens (or at its whole length if
shorter than one chunk) and stores *all* its tokens in the header; a restore looks up
every chunk boundary of its prompt (plus its whole length) in one call, takes the
longest live one, and keeps the longest common prefix of the stored tokens and its
prompt — trimming the rest. So a prompt that extends a saved one restores all the saved
tokens, and an identical prompt restores everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from maasd.llama.adapter import LlamaSeqAdapter, model_fingerprint
from maasd.llama.entries import (
    CLIENT_ERRORS,
    DUPLICATE_KEY,
    ClientLike,
    Entries,
    MappingLike,
    RestEntries,
    WorkerLike,
    close_quietly,
)
from maasd.llama.format import (
    DEFAULT_CHUNK,
    HeaderError,
    as_tokens,
    chunk_keys,
    header_len_for,
    pack_header,
    parse_header,
    save_prefix_len,
    state_checksum,
    state_crc,
    write_header,
)

__all__ = ["KVStore"]

logger = logging.getLogger(__name__)

Tokens = Sequence[int] | npt.NDArray[Any]


class KVStore:
    """Save and restore llama.cpp sequence states in maasd buffers.

    ``model`` is a ``llama_cpp.Llama``; ``client`` a ``maasd.client.Client`` and
    ``worker`` an open ``maasd.client.Worker`` of the same tenant. ``chunk`` is the
    key granularity in tokens (all workers sharing entries must use the same);
    ``ttl_s`` the lease of saved entries, renewed on a hit when ``renew_on_hit``;
    ``fingerprint`` overrides :func:`model_fingerprint` (tests).
    Not thread-safe (neither is a llama.cpp context).

    Example::

        with Worker(socket_path, api_key) as w:
            kv = KVStore(Client(url, api_key), w, llm)      # llm: llama_cpp.Llama
            n = kv.restore(0, prompt, max_tokens=len(prompt) - 1)  # 0 on a miss
            llm.eval(prompt[n:])                            # only the rest
            kv.save(0, prompt)                              # share it (409 → existing)
    """

    def __init__(
        self,
        client: ClientLike,
        worker: WorkerLike,
        model: Any,
        *,
        chunk: int = DEFAULT_CHUNK,
        ttl_s: int = 600,
        renew_on_hit: bool = True,
        fingerprint: str | None = None,
    ) -> None:
        if chunk <= 0:
            raise ValueError("chunk must be > 0")
        self.client = client
        self.worker = worker
        self.model = model
        self.seq = LlamaSeqAdapter(model)
        self.entries: Entries = RestEntries(client, worker)
        self.chunk = chunk
        self.ttl_s = ttl_s
        self.renew_on_hit = renew_on_hit
        self.fingerprint = fingerprint or model_fingerprint(model)
        if len(bytes.fromhex(self.fingerprint)) != 16:
            raise ValueError("fingerprint must be 32 hex digits")

    def key(self, tokens: Tokens) -> str:
        """The key a ``save`` of ``tokens`` is stored under."""
        arr = as_tokens(tokens)
        if len(arr) == 0:
            raise ValueError("no tokens")
        want = save_prefix_len(len(arr), self.chunk)
        return next(k for n, k in chunk_keys(self.fingerprint, arr[:want], self.chunk) if n == want)

    # -- save

    def save(self, seq_id: int, tokens: Tokens) -> Any:
        """Save sequence ``seq_id`` (which must hold exactly ``tokens``) → the Buffer.

        The buffer is keyed, evictable and leased for ``ttl_s``. If another worker
        saved the same prefix first (409 duplicate key), its buffer is returned.
        """
        arr = as_tokens(tokens)
        n = len(arr)
        if n == 0:
            raise ValueError("no tokens to save")
        self.seq.check_seq(seq_id)
        _pmin, pmax = self.seq.seq_pos_range(seq_id)  # pmin > 0 with a sliding-window cache
        if pmax != n - 1:
            raise ValueError(
                f"sequence {seq_id} holds positions up to {pmax}, but {n} tokens were given"
            )
        state_len = self.seq.state_size(seq_id)
        if state_len == 0:
            raise RuntimeError(f"llama.cpp reports an empty state for sequence {seq_id}")
        hlen = header_len_for(n)
        key = self.key(arr)

        for _ in range(3):
            try:
                buf, mapping = self.entries.create(key, hlen + state_len, self.ttl_s)
                break
            except DUPLICATE_KEY:
                existing = self.entries.existing(key)
                if existing is not None:
                    return existing
                # released between the 409 and the lookup: try again
        else:
            raise RuntimeError(f"could not reserve or find key {key}")

        try:
            self._write_entry(mapping, seq_id, arr, hlen, state_len)
        except BaseException:  # never leave a keyed entry that can't be used
            close_quietly(mapping)
            self.entries.discard(buf)
            raise
        close_quietly(mapping)
        return self.entries.publish(buf)

    def _write_entry(
        self, mapping: MappingLike, seq_id: int, arr: npt.NDArray[np.int32], hlen: int, size: int
    ) -> None:
        view = mapping.array
        if mapping.size < hlen + size:
            raise RuntimeError(f"buffer of {mapping.size} B, need {hlen + size}")
        written = self.seq.state_get(seq_id, view, hlen, size)  # straight into the mapping
        if written == 0 or written > size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        crc = state_checksum(view[hlen : hlen + written].data)
        write_header(view, pack_header(self.fingerprint, arr, written, crc, self.chunk))

    # -- restore

    def restore(self, seq_id: int, tokens: Tokens, *, max_tokens: int | None = None) -> int:
        """Restore the longest saved prefix of ``tokens`` into ``seq_id`` → its length (0: miss).

        The sequence is cleared first and stays cleared on any miss or refusal
        (unknown key, other model, bad header, bad checksum, llama.cpp refusal).
        ``max_tokens`` caps the result — pass ``len(tokens) - 1`` when the caller
        needs the logits of the prompt's last token (a state carries no logits).
        For ``seq_id`` 0 the ``Llama`` object's ``n_tokens``/``input_ids`` are set,
        so ``model.eval(tokens[n:])`` and ``model.generate`` continue from there.
        """
        arr = as_tokens(tokens)
        self.seq.check_seq(seq_id)
        self.seq.clear(seq_id)
        cap = len(arr) if max_tokens is None else max(0, min(max_tokens, len(arr)))
        if cap == 0:
            return 0
        keys = chunk_keys(self.fingerprint, arr, self.chunk)
        by_key = {k: n for n, k in keys}
        try:
            hit = self.entries.open_longest([k for _, k in keys])
        except CLIENT_ERRORS as exc:
            logger.warning("kv lookup failed: %s", exc)
            return 0
        if hit is None:
            return 0
        buf, mapping = hit
        try:
            matched = by_key.get(getattr(buf, "key", None) or "")
            n = 0 if matched is None else self._restore_from(seq_id, arr, mapping, matched, cap)
        except Exception:  # a restore is an optimisation: it must not take the worker down
            logger.exception("kv restore from %s failed", buf.id)
            n = 0
        finally:
            close_quietly(mapping)
        if n == 0:
            self.seq.clear(seq_id)
            return 0
        self.seq.set_tokens(seq_id, arr, n)
        if self.renew_on_hit:
            self.entries.keep(buf, self.ttl_s)
        return n

    def _restore_from(
        self, seq_id: int, arr: npt.NDArray[np.int32], mapping: MappingLike, matched: int, cap: int
    ) -> int:
        view = mapping.array
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
        if self.seq.state_set(seq_id, view, hdr.header_len, hdr.state_len) == 0:
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
        return n if self._usable(seq_id, hdr.n_tokens, n) else 0

    def _usable(self, seq_id: int, n_saved: int, n: int) -> bool:
        """Whether the restored ``seq_id`` (``n_saved`` positions) can continue at ``n``;
        trims it to ``n`` if so."""
        pmin, pmax = self.seq.seq_pos_range(seq_id)
        if pmax != n_saved - 1:
            logger.warning("kv entry refused: restored positions do not match its header")
            return False
        # A sliding-window (SWA) cache keeps only the last n_swa positions. The token at
        # position n attends to positions > n - n_swa (llama.cpp's standard SWA mask;
        # a chunked window needs less), so they must all be there.
        n_swa = self.seq.n_swa()
        if pmin > (max(0, n - n_swa + 1) if n_swa > 0 else 0):
            logger.info("kv entry: window cache starts at %d, cannot continue at %d", pmin, n)
            return False
        if n < n_saved and not self.seq.seq_rm(seq_id, n, -1):
            logger.warning("kv entry: could not trim the sequence to %d tokens", n)
            return False
        return True
