"""The per-noun use-case objects the controllers are handed, through litestar's ``Provide``.

As litestar-fullstack's ``domain/*/dependencies.py`` does, each controller names the
core objects it calls as handler parameters (``buffers: NamedDependency[Buffers]``);
:func:`use_cases` provides them for one app, from its composition root
(:class:`maasd.core.Service`), the same object for every request (``use_cache``).

Each depends on ``call`` (the caller and its share of the threads:
:class:`maasd.api.auth.RestCall`), though it does not use it: litestar resolves the
dependencies of a request in batches, a batch of one inline and a larger one in a task
group of its own (~60 µs here), so ``call`` first, then the use-case object, each
alone in its batch (~25 µs for the second, measured with litestar's TestClient).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar.di import NamedDependency, Provide

from maasd.core import Service
from maasd.core.buffers import Buffers
from maasd.core.hosts import Hosts
from maasd.core.pools import Pools
from maasd.core.reserve import Reserves
from maasd.core.stale import LastKnownReads
from maasd.core.tenants import Tenants

__all__ = [
    "Buffers",
    "Hosts",
    "LastKnownReads",
    "Pools",
    "Reserves",
    "Tenants",
    "use_cases",
]


def use_cases(core: Service) -> dict[str, Provide]:
    """The dependencies of /v1: the use-case objects of ``core``, by the name handlers use."""
    provided = {
        "pools": core.pools,  # topology; listing, reading, creating and deleting pools
        "tenants": core.tenants,
        "reserves": core.reserves,  # reserving a buffer
        "buffers": core.buffers,  # a buffer once reserved
        "hosts": core.hosts,
        "last_known": core.last_known,  # the reads answered as last known in an outage
    }
    return {
        name: Provide(_after_call(value), use_cache=True, sync_to_thread=False)
        for name, value in provided.items()
    }


def _after_call(value: object) -> Callable[[Any], object]:
    def provide(call: NamedDependency[Any]) -> object:  # noqa: ARG001 (resolved after it)
        return value

    return provide
