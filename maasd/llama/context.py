"""``ContextStore``: a ``Llama``'s whole context state in maasd entries, without a copy.

What ``Llama.save_state``/``load_state`` move — the llama.cpp context state — saved straight
into an entry and restored straight from one:

* **save**: ``put`` (a writable staged entry, one socket round trip) →
  ``llama_state_get_data`` writes the state into the mapping → header, magic last →
  ``commit`` (immutable from then on). No ``bytes`` of the state, no copy of the
  ``scores`` matrix.
* **restore**: one ``lookup`` (a read-only fd of the longest committed entry, mapped once
  and kept in the worker's mapping cache) → header checks → ``llama_state_set_data``
  reading from the mapping → the header checked again (evicted while read?) → the
  positions checked, the tail past the shared prefix trimmed → ``Llama``'s bookkeeping
  (``input_ids``, ``n_tokens``, ``_requires_eval``) set to the restored prefix.

Entries use the header and keys of :mod:`maasd.llama.format` under a fingerprint of their
own (:func:`context_fingerprint`): a context state is not a sequence state, so a
``KVStore`` never reads one, nor this store a ``KVStore``'s.

Every daemon error is the client's (:mod:`maasd.client.errors`) or an ``OSError``; none
leaves this module: a restore answers an outcome, a save a list of outcomes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from maasd.bounds import DEFAULT_TTL_S
from maasd.client import BufferMapping, EntryMapping, Worker
from maasd.client import errors as ce
from maasd.llama.adapter import LlamaContextAdapter, model_fingerprint
from maasd.llama.format import (
    DEFAULT_CHUNK,
    MAGIC,
    HeaderError,
    check_chunk,
    chunk_keys,
    fingerprint_of,
    header_len_for,
    pack_header,
    parse_header,
    state_checksum,
    write_header,
)
from maasd.llama.link import BREAKING, Link

__all__ = [
    "ContextStore",
    "PendingState",
    "Restore",
    "RestoredState",
    "common_prefix",
    "context_fingerprint",
]

logger = logging.getLogger(__name__)


def context_fingerprint(model: Any) -> str:
    """The fingerprint of ``model``'s *context* states: the model's, tagged as such."""
    return fingerprint_of({"model": model_fingerprint(model), "state": "llama_context"})


def common_prefix(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RestoredState(llama_cpp.LlamaState):
    """What ``MaasdCache[prompt]`` answers on a hit: a state *already loaded* into the model.

    Its ``input_ids`` are the restored prefix (then -1, which matches no token), equal to
    what the model now holds, so ``Llama`` finds nothing longer in it and does not call
    ``load_state`` (which would copy the state once more and fill ``scores``). It is
    still a true state: ``llama_state`` is a read-only, zero-copy view of the entry's
    bytes (valid while the entry lives), ``scores`` one zero row (a state carries no
    logits; ``load_state`` broadcasts it), so ``load_state`` of it works too.
    """

    def __init__(self, ids: Any, n: int, state: memoryview, scores: Any, seed: int) -> None:
        # llama_cpp's stubs want arrays (unused-ignore: without the llama extra it is Any)
        super().__init__(ids, scores, n, state, len(state), seed)  # type: ignore[arg-type, unused-ignore]


class PendingState(llama_cpp.LlamaState):
    """What the hooked ``save_state`` answers inside a completion: nothing copied yet.

    ``Llama`` hands it straight to ``cache[...] =``, where the context state is written
    into the entry from the context itself. It holds no state: ``load_state`` of it fails
    (the scores do not broadcast) rather than load nothing.
    """

    def __init__(self, owner: object, n_tokens: int, seed: int) -> None:
        empty_ids = np.empty(0, dtype=np.intc)
        no_scores = np.empty((0, 0), dtype=np.float32)
        super().__init__(empty_ids, no_scores, n_tokens, b"", 0, seed)
        self.owner = owner


@dataclass(frozen=True)
class Restore:
    """How a restore went. ``outcome``: ``hit``; ``miss`` (no entry); ``not_better`` (the
    entry shares no more than the model holds); ``refused`` (an entry that cannot be
    used, see the log); ``error`` (the daemon failed the lookup); ``down`` (no daemon)."""

    outcome: str
    matched: int = 0  # length of the key that hit
    common: int = 0  # tokens the entry shares with the prompt
    restored: int = 0
    nbytes: int = 0
    state: Any = None


class NotRestorable(Exception):
    """An entry this store will not restore (the reason is the message)."""


class ContextStore:
    """Context states of one ``Llama`` in maasd entries, over a :class:`Link`.

    Not thread-safe (neither is the model); ``chunk`` must be the same in every
    process sharing entries.
    """

    def __init__(
        self,
        link: Link,
        ctx: LlamaContextAdapter,
        fingerprint: str,
        *,
        chunk: int = DEFAULT_CHUNK,
        pool: str | None = None,
        ttl_s: int = DEFAULT_TTL_S,
    ) -> None:
        check_chunk(chunk)
        self.link = link
        self.ctx = ctx
        self.fingerprint = fingerprint
        self.chunk = chunk
        self.pool = pool
        self.ttl_s = ttl_s
        self._zero_row: npt.NDArray[np.float32] | None = None

    def key_at(self, tokens: npt.NDArray[np.int32], n: int) -> str:
        """The key of ``tokens[:n]``."""
        return chunk_keys(self.fingerprint, tokens[:n], self.chunk)[-1][1]

    # -- restore

    def restore(self, prompt: npt.NDArray[np.int32], have: int) -> Restore:
        """Restore the longest entry sharing a prefix with ``prompt`` into the context, if
        it shares more than the ``have`` tokens the model holds already."""
        keys = chunk_keys(self.fingerprint, prompt, self.chunk)
        worker = self.link.get()
        if worker is None:
            return Restore("down")
        try:
            hit = worker.lookup([k for _, k in keys])
        except (ce.MaasdClientError, OSError) as exc:
            logger.warning("prefix lookup failed: %s", exc)
            self.link.failed(exc)
            return Restore("error")
        if hit is None:
            return Restore("miss")
        matched = dict((k, n) for n, k in keys).get(hit.key, 0)
        try:
            return self._restore_from(worker, hit, prompt, have, matched)
        except NotRestorable as why:
            logger.warning("prefix entry %s refused: %s", hit.buffer_id, why)
            return Restore("refused", matched)
        finally:
            hit.close()  # back to the worker's mapping cache

    def _restore_from(
        self,
        worker: Worker,
        hit: EntryMapping,
        prompt: npt.NDArray[np.int32],
        have: int,
        matched: int,
    ) -> Restore:
        view = hit.array
        hdr = self._header(worker, hit, view)
        if hdr.fingerprint != self.fingerprint:
            raise NotRestorable(f"saved by another model or state kind ({hdr.fingerprint})")
        if matched == 0 or hdr.n_tokens < matched or common_prefix(hdr.tokens, prompt) < matched:
            raise NotRestorable("its tokens do not match its key")
        common = common_prefix(hdr.tokens, prompt)
        if common <= have:
            return Restore("not_better", matched, common)
        try:
            self._load(worker, hit, view, hdr, common, len(prompt))
        except BaseException:
            self.ctx.forget_all()  # whatever llama.cpp read is not a state to continue from
            raise
        self.ctx.mark_held(prompt, common)
        state = RestoredState(
            self.ctx.padded_ids(prompt, common),
            common,
            view[hdr.header_len : hdr.header_len + hdr.state_len].data,
            self.zero_row(),
            self.ctx.seed,
        )
        return Restore("hit", matched, common, common, hdr.state_len, state)

    def _header(self, worker: Worker, hit: EntryMapping, view: npt.NDArray[np.uint8]) -> Any:
        try:
            return parse_header(view, hit.size)
        except HeaderError as exc:
            if not view[: len(MAGIC)].any():  # all zeros: released, scrubbed by the daemon
                worker.forget(hit.buffer_id)
            raise NotRestorable(str(exc)) from exc

    def _load(
        self, worker: Worker, hit: EntryMapping, view: Any, hdr: Any, common: int, n_prompt: int
    ) -> None:
        """``llama_state_set_data`` from the mapping, then the checks a load needs."""
        read = self.ctx.context_state_set(view, hdr.header_len, hdr.state_len)
        if read != hdr.state_len:
            raise NotRestorable(f"llama.cpp read {read} of {hdr.state_len} bytes")
        # An entry the daemon evicted while llama.cpp read it was scrubbed from its first
        # page: its header no longer parses (see KVStore._restore_from).
        try:
            again = parse_header(view, hit.size)
        except HeaderError:
            again = None
        if again is None or again.state_crc != hdr.state_crc:
            worker.forget(hit.buffer_id)
            raise NotRestorable("changed while it was read (evicted?)")
        pmin, pmax = self.ctx.seq_pos_range(0)
        if pmax != hdr.n_tokens - 1:
            raise NotRestorable(f"restored positions end at {pmax}, its header says {hdr.n_tokens}")
        # Llama continues at min(common, n_prompt - 1) (it re-evaluates the last prompt
        # token when the whole prompt was restored); a sliding-window cache must still
        # hold every position that token attends to.
        n_swa, at = self.ctx.n_swa(), min(common, n_prompt - 1)
        if n_swa > 0 and pmin > max(0, at - n_swa + 1):
            raise NotRestorable(f"its window cache starts at {pmin}, cannot continue at {at}")
        if common < hdr.n_tokens and not self.ctx.seq_rm(0, common, -1):
            raise NotRestorable(f"llama.cpp cannot trim it to {common} tokens")

    def zero_row(self) -> npt.NDArray[np.float32]:
        if self._zero_row is None:
            self._zero_row = np.zeros((1, self.ctx.model.n_vocab()), dtype=np.float32)
        return self._zero_row

    # -- save

    def save(
        self, tokens: npt.NDArray[np.int32], lengths: Sequence[int], src: Any = None
    ) -> tuple[list[str], int]:
        """Save the context state (or the state bytes ``src``) once per key length in
        ``lengths`` → (an outcome each: ``saved``, ``duplicate`` (another worker has
        that key), ``refused`` (quota, pool …), ``error`` or ``down``; the state's size)."""
        n = len(tokens)
        state_len = self.ctx.context_state_size() if src is None else len(src)
        hlen = header_len_for(n)
        out: list[str] = []
        for length in lengths:
            worker = self.link.get()
            if worker is None:
                out.append("down")
                break
            outcome = self._save_one(worker, tokens, length, hlen, state_len, src)
            out.append(outcome)
            if outcome == "error":
                break
        return out, state_len

    def _save_one(
        self,
        worker: Worker,
        tokens: npt.NDArray[np.int32],
        length: int,
        hlen: int,
        state_len: int,
        src: Any,
    ) -> str:
        try:
            mapping = worker.put(
                self.key_at(tokens, length), hlen + state_len, pool=self.pool, ttl_s=self.ttl_s
            )
        except ce.DuplicateKey:
            return "duplicate"
        except BREAKING as exc:
            self.link.failed(exc)
            logger.warning("prefix save failed: %s", exc)
            return "error"
        except ce.MaasdClientError as exc:
            logger.warning("prefix save refused: %s", exc)
            return "refused"
        try:
            self._write(mapping, tokens, hlen, state_len, src)
            worker.commit(mapping)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                worker.abort(mapping)
            if not isinstance(exc, Exception):
                raise
            self.link.failed(exc)
            logger.warning("prefix save failed: %s", exc, exc_info=not isinstance(exc, OSError))
            return "error"
        return "saved"

    def _write(
        self,
        mapping: BufferMapping,
        tokens: npt.NDArray[np.int32],
        hlen: int,
        size: int,
        src: Any,
    ) -> None:
        view = mapping.array
        if src is None:  # straight from the context into the mapping
            written = self.ctx.context_state_get(view, hlen, size)
            if written == 0 or written > size:
                raise RuntimeError(f"llama_state_get_data wrote {written} of {size} bytes")
        else:  # a state someone else made: the one copy it takes to share it
            written = size
            view[hlen : hlen + size] = np.frombuffer(src, dtype=np.uint8, count=size)
        crc = state_checksum(view[hlen : hlen + written].data)
        write_header(view, pack_header(self.fingerprint, tokens, written, crc, self.chunk))
