"""The REST API's records (docs/api.md) as the client sees them: frozen msgspec Structs.

They mirror the daemon's records field for field (``maasd.models``,
``maasd.topology``) but are defined here, so the client imports nothing from the
server side; tests/unit/test_client_parity.py checks that each pair has the same
field names and that every server record decodes as its client type. Decoding is
lenient — unknown fields are ignored and fields a daemon may omit have defaults
— so a newer daemon does not break an older client.

======================  ==========================
client                  daemon
======================  ==========================
``Pool``                ``models.PoolInfo``
``Tenant``              ``models.TenantInfo``
``NewTenant``           ``models.NewTenant``
``KeyInfo``             ``models.KeyInfo``
``Usage``               ``models.Usage``
``Buffer``              ``models.BufferInfo``
``Checkpoint``          ``models.Checkpoint``
``LookupHit``           ``models.LookupHit``
``Event``               ``models.Event``
``Topology``            ``topology.Topology``
``NumaNode``            ``topology.Node``
======================  ==========================
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Buffer",
    "Checkpoint",
    "Component",
    "DiskTier",
    "Event",
    "Health",
    "Host",
    "KeyInfo",
    "LookupHit",
    "NewTenant",
    "NumaNode",
    "Pool",
    "Tenant",
    "Topology",
    "Usage",
]


# Enumerations (backing, persistence, scrub, state, an event's kind) are plain ``str``
# here on purpose: a value added by a newer daemon must not make a whole listing
# undecodable. The values this daemon sends are the Literals of ``maasd.bounds``
# (``Backing``, ``Persistence``, ``ScrubMode``, ``BufferState``, ``EventKind``), which the
# client takes for what it sends (``Client.reserve(persistence=…)``).


class DiskTier(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's disk tier (docs/operations.md, "The disk tier")."""

    used_bytes: int = 0
    entries: int = 0
    demotions: int = 0
    promotions: int = 0
    drops: dict[str, int] = msgspec.field(default_factory=dict)
    read_bytes: int = 0
    write_bytes: int = 0


class MeasuredFrom(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's node as measured from one CPU node's cpus."""

    cpu_node: int
    latency_us: float | None = None
    gib_per_s: float | None = None


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """What the daemon measured of a pool's node (docs/allocator.md, "Latency classes")."""

    latency_us: float
    cpu_node: int
    gib_per_s: float | None = None
    by_cpu_node: list[MeasuredFrom] = msgspec.field(default_factory=list)
    measured_at: str = ""


class Pool(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    host: str = ""  # the daemon host whose memory it is; names repeat per host
    numa_node: int
    backing: str
    persistence: str
    latency_us: int
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    page_bytes: int
    scrub: str
    prefault: bool = True
    buffers: int = 0
    warm_bytes: int = 0
    warm_target_bytes: int = 0
    #: Of ``used_bytes``: released entries some process still holds open.
    held_bytes: int = 0
    disk_dir: str | None = None  # the disk tier (docs/operations.md, "The disk tier")
    disk_bytes: int = 0
    disk: DiskTier | None = None
    #: The measured latency class beside the declared ``latency_us`` (None: not measured).
    measured_latency_us: float | None = None
    measured: Measured | None = None


class Host(msgspec.Struct, frozen=True, kw_only=True):
    """A daemon host sharing the ledger (admin: ``GET /v1/hosts``)."""

    name: str
    live: bool
    local: bool
    started_at: str
    last_seen: str
    last_seen_age_s: float
    heartbeat_s: float
    stopped_at: str | None = None
    pools: int = 0
    capacity_bytes: int = 0
    buffers: int = 0
    used_bytes: int = 0


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant; ``max_buffers`` is the cap on its buffers in force (its own or the
    daemon's default; ``None`` from a daemon that has no caps)."""

    id: str
    name: str
    quota_bytes: int
    used_bytes: int = 0
    buffers: int = 0
    created_at: str | None = None
    max_buffers: int | None = None
    #: Of ``used_bytes``: released entries some process still holds open.
    held_bytes: int = 0
    #: The disk quota in force (its own, or ``disk_quota_factor`` × the quota) and the
    #: bytes of its entries on the daemon's disk tiers (0 from a daemon without them).
    disk_quota_bytes: int = 0
    disk_used_bytes: int = 0


class NewTenant(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to tenant creation: the only time its first API key is shown.

    ``id`` is the *tenant's* id; ``key_id`` the id of that first key (the one
    ``revoke_key`` takes). In :class:`KeyInfo` the key's id is ``id``.
    """

    id: str
    name: str
    quota_bytes: int
    api_key: str
    used_bytes: int = 0
    key_id: str | None = None
    disk_quota_bytes: int = 0


class KeyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to key issue: the only time the key itself is shown. ``id`` is the key's id."""

    id: str
    api_key: str
    created_at: str | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    quota_bytes: int
    used_bytes: int
    buffers: int
    max_buffers: int | None = None
    #: Of ``used_bytes``: released entries some process still holds open (counted until
    #: every fd and mapping of them is gone).
    held_bytes: int = 0
    #: The disk quota in force and the bytes on the daemon's disk tiers.
    disk_quota_bytes: int = 0
    disk_used_bytes: int = 0


class Buffer(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    pool_id: str
    size_bytes: int
    numa_node: int
    persistence: str
    label: str | None = None
    key: str | None = None
    evictable: bool = False
    state: str = "live"
    created_at: str | None = None
    expires_at: str | None = None
    placement: dict[str, int] | None = None
    checksum: str | None = None
    #: ``buffers(held=True)``: the pids holding this released entry open
    holder_pids: list[int] | None = None


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    checksum: str
    bytes: int


class LookupHit(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    buffer: Buffer


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the audit trail (``GET /v1/events``), newest first.

    ``kind`` is e.g. ``reserve``, ``release``, ``evict``, ``expire``, ``tenant_create``,
    ``key_issue``, ``pool_delete``; ``bytes`` the buffer size (or quota, capacity);
    ``detail`` a name or id the kind needs (never a key itself).
    """

    id: int
    at: str
    kind: str
    tenant_id: str | None = None
    buffer_id: str | None = None
    pool_id: str | None = None
    bytes: int | None = None
    detail: str | None = None


class NumaNode(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    cpus: list[int]
    mem_total_bytes: int
    mem_free_bytes: int
    distances: list[int]
    hugepages_total: int = 0
    hugepages_free: int = 0


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[NumaNode]
    hugepage_bytes: int
    hugepages_free: int
    page_bytes: int = 4096


class Component(msgspec.Struct, frozen=True, kw_only=True):
    """One component of the daemon's health: ``ok``, and why not when it is not."""

    ok: bool
    detail: str = ""


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /healthz``: ``status`` is ``ok`` (200), ``degraded`` (200: the ledger or L2
    is failing, the daemon serves without it) or ``unhealthy`` (503), and then
    ``components`` says which part is not healthy and why."""

    status: str
    components: dict[str, Component] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"
