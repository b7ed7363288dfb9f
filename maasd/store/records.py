"""Rows of the ledger as frozen ``msgspec.Struct``s.

These are the store's vocabulary, not the API's: they carry internal columns
(``host``, ``digest``, ``last_used_at``, ``checkpoint_path`` …) that the service
turns into :mod:`maasd.models` records. Field order equals the column order of
the matching table in :mod:`maasd.store.schema`, so a result row converts
positionally (``BufferRow(*row)``) — the cheapest conversion there is; an import-
time check below keeps the two in step.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from maasd.models import Backing, BufferKind, BufferState, EventKind, Persistence, ScrubMode
from maasd.store import schema

__all__ = ["BufferRow", "EventRow", "Extension", "HostRow", "KeyRow", "PoolRow", "TenantRow"]


class PoolRow(msgspec.Struct, frozen=True):
    """A pool of one daemon host (``host``), with its fixed properties."""

    id: str
    host: str
    name: str
    numa_node: int
    backing: Backing
    persistence: Persistence
    latency_us: int
    capacity_bytes: int
    page_bytes: int
    prefault: bool
    scrub: ScrubMode
    spill_dir: str | None
    created_at: float
    warm_bytes: int = 0
    deleting_at: float | None = None
    disk_dir: str | None = None
    disk_bytes: int = 0


class TenantRow(msgspec.Struct, frozen=True):
    """A tenant, with its usage: the running totals the ledger keeps on its row.

    ``used_bytes`` and ``buffers`` count the buffers in every state
    (:data:`~maasd.store.schema.ACCOUNTED_STATES`) — exactly what quota checks count.
    ``max_buffers`` ``None`` means the daemon's default cap, ``disk_quota_bytes``
    ``None`` the default disk quota (``disk_quota_factor`` × ``quota_bytes``).
    """

    id: str
    name: str
    quota_bytes: int
    created_at: float
    max_buffers: int | None = None
    deleting_at: float | None = None
    disk_quota_bytes: int | None = None
    used_bytes: int = 0
    buffers: int = 0


class KeyRow(msgspec.Struct, frozen=True):
    """An API key: only its SHA-256 ``digest`` is stored, never the token."""

    id: str
    tenant_id: str
    digest: bytes
    created_at: float
    revoked_at: float | None = None


class BufferRow(msgspec.Struct, frozen=True):
    """A buffer in the ledger.

    ``host`` is the host whose memory holds it. ``last_used_at`` orders eviction
    (least recently used first). ``key`` is cleared when the buffer starts
    releasing, so the key can be reused at once. ``kind`` says how it was made:
    ``buffer`` (REST reserve) or ``entry`` (socket put, immutable from
    ``committed_at`` on). ``ttl_s`` is its lease's length as its tenant last gave it
    (:attr:`lease_s`), ``lease_set_at`` when a renew last set its lease.
    """

    id: str
    tenant_id: str
    pool_id: str
    host: str
    size_bytes: int
    numa_node: int
    persistence: Persistence
    label: str | None
    key: str | None
    evictable: bool
    state: BufferState
    created_at: float
    expires_at: float
    last_used_at: float
    kind: BufferKind = "buffer"
    committed_at: float | None = None
    checkpoint_path: str | None = None
    checksum: str | None = None
    checkpointed_at: float | None = None
    ttl_s: int | None = None
    lease_set_at: float | None = None

    @property
    def lease_s(self) -> int:
        """The lease's length: what a lookup hit extends it by, and what a worker renews
        it to. ``ttl_s``, as its tenant last gave it; a row from before migration 0008 has
        none, and the length it was reserved with stands in (``expires_at − created_at``:
        longer if it was renewed or hit since, which only such an old row can be)."""
        if self.ttl_s is not None:
            return self.ttl_s
        return max(1, round(self.expires_at - self.created_at))


class Extension(NamedTuple):
    """A lookup hit's lease extension not written yet: the lease end it asks for, and when
    the hit was. Written only over a lease no renew set after the hit (``lease_set_at``)."""

    expires_at: float
    hit_at: float


class EventRow(msgspec.Struct, frozen=True):
    """One entry of the audit trail (``reserve``, ``release``, ``evict``, ``expire`` …)."""

    id: int
    at: float
    kind: EventKind
    tenant_id: str | None
    buffer_id: str | None
    pool_id: str | None
    bytes: int | None
    detail: str | None


class HostRow(msgspec.Struct, frozen=True):
    """A daemon host sharing the ledger: its current incarnation and heartbeat (database clock)."""

    name: str
    incarnation: str
    started_at: float
    last_seen: float
    heartbeat_s: float
    stopped_at: float | None = None


def _check(record: type[msgspec.Struct], table_columns: tuple[str, ...]) -> None:
    fields = record.__struct_fields__[: len(table_columns)]
    if fields != table_columns:  # pragma: no cover - a programming error, caught by any test
        raise RuntimeError(f"{record.__name__} fields {fields} != columns {table_columns}")


_check(PoolRow, tuple(c.name for c in schema.pools.c if c.name not in schema.TOTALS))
_check(TenantRow, tuple(schema.tenants.c.keys()))
_check(KeyRow, tuple(schema.api_keys.c.keys()))
_check(BufferRow, tuple(schema.buffers.c.keys()))
_check(EventRow, tuple(schema.events.c.keys()))
_check(HostRow, tuple(schema.hosts.c.keys()))
