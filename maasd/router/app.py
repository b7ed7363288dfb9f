"""``maasd router``'s HTTP side: a litestar app over :class:`~maasd.router.proxy.Proxy`.

litestar (already maasd's REST framework) answers the client; a streamed completion is
a litestar ``Stream`` of the very bytes httpx reads from the backend, so the router
writes no HTTP or server-sent-events code of its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from litestar import Litestar, Request, get, post
from litestar.exceptions import HTTPException
from litestar.response import Response, Stream

from maasd.client import Client
from maasd.llama.link import Link
from maasd.router import DEFAULT_CHUNK, DEFAULT_MIN_SAVE_TOKENS, PUBLISH_TTL_S
from maasd.router.fleet import Fleet, FleetConfig
from maasd.router.metrics import CONTENT_TYPE, RouterMetrics
from maasd.router.proxy import Answer, Proxy, Unroutable, error_answer
from maasd.router.publish import Publisher
from maasd.router.share import Sharing
from maasd.serving import head_as_get

__all__ = ["RouterConfig", "Router", "build_app"]

logger = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    fleet: FleetConfig = field(default_factory=FleetConfig)
    socket_path: str | None = None
    maasd_url: str | None = None
    key: str | None = None
    pool: str | None = None
    chunk: int = DEFAULT_CHUNK
    min_save_tokens: int = DEFAULT_MIN_SAVE_TOKENS
    ttl_s: int = PUBLISH_TTL_S
    copy_slot_files: bool = False


class Router:
    """The parts of one router, started and stopped together."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.fleet = Fleet(config.fleet, self.metrics)
        self.link: Link | None = None
        self.publish_link: Link | None = None
        self.sharing: Sharing | None = None
        self.proxy = Proxy(self.fleet, None, self.metrics, None)
        self._rest: Client | None = None
        self.start_error = ""  # why start() failed, in one line ("": it did not)

    async def start(self) -> None:
        await self.fleet.start()
        cfg = self.config
        if cfg.socket_path and cfg.key:
            self.link = Link(cfg.socket_path, cfg.key, on_change=self._sharing_changed)
            self.publish_link = Link(cfg.socket_path, cfg.key)  # publishes: off the request path
            if cfg.maasd_url:
                self._rest = Client(cfg.maasd_url, cfg.key)
            self.sharing = Sharing(
                self.link,
                self.fleet.fingerprint,
                chunk=cfg.chunk,
                pool=cfg.pool,
                ttl_s=cfg.ttl_s,
                drop=self._drop,
                count=self.metrics.count_entry,
                copy_files=cfg.copy_slot_files,
                publish_link=self.publish_link,
                settings=self.fleet.identity.settings if self.fleet.identity else None,
            )
            self.link.get()  # connect now, so the log says at once whether sharing is on
            publisher = Publisher(self.sharing, self.metrics, min_tokens=cfg.min_save_tokens)
            self.proxy = Proxy(self.fleet, self.sharing, self.metrics, publisher)
        else:
            logger.warning(
                "PREFIX SHARING OFF: no maasd socket or key given; serving as a plain balancer"
            )
        self.metrics.sharing.set(1 if self.link is not None and self.link.up else 0)
        logger.info(
            "maasd router: %d backends, fingerprint %s, model %s",
            len(self.fleet.backends),
            self.fleet.fingerprint,
            self.fleet.model_path,
        )

    def _sharing_changed(self, up: bool, _why: str) -> None:
        self.metrics.sharing.set(1 if up else 0)

    def _drop(self, buffer_id: str) -> None:
        """Release an entry that failed its checks, so no one else tries it (best effort)."""
        if self._rest is None:
            return
        try:
            self._rest.release(buffer_id)
        except Exception as exc:  # a drop is best effort
            logger.info("could not drop entry %s: %s", buffer_id, exc)

    async def stop(self) -> None:
        await self.proxy.drain()
        await self.fleet.close()
        for link in (self.link, self.publish_link):
            if link is not None:
                link.close()
        if self.sharing is not None:
            self.sharing.close()
        if self._rest is not None:
            self._rest.close()

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if any(b.alive for b in self.fleet.backends) else "down",
            "sharing": bool(self.link is not None and self.link.up),
            "sharing_why": self.link.why if self.link is not None else "no maasd configured",
            "fingerprint": self.fleet.fingerprint,
            "backends": [
                {
                    "url": b.url,
                    "slot_dir": b.slot_dir,
                    "alive": b.alive,
                    "rejected": b.rejected or None,
                    "slots": b.n_slots,
                    "busy": sum(s.busy for s in b.slots),
                    "restarts": b.process.restarts if b.process else 0,
                    "pid": b.process.proc.pid if b.process and b.process.proc else None,
                }
                for b in self.fleet.backends
            ],
        }


def _respond(a: Answer) -> Response[Any]:
    if a.stream is not None:
        return Stream(a.stream, status_code=a.status, media_type=a.media_type, headers=a.headers)
    return Response(a.body, status_code=a.status, media_type=a.media_type, headers=a.headers)


def _problem(status: int, message: str) -> Response[Any]:
    return _respond(error_answer(status, message))


def _http_error(_request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    """litestar's own refusals (a body over its limit: 413, an unknown path: 404, a
    wrong method: 405) in the OpenAI form every other error of the router has."""
    return _problem(exc.status_code, str(exc.detail))


def build_app(router: Router) -> Litestar:
    async def complete(request: Request[Any, Any, Any]) -> Response[Any]:
        if not any(b.alive for b in router.fleet.backends):
            return _problem(503, "no backend is up")
        try:
            return _respond(await router.proxy.complete(request.url.path, await request.body()))
        except Unroutable as exc:
            return _problem(400, str(exc))

    @post(["/v1/chat/completions", "/v1/completions"], status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await complete(request)

    @get("/v1/models")
    async def models() -> Response[Any]:
        b = router.fleet.any_live()
        if b is None:
            return _problem(503, "no backend is up")
        try:
            r = await b.http.get("/v1/models", timeout=30.0)
        except httpx.HTTPError as exc:
            return _problem(502, f"the backend did not answer: {exc}")
        if r.status_code >= 500:
            return _problem(502, f"the backend failed: {r.status_code}")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @get("/metrics")
    async def metrics() -> Response[bytes]:
        return Response(router.metrics.scrape(), media_type=CONTENT_TYPE)

    @get("/healthz")
    async def healthz() -> Response[Any]:
        h = router.health()
        return Response(h, status_code=200 if h["status"] == "ok" else 503)

    @asynccontextmanager
    async def lifespan(_app: Litestar) -> AsyncIterator[None]:
        try:
            await router.start()
        except Exception as exc:
            router.start_error = str(exc) or type(exc).__name__
            await router.stop()  # the backends it started already
            raise
        try:
            yield
        finally:
            await router.stop()

    app = Litestar(
        route_handlers=[completions, models, metrics, healthz],
        lifespan=[lifespan],
        exception_handlers={HTTPException: _http_error},
        debug=bool(os.environ.get("MAASD_ROUTER_DEBUG")),
    )
    app.asgi_handler = head_as_get(app.asgi_handler)  # a balancer's HEAD /healthz probe
    return app
