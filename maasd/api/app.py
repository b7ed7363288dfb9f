"""The REST control plane: a litestar app over one :class:`maasd.core.Service`.

Controllers are thin: authenticate, decode the body strictly, make one service
call in a worker thread (the service may prefault or scrub gigabytes), return
its record. Errors become problem details in :mod:`maasd.api.problems`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from litestar import Litestar, Request, Response, Router, delete, get, patch, post
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, Schema, SecurityScheme
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from maasd import __version__
from maasd.api import problems
from maasd.api.schemas import (
    LookupBody,
    PinBody,
    QuotaBody,
    RenewBody,
    ReserveBody,
    Status,
    TenantBody,
    decode,
)
from maasd.core import Service
from maasd.metrics import CONTENT_TYPE
from maasd.models import (
    BufferInfo,
    Checkpoint,
    Event,
    KeyInfo,
    LookupHit,
    NewTenant,
    PoolInfo,
    PoolSpec,
    Principal,
    TenantInfo,
    Usage,
)
from maasd.topology import Topology

R = TypeVar("R")

# The problem answers each kind of route can give (declared in the OpenAPI document).
# 400 everywhere: path and query parameters are validated as well as bodies.
KEYED = (400, 401)  # any key
ADMIN = (400, 401, 403)  # admin key only
TENANT = (400, 401, 403)  # tenant key only
BODY = (400, 413)  # a JSON body (strictly decoded, at most MAX_BODY bytes)

#: The strictly decoded request bodies (unknown fields refused).
BODIES = (PoolSpec, TenantBody, QuotaBody, ReserveBody, PinBody, RenewBody, LookupBody)

#: Largest request body accepted; every valid body is far smaller.
MAX_BODY = 64 * 1024


def _token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def create_app(service: Service, *, threads: int = 64) -> Litestar:
    """Build the app. ``threads`` bounds concurrent service calls (each may scrub or prefault)."""
    limiter = CapacityLimiter(threads)

    async def authenticate(request: Request) -> None:
        """``before_request`` of every /v1 route: who is calling, before any body is read.

        A request without a valid key is answered 401 whatever its body holds, and
        an unauthenticated caller never makes the daemon parse anything.
        """
        token = _token(request)
        who = service.known_principal(token)  # admin or a remembered key: no I/O
        if who is None:
            who = await anyio.to_thread.run_sync(service.authenticate, token, limiter=limiter)
        request.state.principal = who

    async def call(request: Request, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(principal, *args)`` in a worker thread (it may prefault or scrub)."""
        who: Principal = request.state.principal
        return await anyio.to_thread.run_sync(lambda: fn(who, *args), limiter=limiter)

    def admin(fn: Callable[..., R]) -> Callable[..., R]:
        def wrapped(who: Principal, *args: Any) -> R:
            service.require_admin(who)
            return fn(*args)

        return wrapped

    # -- anyone ---------------------------------------------------------------------------

    @get("/healthz", tags=["health"], summary="Liveness")
    async def healthz() -> Status:
        return Status(status="ok")

    @get("/metrics", tags=["health"], summary="Prometheus metrics", media_type=CONTENT_TYPE)
    async def metrics() -> Response[bytes]:
        body = await anyio.to_thread.run_sync(service.metrics.render, limiter=limiter)
        return Response(body, media_type=CONTENT_TYPE)

    # -- any key --------------------------------------------------------------------------

    @get(
        "/topology",
        tags=["topology"],
        summary="NUMA nodes, memory and huge pages",
        responses=problems.responses(*KEYED),
    )
    async def topology(request: Request) -> Topology:
        return await call(request, lambda who: service.refresh_topology())

    @get(
        "/pools",
        tags=["pools"],
        summary="List pools with usage",
        responses=problems.responses(*KEYED),
    )
    async def list_pools(request: Request) -> list[PoolInfo]:
        return await call(request, lambda who: service.pools())

    @get(
        "/pools/{pool_id:str}",
        tags=["pools"],
        summary="One pool (id or name)",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_pool(request: Request, pool_id: FromPath[str]) -> PoolInfo:
        return await call(request, lambda who: service.pool(pool_id))

    # -- admin ----------------------------------------------------------------------------

    @post(
        "/pools",
        tags=["pools"],
        summary="Create a pool (admin)",
        status_code=201,
        responses=problems.responses(*ADMIN + BODY + (409, 422)),
    )
    async def create_pool(request: Request, data: JSONBody[PoolSpec]) -> PoolInfo:
        spec = await decode(request, PoolSpec)
        return await call(request, admin(service.create_pool), spec)

    @delete(
        "/pools/{pool_id:str}",
        tags=["pools"],
        summary="Delete a pool (admin)",
        status_code=204,
        responses=problems.responses(*ADMIN + (404, 409)),
    )
    async def delete_pool(
        request: Request, pool_id: FromPath[str], drain: FromQuery[bool] = False
    ) -> None:
        await call(request, admin(partial(service.delete_pool, drain=drain)), pool_id)

    @post(
        "/tenants",
        tags=["tenants"],
        summary="Create a tenant (admin); shows its key once",
        status_code=201,
        responses=problems.responses(*ADMIN + BODY + (409,)),
    )
    async def create_tenant(request: Request, data: JSONBody[TenantBody]) -> NewTenant:
        body = await decode(request, TenantBody)
        return await call(request, admin(service.create_tenant), body.name, body.quota_bytes)

    @get(
        "/tenants",
        tags=["tenants"],
        summary="List tenants (admin)",
        responses=problems.responses(*ADMIN),
    )
    async def list_tenants(request: Request) -> list[TenantInfo]:
        return await call(request, admin(service.tenants))

    @get(
        "/tenants/{tenant_id:str}",
        tags=["tenants"],
        summary="One tenant (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def get_tenant(request: Request, tenant_id: FromPath[str]) -> TenantInfo:
        return await call(request, admin(service.tenant), tenant_id)

    @patch(
        "/tenants/{tenant_id:str}",
        tags=["tenants"],
        summary="Set a tenant's quota (admin)",
        responses=problems.responses(*ADMIN + BODY + (404,)),
    )
    async def set_quota(
        request: Request, tenant_id: FromPath[str], data: JSONBody[QuotaBody]
    ) -> TenantInfo:
        body = await decode(request, QuotaBody)
        return await call(request, admin(service.set_quota), tenant_id, body.quota_bytes)

    @delete(
        "/tenants/{tenant_id:str}",
        tags=["tenants"],
        status_code=204,
        summary="Delete a tenant: release (scrub) its buffers, revoke its keys (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def delete_tenant(request: Request, tenant_id: FromPath[str]) -> None:
        await call(request, admin(service.delete_tenant), tenant_id)

    @post(
        "/tenants/{tenant_id:str}/keys",
        tags=["tenants"],
        status_code=201,
        summary="Issue an API key (admin); shown only here",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def issue_key(request: Request, tenant_id: FromPath[str]) -> KeyInfo:
        return await call(request, admin(service.issue_key), tenant_id)

    @delete(
        "/tenants/{tenant_id:str}/keys/{key_id:str}",
        tags=["tenants"],
        status_code=204,
        summary="Revoke an API key (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def revoke_key(request: Request, tenant_id: FromPath[str], key_id: FromPath[str]) -> None:
        await call(request, admin(service.revoke_key), tenant_id, key_id)

    @get(
        "/events",
        tags=["tenants"],
        summary="The audit trail, newest first (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def events(
        request: Request,
        limit: FromQuery[Annotated[int, Parameter(ge=1, le=1000)]] = 100,
        tenant_id: FromQuery[str | None] = None,
        # The bounds inside the Optional: litestar drops them from ``Annotated[...] | None``.
        before: FromQuery[Annotated[int | None, Parameter(ge=1, le=2**63 - 1)]] = None,
    ) -> list[Event]:
        return await call(request, admin(service.events), limit, tenant_id, before)

    # -- tenant ---------------------------------------------------------------------------

    @get(
        "/usage",
        tags=["buffers"],
        summary="The calling tenant's quota and use",
        responses=problems.responses(*TENANT),
    )
    async def usage(request: Request) -> Usage:
        return await call(request, service.usage)

    @post(
        "/pools/{pool_id:str}/reserve",
        tags=["buffers"],
        status_code=201,
        summary="Reserve a buffer in this pool",
        responses=problems.responses(*TENANT + BODY + (404, 409, 422, 507)),
    )
    async def reserve_in(
        request: Request, pool_id: FromPath[str], data: JSONBody[ReserveBody]
    ) -> BufferInfo:
        spec = (await decode(request, ReserveBody)).to_spec(pool_id)
        return await call(request, lambda who: service.reserve(who, spec))

    @post(
        "/reserve",
        tags=["buffers"],
        status_code=201,
        summary="Reserve a buffer in the pool that meets the QoS with the most free space",
        responses=problems.responses(*TENANT + BODY + (409, 422, 507)),
    )
    async def reserve(request: Request, data: JSONBody[ReserveBody]) -> BufferInfo:
        spec = (await decode(request, ReserveBody)).to_spec()
        return await call(request, lambda who: service.reserve(who, spec))

    @get(
        "/buffers",
        tags=["buffers"],
        summary="Own buffers (admin: all, or ?tenant_id=)",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def list_buffers(
        request: Request, tenant_id: FromQuery[str | None] = None
    ) -> list[BufferInfo]:
        return await call(request, lambda who: service.buffers(who, tenant_id))

    @get(
        "/buffers/{buffer_id:str}",
        tags=["buffers"],
        summary="One buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_buffer(request: Request, buffer_id: FromPath[str]) -> BufferInfo:
        return await call(request, service.buffer, buffer_id)

    @patch(
        "/buffers/{buffer_id:str}/pin",
        tags=["buffers"],
        summary="Bind and migrate a buffer's pages to a NUMA node, then verify",
        responses=problems.responses(*TENANT + BODY + (404, 409, 422)),
    )
    async def pin(
        request: Request, buffer_id: FromPath[str], data: JSONBody[PinBody]
    ) -> BufferInfo:
        body = await decode(request, PinBody)
        return await call(request, service.pin, buffer_id, body.numa_node)

    @post(
        "/buffers/{buffer_id:str}/renew",
        tags=["buffers"],
        status_code=200,
        summary="Extend a buffer's lease",
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def renew(
        request: Request, buffer_id: FromPath[str], data: JSONBody[RenewBody]
    ) -> BufferInfo:
        body = await decode(request, RenewBody)
        return await call(request, service.renew, buffer_id, body.ttl_s)

    @post(
        "/buffers/{buffer_id:str}/checkpoint",
        tags=["buffers"],
        status_code=200,
        summary="Write a persistent buffer to its pool's spill dir",
        responses=problems.responses(*TENANT + (404, 409)),
    )
    async def checkpoint(request: Request, buffer_id: FromPath[str]) -> Checkpoint:
        return await call(request, service.checkpoint, buffer_id)

    @delete(
        "/buffers/{buffer_id:str}",
        tags=["buffers"],
        status_code=204,
        summary="Scrub and free a buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def release(request: Request, buffer_id: FromPath[str]) -> None:
        await call(request, service.release, buffer_id)

    @post(
        "/buffers/lookup",
        tags=["buffers"],
        status_code=200,
        summary="The longest of the given keys that has a live buffer",
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def lookup(request: Request, data: JSONBody[LookupBody]) -> LookupHit:
        body = await decode(request, LookupBody)
        return await call(request, service.lookup, list(body.keys))

    v1 = Router(
        path="/v1",
        before_request=authenticate,
        route_handlers=[
            topology,
            list_pools,
            get_pool,
            create_pool,
            delete_pool,
            create_tenant,
            list_tenants,
            get_tenant,
            set_quota,
            delete_tenant,
            issue_key,
            revoke_key,
            events,
            usage,
            reserve_in,
            reserve,
            list_buffers,
            get_buffer,
            pin,
            renew,
            checkpoint,
            release,
            lookup,
        ],
    )
    app = Litestar(
        route_handlers=[healthz, metrics, v1],
        exception_handlers=problems.HANDLERS,  # type: ignore[arg-type]
        openapi_config=OpenAPIConfig(
            title="maasd",
            version=__version__,
            path="/schema",
            description="Memory-as-a-service control plane (see SPEC §4).",
            components=Components(
                security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}
            ),
            security=[{"bearer": []}],
        ),
        request_max_body_size=MAX_BODY,
        logging_config=None,
        debug=False,
    )
    _declare_strict_bodies(app)
    return app


def _declare_strict_bodies(app: Litestar) -> None:
    """Make the OpenAPI document say what :func:`decode` enforces.

    The generated schemas omit two rules of the body structs: unknown fields are
    refused (``forbid_unknown_fields``), and the lower bounds of the optional reserve
    fields (a ``gt=0``/``ge=0`` bound on an optional field is dropped by the generator). Without
    them a client generator or a fuzzer believes ``{"size_bytes": 0, "x": 1}`` valid.
    """
    schemas = app.openapi_schema.components.schemas or {}
    for body in BODIES:
        schema = schemas.get(body.__name__)
        if schema is not None:
            schema.additional_properties = False
    reserve = schemas.get(ReserveBody.__name__)
    if reserve is not None and reserve.properties:
        for field, bound in (
            ("size_bytes", "exclusive_minimum"),
            ("size_gb", "exclusive_minimum"),
            ("latency_us", "minimum"),
            ("numa_node", "minimum"),
        ):
            prop = reserve.properties.get(field)
            if isinstance(prop, Schema):
                setattr(prop, bound, 0)
