"""Domain records: what the service returns and the REST API serialises as-is.

They are ``msgspec.Struct``s so that the API answers without a conversion
layer, and frozen so that a record handed to a caller can never be mutated
under another thread. Field names are the API's contract (docs/api.md).
"""

from __future__ import annotations

import time

import msgspec

from maasd import bounds
from maasd.bounds import (
    DEFAULT_TTL_S,
    Backing,
    BufferKind,
    BufferState,
    EntryAbortReason,
    EventKind,
    Persistence,
    ReleaseReason,
    ScrubMode,
)

__all__ = [
    "Backing",
    "BufferInfo",
    "BufferKind",
    "BufferState",
    "Checkpoint",
    "DiskTierInfo",
    "EntryAbortReason",
    "Event",
    "EventKind",
    "HostInfo",
    "KeyInfo",
    "LookupHit",
    "Measured",
    "MeasuredFrom",
    "NewTenant",
    "Persistence",
    "PoolInfo",
    "PoolSpec",
    "Principal",
    "ReleaseReason",
    "ReserveSpec",
    "ScrubMode",
    "TenantInfo",
    "Usage",
    "rfc3339",
]

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


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fixed properties of a pool (docs/api.md), as configured (TOML) or POSTed.

    Decoded strictly at either edge with the bounds of :mod:`maasd.bounds`; the
    service checks only the rules (the node exists, the capacity fits the node).
    """

    name: bounds.Name
    numa_node: bounds.NodeId
    capacity_bytes: bounds.PositiveBytes
    backing: Backing = "memfd"
    persistence: Persistence = "volatile"
    latency_us: bounds.LatencyUs = 1
    prefault: bool = True
    scrub: ScrubMode = "zero"
    spill_dir: bounds.SpillDir | None = None
    #: Bytes of fresh, prefaulted regions kept ready (within the capacity); 0 = none.
    warm_bytes: bounds.Bytes = 0
    #: The disk tier: evicted entries worth keeping are demoted here, encrypted (an
    #: absolute path; made 0700 and emptied at start). None = no disk tier.
    disk_dir: bounds.SpillDir | None = None
    #: The bytes the disk tier may hold (0 = none).
    disk_bytes: bounds.Bytes = 0


class ReserveSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a reserve asks for, as the service takes it (built by an edge, never decoded).

    ``size_bytes`` is exact (the edge turned ``size_gb`` into bytes); ``pool`` is an id
    or name, or ``None`` for "the pool that meets the QoS with the most free space".
    ``ttl_s`` is checked against the daemon's ``max_ttl_s`` by the service.
    """

    size_bytes: int
    pool: str | None = None
    latency_us: float | None = None
    #: ``latency_us`` against the pools' declared class, or the measured one.
    latency_source: bounds.LatencySource = "declared"
    persistence: Persistence | None = None
    numa_node: int | None = None
    ttl_s: int = DEFAULT_TTL_S
    label: str | None = None
    key: str | None = None
    evictable: bool = False


class DiskTierInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a pool's disk tier holds now and has done since the daemon started."""

    used_bytes: int = 0  # entries written or being written (plaintext bytes)
    entries: int = 0
    demotions: int = 0  # entries evicted from DRAM and kept here
    promotions: int = 0  # DRAM misses answered from here (hits)
    drops: dict[str, int] = msgspec.field(default_factory=dict)  # by reason
    read_bytes: int = 0
    write_bytes: int = 0


class MeasuredFrom(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's node as measured from one CPU node's cpus (``None``: not measured)."""

    cpu_node: int
    latency_us: float | None = None
    gib_per_s: float | None = None


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """What the daemon's probe measured of a pool's node (docs/allocator.md, "Latency
    classes"): the class is the load-to-use latency from the nearest CPU node's cpus."""

    latency_us: float
    #: The CPU node the class is measured from: the pool's own, or the nearest with cpus.
    cpu_node: int
    gib_per_s: float | None = None
    #: Every CPU node's figures, remote ones included.
    by_cpu_node: list[MeasuredFrom] = msgspec.field(default_factory=list)
    measured_at: str = ""


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    #: The daemon host whose memory the pool is (``MAASD_NODE_NAME``); names repeat per host.
    host: str
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
    #: Of ``used_bytes``: released entries some process still holds open (resident,
    #: zeroed, counted until every fd and mapping of them is gone).
    held_bytes: int = 0
    #: Bytes in the pool's warm stock now (part of the capacity, no tenant's use).
    warm_bytes: int = 0
    #: The warm stock's budget (POST /v1/pools ``warm_bytes``); 0 = none.
    warm_target_bytes: int = 0
    #: The disk tier (docs/operations.md, "The disk tier"); None / 0 = none.
    disk_dir: str | None = None
    disk_bytes: int = 0
    #: What the disk tier holds and did (None without one, or for another host's pool).
    disk: DiskTierInfo | None = None
    #: The measured class beside the declared ``latency_us`` (None: not measured, or
    #: another host's pool); ``measured`` has the figures per CPU node.
    measured_latency_us: float | None = None
    measured: Measured | None = None


class HostInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A daemon host sharing the ledger (docs/scale-out.md), as the ledger knows it.

    ``live``: not stopped cleanly and a heartbeat younger than the daemon's
    ``host_timeout_s``; ``last_seen_age_s`` is that heartbeat's age on the
    database's clock (free of skew between hosts). ``local``: the host of the
    daemon that answers.
    """

    name: str
    live: bool
    local: bool
    started_at: str
    last_seen: str
    last_seen_age_s: float
    heartbeat_s: float
    stopped_at: str | None
    pools: int
    capacity_bytes: int
    buffers: int
    used_bytes: int


class TenantInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant with its use. ``max_buffers`` is the cap on its buffers in force: its own,
    or the daemon's default (``max_buffers_per_tenant``) when it has none."""

    id: str
    name: str
    quota_bytes: int
    used_bytes: int
    buffers: int
    created_at: str
    max_buffers: int
    #: Of ``used_bytes``: released entries some process still holds open (this host's).
    held_bytes: int = 0
    #: The bytes it may hold on this host's disk tiers in force: its own, or
    #: ``disk_quota_factor`` × ``quota_bytes``; and what it holds there now.
    disk_quota_bytes: int = 0
    disk_used_bytes: int = 0


class NewTenant(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to tenant creation: the only time the first API key is shown."""

    id: str
    name: str
    quota_bytes: int
    used_bytes: int
    api_key: str
    key_id: str
    #: The disk quota in force (its own, or ``disk_quota_factor`` × ``quota_bytes``).
    disk_quota_bytes: int = 0


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
    max_buffers: int
    #: Of ``used_bytes``: released entries some process still holds open — a kept fd or
    #: mapping, a child's, one passed on; they count until every one of them is gone.
    held_bytes: int = 0
    #: The disk quota in force (its own, or ``disk_quota_factor`` × ``quota_bytes``) and
    #: the bytes of its entries on this host's disk tiers.
    disk_quota_bytes: int = 0
    disk_used_bytes: int = 0


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
    #: Filled by ``GET /v1/buffers?held=true`` (admin): the processes holding this
    #: released entry's memfd open (an fd or a mapping), as the daemon's /proc shows them.
    holder_pids: list[int] | None = None


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

    ``kind`` is an :data:`~maasd.bounds.EventKind`: ``reserve`` and every
    :data:`~maasd.bounds.ReleaseReason` (``release``, ``evict``, ``expire``, ``pool_drain``,
    ``shutdown``, ``recover``, ``reserve_failed``, and an entry's ``abort``, ``disconnect``,
    ``commit_failed``) for buffers; ``tenant_create``, ``tenant_delete``, ``quota_set``,
    ``max_buffers_set`` (``detail``: the cap), ``disk_quota_set``, ``key_issue``, ``key_revoke`` (tenants);
    ``pool_create``, ``pool_delete`` (pools); ``host_forget`` (a forgotten host: one per
    buffer it held and one for the host). ``bytes`` is the buffer size (or quota,
    capacity); ``detail`` a name or id the kind needs (never a key itself).
    """

    id: int
    at: str
    kind: EventKind
    tenant_id: str | None
    buffer_id: str | None
    pool_id: str | None
    bytes: int | None
    detail: str | None
