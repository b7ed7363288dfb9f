"""One completion through the router: tokens, a slot, a restore, the forward, a publish.

1. The prompt's tokens come from a backend (``/apply-template`` then ``/tokenize`` for a
   chat, ``/tokenize`` for a completion): the server's own template and tokenizer, so
   the keys are those of the tokens it evaluates.
2. :meth:`Fleet.acquire` picks the slot (and marks it busy).
3. If maasd may hold more than the slot does, :meth:`Sharing.stage` finds, checks and
   stages it, and the server restores it (``n_restored`` checked; the slot is erased on
   any failure).
4. The request goes to that slot (``id_slot``, ``cache_prompt``), its answer — a
   stream's bytes as they come — back to the client. Steps 3 and 4 wait for the backend
   with no read timeout, but not for ever: a backend judged hung ends them (a 504, or a
   stream's error event; :meth:`Backend.until_hung`).
5. After the answer, the prefixes worth sharing are published (:mod:`maasd.router.publish`)
   while the slot is still held; then it is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend, BackendHung, SlotActionError
from maasd.router.fleet import Fleet, NoSlot
from maasd.router.metrics import RouterMetrics
from maasd.router.publish import Publisher
from maasd.router.share import Sharing
from maasd.router.slots import Slot, common_prefix

__all__ = ["Answer", "Unroutable", "Proxy", "parse_body", "prompt_tokens"]

logger = logging.getLogger(__name__)

TOKEN_LIMIT = 1 << 31  # token ids are int32 in every state and key
SETTLE_S = 30.0  # how long a restore waits for the server to notice a client went away


class Unroutable(ValueError):
    """A request the router cannot route (not JSON, no prompt): a 400."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object the router can forward, or :class:`Unroutable`.

    Refused: not JSON, not UTF-8, not an object, nested past the decoder's recursion
    limit, ``NaN``/``Infinity`` or a number too large for a double, and a lone UTF-16
    surrogate in a string (``"\\ud800"`` decodes, but is no text anyone can encode):
    each would otherwise fail on the way to the backend, as a 500.
    """
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise Unroutable("the body nests too deep") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise Unroutable(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Unroutable("the body must be a JSON object")
    try:  # what httpx and the forward do with it, once, here
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except RecursionError:
        raise Unroutable("the body nests too deep") from None
    except UnicodeEncodeError:
        raise Unroutable("the body holds a lone UTF-16 surrogate: no text") from None
    except ValueError as exc:  # an infinite number (1e999)
        raise Unroutable(f"the body is not JSON that can be sent on: {exc}") from None
    return body


def _token_ids(prompt: list[Any]) -> npt.NDArray[np.int32]:
    """A prompt given as token ids, checked: ints (no booleans) in [0, 2^31)."""
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < TOKEN_LIMIT:
            raise Unroutable(f"prompt: token id {t!r} is not an int in [0, 2^31)")
    return np.asarray(prompt, dtype=np.int32)


async def prompt_tokens(fleet: Fleet, path: str, body: dict[str, Any]) -> npt.NDArray[np.int32]:
    """A request's prompt tokens (checked first, if given as ids), from the least loaded
    live backend; empty: route by load."""
    chat = path.endswith("/chat/completions")
    prompt = body.get("prompt")
    if chat and not isinstance(body.get("messages"), list):
        raise Unroutable("messages: a list is required")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], list | str):
        return _token_ids(prompt)  # token ids (not a batch of prompts)
    b = fleet.any_live()
    if b is None:
        return np.empty(0, np.int32)
    if chat:
        text = await b.apply_template(body)
    elif isinstance(prompt, str):
        text = prompt
    else:
        return np.empty(0, np.int32)  # a batch: balanced, not routed by prefix
    return np.asarray(await b.tokenize(text), dtype=np.int32)


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

    def headers(self) -> dict[str, str]:
        return {
            "x-maasd-backend": str(self.backend.index),
            "x-maasd-slot": str(self.slot.index),
            "x-maasd-restored": str(self.restored),
        }


def count_timings(metrics: RouterMetrics, turn: Turn, timings: Any) -> None:
    """Count the prompt tokens of the server's own ``timings`` (nothing if malformed)."""
    if not isinstance(timings, dict):
        return
    try:
        cached = int(timings.get("cache_n", 0) or 0)
        evaluated = int(timings.get("prompt_n", 0) or 0)
    except (TypeError, ValueError):
        return
    label = str(turn.backend.index)
    restored = min(turn.restored, cached)
    metrics.prompt_tokens.labels(label, "restored").inc(restored)
    metrics.prompt_tokens.labels(label, "held").inc(max(cached - restored, 0))
    metrics.prompt_tokens.labels(label, "evaluated").inc(max(evaluated, 0))


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

    # -- one request

    async def complete(self, path: str, raw: bytes) -> Answer:
        t0 = time.monotonic()
        body = parse_body(raw)
        try:
            tokens = await prompt_tokens(self.fleet, path, body)
        except Unroutable:
            raise
        except httpx.HTTPStatusError as exc:
            r = exc.response
            if r.status_code < 500:  # the backend's word on a bad request
                return Answer(r.status_code, "application/json", {}, r.content)
            return error_answer(502, f"the backend failed on the prompt: {r.text[:200]}")
        except (httpx.TransportError, ValueError, KeyError, TypeError):
            # that backend just went away, or answered nonsense: route by load alone
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
        avoid: int | None = None
        for attempt in range(2):
            t_wait = time.monotonic()
            try:
                choice = await self.fleet.acquire(tokens, sharing=sharing, avoid=avoid)
            except NoSlot as exc:
                return error_answer(503, str(exc), {"retry-after": "1"})
            self.metrics.slot_wait_seconds.observe(time.monotonic() - t_wait)
            turn = Turn(choice.slot, self.fleet.backend_of(choice.slot), tokens, t0=t0)
            try:
                # Until the whole answer (a stream: its headers) is in, or the backend hangs.
                async with turn.backend.until_hung():
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
                    r = await turn.backend.http.post(
                        path, content=data, headers={"content-type": "application/json"}
                    )
                return await self._whole(r, turn)
            except BackendHung as exc:
                # 504, a gateway timeout: the backend took the request but stopped answering
                # (502 if it was judged gone); not sent again
                logger.warning("request to %s ended: %s", turn.backend.url, exc)
                await self._finish(turn, ok=False)
                return error_answer(exc.status, str(exc))
            except httpx.TransportError as exc:
                # Nothing has reached the client yet: once more, on another slot.
                logger.warning("backend %s failed before answering: %s", turn.backend.url, exc)
                self.metrics.errors.labels(str(turn.backend.index), "transport").inc()
                avoid = turn.backend.index  # it may be dying: another one, if any is up
                await self._finish(turn, ok=False)
                if attempt:
                    break
            except BaseException:
                await self._finish(turn, ok=False)
                raise
        return error_answer(502, "the backend went away")

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
        """Restore the longest prefix maasd holds into the turn's slot; anything that goes
        wrong is a miss (the request runs cold) and the slot is erased."""
        assert self.sharing is not None
        b, slot = turn.backend, turn.slot
        t0 = time.monotonic()
        if slot.unsettled:  # a restore into a slot still at work would queue behind it
            if not await b.settle(slot.index, SETTLE_S):
                self.metrics.errors.labels(str(b.index), "slot_unsettled").inc()
                return
            slot.unsettled = False
        staged = None
        try:
            staged = await asyncio.to_thread(self.sharing.stage, turn.tokens, b.slot_dir, held)
            if staged is None:
                return
            await _restore_slot(b, slot.index, staged.file.name, staged.n_tokens)
        except Exception as exc:  # OSError staging, SlotActionError, a malformed answer
            logger.warning("restore into %s slot %d failed: %s", b.url, slot.index, exc)
            self.metrics.errors.labels(str(b.index), "restore").inc()
            slot.forget()
            with contextlib.suppress(SlotActionError):
                await b.slot_action(slot.index, "erase")  # a failed restore may leave it corrupt
            return
        finally:
            if staged is not None:
                staged.file.close()
        slot.held = turn.tokens[: staged.matched].copy()
        turn.restored = common_prefix(slot.held, turn.tokens)
        self.metrics.restore_seconds.labels(str(b.index)).observe(time.monotonic() - t0)

    async def _whole(self, r: httpx.Response, turn: Turn) -> Answer:
        """The backend's whole answer ``r`` to the client: counted, the slot given back."""
        b = turn.backend
        self.metrics.ttft_seconds.labels(str(b.index)).observe(time.monotonic() - turn.t0)
        with contextlib.suppress(ValueError, AttributeError):
            count_timings(self.metrics, turn, r.json().get("timings"))
        await self._finish(turn, ok=r.status_code == 200)
        return Answer(
            r.status_code,
            r.headers.get("content-type", "application/json"),
            turn.headers(),
            r.content,
        )

    async def _stream(self, path: str, data: bytes, turn: Turn) -> Answer:
        b = turn.backend
        req = b.http.build_request(
            "POST", path, content=data, headers={"content-type": "application/json"}
        )
        resp = await b.http.send(req, stream=True)
        end = _StreamEnd(self, resp, turn)

        async def relay() -> AsyncIterator[bytes]:
            ok, tail = False, b""
            try:
                first = True
                async for chunk in b.reads(resp):
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
                yield _error_event(502, "the backend went away")
            except BackendHung as exc:
                logger.warning("stream from %s ended: %s", b.url, exc)
                yield _error_event(exc.status, str(exc))
            finally:
                task = end(ok, tail)
                if task is not None:  # shielded: a client that went away cancels us, not it
                    await asyncio.shield(task)

        stream = relay()
        weakref.finalize(stream, end.collected)  # a stream the client never read
        return Answer(
            resp.status_code,
            resp.headers.get("content-type", "text/event-stream"),
            turn.headers(),
            stream=stream,
        )

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep a background task until it is done (:meth:`drain` waits for them)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def end_stream(self, resp: httpx.Response, turn: Turn, ok: bool, timings: Any) -> None:
        try:
            await resp.aclose()
            count_timings(self.metrics, turn, timings)
        finally:
            await self._finish(turn, ok=ok)

    async def _finish(self, turn: Turn, *, ok: bool) -> None:
        """Count the request; publish what is worth it in the background (the client has
        its answer), holding the slot until then; give the slot back."""
        self.metrics.requests.labels(str(turn.backend.index), "ok" if ok else "error").inc()
        turn.slot.unsettled = not ok  # the server may still be at work in it
        plan = self.publisher.plan(turn.tokens, turn.restored) if ok and self.publisher else []
        if plan:
            self.track(asyncio.create_task(self._publish_then_release(turn, plan)))
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


class _StreamEnd:
    """Ends one relayed stream, once: the backend's response closed, the timings counted,
    the slot given back — from the relay's ``finally`` (an end, a break, a client gone),
    or, for a relay never started (the client went away before the first read), when
    it is collected. Either way in a task of its own, which no client cancels."""

    def __init__(self, proxy: Proxy, resp: httpx.Response, turn: Turn) -> None:
        self.proxy, self.resp, self.turn = proxy, resp, turn
        self.loop = asyncio.get_running_loop()
        self.done = False

    def __call__(self, ok: bool, tail: bytes) -> asyncio.Task[None] | None:
        if self.done:
            return None
        self.done = True
        coro = self.proxy.end_stream(self.resp, self.turn, ok, _last_timings(tail))
        task = self.loop.create_task(coro)
        self.proxy.track(task)
        return task

    def collected(self) -> None:
        if not self.done and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self, False, b"")


def _error_body(status: int, message: str) -> bytes:
    """An OpenAI-style error (what OpenAI clients parse): ``{"error": {…}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def error_answer(status: int, message: str, headers: dict[str, str] | None = None) -> Answer:
    """The router's own error answer, in the OpenAI form."""
    return Answer(status, "application/json", headers or {}, _error_body(status, message))


def _error_event(status: int, message: str) -> bytes:
    """The error a stream already under way ends with (no ``[DONE]`` after it)."""
    return b"data: " + _error_body(status, message) + b"\n\n"


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
