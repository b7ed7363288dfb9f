"""Request bodies of the REST API, and their strict decoding.

Bodies are decoded by msgspec in *strict* mode (``"5"`` is not an int, ``1``
is not a bool, unknown fields are refused) — stricter than the framework's own
conversion, which is why :func:`decode` re-reads the raw body: the framework
still parses the declared ``data`` type first, which is what puts each body's
schema in the OpenAPI document.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from litestar import Request

from maasd import bounds
from maasd.errors import InvalidRequest
from maasd.models import Persistence, PoolSpec, ReserveSpec

T = TypeVar("T")


class ReserveBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/reserve`` and ``POST /v1/pools/{pool_id}/reserve`` (SPEC §4)."""

    size_bytes: bounds.PositiveBytes | None = None
    size_gb: bounds.SizeGiB | None = None
    latency_us: bounds.LatencyUs | None = None
    persistence: Persistence | None = None
    ttl_s: bounds.TtlS = 600
    label: bounds.Label | None = None
    key: bounds.EntryKey | None = None
    evictable: bool = False
    numa_node: bounds.NodeId | None = None

    def to_spec(self, pool: str | None = None) -> ReserveSpec:
        """The service's input; ``size_gb`` (GiB) becomes bytes. Exactly one size is given."""
        if (self.size_bytes is None) == (self.size_gb is None):
            raise InvalidRequest("give exactly one of size_bytes and size_gb")
        size = self.size_bytes
        if size is None:
            assert self.size_gb is not None
            size = bounds.bytes_of_gib(self.size_gb)
        return ReserveSpec(
            size_bytes=size,
            pool=pool,
            latency_us=self.latency_us,
            persistence=self.persistence,
            numa_node=self.numa_node,
            ttl_s=self.ttl_s,
            label=self.label,
            key=self.key,
            evictable=self.evictable,
        )


class TenantBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: bounds.Name
    quota_bytes: bounds.Bytes


class QuotaBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    quota_bytes: bounds.Bytes


class PinBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    numa_node: bounds.NodeId


class RenewBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ttl_s: bounds.TtlS


class LookupBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: bounds.EntryKeys


class Status(msgspec.Struct, frozen=True):
    status: str


_decoders: dict[type, msgspec.json.Decoder] = {
    t: msgspec.json.Decoder(t)
    for t in (TenantBody, QuotaBody, PinBody, RenewBody, LookupBody, PoolSpec, ReserveBody)
}


async def decode(request: Request, kind: type[T]) -> T:
    """Strictly decode the JSON body of ``request`` as ``kind``; InvalidRequest otherwise."""
    media = request.content_type[0]
    if media != "application/json":
        raise InvalidRequest(f"expected an application/json body, got {media or 'no content type'}")
    raw = await request.body()
    try:
        return _decoders[kind].decode(raw)
    except msgspec.ValidationError as e:
        raise InvalidRequest(str(e)) from e
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"malformed JSON: {e}") from e
