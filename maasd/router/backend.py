"""One ``llama-server`` behind the router: its HTTP client, its slots, and (if the router
started it) its process, restarted when it dies.

The HTTP client is httpx's ``AsyncClient`` (connection pooling, timeouts, streaming
bodies as they arrive): the router forwards a streamed completion's bytes as httpx
yields them and never parses or re-frames the server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from maasd.router.files import sweep
from maasd.router.slots import Slot

__all__ = [
    "Backend",
    "BackendGone",
    "BackendHung",
    "BackendProcess",
    "Health",
    "REQUIRED_FLAGS",
    "RESERVED_FLAGS",
    "SlotActionError",
    "check_server_args",
]

logger = logging.getLogger(__name__)

#: What every backend runs with, and why (docs/llama-server.md):
#: --kv-unified   one KV stream, so a state fits any slot of any process;
#: -fa off        V stored transposed, as llama-cpp-python's default (shared states);
#: --swa-full     a full cache for sliding-window layers: a saved prefix can be continued;
#: --cache-ram 0  no second, private prompt cache: maasd is the cache, bounded and shared;
#: --no-cache-idle-slots  idle slots keep what they hold (the router tracks it).
REQUIRED_FLAGS = ("--kv-unified", "-fa", "off", "--swa-full", "--cache-ram", "0")
REQUIRED_FLAGS_EXTRA = ("--no-cache-idle-slots",)

#: Flags extra arguments (after ``--``) may not give, every alias of each: the router
#: sets them (the flags above, the cache types of ``--cache-type-k/-v``, slots, model,
#: address, slot dir), or they would make states it can't share (LoRA adapters, whose
#: scales a request may change), or a server without completions.
# fmt: off
RESERVED_FLAGS = frozenset((
    "-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file",
    "-dr", "--docker-repo", "--models-dir", "--models-preset", "--models-max",
    "--models-autoload", "--no-models-autoload",
    "--host", "--port", "--reuse-port", "--api-prefix", "--slot-save-path", "--slots",
    "--no-slots", "-np", "--parallel", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified",
    "-fa", "--flash-attn", "--swa-full", "-cram", "--cache-ram", "--cache-idle-slots",
    "--no-cache-idle-slots", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v",
    "--lora", "--lora-scaled", "--lora-init-without-apply",
    "--embedding", "--embeddings", "--rerank", "--reranking", "--pooling",
))
#: Flags that change the values a state holds, with how many values each takes: allowed,
#: and named in the fingerprint (such a fleet shares only with one run the same way).
MODEL_FLAGS = {
    "--control-vector": 1, "--control-vector-scaled": 1, "--control-vector-layer-range": 2,
    "--override-kv": 1, "--rope-scaling": 1, "--rope-scale": 1, "--rope-freq-base": 1,
    "--rope-freq-scale": 1, "--yarn-orig-ctx": 1, "--yarn-ext-factor": 1,
    "--yarn-attn-factor": 1, "--yarn-beta-slow": 1, "--yarn-beta-fast": 1,
}
# fmt: on


def check_server_args(args: Sequence[str]) -> tuple[str, ...]:
    """The extra llama-server arguments of a router's backends, checked: ValueError names
    any that overrides what the router sets → those that change what a state holds
    (each flag with its values), for the fingerprint."""
    refused = [a for a in args if a.split("=", 1)[0] in RESERVED_FLAGS]
    if refused:
        raise ValueError(
            f"llama-server arguments {' '.join(refused)} are the router's to set: use its own "
            "options (--model, --slots, --cache-type-k, --cache-type-v; "
            "docs/llama-server.md, 'The flags every backend needs')"
        )
    model: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        n = MODEL_FLAGS.get(flag, 0) if "=" not in args[i] else 0
        if flag in MODEL_FLAGS:
            model += args[i : i + 1 + n]
        i += 1 + n
    return tuple(model)


#: The calls a server answers at once (tokens, a template) wait this long, not for ever:
#: a hung server's are a transport error, and the request is routed by load alone.
QUICK_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


class SlotActionError(RuntimeError):
    """A ``/slots/{id}`` action the server refused or failed (why is in the message)."""


class BackendHung(RuntimeError):
    """The router stopped waiting for a server's answer: the server was judged hung (a
    gateway timeout to the client: ``status``)."""

    status = 504


class BackendGone(BackendHung):
    """The router stopped waiting for a server's answer: the server was judged gone (it
    refuses or resets connections, or answers ``/health`` with other than 200; a bad
    gateway to the client)."""

    status = 502


class Health(enum.Enum):
    """How a ``/health`` probe went."""

    UP = "up"  # answered 200: the model is loaded
    HUNG = "hung"  # no answer in time (connecting included): the server is stuck
    GONE = "gone"  # refused, reset, or an answer other than 200: no ready server there


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Backend:
    """A llama-server the router sends requests to (started by it or attached)."""

    index: int
    url: str
    slot_dir: str
    n_slots: int = 1
    alive: bool = False
    process: BackendProcess | None = None
    slots: list[Slot] = field(default_factory=list)
    identity: Any = None  # maasd.router.identity.Identity, once identified
    rejected: str = ""  # why it is kept out of rotation ("": it is not)
    recheck_at: float = 0.0  # when a kept-out attached backend is asked again
    missed: int = 0  # /health probes of an attached backend unanswered in a row
    http: httpx.AsyncClient = field(init=False)
    #: the waits for the server's answer (:meth:`until_hung`), each with why it was ended
    _waits: dict[asyncio.Timeout, Health | None] = field(
        init=False, default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        # Completions may run for minutes: no read timeout; connecting must be quick. Idle
        # connections are dropped after 2 s, before llama-server's own keep-alive timeout
        # (5 s) closes them under a request being sent.
        self.http = httpx.AsyncClient(
            base_url=self.url.rstrip("/"),
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(
                max_connections=64, max_keepalive_connections=16, keepalive_expiry=2.0
            ),
        )
        self.resize(self.n_slots)

    def resize(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.slots = [Slot(self.index, i) for i in range(n_slots)]

    def forget_all(self) -> None:
        """The server restarted (or died): its slots hold nothing."""
        for s in self.slots:
            s.forget()

    @contextlib.asynccontextmanager
    async def until_hung(self) -> AsyncIterator[None]:
        """Wait for the server's answer in this block (a completion, a slot action: no read
        timeout, since an answer may take minutes) until the server is judged hung: then
        :meth:`end_waits` cancels the block, which raises :class:`BackendHung` (judged
        gone: :class:`BackendGone`). Nothing else ends it: a long answer of a server that
        answers ``/health`` is never cut."""
        why: Health | None = None
        try:
            async with asyncio.timeout(None) as t:
                self._waits[t] = None
                try:
                    yield
                finally:
                    why = self._waits.pop(t, None)
        except TimeoutError:
            if not t.expired():  # a timeout of the block's own
                raise
            if why is Health.GONE:
                raise BackendGone(f"llama-server {self.url} went away (gone)") from None
            raise BackendHung(f"llama-server {self.url} stopped answering (hung)") from None

    async def reads(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        """A streamed response's bytes as they come, each read :meth:`until_hung` — the
        reads alone: a cut must never land in the caller's work between them."""
        chunks = resp.aiter_raw()
        while True:
            async with self.until_hung():
                chunk = await anext(chunks, None)
            if chunk is None:
                return
            yield chunk

    def end_waits(self, why: Health = Health.HUNG) -> int:
        """End every wait for the server's answer (:meth:`until_hung`): it is hung (or
        gone: ``why``) → how many. Attached backends need it: no kill ends their requests."""
        now = asyncio.get_running_loop().time()
        waits = [t for t in self._waits if not t.expired()]
        for t in waits:
            self._waits[t] = why
            t.reschedule(now)
        return len(waits)

    async def health(self, timeout_s: float = 5.0) -> Health:
        """How the server answers ``/health``: 200 (up), not within ``timeout_s`` (hung),
        or it refuses, resets or answers otherwise (gone)."""
        try:
            r = await self.http.get("/health", timeout=timeout_s)
        except httpx.TimeoutException:
            return Health.HUNG
        except httpx.HTTPError:
            return Health.GONE
        return Health.UP if r.status_code == 200 else Health.GONE

    async def probe(self) -> bool:
        """Whether the server answers ``/health`` with 200 (the model is loaded)."""
        return await self.health() is Health.UP

    async def props(self) -> dict[str, Any]:
        r = await self.http.get("/props", timeout=10.0)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    async def lora_adapters(self) -> list[Any]:
        """The LoRA adapters the server has loaded (``/lora-adapters``; [] if none)."""
        r = await self.http.get("/lora-adapters", timeout=10.0)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        out = r.json()
        return list(out) if isinstance(out, list) else [out]

    async def processing(self, slot: int) -> bool:
        """Whether the server is still working in ``slot`` (``/slots`` ``is_processing``):
        after a client went away mid-answer, until the server sees it."""
        r = await self.http.get("/slots", timeout=10.0)
        r.raise_for_status()
        for s in r.json():
            if isinstance(s, dict) and s.get("id") == slot:
                return bool(s.get("is_processing"))
        return False

    async def settle(self, slot: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the server no longer works in ``slot`` →
        whether it stopped (False too when ``/slots`` does not answer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                if not await self.processing(slot):
                    return True
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                return False
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)

    async def tokenize(self, text: str) -> list[int]:
        """The tokens the server evaluates for ``text`` (special tokens parsed, BOS added
        as the model wants: what its completion endpoints do)."""
        r = await self.http.post(
            "/tokenize",
            json={"content": text, "add_special": True, "parse_special": True},
            timeout=QUICK_TIMEOUT,
        )
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    async def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt the server makes of a chat request (its own template)."""
        r = await self.http.post("/apply-template", json=body, timeout=QUICK_TIMEOUT)
        r.raise_for_status()
        return str(r.json()["prompt"])

    async def slot_action(
        self, slot: int, action: str, filename: str | None = None
    ) -> dict[str, Any]:
        """``POST /slots/{slot}?action=…`` → the server's answer; raises SlotActionError
        (also when the server is judged hung: a save after an answer waits for no one)."""
        body = {} if filename is None else {"filename": filename}
        try:
            async with self.until_hung():
                r = await self.http.post(f"/slots/{slot}", params={"action": action}, json=body)
        except (httpx.HTTPError, BackendHung) as exc:
            raise SlotActionError(f"{action} of slot {slot}: {exc}") from exc
        if r.status_code != 200:
            raise SlotActionError(f"{action} of slot {slot}: {r.status_code} {r.text[:200]}")
        out: dict[str, Any] = r.json()
        return out

    async def close(self) -> None:
        await self.http.aclose()


class BackendProcess:
    """A llama-server the router runs: started, watched, restarted when it dies."""

    def __init__(
        self,
        binary: str,
        model: str,
        *,
        n_slots: int,
        cache_types: tuple[str, str] = ("f16", "f16"),
        extra: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_dir: str | None = None,
    ) -> None:
        self.binary = binary
        self.model = model
        self.n_slots = n_slots
        self.cache_types = cache_types
        check_server_args(extra)
        self.extra = list(extra)
        self.host = host
        self.port = free_port(host)
        self.slot_dir = tempfile.mkdtemp(prefix="maasd-router-slots-")
        self.log_dir = log_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The command line: the extra arguments first, so that even an alias the router
        missed could not override what follows (llama.cpp keeps a flag's last value)."""
        return [
            self.binary,
            *self.extra,
            "-m",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--slot-save-path",
            self.slot_dir + "/",
            "-np",
            str(self.n_slots),
            *REQUIRED_FLAGS,
            *REQUIRED_FLAGS_EXTRA,
            "-ctk",
            self.cache_types[0],
            "-ctv",
            self.cache_types[1],
        ]

    @staticmethod
    def env() -> dict[str, str]:
        """The router's environment less llama.cpp's ``LLAMA_ARG_*`` variables: what a
        backend runs is on its command line, where the router checks it."""
        return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}

    async def start(self) -> None:
        sweep(self.slot_dir)
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_dir:
            out = open(os.path.join(self.log_dir, f"llama-server-{self.port}.log"), "ab")  # noqa: SIM115
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.env(),
            )
        finally:
            if out is not asyncio.subprocess.DEVNULL:
                out.close()
        logger.info("started llama-server pid %d on %s", self.proc.pid, self.url)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def ended(self) -> str:
        """How the process ended, for a message (its log: ``--log-dir``)."""
        code = self.proc.returncode if self.proc is not None else None
        return f"exited with {code}" if code is not None and code >= 0 else f"died ({code})"

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL (a hung server: SIGTERM would wait for it)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def stop(self, timeout: float = 10.0) -> None:
        p = self.proc
        if p is None or p.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()

    def remove_dir(self) -> None:
        sweep(self.slot_dir)
        with contextlib.suppress(OSError):
            for p in Path(self.slot_dir).iterdir():
                p.unlink()
            os.rmdir(self.slot_dir)
