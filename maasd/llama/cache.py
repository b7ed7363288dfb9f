"""``MaasdCache``: llama-cpp-python's prompt cache, shared through maasd.

::

    llm = llama_cpp.Llama("model.gguf", n_ctx=4096, logits_all=False)
    llm.set_cache(MaasdCache(llm, "http://127.0.0.1:7878", "/var/lib/maasd/maasd.sock", key))
    llm.create_chat_completion(messages)     # unchanged code: states go to maasd entries

Every process (and every restart) of the same model and tenant then starts a prompt from
the longest prefix any of them saved. How ``Llama`` uses a cache, and what this one does
instead of what ``LlamaRAMCache`` does (llama-cpp-python 0.3.36, ``Llama._create_completion``):

* ``cache[prompt]`` (a ``KeyError`` is a miss), then ``load_state(item)`` if the item
  shares more of the prompt than the context holds. Here ``cache[prompt]`` restores the
  entry into the context itself, straight from the read-only mapping, and answers a
  :class:`~maasd.llama.context.RestoredState` equal to what the context now holds, so
  ``Llama`` skips ``load_state``: no ``from_buffer_copy`` of the state, no fill of the
  ``scores`` matrix (n_batch × n_vocab float32: 512 MiB for Gemma 3).
* ``cache[prompt + completion] = save_state()`` after the completion (also at the end of a
  stream). ``save_state`` copies the state three times and the scores matrix once; this
  cache replaces the model's ``save_state`` *for that one call* (the caller is
  ``_create_completion`` and the model's cache is this one) by a
  :class:`~maasd.llama.context.PendingState`, and the assignment writes the context state
  straight into a maasd entry. Every other ``save_state()`` is the original.
* Generation never reads a restored ``scores`` row: after a load ``Llama`` evaluates at
  least the last prompt token again and samples from llama.cpp's fresh logits. Only a model
  with ``logits_all=True`` reads prompt rows (``echo`` with ``logprobs``), so such a model
  is refused here.

Which keys a save goes under (all workers must use the same ``chunk``). A daemon entry has
one key, and a lookup finds an entry only under a key it asks for: the chained hash of one
of the prompt's chunk boundaries. So:

* the longest chunk boundary of what the context holds: the next turn of the same
  conversation, whose prompt extends this one, finds it;
* the *fork point*, when this completion's lookup hit an entry sharing a longer prefix
  with the prompt than the key it was found under: the chunk boundary of that shared
  prefix, so the next prompt that shares it finds it under its own key;
* after a miss, where the fork point is unknown, the largest ``MISS_FORKS`` key lengths
  of ``chunk × 2^k`` within the prompt: a prompt sharing S tokens with this one (S at
  least a chunk and a quarter of this prompt) finds one of them at a boundary
  above S/2,
  still restores all S (an entry holds all its tokens: the restore keeps the common
  prefix), and saves its fork point for the next ones.

A shared system prompt is then restored in full by every conversation from the second on.
Each key is an entry of its own (the same state, stored again): a miss costs up to
``1 + MISS_FORKS`` saves, a hit one or two.

A miss, a daemon that is down, a refused entry: never an exception into ``Llama``; they
are logged and counted, and behave as a miss. See ``docs/llama.md``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import llama_cpp
import numpy as np

from maasd.bounds import DEFAULT_TTL_S
from maasd.llama.adapter import LlamaContextAdapter
from maasd.llama.context import (
    ContextStore,
    PendingState,
    Restore,
    common_prefix,
    context_fingerprint,
)
from maasd.llama.format import DEFAULT_CHUNK, as_tokens, save_prefix_len
from maasd.llama.link import Link

__all__ = ["CacheObserver", "CacheStats", "MaasdCache", "save_lengths"]

logger = logging.getLogger(__name__)

#: After a miss, a save also goes under this many power-of-two key lengths (see above).
MISS_FORKS = 3


class CacheObserver(Protocol):
    """What a cache reports (``maasd worker`` turns it into Prometheus metrics)."""

    def looked_up(self, prompt: int, held: int, restored: int, outcome: str) -> None:
        """A completion starts: ``prompt`` tokens, ``held`` already in the context,
        ``restored`` from maasd; ``outcome`` as in :class:`~maasd.llama.context.Restore`
        (or ``held``: nothing to look up)."""

    def saved(self, outcomes: Sequence[str], nbytes: int, seconds: float) -> None:
        """A completion's state was saved (an outcome per key) in ``seconds``."""

    def restored(self, nbytes: int, seconds: float) -> None:
        """A hit restored ``nbytes`` of state in ``seconds``."""

    def sharing(self, up: bool) -> None:
        """maasd became reachable (``up``) or not."""


@dataclass
class CacheStats:
    """What one cache did, in this process (``MaasdCache.stats``)."""

    lookups: Counter[str] = field(default_factory=Counter)
    saves: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    held_tokens: int = 0
    restored_tokens: int = 0
    saved_bytes: int = 0
    restored_bytes: int = 0
    save_seconds: float = 0.0
    restore_seconds: float = 0.0


class MaasdCache(llama_cpp.BaseLlamaCache):
    """A ``llama_cpp.BaseLlamaCache`` whose items are maasd entries of one tenant.

    ``model`` is the ``llama_cpp.Llama`` the cache is set on (``Llama`` never passes
    itself to its cache); ``url`` the daemon's REST address, unused (the cache talks over
    the worker socket only); ``socket`` the worker socket's path; ``key`` the tenant's
    API key. ``pool`` (id or name) is where entries go — a persistent pool keeps them
    across daemon restarts. ``chunk`` is the key granularity in tokens, ``ttl_s`` the
    lease of an entry (each hit extends it). ``observer`` gets every event
    (:class:`CacheObserver`); ``link`` replaces the connection (tests).

    Raises ``ValueError`` for a model with ``logits_all=True`` (see the module docstring).
    Call :meth:`close` (or ``llm.set_cache(None)`` then ``close``) to give the model its own
    ``save_state`` back and close the connection.
    """

    def __init__(
        self,
        model: Any,
        url: str | None,
        socket: str,
        key: str,
        *,
        pool: str | None = None,
        chunk: int = DEFAULT_CHUNK,
        ttl_s: int = DEFAULT_TTL_S,
        observer: CacheObserver | None = None,
        link: Link | None = None,
    ) -> None:
        super().__init__(capacity_bytes=0)
        del url  # the signature's: the cache talks over the worker socket only
        self.model = model
        self._ctx = LlamaContextAdapter(model)
        if self._ctx.logits_all:
            raise ValueError(
                "MaasdCache needs a model made with logits_all=False: with logits_all=True, "
                "echo with logprobs reads the prompt's logits rows, which entries do not keep"
            )
        self.observer = observer
        self.link = link or Link(socket, key, on_change=self._sharing_changed)
        self.store = ContextStore(
            self.link, self._ctx, context_fingerprint(model), chunk=chunk, pool=pool, ttl_s=ttl_s
        )
        self.stats = CacheStats()
        self._last: tuple[Restore, int] | None = None  # this completion's lookup, prompt length
        self._ctx.hook_save_state(self._save_state)

    @property
    def fingerprint(self) -> str:
        return self.store.fingerprint

    @property
    def cache_size(self) -> int:
        """Bytes of state this cache has saved (the daemon holds, evicts and counts them)."""
        return self.stats.saved_bytes

    def __bool__(self) -> bool:  # Llama tests ``if self.cache:``
        return True

    def close(self) -> None:
        """Give the model its own ``save_state`` back; close the connection to maasd."""
        self._ctx.unhook_save_state()
        self.link.close()

    # -- llama-cpp-python's cache protocol

    def __contains__(self, key: Sequence[int]) -> bool:
        """Whether maasd holds an entry sharing a prefix of ``key`` (a lookup, no restore)."""
        r = self.store.restore(as_tokens(key), have=len(key))  # never better than "held"
        return r.outcome in ("not_better", "hit")

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.LlamaState:
        """Restore the longest shared prefix of the prompt ``key`` into the model → a
        :class:`~maasd.llama.context.RestoredState`; ``KeyError`` when maasd has nothing
        longer than what the model holds already (or cannot be reached)."""
        prompt = as_tokens(key)
        held = common_prefix(self._ctx.held_tokens(), prompt)
        if len(prompt) - held <= 1:  # Llama's own prefix reuse does as well
            r = Restore("held")
        else:
            t0 = time.perf_counter()
            try:
                r = self.store.restore(prompt, held)
            except Exception:  # a restore must never fail the completion
                logger.exception("prefix restore failed")
                self._ctx.forget_all()
                r, held = Restore("refused"), 0
            if r.outcome == "hit":
                self._count_restore(r.nbytes, time.perf_counter() - t0)
        self._last = (r, len(prompt))
        self._count_lookup(len(prompt), held, r)
        if r.state is None:
            raise KeyError("no longer shared prefix in maasd")
        state: llama_cpp.LlamaState = r.state
        return state

    def __setitem__(self, key: Sequence[int], value: llama_cpp.LlamaState) -> None:
        """Save a state: the context itself when ``value`` is this cache's pending state
        (the ``save_state()`` of a completion), else ``value``'s bytes (one copy)."""
        last, self._last = self._last, None
        t0 = time.perf_counter()
        try:
            outcomes, nbytes = self._save(value, last)
        except Exception:  # a save must never fail the completion
            logger.exception("prefix save failed")
            outcomes, nbytes = ["error"], 0
        self._count_save(outcomes, nbytes, time.perf_counter() - t0)

    # -- internals

    def _save_state(self) -> llama_cpp.LlamaState:
        """The model's ``save_state``: pending (nothing copied) inside a completion that
        saves into this cache, the original everywhere else."""
        if self._ctx.called_by_completion() and self._ctx.cache_is(self):
            return PendingState(self, self.model.n_tokens, self._ctx.seed)
        state: llama_cpp.LlamaState = self._ctx.instance_save_state()()
        return state

    def _save(
        self, value: llama_cpp.LlamaState, last: tuple[Restore, int] | None
    ) -> tuple[list[str], int]:
        if isinstance(value, PendingState):
            if value.owner is not self or self.model.n_tokens != value.n_tokens:
                return ["stale"], 0
            tokens = as_tokens(self._ctx.held_tokens()).copy()
            if len(tokens) == 0:
                return [], 0
            lengths = self.save_lengths(len(tokens), last)
            if not lengths:
                return [], 0
            outcomes, nbytes = self.store.save(tokens, lengths)
        else:
            n = int(value.n_tokens)
            tokens = as_tokens(np.asarray(value.input_ids)[:n]).copy()
            src = memoryview(value.llama_state).cast("B")[: int(value.llama_state_size)]
            if n == 0 or len(src) == 0:
                return [], 0
            key_len = save_prefix_len(n, self.store.chunk)
            outcomes, nbytes = self.store.save(tokens, [key_len], src)
        return outcomes, nbytes * outcomes.count("saved")

    def save_lengths(self, n: int, last: tuple[Restore, int] | None) -> list[int]:
        """The key lengths a save of ``n`` held tokens goes under: :func:`save_lengths`."""
        return save_lengths(n, self.store.chunk, last)

    def _sharing_changed(self, up: bool, why: str) -> None:
        del why  # the link logged it
        if self.observer is not None:
            self.observer.sharing(up)

    def _count_lookup(self, prompt: int, held: int, r: Restore) -> None:
        s = self.stats
        s.lookups[r.outcome] += 1
        s.prompt_tokens += prompt
        s.held_tokens += held if r.outcome != "hit" else 0
        s.restored_tokens += r.restored
        if self.observer is not None:
            self.observer.looked_up(
                prompt, held if r.outcome != "hit" else 0, r.restored, r.outcome
            )

    def _count_restore(self, nbytes: int, seconds: float) -> None:
        self.stats.restored_bytes += nbytes
        self.stats.restore_seconds += seconds
        if self.observer is not None:
            self.observer.restored(nbytes, seconds)

    def _count_save(self, outcomes: Sequence[str], nbytes: int, seconds: float) -> None:
        self.stats.saves.update(outcomes)
        self.stats.saved_bytes += nbytes
        self.stats.save_seconds += seconds
        if self.observer is not None and outcomes:
            self.observer.saved(outcomes, nbytes, seconds)


def save_lengths(n: int, chunk: int, last: tuple[Restore, int] | None) -> list[int]:
    """The key lengths a save of ``n`` held tokens goes under (see the module docstring),
    given the completion's lookup ``(outcome, prompt length)``; none it found there."""
    end = save_prefix_len(n, chunk)
    if last is None:
        return [end]
    r, n_prompt = last
    forks: list[int] = []
    if r.outcome == "miss":  # chunk × 2^k within the prompt: the largest MISS_FORKS
        k = chunk
        while k <= min(n_prompt, n):
            forks.insert(0, k)
            k *= 2
        forks = forks[:MISS_FORKS]
    elif r.outcome in ("hit", "not_better", "refused"):
        forks = [min(r.common, n) // chunk * chunk]
    return [k for k in dict.fromkeys((end, *forks)) if 0 < k <= n and k != r.matched]
