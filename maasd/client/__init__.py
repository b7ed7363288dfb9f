"""maasd's Python client: ``Client`` (REST control plane) and ``Worker`` (local data plane).

Example::

    from maasd.client import Client, Worker, QuotaExceeded

    with Client("http://127.0.0.1:7878", api_key) as c:
        buf = c.reserve(size_bytes=64 << 20, pool="node0")
        with Worker("/var/lib/maasd/maasd.sock", api_key) as w:
            m = w.attach(buf.id)
            m.array[:4] = 7            # numpy uint8 over the shared memfd, zero-copy
        c.release(buf.id)

This package imports nothing from the daemon's side (only :mod:`maasd.protocol`,
which is msgspec and the standard library). See ``docs/client.md``.
"""

from maasd.client.entries import Entry, EntryMapping
from maasd.client.errors import (
    BadRequest,
    BodyTooLarge,
    BufferCountExceeded,
    Conflict,
    ConnectionFailed,
    DuplicateKey,
    Forbidden,
    InsufficientStorage,
    InternalError,
    InvalidReference,
    LedgerUnavailable,
    LimitExceeded,
    MaasdClientError,
    MethodNotAllowed,
    NotFound,
    PlacementError,
    PoolExhausted,
    ProtocolError,
    QosUnmet,
    QuotaExceeded,
    ResourceLimit,
    ServerError,
    StateConflict,
    TooLarge,
    Unauthorized,
    Unprocessable,
    UnsupportedMediaType,
)
from maasd.client.mapping import BufferMapping, Mapping
from maasd.client.rest import Client, raw_json
from maasd.client.scratch import Scratch
from maasd.client.types import (
    Buffer,
    Checkpoint,
    Component,
    DiskTier,
    Event,
    Health,
    Host,
    KeyInfo,
    LookupHit,
    Measured,
    MeasuredFrom,
    NewTenant,
    NumaNode,
    Pool,
    Tenant,
    Topology,
    Usage,
)
from maasd.client.worker import Worker

__all__ = [
    "BadRequest",
    "BodyTooLarge",
    "Buffer",
    "BufferMapping",
    "BufferCountExceeded",
    "Checkpoint",
    "Component",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "DiskTier",
    "DuplicateKey",
    "Entry",
    "EntryMapping",
    "Event",
    "Forbidden",
    "Health",
    "Host",
    "InsufficientStorage",
    "InternalError",
    "InvalidReference",
    "KeyInfo",
    "LedgerUnavailable",
    "LimitExceeded",
    "LookupHit",
    "MaasdClientError",
    "Mapping",
    "MethodNotAllowed",
    "NewTenant",
    "NotFound",
    "NumaNode",
    "PlacementError",
    "Measured",
    "MeasuredFrom",
    "Pool",
    "PoolExhausted",
    "ProtocolError",
    "QosUnmet",
    "QuotaExceeded",
    "ResourceLimit",
    "Scratch",
    "ServerError",
    "StateConflict",
    "Tenant",
    "TooLarge",
    "Topology",
    "Unauthorized",
    "Unprocessable",
    "UnsupportedMediaType",
    "Usage",
    "Worker",
    "raw_json",
]
