"""Which prefixes a router publishes into maasd after a request, and how.

Worth saving (:meth:`Publisher.plan`), both at chunk boundaries (the only lengths a
lookup can find, :func:`~maasd.llama.format.chunk_keys`) and at least
``min_tokens`` long (a short prefix costs more to save and restore than to prefill:
a restore is ~10 ms, a 64-token prefill of a small model about as much):

* **the prompt's own prefix** (its longest chunk boundary), unless maasd gave it to us
  already: the next turn of the same conversation, on any backend, starts from it;
* **the prefix it shares with a recent prompt** (the longest common prefix with any of
  the last ``recent`` prompts, at a chunk boundary): a prefix seen twice — a system
  prompt, a shared document — is the one the next user will send too, and the prompt's
  own prefix cannot serve them (its key covers this user's question).

A prefix published (or found a duplicate) recently is not saved again.

How (:meth:`Publisher.after`), per length ``n``, longest first while the request's slot
is still held: a prefix-only prefill (``/completion`` with the ``n`` tokens,
``n_predict: 0``) so the slot holds exactly them — for a sliding-window model the only
state that can be continued, for any model the one the key describes; the server's
save into an unsealed memfd of the router; then a copy into a ``put`` entry and a
``commit`` (:meth:`Sharing.publish`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend
from maasd.router.files import LinkedFile
from maasd.router.metrics import RouterMetrics
from maasd.router.share import Sharing
from maasd.router.slots import Slot, common_prefix

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
    ) -> None:
        self.sharing = sharing
        self.metrics = metrics
        self.min_tokens = max(min_tokens, sharing.chunk)
        self._recent: collections.deque[npt.NDArray[np.int32]] = collections.deque(maxlen=recent)
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()

    def _boundary(self, n: int) -> int:
        return n - n % self.sharing.chunk

    def _key(self, tokens: npt.NDArray[np.int32], n: int) -> str:
        return self.sharing.keys(tokens[:n])[-1][1]

    def plan(self, tokens: npt.NDArray[np.int32], restored: int) -> list[int]:
        """The prefix lengths of ``tokens`` worth publishing, longest first ([]: none)."""
        shared = max((common_prefix(r, tokens) for r in self._recent), default=0)
        self._recent.append(tokens)
        if not self.sharing.up:
            return []
        out: list[int] = []
        for n in (self._boundary(len(tokens)), self._boundary(shared)):
            fresh = n >= self.min_tokens and n > restored and n not in out
            if fresh and self._key(tokens, n) not in self._done:
                out.append(n)
        return sorted(out, reverse=True)

    def _remember(self, key: str) -> None:
        self._done[key] = None
        while len(self._done) > 4096:
            self._done.popitem(last=False)

    async def after(
        self, slot: Slot, backend: Backend, tokens: npt.NDArray[np.int32], plan: list[int]
    ) -> npt.NDArray[np.int32] | None:
        """Publish the prefixes of ``plan`` from ``slot`` → what the slot holds after."""
        held: npt.NDArray[np.int32] | None = tokens
        for n in plan:
            t0 = time.monotonic()
            held = None  # until the prefill says otherwise
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
            held = tokens[:n]
            ok = await self._save(slot, backend, tokens, n)
            if ok is not None:
                self._remember(self._key(tokens, n))
            if ok:
                self.metrics.save_seconds.labels(str(backend.index)).observe(time.monotonic() - t0)
        return held

    async def _save(
        self, slot: Slot, backend: Backend, tokens: npt.NDArray[np.int32], n: int
    ) -> bool | None:
        """Save the slot and publish it → True: published, False: a duplicate, None: failed."""
        with LinkedFile(backend.slot_dir, "save", copy=self.sharing.copy_files) as f:
            try:
                r = await backend.slot_action(slot.index, "save", f.name)
            except Exception as exc:
                logger.warning("save of %s slot %d failed: %s", backend.url, slot.index, exc)
                self.metrics.errors.labels(str(backend.index), "save").inc()
                return None
            if int(r.get("n_saved", -1)) != n:
                self.metrics.errors.labels(str(backend.index), "save").inc()
                return None
            written = int(r.get("n_written", 0))
            return await asyncio.to_thread(self.sharing.publish, f, written, tokens, n)
