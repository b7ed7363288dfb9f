"""The routes of the REST API (SPEC §4), one controller per noun.

Each handler is one service call in a worker thread (``run``) and a return.
Who may call is decided before that, by guards on the event loop
(:mod:`maasd.api.auth`); a body arrives decoded strictly as its ``data`` type
(:mod:`maasd.api.strict`). ``service``, ``run`` and ``who`` (the caller's
:class:`~maasd.models.Principal`) are dependencies the app provides.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

from litestar import Controller, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from maasd.api import problems
from maasd.api.auth import Run, may_read_metrics, requires_admin, requires_tenant
from maasd.api.health import Health
from maasd.api.schemas import (
    LookupBody,
    PinBody,
    RenewBody,
    ReserveBody,
    Status,
    TenantBody,
    TenantPatchBody,
    Unhealthy,
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

__all__ = [
    "BuffersController",
    "HealthController",
    "PoolsController",
    "TenantsController",
    "TopologyController",
]

# The problem answers each kind of route can give (declared in the OpenAPI document).
# 400 everywhere: path and query parameters are validated as well as bodies.
KEYED = (400, 401)  # any key
ADMIN = (400, 401, 403)  # admin key only
TENANT = (400, 401, 403)  # tenant key only
BODY = (400, 413)  # a JSON body (strictly decoded, at most MAX_BODY bytes)

_HEALTH = {
    200: ResponseSpec(data_container=Status, description="The daemon and every component are ok"),
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
    async def healthz(self, health: NamedDependency[Health]) -> Response[Status | Unhealthy]:
        return await health.answer()

    @get(
        "/metrics",
        summary="Prometheus metrics",
        media_type=CONTENT_TYPE,
        guards=[may_read_metrics],
        responses=problems.responses(401, 403),
    )
    async def metrics(
        self, service: NamedDependency[Service], run: NamedDependency[Run]
    ) -> Response[bytes]:
        return Response(await run(service.metrics.render), media_type=CONTENT_TYPE)


class TopologyController(Controller):
    path = "/topology"
    tags = ["topology"]

    @get(summary="NUMA nodes, memory and huge pages", responses=problems.responses(*KEYED))
    async def topology(
        self, service: NamedDependency[Service], run: NamedDependency[Run]
    ) -> Topology:
        return await run(service.refresh_topology)


class PoolsController(Controller):
    path = "/pools"
    tags = ["pools"]

    @get(
        summary="List pools with usage: this host's (tenant key), every host's (admin key)",
        responses=problems.responses(*KEYED),
    )
    async def list_pools(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
    ) -> list[PoolInfo]:
        return await run(partial(service.pools, all_hosts=who.is_admin))

    @get(
        "/{pool_id:str}",
        summary="One pool: a name is this host's pool; the admin may name any host's by id",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_pool(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        pool_id: FromPath[str],
    ) -> PoolInfo:
        return await run(partial(service.pool, any_host=who.is_admin), pool_id)

    @post(
        summary="Create a pool (admin)",
        status_code=201,
        guards=[requires_admin],
        responses=problems.responses(*ADMIN + BODY + (409, 422)),
    )
    async def create_pool(
        self, service: NamedDependency[Service], run: NamedDependency[Run], data: JSONBody[PoolSpec]
    ) -> PoolInfo:
        return await run(service.create_pool, data)

    @delete(
        "/{pool_id:str}",
        summary="Delete a pool (admin)",
        status_code=204,
        guards=[requires_admin],
        responses=problems.responses(*ADMIN + (404, 409)),
    )
    async def delete_pool(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        pool_id: FromPath[str],
        drain: FromQuery[bool] = False,
    ) -> None:
        await run(partial(service.delete_pool, drain=drain), pool_id)


class TenantsController(Controller):
    """Tenants, their keys, and the audit trail: all admin."""

    tags = ["tenants"]
    guards = [requires_admin]

    @post(
        "/tenants",
        summary="Create a tenant (admin); shows its key once",
        status_code=201,
        responses=problems.responses(*ADMIN + BODY + (409,)),
    )
    async def create_tenant(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        data: JSONBody[TenantBody],
    ) -> NewTenant:
        return await run(service.create_tenant, data.name, data.quota_bytes)

    @get("/tenants", summary="List tenants (admin)", responses=problems.responses(*ADMIN))
    async def list_tenants(
        self, service: NamedDependency[Service], run: NamedDependency[Run]
    ) -> list[TenantInfo]:
        return await run(service.tenants)

    @get(
        "/tenants/{tenant_id:str}",
        summary="One tenant (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def get_tenant(
        self, service: NamedDependency[Service], run: NamedDependency[Run], tenant_id: FromPath[str]
    ) -> TenantInfo:
        return await run(service.tenant, tenant_id)

    @patch(
        "/tenants/{tenant_id:str}",
        summary="Set a tenant's quota and/or buffer cap (admin)",
        responses=problems.responses(*ADMIN + BODY + (404,)),
    )
    async def update_tenant(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        tenant_id: FromPath[str],
        data: JSONBody[TenantPatchBody],
    ) -> TenantInfo:
        quota, cap = data.given()
        return await run(
            partial(service.update_tenant, quota_bytes=quota, max_buffers=cap), tenant_id
        )

    @delete(
        "/tenants/{tenant_id:str}",
        status_code=204,
        summary="Delete a tenant: release (scrub) its buffers, revoke its keys (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def delete_tenant(
        self, service: NamedDependency[Service], run: NamedDependency[Run], tenant_id: FromPath[str]
    ) -> None:
        await run(service.delete_tenant, tenant_id)

    @post(
        "/tenants/{tenant_id:str}/keys",
        status_code=201,
        summary="Issue an API key (admin); shown only here",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def issue_key(
        self, service: NamedDependency[Service], run: NamedDependency[Run], tenant_id: FromPath[str]
    ) -> KeyInfo:
        return await run(service.issue_key, tenant_id)

    @delete(
        "/tenants/{tenant_id:str}/keys/{key_id:str}",
        status_code=204,
        summary="Revoke an API key (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def revoke_key(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        tenant_id: FromPath[str],
        key_id: FromPath[str],
    ) -> None:
        await run(service.revoke_key, tenant_id, key_id)

    @get(
        "/events",
        summary="The audit trail, newest first (admin)",
        responses=problems.responses(*ADMIN + (404,)),
    )
    async def events(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        limit: FromQuery[Annotated[int, Parameter(ge=1, le=1000)]] = 100,
        tenant_id: FromQuery[str | None] = None,
        before: FromQuery[Annotated[int | None, Parameter(ge=1, le=2**63 - 1)]] = None,
    ) -> list[Event]:
        return await run(service.events, limit, tenant_id, before)


class BuffersController(Controller):
    """A tenant's own use: usage, reserve, buffers, lookup (the admin sees and releases all)."""

    tags = ["buffers"]

    @get(
        "/usage",
        summary="The calling tenant's quota and use",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT),
    )
    async def usage(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
    ) -> Usage:
        return await run(service.usage, who)

    @post(
        "/pools/{pool_id:str}/reserve",
        status_code=201,
        summary="Reserve a buffer in this pool",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + BODY + (404, 409, 422, 507)),
    )
    async def reserve_in(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        pool_id: FromPath[str],
        data: JSONBody[ReserveBody],
    ) -> BufferInfo:
        return await run(service.reserve, who, data.to_spec(pool_id))

    @post(
        "/reserve",
        status_code=201,
        summary="Reserve a buffer in the pool that meets the QoS with the most free space",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + BODY + (409, 422, 507)),
    )
    async def reserve(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        data: JSONBody[ReserveBody],
    ) -> BufferInfo:
        return await run(service.reserve, who, data.to_spec())

    @get(
        "/buffers",
        summary="Own buffers (admin: all, or ?tenant_id=)",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def list_buffers(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        tenant_id: FromQuery[str | None] = None,
    ) -> list[BufferInfo]:
        return await run(service.buffers, who, tenant_id)

    @get(
        "/buffers/{buffer_id:str}",
        summary="One buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def get_buffer(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        buffer_id: FromPath[str],
    ) -> BufferInfo:
        return await run(service.buffer, who, buffer_id)

    @patch(
        "/buffers/{buffer_id:str}/pin",
        summary="Bind and migrate a buffer's pages to a NUMA node, then verify",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + BODY + (404, 409, 422)),
    )
    async def pin(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        buffer_id: FromPath[str],
        data: JSONBody[PinBody],
    ) -> BufferInfo:
        return await run(service.pin, who, buffer_id, data.numa_node)

    @post(
        "/buffers/{buffer_id:str}/renew",
        status_code=200,
        summary="Extend a buffer's lease",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def renew(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        buffer_id: FromPath[str],
        data: JSONBody[RenewBody],
    ) -> BufferInfo:
        return await run(service.renew, who, buffer_id, data.ttl_s)

    @post(
        "/buffers/{buffer_id:str}/checkpoint",
        status_code=200,
        summary="Write a persistent buffer to its pool's spill dir",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + (404, 409)),
    )
    async def checkpoint(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        buffer_id: FromPath[str],
    ) -> Checkpoint:
        return await run(service.checkpoint, who, buffer_id)

    @delete(
        "/buffers/{buffer_id:str}",
        status_code=204,
        summary="Scrub and free a buffer",
        responses=problems.responses(*KEYED + (404,)),
    )
    async def release(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        buffer_id: FromPath[str],
    ) -> None:
        await run(service.release, who, buffer_id)

    @post(
        "/buffers/lookup",
        status_code=200,
        summary="The longest of the given keys that has a live buffer",
        guards=[requires_tenant],
        responses=problems.responses(*TENANT + BODY + (404,)),
    )
    async def lookup(
        self,
        service: NamedDependency[Service],
        run: NamedDependency[Run],
        who: NamedDependency[Principal],
        data: JSONBody[LookupBody],
    ) -> LookupHit:
        return await run(service.lookup, who, list(data.keys))
