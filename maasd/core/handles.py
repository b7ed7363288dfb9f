"""Handles for the socket broker: a buffer's memfd for a worker, and the attachment count.

An attach is on a worker's hot path, so it writes nothing to the ledger: the
use (the LRU order eviction follows) is remembered in the runtime and written
in a batch later (:meth:`maasd.core.buffers.Buffers.flush_uses`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from maasd.core.auth import require_tenant
from maasd.core.runtime import Runtime
from maasd.errors import NotFound
from maasd.metrics import Metrics
from maasd.models import Principal
from maasd.store import Store

__all__ = ["Handle", "Handles"]


@dataclass(frozen=True)
class Handle:
    """A buffer as handed to a worker: ``fd`` is a dup the receiver of this object closes."""

    fd: int
    buffer_id: str
    size_bytes: int
    numa_node: int


class Handles:
    """Opens and drops handles; counts attachments per tenant (a gauge) and per buffer."""

    def __init__(self, store: Store, runtime: Runtime, metrics: Metrics) -> None:
        self._store = store
        self._runtime = runtime
        self._metrics = metrics

    def open(self, who: Principal, buffer_id: str) -> Handle:
        """A dup of the buffer's sealed memfd for a worker; NotFound for foreign/unknown ids."""
        tenant_id = require_tenant(who)
        row = self._store.buffer(buffer_id, tenant_id)
        if row is None or row.state != "live":
            raise NotFound(f"no buffer {buffer_id!r}")
        fd = self._runtime.dup_fd(row.id)
        if fd is None:
            raise NotFound(f"no buffer {buffer_id!r}")
        count = self._runtime.attach(tenant_id, row.id)
        self._metrics.attached.labels(tenant=tenant_id).set(count)
        self._runtime.touch(row.id, time.time())
        return Handle(fd=fd, buffer_id=row.id, size_bytes=row.size_bytes, numa_node=row.numa_node)

    def drop(self, who: Principal, buffer_id: str) -> None:
        """A worker let go of one handle of the buffer (detach, or its connection closed)."""
        tenant_id = who.tenant_id
        if tenant_id is None:
            return
        count = self._runtime.detach(tenant_id, buffer_id)
        self._metrics.attached.labels(tenant=tenant_id).set(count)
