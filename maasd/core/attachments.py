"""How many handles workers hold, per buffer and per tenant, and the buffers released
while some still were.

Counted by :mod:`maasd.core.handles` (an attach, a detach) and by
:class:`~maasd.core.regions.Regions` (a lookup hit is counted in the same step its fd
is made, under the regions lock: lock 2 → this one). Read by eviction (buffers a
worker holds are evicted last) and the metrics. A leaf lock (:mod:`maasd.core.regions`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterator

from maasd.models import BufferKind

__all__ = ["Attachments"]


class Attachments:
    """Attachment counts (a leaf lock: never held while taking another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tenant: Counter[str] = Counter()
        self._by_buffer: Counter[str] = Counter()
        # Buffers released while workers still had handles attached: tenant, kind, size —
        # until the last handle goes (released_attached).
        self._released: dict[str, tuple[str, str, int]] = {}

    def attach(self, tenant_id: str, buffer_id: str) -> int:
        """Count one more handle of this tenant on this buffer; returns the tenant's count."""
        with self._lock:
            self._by_buffer[buffer_id] += 1
            self._by_tenant[tenant_id] += 1
            return self._by_tenant[tenant_id]

    def detach(self, tenant_id: str, buffer_id: str) -> int:
        """Count one handle less; returns the tenant's count.

        A buffer with no handle counted changes nothing: counts never go below zero,
        and the tenant's count stays the sum of its buffers'.
        """
        with self._lock:
            if self._by_buffer[buffer_id] > 0:
                for counts, key in ((self._by_buffer, buffer_id), (self._by_tenant, tenant_id)):
                    counts[key] -= 1
                    if counts[key] <= 0:
                        del counts[key]
                if buffer_id not in self._by_buffer:
                    self._released.pop(buffer_id, None)
            return self._by_tenant[tenant_id]

    def attached_ids(self) -> Collection[str]:
        """The buffers some worker holds a handle of, each question answered now: a
        view, not a copy. A reserve passes it to every admission (eviction defers the
        held ones) and most need no victim, so copying every id for each reserve, under
        this lock, cost in proportion to the handles held for nothing."""
        return _Attached(self._lock, self._by_buffer)

    def attached(self, buffer_id: str) -> int:
        """How many handles workers hold on this buffer now (attached, not yet dropped)."""
        with self._lock:
            return self._by_buffer[buffer_id]

    def tenant_attached(self, tenant_id: str) -> int:
        """How many handles this tenant's workers hold now, over all its buffers."""
        with self._lock:
            return self._by_tenant[tenant_id]

    def note_released(
        self, buffer_id: str, tenant_id: str, kind: BufferKind | str, size: int
    ) -> None:
        """A buffer was released: if workers still have handles attached, remember it until
        they detach (their fds can fault fresh pages in that no ledger counts)."""
        with self._lock:
            if self._by_buffer[buffer_id] > 0:
                self._released[buffer_id] = (tenant_id, kind, size)

    def released_attached(self) -> list[tuple[str, str, int, int]]:
        """``(tenant_id, kind, size_bytes, handles)`` of every buffer released while
        handles on it were attached, as long as they still are."""
        with self._lock:
            return [
                (tenant, kind, size, self._by_buffer[buffer_id])
                for buffer_id, (tenant, kind, size) in self._released.items()
            ]


class _Attached(Collection[str]):
    """:meth:`Attachments.attached_ids`: membership and size under its lock."""

    def __init__(self, lock: threading.Lock, by_buffer: Counter[str]) -> None:
        self._lock, self._by_buffer = lock, by_buffer

    def __contains__(self, buffer_id: object) -> bool:
        with self._lock:
            return buffer_id in self._by_buffer

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_buffer)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._by_buffer))
