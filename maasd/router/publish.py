"""Which prefixes a router publishes into maasd after a request, and how.

Worth saving (:meth:`Publisher.plan`), both at chunk boundaries (the only lengths a
lookup can find, :func:`~maasd.llama.format.chunk_keys`) and at least
``min_tokens`` long (a short prefix costs more to save and restore than to prefill:
a restore is ~10 ms, a 64-token prefill of a small model about as much):

* **the prompt's own prefix** (its longest chunk boundary), unless maasd gave it to us
  already: the next turn of the same conversation, on any backend, starts from it;
* **the prefix it shares with a recent prompt** (the longest common prefix with any of
  the last ``recent`` prompts, ``recent_tokens`` tokens in all, at a chunk boundary): a prefix seen twice — a system
  prompt, a shared document — is the one the next user will send too, and the prompt's
  own prefix cannot serve them (its key covers this user's question).

A prefix published (or found a duplicate) recently is not saved again, and one being
published is waited for, not computed twice.

**A shared prefix is published before the request that found it is answered**
(:meth:`Publisher.before`): when a prompt arrives sharing a prefix of at least
``min_tokens`` with a prompt seen before (a system prompt, a document: the first users of
a fleet send it at once) that maasd does not hold yet, this request *leads*: its slot
prefills that prefix alone, saves and publishes it, then goes on with the rest of the
prompt; the requests that arrive meanwhile with the same prefix wait for it (at most
``wait_s``) and then restore it, on any backend, instead of each prefilling it again at
once on the same few cores. A prefix being published *after* an answer (the previous
turn of a conversation, whose next turn comes at once) is waited for the same way: the
slot that saves it holds the whole conversation, and the next turn goes on there.

How, after an answer (:meth:`Publisher.after`), while the request's slot is still held:
one save of the slot as it is — the prompt and the answer, nothing prefilled again,
nothing the next turn needs cut off (with ``--swa-full`` a sliding-window model continues
such a state: measured, 3 of 110 tokens evaluated) — into an unsealed memfd of the
router, then for each length a copy into a ``put`` entry under the key of that prefix
(all the saved tokens in its header: a restore trims to what a prompt shares) and a
``commit`` (:meth:`Sharing.publish`). Before an answer (:meth:`Publisher.lead`): a
prefix-only prefill (``/completion`` with the ``n`` tokens, ``n_predict: 0``) so the slot
holds exactly the shared prefix, then the same save and publish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend
from maasd.router.files import LinkedFile
from maasd.router.metrics import RouterMetrics
from maasd.router.share import Sharing
from maasd.router.slots import RecentPrompts, Slot

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        sharing: Sharing,
        metrics: RouterMetrics,
        *,
        min_tokens: int = 128,
        recent: int = 64,
        recent_tokens: int = 1 << 20,
        wait_s: float = 60.0,
    ) -> None:
        self.sharing = sharing
        self.metrics = metrics
        self.min_tokens = max(min_tokens, sharing.chunk)
        self.wait_s = wait_s
        # the last prompts answered and arrived, bounded by count and by tokens
        self._recent = RecentPrompts(recent, recent_tokens)
        self._arrived = RecentPrompts(recent, recent_tokens)
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pending: dict[str, asyncio.Event] = {}  # keys being published now

    def _boundary(self, n: int) -> int:
        return n - n % self.sharing.chunk

    def _key(self, tokens: npt.NDArray[np.int32], n: int) -> str:
        return self.sharing.keys(tokens[:n])[-1][1]

    def plan(self, tokens: npt.NDArray[np.int32], restored: int) -> list[int]:
        """The prefix lengths of ``tokens`` worth publishing, longest first ([]: none)."""
        shared = self._recent.longest_shared(tokens)
        self._recent.add(tokens)
        if not self.sharing.up:
            return []
        out: list[int] = []
        for n in (self._boundary(len(tokens)), self._boundary(shared)):
            fresh = n >= self.min_tokens and n > restored and n not in out
            key = self._key(tokens, n) if fresh else ""
            if fresh and key not in self._done and key not in self._pending:
                out.append(n)
                self._pending[key] = asyncio.Event()
        return sorted(out, reverse=True)

    async def before(self, tokens: npt.NDArray[np.int32]) -> int:
        """On arrival: the length of a shared prefix this request publishes before it is
        answered (0: none; the caller settles it then: :meth:`settle`). Waits first, if another
        request is publishing the prefix this one shares."""
        shared = self._arrived.longest_shared(tokens)
        self._arrived.add(tokens)
        n = self._boundary(shared)
        if n < self.min_tokens or not self.sharing.up:
            return 0
        key = self._key(tokens, n)
        if key in self._done:
            return 0
        pending = self._pending.get(key)
        if pending is not None:
            t0 = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.wait(), self.wait_s)
            self.metrics.lead_wait_seconds.observe(time.monotonic() - t0)
            return 0
        self._pending[key] = asyncio.Event()
        return n

    def settle(self, tokens: npt.NDArray[np.int32], n: int) -> None:
        """The publish of ``tokens[:n]`` is over (done or failed): its waiters go on."""
        ev = self._pending.pop(self._key(tokens, n), None)
        if ev is not None:
            ev.set()

    def _remember(self, key: str) -> None:
        self._done[key] = None
        while len(self._done) > 4096:
            self._done.popitem(last=False)

    async def after(
        self, slot: Slot, backend: Backend, tokens: npt.NDArray[np.int32], plan: list[int]
    ) -> npt.NDArray[np.int32] | None:
        """After the answer: save ``slot`` as it is (the prompt and the answer: nothing is
        prefilled again, nothing the next turn needs is cut off) and publish it under the
        key of each prefix in ``plan`` → what the slot holds after (None: unknown)."""
        t0 = time.monotonic()
        try:
            done = await self._save(slot, backend, tokens, plan)
        finally:
            for n in plan:
                self.settle(tokens, n)
        if done is None:
            return tokens  # the save failed; the slot holds what it held
        for n, ok in zip(plan, done, strict=True):
            if ok is not None:
                self._remember(self._key(tokens, n))
        if any(done):
            self.metrics.save_seconds.labels(str(backend.index)).observe(time.monotonic() - t0)
        return tokens

    async def lead(
        self, slot: Slot, backend: Backend, tokens: npt.NDArray[np.int32], n: int
    ) -> npt.NDArray[np.int32] | None:
        """Before the answer: prefill ``tokens[:n]`` alone in ``slot``, save and publish it
        → what the slot holds (None: unknown)."""
        t0 = time.monotonic()
        try:
            r = await backend.http.post(
                "/completion",
                json={
                    "prompt": tokens[:n].tolist(),
                    "n_predict": 0,
                    "id_slot": slot.index,
                    "cache_prompt": True,
                },
            )
            if r.status_code != 200:
                self.metrics.errors.labels(str(backend.index), "save").inc()
                return None
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                evaluated = int(r.json()["timings"]["prompt_n"])
                self.metrics.prompt_tokens.labels(str(backend.index), "publish").inc(evaluated)
            done = await self._save(slot, backend, tokens, [n])
        finally:
            self.settle(tokens, n)
        if done is not None and done[0] is not None:
            self._remember(self._key(tokens, n))
        if done and done[0]:
            self.metrics.save_seconds.labels(str(backend.index)).observe(time.monotonic() - t0)
        return tokens[:n]

    async def _save(
        self, slot: Slot, backend: Backend, tokens: npt.NDArray[np.int32], lengths: list[int]
    ) -> list[bool | None] | None:
        """Save the slot once and publish it under the key of each prefix length → for
        each, True: published, False: a duplicate, None: refused; None: the save failed."""
        with LinkedFile(backend.slot_dir, "save", copy=self.sharing.copy_files) as f:
            try:
                r = await backend.slot_action(slot.index, "save", f.name)
            except Exception as exc:
                logger.warning("save of %s slot %d failed: %s", backend.url, slot.index, exc)
                self.metrics.errors.labels(str(backend.index), "save").inc()
                return None
            if int(r.get("n_saved", -1)) < max(lengths):
                self.metrics.errors.labels(str(backend.index), "save").inc()
                return None
            written = int(r.get("n_written", 0))

            def publish_all() -> list[bool | None]:
                return [self.sharing.publish(f, written, tokens, n) for n in lengths]

            return await asyncio.to_thread(publish_all)
