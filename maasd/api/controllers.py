"""The routes of the REST API (docs/api.md), one controller per noun.

Each handler is one use-case call in a worker thread (``call.run``) and a return.
Who may call is decided before that, by the /v1 ``before_request`` hook on the event loop and the
role in a route's ``opt`` (:mod:`maasd.api.auth`); a body arrives decoded
strictly as its ``data`` type (:mod:`maasd.api.strict`). A /v1 handler's one
per-request dependency is ``call`` (:class:`~maasd.api.auth.RestCall`: the runner and
the caller); the use-case objects it calls are its other parameters, provided once
per app (:mod:`maasd.api.dependencies`); ``/healthz`` and ``/metrics`` get ``api`` (the app's
:class:`~maasd.api.auth.ApiContext`).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, TypeVar

from litestar import Controller, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from maasd.api import problems
from maasd.api.auth import ADMIN_ONLY, TENANT_ONLY, ApiContext, RestCall, may_read_metrics
from maasd.api.dependencies import Buffers, LastKnownReads, Pools, Reserves, Tenants
from maasd.api.schemas import (
    LookupBody,
    NoBody,
    PinBody,
    PoolReserveBody,
    RenewBody,
    ReserveBody,
    Status,
    TenantBody,
    TenantPatchBody,
    Unhealthy,
)
from maasd.core.stale import Maybe
from maasd.errors import NotFound
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
    TenantInfo,
    Usage,
    rfc3339,
)
from maasd.topology import Topology

__all__ = [
    "BuffersController",
    "HealthController",
    "PoolsController",
    "TenantsController",
    "TopologyController",
]

T = TypeVar("T")

# The problem answers each kind of route can give (declared in the OpenAPI document).
# 400 everywhere: path and query parameters are validated as well as bodies.
KEYED = (400, 401)  # any key
ADMIN = (400, 401, 403)  # admin key only
TENANT = (400, 401, 403)  # tenant key only
BODY = (400, 413)  # a JSON body (strictly decoded, at most MAX_BODY bytes)

_HEALTH = {
    200: ResponseSpec(
        data_container=Status,
        description="The daemon serves: every component ok, or `degraded` (then with "
        "`components`, as for 503) when only the ledger or L2 is failing",
    ),
    503: ResponseSpec(
        data_container=Unhealthy,
        description="A component is not ok (the broken one says why)",
        generate_examples=False,
    ),
}


class HealthController(Controller):
    """``/healthz`` (anyone) and ``/metrics`` (admin key, metrics key, or public)."""

    tags = ["health"]

    @get("/healthz", summary="Liveness", responses=_HEALTH)
    async def healthz(self, api: NamedDependency[ApiContext]) -> Response[Status | Unhealthy]:
        return await api.health.answer()

    @get(
        "/metrics",
        summary="Prometheus metrics",
        media_type=CONTENT_TYPE,
        guards=[may_read_metrics],
        responses=problems.responses(401, 403),
    )
    async def metrics(self, api: NamedDependency[ApiContext]) -> Response[bytes]:
        return Response(await api.run(api.metrics.render), media_type=CONTENT_TYPE)


class TopologyController(Controller):
    path = "/topology"
    tags = ["topology"]

    @get(summary="NUMA nodes, memory and huge pages", responses=problems.responses(*KEYED))
    async def topology(
        self, call: NamedDependency[RestCall], pools: NamedDependency[Pools]
    ) -> Topology:
        return await call.run(pools.refresh_topology)


#: The header of an answer read from memory while the ledger is down (docs/api.md).
STALE_HEADER = "Maasd-Stale"


def _maybe_stale(answer: Maybe[T]) -> Response[T]:
    """The answer; a remembered one (the ledger is down) carries ``Maasd-Stale``:
    ``ledger-unavailable; as-of=<when it was read, RFC 3339 as every timestamp>``."""
    if answer.stale_since is None:
        return Response(answer.value)
    as_of = rfc3339(answer.stale_since)  # the one timestamp format of the API
    return Response(answer.value, headers={STALE_HEADER: f"ledger-unavailable; as-of={as_of}"})


class PoolsController(Controller):
    path = "/pools"
    tags = ["pools"]

    @get(
        summary="List pools with usage: this host's (tenant key), every host's (admin key)",
        responses=problems.responses(*KEYED),
    )
    async def list_pools(
        self, call: NamedDependency[RestCall], last_known: NamedDependency[LastKnownReads]
    ) -> Response[list[PoolInfo]]:
        read = partial(last_known.pools, call.who.is_admin)
        return _maybe_stale(await call.run(read))

    @get(
        "/{pool_id:str}",
        summary="One pool: a name is this host's pool; the admin may name any host's by id",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_pool(
        self, call: NamedDependency[RestCall], pools: NamedDependency[Pools], pool_id: FromPath[str]
    ) -> PoolInfo:
        return await call.run(partial(pools.info, any_host=call.who.is_admin), pool_id)

    @post(
        summary="Create a pool (admin)",
        status_code=201,
        opt=ADMIN_ONLY,
        responses=problems.responses(*ADMIN + BODY + (409, 422)),
    )
    async def create_pool(
        self,
        call: NamedDependency[RestCall],
        pools: NamedDependency[Pools],
        data: JSONBody[PoolSpec],
    ) -> PoolInfo:
        return await call.run(pools.create, data)

    @delete(
        "/{pool_id:str}",
        summary="Delete a pool (admin)",
        status_code=204,
        opt=ADMIN_ONLY,
        responses=problems.responses(*ADMIN + (404, 409)),
    )
    async def delete_pool(
        self,
        call: NamedDependency[RestCall],
        pools: NamedDependency[Pools],
        pool_id: FromPath[str],
        drain: FromQuery[bool] = False,
    ) -> None:
        await call.run(partial(pools.delete, drain=drain), pool_id)


class TenantsController(Controller):
    """Tenants, their keys, and the audit trail: all admin."""

    tags = ["tenants"]
    opt = ADMIN_ONLY

    @post(
        "/tenants",
        summary="Create a tenant (admin); shows its key once",
        status_code=201,
        responses=problems.responses(*ADMIN + BODY + (409,)),
    )
    async def create_tenant(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        data: JSONBody[TenantBody],
    ) -> NewTenant:
        return await call.run(tenants.create, data.name, data.quota_bytes, data.disk_quota())

    @get("/tenants", summary="List tenants (admin)", responses=problems.responses(*ADMIN))
    async def list_tenants(
        self, call: NamedDependency[RestCall], tenants: NamedDependency[Tenants]
    ) -> list[TenantInfo]:
        return await call.run(tenants.infos)

    @get(
        "/tenants/{tenant_id:str}",
        summary="One tenant (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def get_tenant(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        tenant_id: FromPath[str],
    ) -> TenantInfo:
        return await call.run(tenants.info, tenant_id)

    @patch(
        "/tenants/{tenant_id:str}",
        summary="Set a tenant's quota, buffer cap and/or disk quota (admin)",
        responses=problems.responses(*ADMIN + BODY + (404,)),
    )
    async def update_tenant(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        tenant_id: FromPath[str],
        data: JSONBody[TenantPatchBody],
    ) -> TenantInfo:
        quota, cap, disk = data.given()
        change = partial(tenants.update, quota_bytes=quota, max_buffers=cap, disk_quota_bytes=disk)
        return await call.run(change, tenant_id)

    @delete(
        "/tenants/{tenant_id:str}",
        status_code=204,
        summary="Delete a tenant: release (scrub) its buffers, revoke its keys (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def delete_tenant(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        tenant_id: FromPath[str],
    ) -> None:
        await call.run(tenants.delete, tenant_id)

    @post(
        "/tenants/{tenant_id:str}/keys",
        status_code=201,
        summary="Issue an API key (admin); shown only here",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def issue_key(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        tenant_id: FromPath[str],
        data: JSONBody[NoBody | None] = None,
    ) -> KeyInfo:
        del data  # decoded only: a field in it is refused (400)
        return await call.run(tenants.issue_key, tenant_id)

    @delete(
        "/tenants/{tenant_id:str}/keys/{key_id:str}",
        status_code=204,
        summary="Revoke an API key (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def revoke_key(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
    ) -> None:
        await call.run(tenants.revoke_key, tenant_id, key_id)

    @get(
        "/events",
        summary="The audit trail, newest first (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def events(
        self,
        call: NamedDependency[RestCall],
        tenants: NamedDependency[Tenants],
        limit: FromQuery[Annotated[int, Parameter(ge=1, le=1000)]] = 100,
        tenant_id: FromQuery[str | None] = None,
        before: FromQuery[Annotated[int | None, Parameter(ge=1, le=2**63 - 1)]] = None,
    ) -> list[Event]:
        return await call.run(tenants.events, limit, tenant_id, before)


class BuffersController(Controller):
    """A tenant's own use: usage, reserve, buffers, lookup (the admin sees and releases all)."""

    tags = ["buffers"]

    @get(
        "/usage",
        summary="The calling tenant's quota and use",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT),
    )
    async def usage(
        self,
        call: NamedDependency[RestCall],
        last_known: NamedDependency[LastKnownReads],
    ) -> Response[Usage]:
        return _maybe_stale(await call.run(last_known.usage, call.who))

    @post(
        "/pools/{pool_id:str}/reserve",
        status_code=201,
        summary="Reserve a buffer in this pool",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + BODY + (404, 409, 422, 507)),
    )
    async def reserve_in(
        self,
        call: NamedDependency[RestCall],
        reserves: NamedDependency[Reserves],
        pool_id: FromPath[str],
        data: JSONBody[PoolReserveBody],
    ) -> BufferInfo:
        return await call.run(reserves.reserve, call.who, data.to_spec(pool_id))

    @post(
        "/reserve",
        status_code=201,
        summary="Reserve a buffer in the pool that meets the QoS with the most free space",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + BODY + (409, 422, 507)),
    )
    async def reserve(
        self,
        call: NamedDependency[RestCall],
        reserves: NamedDependency[Reserves],
        data: JSONBody[ReserveBody],
    ) -> BufferInfo:
        return await call.run(reserves.reserve, call.who, data.to_spec())

    @get(
        "/buffers",
        summary="Own buffers (admin: all, or ?tenant_id=; ?held=true: released, still held)",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def list_buffers(
        self,
        call: NamedDependency[RestCall],
        last_known: NamedDependency[LastKnownReads],
        tenant_id: FromQuery[str | None] = None,
        held: FromQuery[bool] = False,
    ) -> Response[list[BufferInfo]]:
        read = last_known.buffers
        return _maybe_stale(await call.run(read, call.who, tenant_id, held))

    @get(
        "/buffers/{buffer_id:str}",
        summary="One buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_buffer(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        buffer_id: FromPath[str],
    ) -> BufferInfo:
        return await call.run(buffers.buffer, call.who, buffer_id)

    @patch(
        "/buffers/{buffer_id:str}/pin",
        summary="Bind and migrate a buffer's pages to a NUMA node, then verify",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + BODY + (404, 409, 422)),
    )
    async def pin(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        buffer_id: FromPath[str],
        data: JSONBody[PinBody],
    ) -> BufferInfo:
        return await call.run(buffers.pin, call.who, buffer_id, data.numa_node)

    @post(
        "/buffers/{buffer_id:str}/renew",
        status_code=200,
        summary="Extend a buffer's lease",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def renew(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        buffer_id: FromPath[str],
        data: JSONBody[RenewBody],
    ) -> BufferInfo:
        return await call.run(buffers.renew, call.who, buffer_id, data.ttl_s)

    @post(
        "/buffers/{buffer_id:str}/checkpoint",
        status_code=200,
        summary="Write a persistent buffer to its pool's spill dir",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + (404, 409)),
    )
    async def checkpoint(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        buffer_id: FromPath[str],
        data: JSONBody[NoBody | None] = None,
    ) -> Checkpoint:
        del data  # decoded only: a field in it is refused (400)
        return await call.run(buffers.checkpoint, call.who, buffer_id)

    @delete(
        "/buffers/{buffer_id:str}",
        status_code=204,
        summary="Scrub and free a buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def release(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        buffer_id: FromPath[str],
    ) -> None:
        await call.run(buffers.release, call.who, buffer_id)

    @post(
        "/buffers/lookup",
        status_code=200,
        summary="The longest of the given keys that has a live buffer",
        opt=TENANT_ONLY,
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def lookup(
        self,
        call: NamedDependency[RestCall],
        buffers: NamedDependency[Buffers],
        data: JSONBody[LookupBody],
    ) -> LookupHit:
        hit = await call.run(buffers.lookup, call.who, list(data.keys))
        if hit is None:
            raise NotFound("no live buffer carries any of these keys")
        return hit
