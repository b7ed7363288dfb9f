"""Handles for the socket broker: a buffer's memfd for a worker, and the attachment count.

An attach is on a worker's hot path, and the broker answers it on its event loop:
it is answered from memory (:mod:`maasd.core.regions`) — which regions this daemon holds, whose
they are, whether they are live — and reads or writes nothing in the ledger. The
use (the LRU order eviction follows) is remembered (:mod:`maasd.core.uses`) and written in a
batch later (:meth:`maasd.core.uses.UseBatch.flush`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from maasd.core.attachments import Attachments
from maasd.core.auth import require_tenant
from maasd.core.regions import Regions
from maasd.core.uses import UseBatch
from maasd.errors import NotFound
from maasd.metrics import Metrics
from maasd.models import Principal

__all__ = ["BufferHandle", "Handles"]


@dataclass(frozen=True)
class BufferHandle:
    """A buffer as handed to a worker: ``fd`` is a dup the receiver of this object closes."""

    fd: int
    buffer_id: str
    size_bytes: int
    numa_node: int
    #: the lease it was reserved with (seconds; 0: not known), what a worker renews it to
    ttl_s: int = 0


class Handles:
    """Opens and drops handles; counts attachments per tenant (a gauge) and per buffer."""

    def __init__(
        self, regions: Regions, attachments: Attachments, uses: UseBatch, metrics: Metrics
    ) -> None:
        self._regions = regions
        self._attachments = attachments
        self._uses = uses
        self._metrics = metrics

    def open(self, who: Principal, buffer_id: str) -> BufferHandle:
        """A dup of the buffer's sealed memfd for a worker; NotFound for foreign/unknown ids
        and for entries not yet committed. A committed entry's handle is read-only."""
        tenant_id = require_tenant(who)
        opened = self._regions.open_handle(tenant_id, buffer_id)
        if opened is None:
            raise NotFound(f"no buffer {buffer_id!r}")
        if opened.tenant_attached is not None:  # always: an attach is counted
            self._metrics.tenant(tenant_id).attached.set(opened.tenant_attached)
        self._uses.touch(buffer_id, time.time())
        return BufferHandle(
            fd=opened.fd,
            buffer_id=buffer_id,
            size_bytes=opened.size_bytes,
            numa_node=opened.numa_node,
            ttl_s=opened.ttl_s,
        )

    def drop(self, who: Principal, buffer_id: str) -> None:
        """A worker let go of one handle of the buffer (detach, or its connection closed)."""
        tenant_id = who.tenant_id
        if tenant_id is None:
            return
        count = self._attachments.detach(tenant_id, buffer_id)
        self._metrics.tenant(tenant_id).attached.set(count)
