"""The backends of one router: started or attached, watched, and their slots handed out.

``acquire`` is the only way to a slot: it applies :func:`~maasd.router.slots.choose`
and marks the slot busy in the same step (one event loop: no lock needed beyond the
condition the waiters sleep on), so two requests never share a slot and a restore never
targets a busy one. ``release`` gives it back with what it now holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend, BackendProcess
from maasd.router.metrics import RouterMetrics
from maasd.router.slots import Choice, Slot, choose, restore_target
from maasd.router.state import fleet_fingerprint

__all__ = ["Fleet", "FleetConfig", "build_id"]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10, 30)


def build_id(build_info: str) -> str:
    """The llama.cpp build a server names in ``/props``: ``b0-llama-cpp-python-0.3.36`` →
    ``llama-cpp-python-0.3.36`` (how llama-cpp-python workers name the same build)."""
    return re.sub(r"^b\d+-", "", build_info)


@dataclass
class FleetConfig:
    attach: Sequence[tuple[str, str]] = ()  # (URL, slot dir)
    spawn: int = 0
    llama_server: str | None = None
    model: str | None = None
    slots_per_backend: int = 1
    server_args: Sequence[str] = ()
    log_dir: str | None = None
    type_k: str = "f16"
    type_v: str = "f16"
    ready_timeout_s: float = 300.0
    restart: bool = True
    processes: list[BackendProcess] = field(default_factory=list)


class Fleet:
    def __init__(self, config: FleetConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.backends: list[Backend] = []
        self.fingerprint = ""
        self.model_path = ""
        self._cond = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # -- lifecycle

    async def start(self) -> None:
        cfg = self.config
        for url, slot_dir in cfg.attach:
            self.backends.append(Backend(len(self.backends), url, slot_dir))
        for _ in range(cfg.spawn):
            if not cfg.llama_server or not cfg.model:
                raise ValueError("--backends needs --llama-server and --model")
            p = BackendProcess(
                cfg.llama_server,
                cfg.model,
                n_slots=cfg.slots_per_backend,
                extra=cfg.server_args,
                log_dir=cfg.log_dir,
            )
            await p.start()
            self.backends.append(
                Backend(len(self.backends), p.url, p.slot_dir, cfg.slots_per_backend, process=p)
            )
        if not self.backends:
            raise ValueError("no backends: give --backends N or --backend URL")
        await asyncio.gather(*(self._until_ready(b) for b in self.backends))
        await self._identify()
        for b in self.backends:
            self.metrics.backend_info.labels(str(b.index), b.url).set(1)
            self.metrics.slots.labels(str(b.index)).set(b.n_slots)
            if b.process is not None:
                self._tasks.append(asyncio.create_task(self._supervise(b)))
        if cfg.attach:
            self._tasks.append(asyncio.create_task(self._watch_attached()))

    async def _until_ready(self, b: Backend) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ready_timeout_s
        while not await b.probe():
            if b.process is not None and not b.process.running:
                raise RuntimeError(f"llama-server {b.url} exited ({b.process.proc})")
            if loop.time() > deadline:
                raise TimeoutError(f"llama-server {b.url} not ready")
            await asyncio.sleep(0.2)
        props = await b.props()
        b.resize(int(props.get("total_slots", b.n_slots)))
        b.alive = True
        self.metrics.backend_up.labels(str(b.index)).set(1)

    async def _identify(self) -> None:
        """The fingerprint of the fleet: every backend must run the same model and build."""
        seen: dict[str, str] = {}
        for b in self.backends:
            props = await b.props()
            path = self.config.model or str(props.get("model_path", ""))
            fp = fleet_fingerprint(
                path,
                build_id(str(props.get("build_info", "?"))),
                type_k=self.config.type_k,
                type_v=self.config.type_v,
            )
            seen[fp] = b.url
            self.model_path = path
        if len(seen) > 1:
            raise ValueError(f"backends run different models or builds: {sorted(seen.values())}")
        self.fingerprint = next(iter(seen))

    async def _supervise(self, b: Backend) -> None:
        assert b.process is not None
        attempt = 0
        while not self._closing:
            code = await b.process.wait()
            if self._closing:
                return
            b.alive = False
            b.forget_all()
            self.metrics.backend_up.labels(str(b.index)).set(0)
            self.metrics.errors.labels(str(b.index), "backend_died").inc()
            logger.warning("llama-server %s exited with %s: restarting it", b.url, code)
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1
            try:
                await b.process.start()
                await self._until_ready(b)
            except (OSError, RuntimeError, TimeoutError) as exc:
                logger.warning("llama-server %s did not come back: %s", b.url, exc)
                continue
            attempt = 0
            b.process.restarts += 1
            self.metrics.restarts.labels(str(b.index)).inc()
            async with self._cond:
                self._cond.notify_all()

    async def _watch_attached(self, every_s: float = 1.0) -> None:
        """Attached backends are not ours to restart: follow their ``/health``."""
        while not self._closing:
            await asyncio.sleep(every_s)
            for b in self.backends:
                if b.process is not None:
                    continue
                up = await b.probe()
                if up == b.alive:
                    continue
                b.alive = up
                b.forget_all()  # a backend that went away and came back holds nothing
                self.metrics.backend_up.labels(str(b.index)).set(1 if up else 0)
                if up:
                    logger.info("llama-server %s is back", b.url)
                    async with self._cond:
                        self._cond.notify_all()
                else:
                    self.metrics.errors.labels(str(b.index), "backend_down").inc()
                    logger.warning("llama-server %s does not answer", b.url)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for b in self.backends:
            if b.process is not None:
                await b.process.stop()
                b.process.remove_dir()
            await b.close()

    # -- slots

    def any_live(self) -> Backend | None:
        live = [b for b in self.backends if b.alive]
        return min(live, key=self._load) if live else None

    def _load(self, b: Backend) -> int:
        return sum(s.busy for s in b.slots)

    async def acquire(
        self, tokens: npt.NDArray[np.int32], *, sharing: bool, timeout: float = 600.0
    ) -> Choice:
        """A slot for ``tokens``, marked busy (waits while every live slot is busy)."""
        async with self._cond:
            choice = await asyncio.wait_for(
                self._cond.wait_for(lambda: self._pick(tokens, sharing)), timeout
            )
        assert choice is not None  # wait_for returns the predicate's first true value
        return choice

    def _pick(self, tokens: npt.NDArray[np.int32], sharing: bool) -> Choice | None:
        live = [s for b in self.backends if b.alive for s in b.slots]
        load = {b.index: self._load(b) for b in self.backends}
        choice = choose(live, tokens, load, sharing=sharing)
        if choice is None:
            return None
        if choice.restore:
            target = restore_target(live, choice, load)
            if target is not choice.slot:
                choice = Choice(target, 0, True)
        choice.slot.busy = True
        self._gauge(choice.slot.backend)
        return choice

    async def release(self, slot: Slot, held: npt.NDArray[np.int32] | None) -> None:
        """Give ``slot`` back; ``held``: what it holds now (None: unknown, forget it)."""
        if held is None:
            slot.forget()
        else:
            slot.held = held
        slot.busy = False
        self._gauge(slot.backend)
        async with self._cond:
            self._cond.notify_all()

    def backend_of(self, slot: Slot) -> Backend:
        return self.backends[slot.backend]

    def _gauge(self, index: int) -> None:
        self.metrics.slots_busy.labels(str(index)).set(self._load(self.backends[index]))
