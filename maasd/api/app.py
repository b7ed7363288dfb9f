"""The REST control plane: a litestar app over the use-cases of one :class:`maasd.core.Service`.

How a request goes through it::

    raw path       an empty, '.' or '..' segment, or an encoded '/' → 400 problem,
                   before routing (maasd.api.paths)
    HEAD           routed as GET, its answer sent without the body (maasd.serving)
    routing        unknown path → 404 problem, wrong method → 405 problem
    before_request /v1: authenticated — a valid key (401), the route's role (403),
                   on the event loop, before the body is read (maasd.api.auth)
    body           read (≤ 64 KiB, else 413), decoded strictly once (400, 415)
                   into the handler's ``data`` type (maasd.api.strict)
    handler        one use-case call in a worker thread, at most ``threads`` at once
                   (the use-case objects: maasd.api.dependencies)
    errors         every error answer is a problem (maasd.api.problems)

The routes live in :mod:`maasd.api.controllers`, one controller per noun.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from litestar import Litestar, Router
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.routes import HTTPRoute

from maasd import __version__
from maasd.api import docs, problems
from maasd.api.auth import STATE_KEY, ApiContext, Run, authenticated, caller, metrics_digest
from maasd.api.controllers import (
    BuffersController,
    HealthController,
    PoolsController,
    TenantsController,
    TopologyController,
)
from maasd.api.dependencies import use_cases
from maasd.api.health import HealthCheck, Healthz
from maasd.api.hosts import HostsController
from maasd.api.paths import one_segment_per_id
from maasd.api.requests import BodyRequest
from maasd.api.schemas import MAX_BODY
from maasd.api.server import anonymous_share
from maasd.api.strict import StrictBodies
from maasd.core import Service
from maasd.core.limits import REST_THREADS
from maasd.serving import head_as_get
from maasd.settings import DEFAULT_TENANT_THREADS

__all__ = ["MAX_BODY", "create_app"]


def create_app(
    service: Service,
    *,
    health: HealthCheck | None = None,
    degraded: HealthCheck | None = None,
    metrics_key: str | None = None,
    metrics_public: bool = False,
    threads: int = REST_THREADS,  # the region budget keeps a transient file for each
    caller_threads: int = DEFAULT_TENANT_THREADS,
) -> Litestar:
    """Build the app.

    ``health``: ``() -> {component: (ok, why)}`` for ``/healthz`` (see
    :func:`maasd.api.health.of_checks`); ``degraded``: the same for components the
    daemon serves without (``/healthz`` says ``degraded``, still 200). ``metrics_key``: a key good for ``GET
    /metrics`` only; ``metrics_public``: ``/metrics`` needs no key at all.
    ``threads`` bounds concurrent service calls (each may scrub or prefault);
    ``caller_threads`` those of one caller (a tenant, the admin): its further calls
    wait for its own to end (``Settings.http_tenant_threads``).
    """
    ctx = ApiContext(
        auth=service.auth,
        metrics=service.metrics,
        run=Run(threads, per_caller=caller_threads),
        metrics_digest=metrics_digest(metrics_key),
        metrics_public=metrics_public,
        health=Healthz(health, degraded),
    )

    v1 = Router(
        path="/v1",
        before_request=authenticated,
        dependencies={"call": Provide(caller, sync_to_thread=False), **use_cases(service)},
        route_handlers=[
            TopologyController,
            PoolsController,
            TenantsController,
            BuffersController,
            HostsController,
        ],
    )
    # litestar adds its pydantic plugins whenever pydantic imports: not here (_pydantic_unseen).
    with _pydantic_unseen():
        app = Litestar(
            route_handlers=[HealthController, v1, *docs.ROUTES],  # docs: /docs, the API page
            dependencies={"api": Provide(lambda: ctx, use_cache=True, sync_to_thread=False)},
            state=State({STATE_KEY: ctx}),
            plugins=[StrictBodies()],
            request_class=BodyRequest,  # a client gone mid-body: ClientGone (maasd.api.requests)
            exception_handlers=problems.HANDLERS,  # type: ignore[arg-type]
            openapi_config=OpenAPIConfig(
                title="maasd",
                version=__version__,
                path="/schema",
                description="Memory-as-a-service control plane: tenants reserve sealed-memfd buffers that workers map zero-copy.",
                components=Components(
                    security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}
                ),
                security=[{"bearer": []}],
                render_plugins=docs.SCHEMA_PLUGINS,
            ),
            request_max_body_size=MAX_BODY,
            logging_config=None,
            debug=False,
        )
    # In front of the router: a path is routed as the client wrote it (maasd.api.paths).
    # Not a Litestar(middleware=...) entry: litestar runs those per route, after routing,
    # so a path the router folds onto another route, or onto none, would answer that
    # route's answer or a 404/405 instead of the 400 (tests/unit/test_path_segments.py).
    # The app's own asgi_handler (its exception handling around the router) is the one
    # place in front of routing litestar has, and this wraps it once, here.
    # HEAD is the GET without its body (litestar routes it to no GET handler: 405), with
    # the GET's authentication: load balancers probe /healthz with it (maasd.serving).
    # Outermost: a request outside /v1 is counted in the anonymous share of requests in
    # progress before anything else is done for it (maasd.api.server.anonymous_share).
    app.asgi_handler = anonymous_share(head_as_get(one_segment_per_id(app.asgi_handler)))
    ctx.query_names.update(_query_names(app))
    ctx.bodiless.update(_bodiless(app))
    return app


_LITESTAR_PYDANTIC = ("litestar.plugins.pydantic", "litestar.contrib.pydantic")


@contextlib.contextmanager
def _pydantic_unseen() -> Iterator[None]:
    """Hide pydantic from litestar while the app is built. litestar registers its pydantic
    plugins whenever pydantic imports (it does where the ``llama`` extra brings FastAPI),
    at 0.15-0.2 s of CPU per daemon start; no route of maasd takes or returns a pydantic
    model (their bodies are msgspec structs, :mod:`maasd.api.schemas`). ``None`` in
    ``sys.modules`` makes ``import pydantic`` fail; what was there is put back after, and
    litestar's pydantic modules imported half-way meanwhile are dropped, so that a later
    ``import litestar.plugins.pydantic`` in this process imports them whole."""
    missing = object()
    before = sys.modules.get("pydantic", missing)
    loaded = set(sys.modules)
    sys.modules["pydantic"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if before is missing:
            del sys.modules["pydantic"]
        else:
            sys.modules["pydantic"] = before  # type: ignore[assignment]
        for name in [n for n in sys.modules if n.startswith(_LITESTAR_PYDANTIC)]:
            if name not in loaded:
                del sys.modules[name]


def _query_names(app: Litestar) -> dict[int, frozenset[str]]:
    """The query parameters each route handler takes, as litestar parsed its signature."""
    names: dict[int, frozenset[str]] = {}
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            for handler, kwargs_model in route.route_handler_map.values():
                params = kwargs_model.expected_query_params
                names[id(handler)] = frozenset(p.field_alias for p in params)
    return names


def _bodiless(app: Litestar) -> set[int]:
    """The route handlers that take no request body (no ``data``, no ``body``)."""
    ids: set[int] = set()
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            for handler, kwargs_model in route.route_handler_map.values():
                if not {"data", "body"} & set(kwargs_model.expected_reserved_kwargs):
                    ids.add(id(handler))
    return ids
