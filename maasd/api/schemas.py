"""Request bodies of the REST API, and the health answers.

Every body is a ``forbid_unknown_fields`` Struct whose fields are the types of
:mod:`maasd.bounds`. :mod:`maasd.api.strict` decodes each one once, strictly
(``"5"`` is not an int, ``1`` is not a bool, unknown fields are refused), from
the raw bytes.
"""

from __future__ import annotations

import msgspec

from maasd import bounds
from maasd.errors import InvalidRequest
from maasd.models import Persistence, ReserveSpec

#: Largest request body accepted; every valid body is far smaller.
MAX_BODY = 64 * 1024


class PoolReserveBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/pools/{pool_id}/reserve`` (docs/api.md): the pool fixes the node."""

    size_bytes: bounds.PositiveBytes | None = None
    size_gb: bounds.SizeGiB | None = None
    latency_us: bounds.LatencyCeilingUs | None = None
    latency_source: bounds.LatencySource = "declared"
    persistence: Persistence | None = None
    ttl_s: bounds.TtlS = bounds.DEFAULT_TTL_S
    label: bounds.Label | None = None
    key: bounds.EntryKey | None = None
    evictable: bool = False

    @property
    def node(self) -> int | None:
        """The node asked for (only ``POST /v1/reserve`` takes one)."""
        return None

    def to_spec(self, pool: str | None = None) -> ReserveSpec:
        """The service's input; ``size_gb`` (GiB) becomes bytes. Exactly one size is given."""
        if (self.size_bytes is None) == (self.size_gb is None):
            raise InvalidRequest("give exactly one of size_bytes and size_gb")
        if self.latency_source != "declared" and self.latency_us is None:
            raise InvalidRequest("latency_source needs latency_us (the ceiling it is held to)")
        size = self.size_bytes
        if size is None:
            assert self.size_gb is not None
            size = bounds.bytes_of_gib(self.size_gb)
        return ReserveSpec(
            size_bytes=size,
            pool=pool,
            latency_us=self.latency_us,
            latency_source=self.latency_source,
            persistence=self.persistence,
            numa_node=self.node,
            ttl_s=self.ttl_s,
            label=self.label,
            key=self.key,
            evictable=self.evictable,
        )


class ReserveBody(PoolReserveBody, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/reserve``: the same body plus an optional ``numa_node``."""

    numa_node: bounds.NodeId | None = None

    @property
    def node(self) -> int | None:
        return self.numa_node


class TenantBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/tenants``; ``disk_quota_bytes`` left out: the default disk quota."""

    name: bounds.Name
    quota_bytes: bounds.Bytes
    disk_quota_bytes: bounds.Bytes | msgspec.UnsetType = msgspec.UNSET

    def disk_quota(self) -> int | None:
        return (
            None if isinstance(self.disk_quota_bytes, msgspec.UnsetType) else self.disk_quota_bytes
        )


class TenantPatchBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``PATCH /v1/tenants/{id}``: the quota, the buffer cap, the disk quota (at least one).

    A field left out is left alone; ``null`` is refused like any wrong type.
    """

    quota_bytes: bounds.Bytes | msgspec.UnsetType = msgspec.UNSET
    max_buffers: bounds.MaxBuffers | msgspec.UnsetType = msgspec.UNSET
    disk_quota_bytes: bounds.Bytes | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if all(
            v is msgspec.UNSET for v in (self.quota_bytes, self.max_buffers, self.disk_quota_bytes)
        ):
            raise ValueError("give quota_bytes, max_buffers or disk_quota_bytes")

    def given(self) -> tuple[int | None, int | None, int | None]:
        """``(quota_bytes, max_buffers, disk_quota_bytes)`` as the service takes them:
        ``None`` = leave alone."""
        quota, cap, disk = self.quota_bytes, self.max_buffers, self.disk_quota_bytes
        return (
            None if isinstance(quota, msgspec.UnsetType) else quota,
            None if isinstance(cap, msgspec.UnsetType) else cap,
            None if isinstance(disk, msgspec.UnsetType) else disk,
        )


class PinBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    numa_node: bounds.NodeId


class NoBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of a route that takes none: nothing, or ``{}`` — any field is unknown."""


class RenewBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ttl_s: bounds.TtlS


class LookupBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: bounds.StoredKeys


class Status(msgspec.Struct, frozen=True):
    """``GET /healthz`` when every component is healthy: ``{"status": "ok"}`` (docs/api.md)."""

    status: str


class Component(msgspec.Struct, frozen=True):
    """One component's health: ``ok``, and why not when it is not."""

    ok: bool
    detail: str


class Unhealthy(msgspec.Struct, frozen=True):
    """``GET /healthz`` (503) when a component is not healthy; every component is listed."""

    status: str
    components: dict[str, Component]
