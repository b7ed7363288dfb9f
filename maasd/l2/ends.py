"""Pure: the L2 values this daemon's entries wrote (or were restored from), and which of
them an entry's release deletes.

Only an eviction leaves an entry's value in L2 (L2 is the tier below for capacity
decisions). Any other end of an entry — a tenant's or admin's DELETE (``release``), its
lease (``expire``), a pool drain — must not be undone by the next lookup restoring it
from L2, on this host or another, so the value it wrote is deleted. A tenant's delete is
the tier's ``drop_tenant`` (all of the tenant's values at once). An entry restored here
from L2 deletes the value it came from on a DELETE only: its lease or its pool's drain
ends this host's copy, while the entry that wrote the value may live on elsewhere.

A value is known by its digest (:func:`maasd.l2.codec.digest`), so that the delete drops
that value and not a newer one of the same key (another host's).

The writer's store of an entry can race its release: the entry is released while its
write is queued or in flight. Each write offered is *pending* until the writer is done
with it; a release meanwhile marks it, and the writer either skips it (not begun) or has
the value it stored deleted (done). A release that comes before the write is even offered
(the commit hook runs after the writer's answer) is remembered for a while
(``recent``), and the offer is refused.

Until its delete has landed, a value being deleted is not restored here either (a
lookup right after the DELETE, or while L2 refuses the delete, misses): the digests of
the values to delete are kept (``deleting``) until their delete is done, and a bounded
number of them past that when it is not (given up, or never queued).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

__all__ = ["DROPS", "DROPS_RESTORED", "Ends", "Written"]

#: The release reasons (:data:`maasd.bounds.ReleaseReason`) that delete the value an
#: entry wrote. Not ``evict``; not ``tenant_delete`` (``drop_tenant`` does all of them);
#: the reasons of a staged entry's end never find a value (it was never written).
DROPS = frozenset({"release", "expire", "pool_drain"})
#: Those that delete the value an entry restored from L2 was read from.
DROPS_RESTORED = frozenset({"release"})
#: Releases remembered while no write of theirs was offered (yet).
RECENT = 4096


@dataclass(frozen=True, slots=True)
class Written:
    """A value in L2 that an entry of this daemon wrote, or was ``restored`` from."""

    tenant_id: str
    key: str
    digest: bytes
    restored: bool = False

    def dropped_by(self, reason: str) -> bool:
        """Whether its entry's release for ``reason`` deletes it."""
        return reason in (DROPS_RESTORED if self.restored else DROPS)


class _Pending:
    __slots__ = ("ended", "tenant_id")

    def __init__(self, tenant_id: str) -> None:
        self.tenant_id = tenant_id
        self.ended: str | None = None  # the reason its entry was released, if it was


class Ends:
    """Thread-safe: the core's release hook, the writer thread and lookups call it."""

    def __init__(self, recent: int = RECENT) -> None:
        self._lock = threading.Lock()
        self._written: dict[str, Written] = {}  # buffer id → the value its entry left
        self._pending: dict[str, _Pending] = {}  # buffer id → its write, offered, not done
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._max_recent = recent
        self._deleting: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        """The values known (one per live entry that wrote, or was restored from, one)."""
        return len(self._written)

    def offered(self, tenant_id: str, buffer_id: str) -> bool:
        """A write of ``buffer_id`` is about to be queued: False if its entry was released
        already (the write is not to be done)."""
        with self._lock:
            if buffer_id in self._recent:
                return False
            self._pending[buffer_id] = _Pending(tenant_id)
            return True

    def withdrawn(self, buffer_id: str) -> None:
        """The write offered is not done after all (refused, or taken out of the queue)."""
        with self._lock:
            self._pending.pop(buffer_id, None)

    def wanted(self, buffer_id: str) -> bool:
        """Whether the writer is still to write ``buffer_id``: its entry is not known to
        be released."""
        with self._lock:
            p = self._pending.get(buffer_id)
            return buffer_id not in self._recent if p is None else p.ended is None

    def stored(self, buffer_id: str, left: Written | None) -> Written | None:
        """The writer is done with ``buffer_id``; ``left``: the value its store may have
        left in L2 (None: nothing). The value to delete now, if its entry was released
        meanwhile for a reason that deletes it; else None (and ``left`` is remembered
        for the entry's release)."""
        with self._lock:
            p = self._pending.pop(buffer_id, None)
            if left is None or p is None:  # nothing stored, or its tenant is gone
                return None
            if p.ended is None:
                self._written[buffer_id] = left
                return None
            return self._deleted(left) if left.dropped_by(p.ended) else None

    def restored(self, buffer_id: str, value: Written) -> None:
        """The entry ``buffer_id`` was restored here from ``value`` (unless it was released
        already: nothing to remember then)."""
        with self._lock:
            if buffer_id not in self._recent:
                self._written[buffer_id] = value

    def ended(self, buffer_id: str, reason: str) -> Written | None:
        """The entry ``buffer_id`` is being released for ``reason``: the value to delete,
        if any. A write of it still pending is marked (see the module docstring)."""
        with self._lock:
            value = self._written.pop(buffer_id, None)
            p = self._pending.get(buffer_id)
            if p is not None:
                p.ended = reason
            else:
                self._recent[buffer_id] = None
                while len(self._recent) > self._max_recent:
                    self._recent.popitem(last=False)
            if value is None or not value.dropped_by(reason):
                return None
            return self._deleted(value)

    def _deleted(self, value: Written) -> Written:
        """``value`` is to be deleted: not restored from L2 here meanwhile (the lock held)."""
        self._deleting[value.digest] = None
        while len(self._deleting) > self._max_recent:
            self._deleting.popitem(last=False)
        return value

    def deleting(self, digest: bytes) -> bool:
        """Whether the value of ``digest`` is one this daemon deletes (not to be restored)."""
        return digest in self._deleting

    def settled(self, digest: bytes) -> None:
        """The delete of the value of ``digest`` is done: it is gone from L2."""
        with self._lock:
            self._deleting.pop(digest, None)

    def drop_tenant(self, tenant_id: str) -> None:
        """The tenant was deleted: its values (all dropped at once) and writes forgotten."""
        with self._lock:
            for buffer_id in [b for b, v in self._written.items() if v.tenant_id == tenant_id]:
                del self._written[buffer_id]
            for buffer_id in [b for b, p in self._pending.items() if p.tenant_id == tenant_id]:
                del self._pending[buffer_id]
