"""``/v1/hosts``: the daemon hosts sharing the ledger (docs/scale-out.md), for the admin.

``GET /v1/hosts`` lists them with their heartbeat and what the ledger holds
for each; ``DELETE /v1/hosts/{name}`` forgets a host that is not serving
(docs/scale-out.md, "A host that never comes back").
"""

from __future__ import annotations

from litestar import Controller, delete, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from maasd.api import problems
from maasd.api.auth import ADMIN_ONLY, RestCall
from maasd.api.controllers import ADMIN
from maasd.api.dependencies import Hosts
from maasd.models import HostInfo

__all__ = ["HostsController"]


class HostsController(Controller):
    path = "/hosts"
    tags = ["hosts"]
    opt = ADMIN_ONLY

    @get(summary="The hosts sharing the ledger (admin)", responses=problems.responses(*ADMIN))
    async def list_hosts(
        self, call: NamedDependency[RestCall], hosts: NamedDependency[Hosts]
    ) -> list[HostInfo]:
        return await call.run(hosts.infos)

    @delete(
        "/{name:str}",
        status_code=204,
        summary="Forget a host that is not serving: its buffers stop counting, its pools go "
        "(admin)",
        responses=problems.responses(*ADMIN + (404, 409)),
    )
    async def forget_host(
        self, call: NamedDependency[RestCall], hosts: NamedDependency[Hosts], name: FromPath[str]
    ) -> None:
        await call.run(hosts.forget, name)
