"""``KVStore``: llama.cpp sequence states saved into and restored from maasd entries.

Both paths are zero-copy: llama.cpp writes the state straight into the worker's
mapping of the entry (``llama_state_seq_get_data`` on a pointer into the mmap) and
reads it straight from there (``llama_state_seq_set_data``). See ``docs/llama.md``.

By default both go through the worker socket's entry fast path (docs/client.md): a save
writes the entry into a scratch memfd of the worker's (kept mapped from one save to the
next) and ``publish``-es it, one round trip, in which the daemon copies it into a sealed
region of its own (immutable from then on), a restore one ``lookup`` that
answers with a read-only fd, then a header check, ``set_data`` from the mapping and
the header check again (an entry evicted mid-read is scrubbed from its first page,
so the second check catches it). Immutability, enforced by the kernel, replaces a
hash of the whole state on every read.

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

from maasd.bounds import DEFAULT_TTL_S, MAX_LOOKUP_KEYS
from maasd.llama.adapter import LlamaSeqAdapter, model_fingerprint
from maasd.llama.entries import (
    CLIENT_ERRORS,
    DUPLICATE_KEY,
    EntryTransport,
    MappingLike,
    Published,
    SocketEntries,
    SocketWorkerLike,
    close_quietly,
    entry_id,
)
from maasd.llama.format import (
    DEFAULT_CHUNK,
    MAGIC,
    HeaderError,
    as_tokens,
    check_chunk,
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
    """Save and restore llama.cpp sequence states in maasd entries.

    ``model`` is a ``llama_cpp.Llama`` (``Any``: the adapter reaches into its private
    fields, :mod:`maasd.llama.adapter`); ``worker`` an open ``maasd.client.Worker`` (or
    ``None`` with ``entries``);
    ``client`` a ``maasd.client.Client`` of the same tenant: the default transport, the
    worker socket's entry fast path, makes no REST call, and the store calls it only to
    answer a save of a prefix another worker saved first with that entry (``None`` will
    do: such a save answers ``None``; :class:`~maasd.llama.entries.RestEntries` takes its own).
    ``pool`` (id or name) sends saved entries to that pool — a persistent pool keeps
    them across daemon restarts. ``chunk`` is the key granularity in tokens (all
    workers sharing entries must use the same); ``ttl_s`` the lease of saved entries
    (a hit extends it by as much; with ``renew_on_hit`` over REST, a renew does);
    ``fingerprint`` overrides :func:`model_fingerprint` (tests); ``entries``
    replaces the transport (:class:`~maasd.llama.entries.RestEntries` for a daemon
    without the fast path). Not thread-safe (neither is a llama.cpp context).

    Example::

        with Worker(socket_path, api_key) as w:
            kv = KVStore(Client(url, api_key), w, llm)      # llm: llama_cpp.Llama
            n = kv.restore(0, prompt, max_tokens=len(prompt) - 1)  # 0 on a miss
            llm.eval(prompt[n:])                            # only the rest
            kv.save(0, prompt)                              # share it → its Buffer
    """

    def __init__(
        self,
        client: object,
        worker: SocketWorkerLike | None,
        model: Any,
        pool: str | None = None,
        *,
        chunk: int = DEFAULT_CHUNK,
        ttl_s: int = DEFAULT_TTL_S,
        renew_on_hit: bool = True,
        fingerprint: str | None = None,
        entries: EntryTransport | None = None,
    ) -> None:
        check_chunk(chunk)
        # The transport (``entries``) is what talks to maasd; the client only answers
        # what a duplicate save returns (the entry another worker saved: its lookup).
        self.client = client
        if entries is None:
            if worker is None:
                raise TypeError("KVStore needs a worker (maasd.client.Worker) or entries")
            entries = SocketEntries(worker, pool=pool)
        self.model = model
        self.seq = LlamaSeqAdapter(model)
        self.entries: EntryTransport = entries
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

    def save(self, seq_id: int, tokens: Tokens) -> Published | None:
        """Save sequence ``seq_id`` (which must hold exactly ``tokens``) → the entry's
        ``maasd.client.Buffer`` (keyed, evictable, live). When another worker saved that
        prefix first (a 409 duplicate key), its entry's ``Buffer`` (a REST lookup of the
        key, with ``client``); ``None`` while that one is still being written, or
        without a client.

        The entry is keyed, evictable and leased for ``ttl_s``; it is published (and
        immutable) only once whole, so no reader ever sees a half-written one.
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

        try:
            buf, mapping = self.entries.create(key, hlen + state_len, self.ttl_s)
        except DUPLICATE_KEY:
            return self._saved(key)  # another worker has it, or is writing it
        try:
            self._write_entry(mapping, seq_id, arr, hlen, state_len)
            return self.entries.publish(buf)
        except DUPLICATE_KEY:  # a publish learns of another worker's entry only now
            return self._saved(key)
        except BaseException:  # never leave a keyed entry that can't be used
            self.entries.discard(buf)
            raise
        finally:
            close_quietly(mapping)

    def _saved(self, key: str) -> Published | None:
        """The entry another worker saved under ``key`` (REST lookup), if it is published."""
        lookup = getattr(self.client, "lookup", None)
        if lookup is None:
            return None
        try:
            found: Published | None = lookup([key])
        except Exception:  # the save is done either way: the entry exists
            logger.debug("looking up the entry saved under %s failed", key, exc_info=True)
            return None
        return found

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
        # A lookup names at most MAX_LOOKUP_KEYS keys (the daemon refuses more): the
        # longest, those worth a restore.
        keys = chunk_keys(self.fingerprint, arr, self.chunk)[-MAX_LOOKUP_KEYS:]
        by_key = {k: n for n, k in keys}
        try:
            hit = self.entries.open_longest([k for _, k in keys])
        except CLIENT_ERRORS as exc:
            logger.warning("kv lookup failed: %s", exc)
            return 0
        if hit is None:
            return 0
        buf, mapping = hit
        n, stale = 0, False
        try:
            matched = by_key.get(getattr(buf, "key", None) or "")
            if matched is not None:
                n, stale = self._restore_from(seq_id, arr, mapping, matched, cap)
        except Exception:  # a restore is an optimisation: it must not take the worker down
            logger.exception("kv restore from %s failed", entry_id(buf))
            n = 0
        finally:
            self.entries.done(buf, mapping, stale=stale)
        if n == 0:
            self.seq.clear(seq_id)
            return 0
        self.seq.set_tokens(seq_id, arr, n)
        if self.renew_on_hit:
            self.entries.keep(buf, self.ttl_s)
        return n

    def _restore_from(
        self, seq_id: int, arr: npt.NDArray[np.int32], mapping: MappingLike, matched: int, cap: int
    ) -> tuple[int, bool]:
        """Restore from a mapped entry → (tokens restored, whether it read as released)."""
        view = mapping.array
        try:
            hdr = parse_header(view, mapping.size)
        except HeaderError as exc:
            logger.warning("kv entry refused: %s", exc)
            return 0, not view[: len(MAGIC)].any()  # all zeros: scrubbed by the daemon
        if hdr.fingerprint != self.fingerprint:
            logger.warning("kv entry refused: saved by another model (%s)", hdr.fingerprint)
            return 0, False
        if hdr.n_tokens < matched or not np.array_equal(hdr.tokens[:matched], arr[:matched]):
            logger.warning("kv entry refused: its tokens do not match its key")
            return 0, False
        if hdr.n_tokens > self.seq.n_ctx():  # llama.cpp's padded cache might take it
            logger.info("kv entry of %d tokens: larger than this context", hdr.n_tokens)
            return 0, False
        # An immutable entry was whole when it was committed and no one can change it
        # since: only an entry others may still write needs its state hashed.
        if not self.entries.immutable and state_crc(view, hdr) != hdr.state_crc:
            logger.warning("kv entry refused: state checksum mismatch")
            return 0, False
        common = int(np.argmin(np.append(hdr.tokens[: len(arr)] == arr[: hdr.n_tokens], False)))
        n = min(common, cap)
        if self.seq.state_set(seq_id, view, hdr.header_len, hdr.state_len) == 0:
            logger.warning("kv entry refused by llama.cpp (llama_state_seq_set_data returned 0)")
            return 0, False
        # The daemon may have evicted (scrubbed) the entry while llama.cpp read it. A
        # scrub runs from the first page to the last (memset, or a hole punched in page
        # order), so if any byte read had been scrubbed, the header — first — no longer
        # parses. Re-checking it costs microseconds.
        try:
            again = parse_header(view, mapping.size)
        except HeaderError:
            again = None
        if again is None or again.state_crc != hdr.state_crc:
            logger.warning("kv entry changed while it was read (evicted?)")
            return 0, True
        return (n if self._usable(seq_id, hdr.n_tokens, n) else 0), False

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
