"""One completion through the router: tokens, a slot, a restore, the forward, a publish.

1. The prompt's tokens come from a backend (``/apply-template`` then ``/tokenize`` for a
   chat, ``/tokenize`` for a completion): the server's own template and tokenizer, so
   the keys are those of the tokens it evaluates.
2. :meth:`Fleet.acquire` picks the slot (and marks it busy).
3. If maasd may hold more than the slot does, :meth:`Sharing.stage` finds, checks and
   stages it, and the server restores it (``n_restored`` checked; the slot is erased on
   any failure).
4. The request goes to that slot (``id_slot``, ``cache_prompt``), its answer — a
   stream's bytes as they come — back to the client.
5. After the answer, the prefixes worth sharing are published (:mod:`maasd.router.publish`)
   while the slot is still held; then it is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend, SlotActionError
from maasd.router.fleet import Fleet
from maasd.router.metrics import RouterMetrics
from maasd.router.publish import Publisher
from maasd.router.share import Sharing
from maasd.router.slots import Slot, common_prefix

__all__ = ["Answer", "Proxy", "Unroutable"]

logger = logging.getLogger(__name__)


class Unroutable(ValueError):
    """A request the router cannot route (not JSON, no prompt): a 400."""


@dataclass
class Answer:
    """What goes back to the client: a whole body, or a stream of the backend's bytes."""

    status: int
    media_type: str
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


@dataclass
class Turn:
    """One request's hold on a slot."""

    slot: Slot
    backend: Backend
    tokens: npt.NDArray[np.int32]
    restored: int = 0
    t0: float = 0.0


class Proxy:
    def __init__(
        self,
        fleet: Fleet,
        sharing: Sharing | None,
        metrics: RouterMetrics,
        publisher: Publisher | None,
    ) -> None:
        self.fleet = fleet
        self.sharing = sharing
        self.metrics = metrics
        self.publisher = publisher
        self._background: set[asyncio.Task[None]] = set()

    # -- tokens

    async def tokens(self, path: str, body: dict[str, Any]) -> npt.NDArray[np.int32]:
        b = self.fleet.any_live()
        if b is None:
            return np.empty(0, np.int32)
        if path.endswith("/chat/completions"):
            if not isinstance(body.get("messages"), list):
                raise Unroutable("messages: a list is required")
            text = await b.apply_template(body)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return np.asarray(prompt, dtype=np.int32)
            if not isinstance(prompt, str):
                return np.empty(0, np.int32)  # a batch: balanced, not routed by prefix
            text = prompt
        return np.asarray(await b.tokenize(text), dtype=np.int32)

    # -- one request

    async def complete(self, path: str, raw: bytes) -> Answer:
        t0 = time.monotonic()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Unroutable(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Unroutable("the body must be a JSON object")
        try:
            tokens = await self.tokens(path, body)
        except httpx.HTTPStatusError as exc:
            return Answer(exc.response.status_code, "application/json", {}, exc.response.content)
        except httpx.TransportError:  # that backend just went away: route by load alone
            tokens = np.empty(0, np.int32)
        self.metrics.tokenize_seconds.observe(time.monotonic() - t0)
        sharing = False
        if self.sharing is not None and len(tokens) > 0:
            sharing = await asyncio.to_thread(self.sharing.available)
        lead = 0
        if sharing and self.publisher is not None:
            lead = await self.publisher.before(tokens)
        try:
            return await self._route(path, body, tokens, sharing, lead, t0)
        finally:
            if lead and self.publisher is not None:
                self.publisher.settle(tokens, lead)

    async def _route(
        self,
        path: str,
        body: dict[str, Any],
        tokens: npt.NDArray[np.int32],
        sharing: bool,
        lead: int,
        t0: float,
    ) -> Answer:
        """A slot, a restore (and a lead's publish), then the request; once more on a
        transport error before anything reached the client."""
        for attempt in range(2):
            t_wait = time.monotonic()
            choice = await self.fleet.acquire(tokens, sharing=sharing)
            self.metrics.slot_wait_seconds.observe(time.monotonic() - t_wait)
            turn = Turn(choice.slot, self.fleet.backend_of(choice.slot), tokens, t0=t0)
            try:
                if choice.restore:
                    await self._restore(turn, choice.held)
                if lead:
                    await self._lead(turn, lead)
                    lead = 0
                body["id_slot"] = turn.slot.index
                body["cache_prompt"] = True
                data = json.dumps(body).encode()
                if body.get("stream"):
                    return await self._stream(path, data, turn)
                return await self._whole(path, data, turn)
            except httpx.TransportError as exc:
                # Nothing has reached the client yet: once more, on another slot.
                logger.warning("backend %s failed before answering: %s", turn.backend.url, exc)
                self.metrics.errors.labels(str(turn.backend.index), "transport").inc()
                await self._finish(turn, ok=False)
                if attempt:
                    break
            except BaseException:
                await self._finish(turn, ok=False)
                raise
        err = {"error": {"message": "the backend went away", "type": "server_error"}}
        return Answer(502, "application/json", {}, json.dumps(err).encode())

    async def _lead(self, turn: Turn, n: int) -> None:
        """Publish the shared prefix ``tokens[:n]`` from this request's slot before the
        request goes on (others wait for it), unless the slot holds it already."""
        assert self.publisher is not None
        if common_prefix(turn.slot.held, turn.tokens) >= n:
            return
        held = await self.publisher.lead(turn.slot, turn.backend, turn.tokens, n)
        if held is None:
            turn.slot.forget()
        else:
            turn.slot.held = held.copy()

    async def _restore(self, turn: Turn, held: int) -> None:
        assert self.sharing is not None
        b, slot = turn.backend, turn.slot
        t0 = time.monotonic()
        staged = await asyncio.to_thread(self.sharing.stage, turn.tokens, b.slot_dir, held)
        if staged is None:
            return
        try:
            await _restore_slot(b, slot.index, staged.file.name, staged.n_tokens)
        except SlotActionError as exc:
            logger.warning("restore into %s slot %d failed: %s", b.url, slot.index, exc)
            self.metrics.errors.labels(str(b.index), "restore").inc()
            slot.forget()
            with contextlib.suppress(SlotActionError):
                await b.slot_action(slot.index, "erase")  # a failed restore may leave it corrupt
            return
        finally:
            staged.file.close()
        slot.held = turn.tokens[: staged.matched].copy()
        turn.restored = common_prefix(slot.held, turn.tokens)
        self.metrics.restore_seconds.labels(str(b.index)).observe(time.monotonic() - t0)

    async def _whole(self, path: str, data: bytes, turn: Turn) -> Answer:
        b = turn.backend
        r = await b.http.post(path, content=data, headers={"content-type": "application/json"})
        self.metrics.ttft_seconds.labels(str(b.index)).observe(time.monotonic() - turn.t0)
        with contextlib.suppress(ValueError, AttributeError):
            self._count_timings(turn, r.json().get("timings"))
        await self._finish(turn, ok=r.status_code == 200)
        return Answer(
            r.status_code,
            r.headers.get("content-type", "application/json"),
            self._headers(turn),
            r.content,
        )

    async def _stream(self, path: str, data: bytes, turn: Turn) -> Answer:
        b = turn.backend
        req = b.http.build_request(
            "POST", path, content=data, headers={"content-type": "application/json"}
        )
        resp = await b.http.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            ok, tail = False, b""
            try:
                first = True
                async for chunk in resp.aiter_raw():
                    if first:
                        self.metrics.ttft_seconds.labels(str(b.index)).observe(
                            time.monotonic() - turn.t0
                        )
                        first = False
                    tail = (tail + chunk)[-16384:]
                    yield chunk
                ok = resp.status_code == 200
            except httpx.HTTPError as exc:
                logger.warning("stream from %s broke: %s", b.url, exc)
                self.metrics.errors.labels(str(b.index), "stream").inc()
                err = {"error": {"message": "the backend went away", "type": "server_error"}}
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
            finally:
                await resp.aclose()
                self._count_timings(turn, _last_timings(tail))
                await self._finish(turn, ok=ok)

        return Answer(
            resp.status_code,
            resp.headers.get("content-type", "text/event-stream"),
            self._headers(turn),
            stream=relay(),
        )

    def _headers(self, turn: Turn) -> dict[str, str]:
        return {
            "x-maasd-backend": str(turn.backend.index),
            "x-maasd-slot": str(turn.slot.index),
            "x-maasd-restored": str(turn.restored),
        }

    def _count_timings(self, turn: Turn, timings: Any) -> None:
        if not isinstance(timings, dict):
            return
        label = str(turn.backend.index)
        cached = int(timings.get("cache_n", 0) or 0)
        restored = min(turn.restored, cached)
        self.metrics.prompt_tokens.labels(label, "restored").inc(restored)
        self.metrics.prompt_tokens.labels(label, "held").inc(cached - restored)
        self.metrics.prompt_tokens.labels(label, "evaluated").inc(
            int(timings.get("prompt_n", 0) or 0)
        )

    async def _finish(self, turn: Turn, *, ok: bool) -> None:
        """Count the request; publish what is worth it in the background (the client has
        its answer), holding the slot until then; give the slot back."""
        self.metrics.requests.labels(str(turn.backend.index), "ok" if ok else "error").inc()
        plan = self.publisher.plan(turn.tokens, turn.restored) if ok and self.publisher else []
        if plan:
            task = asyncio.create_task(self._publish_then_release(turn, plan))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        await self.fleet.release(turn.slot, turn.tokens if ok else None)

    async def _publish_then_release(self, turn: Turn, plan: list[int]) -> None:
        assert self.publisher is not None
        held: npt.NDArray[np.int32] | None = None
        try:
            held = await self.publisher.after(turn.slot, turn.backend, turn.tokens, plan)
        except Exception:
            logger.exception("publish from %s slot %d failed", turn.backend.url, turn.slot.index)
        finally:
            await self.fleet.release(turn.slot, held)

    async def drain(self) -> None:
        """Wait for the publishes under way (shutdown, tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


async def _restore_slot(b: Backend, slot: int, filename: str, n_tokens: int) -> None:
    """The server's restore of ``filename`` into ``slot``, which must restore ``n_tokens``."""
    r = await b.slot_action(slot, "restore", filename)
    if int(r.get("n_restored", -1)) != n_tokens:
        raise SlotActionError(f"n_restored {r.get('n_restored')}, expected {n_tokens}")


def _last_timings(tail: bytes) -> Any:
    """The ``timings`` of the last event of a stream that has them (llama-server's last)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"timings"' in line:
            with contextlib.suppress(ValueError):
                return json.loads(line[6:]).get("timings")
    return None
