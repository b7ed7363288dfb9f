"""One ``llama-server`` behind the router: its HTTP client, its slots, and (if the router
started it) its process, restarted when it dies.

The HTTP client is httpx's ``AsyncClient`` (connection pooling, timeouts, streaming
bodies as they arrive): the router forwards a streamed completion's bytes as httpx
yields them and never parses or re-frames the server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from maasd.router.files import sweep
from maasd.router.slots import Slot

__all__ = ["Backend", "BackendProcess", "REQUIRED_FLAGS", "SlotActionError"]

logger = logging.getLogger(__name__)

#: What every backend runs with, and why (docs/llama-server.md):
#: --kv-unified   one KV stream, so a state fits any slot of any process;
#: -fa off        V stored transposed, as llama-cpp-python's default (shared states);
#: --swa-full     a full cache for sliding-window layers: a saved prefix can be continued;
#: --cache-ram 0  no second, private prompt cache: maasd is the cache, bounded and shared;
#: --no-cache-idle-slots  idle slots keep what they hold (the router tracks it).
REQUIRED_FLAGS = ("--kv-unified", "-fa", "off", "--swa-full", "--cache-ram", "0")
REQUIRED_FLAGS_EXTRA = ("--no-cache-idle-slots",)


class SlotActionError(RuntimeError):
    """A ``/slots/{id}`` action the server refused or failed (why is in the message)."""


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
    http: httpx.AsyncClient = field(init=False)

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

    async def probe(self) -> bool:
        """Whether the server answers ``/health`` with 200 (the model is loaded)."""
        try:
            r = await self.http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def props(self) -> dict[str, Any]:
        r = await self.http.get("/props", timeout=10.0)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    async def tokenize(self, text: str) -> list[int]:
        """The tokens the server evaluates for ``text`` (special tokens parsed, BOS added
        as the model wants: what its completion endpoints do)."""
        r = await self.http.post(
            "/tokenize", json={"content": text, "add_special": True, "parse_special": True}
        )
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    async def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt the server makes of a chat request (its own template)."""
        r = await self.http.post("/apply-template", json=body)
        r.raise_for_status()
        return str(r.json()["prompt"])

    async def slot_action(
        self, slot: int, action: str, filename: str | None = None
    ) -> dict[str, Any]:
        """``POST /slots/{slot}?action=…`` → the server's answer; raises SlotActionError."""
        body = {} if filename is None else {"filename": filename}
        try:
            r = await self.http.post(f"/slots/{slot}", params={"action": action}, json=body)
        except httpx.HTTPError as exc:
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
        extra: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_dir: str | None = None,
    ) -> None:
        self.binary = binary
        self.model = model
        self.n_slots = n_slots
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
        return [
            self.binary,
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
            *self.extra,
        ]

    async def start(self) -> None:
        sweep(self.slot_dir)
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_dir:
            out = open(os.path.join(self.log_dir, f"llama-server-{self.port}.log"), "ab")  # noqa: SIM115
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
            )
        finally:
            if out is not asyncio.subprocess.DEVNULL:
                out.close()
        logger.info("started llama-server pid %d on %s", self.proc.pid, self.url)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

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
