"""``EntryMaps``: the mappings a worker keeps of the entries it looked up.

A lookup's answer is a read-only fd; mapping it and faulting its pages in is what a
second lookup of the same entry should not pay again (docs/performance.md, "Lookup's
fd, per entry"). :class:`EntryMaps` owns that part of a worker: the
:class:`~maasd.client.entries.MappingCache` (which decides what is kept), the time it
was last aged, and what is done with each mapping the cache lets go of — unmapped, and
detached unless the daemon released it (it owes no detach then). The worker asks the
daemon; this object turns the answer into an
:class:`~maasd.client.entries.EntryMapping`.

:meth:`found` is on the lookup's hot path: a cache hit is one ``checkout``, one
``close`` of the new fd and the answer object.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from maasd import protocol
from maasd.client.entries import CachedMapping, EntryMapping, MappingCache
from maasd.client.mapping import BufferMapping, check_memfd_size

__all__ = ["SWEEP_INTERVAL_S", "EntryMaps"]

#: Idle entry mappings are aged out at most this often (on lookups and renewals).
SWEEP_INTERVAL_S = 1.0

#: tells the daemon a mapping is over: ``(buffer_id, attached)``; a no-op unless attached
Detach = Callable[[str, bool], None]


class EntryMaps:
    """Looked-up entries mapped read-only, one mapping per entry shared by its users.

    ``detach`` is the worker's quiet detach (it logs a failure rather than raising:
    a mapping let go of is gone here whatever the daemon answers).
    """

    def __init__(self, cache: MappingCache, detach: Detach) -> None:
        self.cache = cache
        self._detach = detach
        self._swept = time.monotonic()

    def found(self, reply: protocol.Found, fd: int) -> EntryMapping:
        """The answer to a hit: the cached mapping of the entry (``fd`` closed: it is not
        needed), or a new mapping of ``fd``, cached."""
        cache = self.cache
        slot = cache.checkout(reply.buffer_id)
        if slot is not None:
            os.close(fd)
            return EntryMapping(slot, self.give_back)
        if len(cache):  # a new entry under this key: an older one is released
            self._drop(cache.forget_keys([reply.key], keep=reply.buffer_id))
        try:
            check_memfd_size(fd, reply.size_bytes)
            m = BufferMapping(
                None, reply.buffer_id, fd, reply.size_bytes, reply.numa_node, writable=False
            )
        except BaseException:
            os.close(fd)
            self._detach(reply.buffer_id, True)
            raise
        slot = CachedMapping(m, reply.key)
        self._drop(cache.add(slot))
        return EntryMapping(slot, self.give_back)

    def missed(self, keys: list[str]) -> None:
        """The daemon found none of ``keys``: what was cached under them is released."""
        if len(self.cache):
            self._drop(self.cache.forget_keys(keys))

    def forget(self, buffer_id: str) -> None:
        """Drop one entry (unmapped once no one uses it)."""
        self._drop(self.cache.forget(buffer_id))

    def give_back(self, slot: CachedMapping) -> None:
        """An :class:`EntryMapping` closed: one user less; unmapped if the cache says so."""
        self._drop(self.cache.checkin(slot))

    def sweep(self, force: bool = False) -> None:
        """Age idle entry mappings out (at most every SWEEP_INTERVAL_S unless ``force``)."""
        now = time.monotonic()
        if force or now - self._swept >= SWEEP_INTERVAL_S:
            self._swept = now
            self._drop(self.cache.expire(now))

    def clear(self) -> list[BufferMapping]:
        """Every mapping, taken out of the cache (the worker is closing: it unmaps them
        and the daemon drops the attachments with the connection)."""
        return [slot.mapping for slot in self.cache.clear()]

    def _drop(self, slots: list[CachedMapping]) -> None:
        """Unmap what the cache let go of; detach each unless the daemon released it."""
        for slot in slots:
            slot.mapping.unmap()
            self._detach(slot.buffer_id, not slot.released)
