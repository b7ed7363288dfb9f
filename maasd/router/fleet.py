"""The backends of one router: started or attached, identified, watched, and their slots
handed out.

Every backend is identified (:mod:`maasd.router.identity`: what it really runs) before it
serves, at start and whenever it comes back: at start, backends that differ in anything
a state depends on are refused — the router does not start, and says what differs — since
one router has one fingerprint (a fleet of two models behind one OpenAI endpoint is a
misconfiguration, not a feature); later, a backend that comes back running something
else is kept out of rotation (``/healthz`` says why) while the others serve.

``acquire`` is the only way to a slot: it applies :func:`~maasd.router.slots.choose`
and marks the slot busy in the same step (one event loop: no lock needed beyond the
condition the waiters sleep on), so two requests never share a slot and a restore never
targets a busy one. ``release`` gives it back with what it now holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from maasd.router.backend import Backend, BackendProcess, Health, check_server_args
from maasd.router.files import sweep
from maasd.router.identity import Identity, IdentityError, build_id, identify, same_identity
from maasd.router.metrics import RouterMetrics
from maasd.router.slots import Choice, Slot, choose, restore_target

__all__ = ["Fleet", "FleetConfig", "NoSlot", "build_id"]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10, 30)
RECHECK_S = 30.0  # how often a backend kept out for what it runs is asked again
#: A backend that leaves this many ``/health`` probes in a row unanswered (each waits
#: 5 s, 1 s apart) is hung — stopped, deadlocked, swapped out — or gone: llama-server
#: answers ``/health`` from its HTTP threads, also while it generates. One the router
#: started is killed, so that its clients get an error and it is restarted; an attached
#: one's requests are ended (:meth:`Backend.end_waits`), since no kill ends them. Each
#: attached backend is probed by a task of its own: judging one takes as long however
#: many others are hung.
HUNG_PROBES = 3


def _up(metrics: RouterMetrics, b: Backend) -> None:
    b.alive = True
    metrics.backend_up.labels(str(b.index)).set(1)


def _down(metrics: RouterMetrics, b: Backend) -> None:
    b.alive = False
    metrics.backend_up.labels(str(b.index)).set(0)


def count_probe(b: Backend, health: Health, metrics: RouterMetrics) -> bool:
    """Count an attached backend's ``/health`` probe → whether it is up. At the
    ``HUNG_PROBES``-th unanswered in a row it is hung (that probe timed out:
    ``backend_hung``) or gone (refused, reset or not 200: ``backend_gone``): the requests
    waiting for its answer are ended — no read timeout would end them, and no kill: it
    is not the router's."""
    up = health is Health.UP
    b.missed = 0 if up else b.missed + 1
    if b.missed == HUNG_PROBES:
        gone = health is Health.GONE
        n = b.end_waits(Health.GONE if gone else Health.HUNG)
        metrics.errors.labels(str(b.index), "backend_gone" if gone else "backend_hung").inc()
        logger.warning(
            "llama-server %s does not answer /health (%s): %d requests ended",
            b.url,
            "gone" if gone else "hung",
            n,
        )
    return up


async def watch_hung(
    b: Backend, metrics: RouterMetrics, closing: Callable[[], bool], every_s: float = 1.0
) -> None:
    """Kill a started backend that no longer answers ``/health`` (its process lives, but
    it is hung): out of rotation at once, then the fleet's supervisor restarts it. A hung
    one would otherwise hold its requests, and every request it tokenizes, for ever."""
    assert b.process is not None
    missed = 0
    while not closing():
        await asyncio.sleep(every_s)
        if not b.alive or not b.process.running:
            missed = 0  # down already: the supervisor restarts it
            continue
        missed = 0 if await b.probe() else missed + 1
        if missed < HUNG_PROBES or closing() or not b.process.running:
            continue
        missed = 0
        _down(metrics, b)
        metrics.errors.labels(str(b.index), "backend_hung").inc()
        logger.warning("llama-server %s does not answer /health: killing it", b.url)
        b.process.kill()


class NoSlot(RuntimeError):
    """No slot for a request: too many wait already, or none came free in time (a 503)."""


@dataclass
class FleetConfig:
    attach: Sequence[tuple[str, str]] = ()  # (URL, slot dir)
    spawn: int = 0
    llama_server: str | None = None
    model: str | None = None
    slots_per_backend: int = 1
    server_args: Sequence[str] = ()
    log_dir: str | None = None
    type_k: str | None = None  # None: f16 for the backends it starts, any for attached ones
    type_v: str | None = None
    copy_files: bool = False  # --slot-files copy (the identity probe saves a slot too)
    ready_timeout_s: float = 300.0
    slot_timeout_s: float = 600.0  # a request waits this long for a slot at most
    max_waiting: int = 64  # requests waiting for a slot at once, at most
    restart: bool = True
    processes: list[BackendProcess] = field(default_factory=list)


class Fleet:
    def __init__(self, config: FleetConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.backends: list[Backend] = []
        self.fingerprint = self.model_path = ""
        self.identity: Identity | None = None
        self.model_args = check_server_args(config.server_args) if config.spawn else ()
        self.waiting = 0
        self._cond = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # -- lifecycle

    async def start(self) -> None:
        cfg = self.config
        for url, slot_dir in cfg.attach:
            if n := sweep(slot_dir):  # links a crashed router left
                logger.info("removed %d stale router links from %s", n, slot_dir)
            self.backends.append(Backend(len(self.backends), url, slot_dir))
        for _ in range(cfg.spawn):
            if not cfg.llama_server or not cfg.model:
                raise ValueError("--backends needs --llama-server and --model")
            p = BackendProcess(
                cfg.llama_server,
                cfg.model,
                n_slots=cfg.slots_per_backend,
                cache_types=(cfg.type_k or "f16", cfg.type_v or "f16"),
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
        await self._identify_all()
        for b in self.backends:
            _up(self.metrics, b)
            self.metrics.backend_info.labels(str(b.index), b.url).set(1)
            self.metrics.slots.labels(str(b.index)).set(b.n_slots)
            if b.process is not None:
                self._tasks.append(asyncio.create_task(self._supervise(b)))
                hung = watch_hung(b, self.metrics, lambda: self._closing)
                self._tasks.append(asyncio.create_task(hung))
            else:  # attached: each probed on its own, never waiting for another's probe
                self._tasks.append(asyncio.create_task(self._watch_attached(b)))

    async def _until_ready(self, b: Backend) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ready_timeout_s
        while not await b.probe():
            if b.process is not None and not b.process.running:
                raise RuntimeError(f"llama-server {b.url} {b.process.ended} before it was ready")
            if loop.time() > deadline:
                raise TimeoutError(f"llama-server {b.url} not ready")
            await asyncio.sleep(0.2)
        props = await b.props()
        b.resize(int(props.get("total_slots", b.n_slots)))

    async def _identity_of(self, b: Backend) -> Identity:
        return await identify(
            b,
            swa_full=True,  # set on those it starts; required of attached ones (identity.py)
            model_args=self.model_args,
            copy_files=self.config.copy_files,
        )

    async def _identify_all(self) -> None:
        """The fleet's identity: every backend must run the same, and what was asked."""
        cfg = self.config
        ids = [await self._identity_of(b) for b in self.backends]  # one hash per file
        first = same_identity(
            [b.url for b in self.backends],
            ids,
            model=None if cfg.spawn else cfg.model,
            cache_types=(cfg.type_k, cfg.type_v),
        )
        for b, i in zip(self.backends, ids, strict=True):
            b.identity = i
        self.identity, self.fingerprint, self.model_path = (
            first,
            first.fingerprint,
            first.model_path,
        )

    async def _admit(self, b: Backend) -> bool:
        """Identify ``b`` as it comes back: in rotation if it runs what the fleet runs,
        else kept out (why: ``b.rejected``) → whether it is in."""
        assert self.identity is not None
        try:
            i = await self._identity_of(b)
            why = "; ".join(self.identity.differences(i))
        except IdentityError as exc:
            why = str(exc)
        if why:
            b.rejected = f"runs what the fleet does not: {why}"
            logger.error("llama-server %s kept out of rotation: %s", b.url, b.rejected)
            self.metrics.errors.labels(str(b.index), "identity").inc()
            return False
        b.identity, b.rejected = i, ""
        _up(self.metrics, b)
        return True

    async def _supervise(self, b: Backend) -> None:
        assert b.process is not None
        attempt = 0
        while not self._closing:
            code = await b.process.wait()
            if self._closing:
                return
            _down(self.metrics, b)
            b.forget_all()
            self.metrics.errors.labels(str(b.index), "backend_died").inc()
            logger.warning("llama-server %s exited with %s: restarting it", b.url, code)
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1
            try:
                await b.process.start()
                await self._until_ready(b)
                b.process.restarts += 1
                self.metrics.restarts.labels(str(b.index)).inc()
                admitted = await self._admit(b)
            except Exception as exc:  # an HTTP error of /props included: killed, restarted
                logger.warning("llama-server %s did not come back: %s", b.url, exc)
                b.process.kill()  # (if it runs) restarted by the next turn, after its backoff
                continue
            attempt = 0
            if admitted:
                async with self._cond:
                    self._cond.notify_all()

    async def _watch_attached(self, b: Backend, every_s: float = 1.0) -> None:
        """An attached backend is not ours to restart: follow its ``/health`` (out at once,
        hung or gone: :func:`count_probe`), identify it when it comes back; whatever it
        answers, its watch goes on. One task per backend, its probes one after another."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            await asyncio.sleep(every_s)
            up = count_probe(b, await b.health(), self.metrics)
            if up and b.rejected and loop.time() < b.recheck_at:
                continue  # kept out: asked again every RECHECK_S
            if up == b.alive:
                continue
            _down(self.metrics, b)
            b.forget_all()  # a backend that went away and came back holds nothing
            if not up:
                self.metrics.errors.labels(str(b.index), "backend_down").inc()
                logger.warning("llama-server %s does not answer", b.url)
                continue
            b.recheck_at = loop.time() + RECHECK_S
            try:
                await self._until_ready(b)
                admitted = await self._admit(b)
            except Exception as exc:  # an HTTP error, not JSON: out, asked again next probe
                logger.warning("llama-server %s answers, but not as it should: %s", b.url, exc)
                continue
            if admitted:
                logger.info("llama-server %s is back", b.url)
                async with self._cond:
                    self._cond.notify_all()

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
        self, tokens: npt.NDArray[np.int32], *, sharing: bool, avoid: int | None = None
    ) -> Choice:
        """A slot for ``tokens``, marked busy (on another backend than ``avoid`` if one is
        up); waits while every live slot is busy, but raises :class:`NoSlot` if
        ``max_waiting`` requests wait already, or after ``slot_timeout_s``."""
        cfg = self.config
        choice = self._pick(tokens, sharing, avoid)
        if choice is not None:
            return choice
        if self.waiting >= cfg.max_waiting:
            self.metrics.errors.labels("-", "too_many_waiting").inc()
            raise NoSlot(f"{self.waiting} requests wait for a slot already (--max-waiting)")
        self.waiting += 1
        try:
            async with self._cond:
                choice = await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._pick(tokens, sharing, avoid)),
                    cfg.slot_timeout_s,
                )
        except TimeoutError:
            self.metrics.errors.labels("-", "slot_timeout").inc()
            raise NoSlot(f"no slot came free in {cfg.slot_timeout_s:g} s") from None
        finally:
            self.waiting -= 1
        assert choice is not None  # wait_for returns the predicate's first true value
        return choice

    def _pick(
        self, tokens: npt.NDArray[np.int32], sharing: bool, avoid: int | None = None
    ) -> Choice | None:
        up = [b for b in self.backends if b.alive]
        if any(b.index != avoid for b in up):  # another backend than the one that failed
            up = [b for b in up if b.index != avoid]
        live = [s for b in up for s in b.slots]
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
