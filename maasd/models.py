"""Domain records: what the service returns and the REST API serialises as-is.

They are ``msgspec.Struct``s so that the API answers without a conversion
layer, and frozen so that a record handed to a caller can never be mutated
under another thread. Field names are the contract of SPEC §4.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

Backing = Literal["memfd", "hugetlb"]
Persistence = Literal["volatile", "persistent"]
ScrubMode = Literal["zero", "punch"]
BufferState = Literal["reserving", "live", "releasing"]

#: RFC 3339, UTC, microseconds, always the same width: sorts as text.
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.{us:06d}Z"


def rfc3339(epoch_s: float) -> str:
    """Format epoch seconds as a fixed-width RFC 3339 UTC timestamp.

    >>> rfc3339(0.5)
    '1970-01-01T00:00:00.500000Z'
    """
    whole = int(epoch_s)
    us = round((epoch_s - whole) * 1_000_000)
    if us >= 1_000_000:
        whole, us = whole + 1, us - 1_000_000
    return time.strftime(TIMESTAMP_FORMAT, time.gmtime(whole)).format(us=us)


#: Largest byte count anywhere in the API (sizes are below 2^63).
MAX_BYTES = (1 << 63) - 1
#: Largest NUMA node id accepted in a request (Linux's MAX_NUMNODES is at most 1024).
MAX_NODE = 1023
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=64)]
NodeId = Annotated[int, msgspec.Meta(ge=0, le=MAX_NODE)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fixed properties of a pool (SPEC §1), as configured or POSTed."""

    name: Name
    numa_node: NodeId
    capacity_bytes: Annotated[int, msgspec.Meta(gt=0, le=MAX_BYTES)]
    backing: Backing = "memfd"
    persistence: Persistence = "volatile"
    latency_us: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 1
    prefault: bool = True
    scrub: ScrubMode = "zero"
    spill_dir: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    numa_node: int
    backing: Backing
    persistence: Persistence
    latency_us: int
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    page_bytes: int
    prefault: bool
    scrub: ScrubMode
    buffers: int = 0


class TenantInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    quota_bytes: int
    used_bytes: int
    buffers: int
    created_at: str


class NewTenant(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to tenant creation: the only time the first API key is shown."""

    id: str
    name: str
    quota_bytes: int
    used_bytes: int
    api_key: str
    key_id: str


class KeyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to key issue: the only time the key itself is shown."""

    id: str
    api_key: str
    created_at: str


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    quota_bytes: int
    used_bytes: int
    buffers: int


class BufferInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    pool_id: str
    size_bytes: int
    numa_node: int
    persistence: Persistence
    label: str | None
    key: str | None
    evictable: bool
    state: BufferState
    created_at: str
    expires_at: str
    placement: dict[str, int] | None = None
    checksum: str | None = None


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    checksum: str
    bytes: int


class LookupHit(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    buffer: BufferInfo


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling: the admin, or one tenant (through one of its keys)."""

    is_admin: bool
    tenant_id: str | None = None
    key_id: str | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the audit trail: what happened to which tenant, buffer or pool.

    ``kind`` is one of ``reserve``, ``release``, ``evict``, ``expire``, ``pool_drain``,
    ``shutdown``, ``recover``, ``reserve_failed`` (buffers), ``tenant_create``,
    ``tenant_delete``, ``quota_set``, ``key_issue``, ``key_revoke`` (tenants),
    ``pool_create``, ``pool_delete`` (pools). ``bytes`` is the buffer size (or quota,
    capacity); ``detail`` a name or id the kind needs (never a key itself).
    """

    id: int
    at: str
    kind: str
    tenant_id: str | None
    buffer_id: str | None
    pool_id: str | None
    bytes: int | None
    detail: str | None
