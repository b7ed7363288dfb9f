"""Committed entries as a worker maps them: :class:`EntryMapping` and the mapping cache.

A ``Worker.lookup`` is one socket round trip that answers with a read-only fd of the
committed entry; mapping that fd and faulting its pages in is what a second lookup
of the same entry should not pay again. :class:`MappingCache` keeps one read-only
mapping per entry, shared by every :class:`EntryMapping` handed out for it, bounded
in bytes and in idle time. The daemon counts one attachment per connection and
entry however often it is looked up, so the cache detaches an entry once, when it
unmaps it.

An entry the daemon released (evicted, expired, deleted) reads zeros and, while mapped
here, still counts in the tenant's quota (its pages cannot be freed while anyone maps
them). The daemon says so with a pushed ``released`` frame, which the worker handles
before its next call returns (also while it waits for another answer): the mapping is
dropped at once (unmapped, fd closed), or when its user gives it back. Every lookup
still asks the daemon, so a released entry is not found again:
a miss drops the cached mappings of the keys asked for, and a hit drops one cached
under the same key with another id (the key was published again). An entry released
between a lookup and its read fails the reader's header check, and
``Worker.forget(buffer_id)`` drops it.

The worker's side of it — what it does with the answers and the slots let go of — is
:class:`~maasd.client.entry_maps.EntryMaps`. Only ``mmap``, ``numpy`` and the standard
library are used here.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from maasd.client.mapping import BufferMapping

__all__ = ["DEFAULT_CACHE_AGE_S", "DEFAULT_CACHE_BYTES", "Entry", "EntryMapping", "MappingCache"]

#: Bytes of idle entry mappings a worker keeps (``Worker(cache_bytes=…)``).
DEFAULT_CACHE_BYTES = 256 << 20
#: Seconds an entry mapping may stay idle in the cache (``Worker(cache_age_s=…)``).
DEFAULT_CACHE_AGE_S = 30.0
#: Released ids remembered that were not cached when the daemon said so.
_GONE_KEPT = 1024


@dataclass(frozen=True)
class Entry:
    """A committed entry, as its writer knows it after ``Worker.commit``."""

    id: str
    key: str
    size_bytes: int
    numa_node: int


@dataclass(eq=False)
class CachedMapping:
    """One cached mapping: the read-only :class:`BufferMapping` and who uses it now."""

    mapping: BufferMapping
    key: str
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    forgotten: bool = False
    #: the daemon said it was released: dropped without a detach (it owes none)
    released: bool = False

    @property
    def buffer_id(self) -> str:
        return self.mapping.buffer_id


#: gives a slot back to the worker that handed it out
_Release = Callable[[CachedMapping], None]


class EntryMapping:
    """A committed entry mapped read-only (``Worker.lookup``'s answer).

    ``array`` is a read-only ``numpy.uint8`` view of the whole entry (zero-copy;
    writing raises, and so does every attempt to make it writable — the kernel
    refuses); ``key`` is the key that matched, ``size`` the entry's size in bytes.
    :meth:`close` (or leaving a ``with`` block) gives it back: the worker's mapping
    cache keeps the mapping for the next lookup, or unmaps it.
    """

    def __init__(self, slot: CachedMapping, release: _Release) -> None:
        self._slot: CachedMapping | None = slot
        self._release = release
        self.buffer_id = slot.buffer_id
        self.key = slot.key
        self.size = slot.mapping.size
        self.numa_node = slot.mapping.numa_node

    @property
    def closed(self) -> bool:
        return self._slot is None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The entry as a read-only numpy ``uint8`` array (zero-copy)."""
        if self._slot is None:
            raise ValueError(f"entry mapping {self.buffer_id} is closed")
        return self._slot.mapping.array

    @property
    def fd(self) -> int:
        """The entry's read-only memfd (the mapping cache's: never close it), e.g. to
        ``Worker.publish`` its bytes under another key."""
        if self._slot is None:
            raise ValueError(f"entry mapping {self.buffer_id} is closed")
        return self._slot.mapping.fd

    def close(self) -> None:
        """Give the mapping back (idempotent); do not use ``array`` afterwards."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._release(slot)

    def __enter__(self) -> EntryMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"EntryMapping(buffer_id={self.buffer_id!r}, key={self.key!r}, size={self.size}, {state})"


class MappingCache:
    """Entry mappings by buffer id, least recently used first; thread-safe.

    Slots in use are never evicted. Idle slots are evicted beyond ``max_bytes`` (0:
    none is kept idle) and after ``max_age_s`` seconds idle. Every method returns
    the slots it evicted: the caller unmaps them and tells the daemon (detach).

    A hit's ``checkout`` and ``checkin`` cost the same with one slot cached or ten
    thousand: the idle bytes are a running sum, the slots are kept in the order of their
    last use (so the oldest idle ones are first), the ids cached under each key are
    indexed, and a trim looks at no more slots than it evicts (and the in-use ones it
    passes on the way).
    """

    def __init__(
        self, max_bytes: int = DEFAULT_CACHE_BYTES, max_age_s: float = DEFAULT_CACHE_AGE_S
    ):
        if max_bytes < 0 or max_age_s < 0:
            raise ValueError("cache_bytes and cache_age_s must be >= 0")
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        #: least recently used (checked out or in) first
        self._slots: collections.OrderedDict[str, CachedMapping] = collections.OrderedDict()
        #: key → the ids cached under it (a key published again has two for a while)
        self._by_key: dict[str, set[str]] = {}
        #: bytes of the slots no one uses
        self._idle_bytes = 0
        #: released ids not cached when the daemon said so (a lookup's answer racing the
        #: frame): a slot added for one of them is dropped when given back
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: forgotten slots still in use whose id was cached again: dropped when given back
        self._retired: set[CachedMapping] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def __contains__(self, buffer_id: object) -> bool:
        with self._lock:
            return buffer_id in self._slots

    @property
    def nbytes(self) -> int:
        """Bytes of every mapping the cache holds (in use or idle)."""
        with self._lock:
            return sum(s.mapping.size for s in self._slots.values())

    @property
    def idle_bytes(self) -> int:
        """Bytes of the mappings no one uses now (what ``max_bytes`` bounds)."""
        with self._lock:
            return self._idle_bytes

    def checkout(self, buffer_id: str) -> CachedMapping | None:
        """The slot of ``buffer_id``, one more user counted; ``None`` if not cached."""
        with self._lock:
            slot = self._slots.get(buffer_id)
            if slot is None or slot.forgotten:
                return None
            if not slot.users:
                self._idle_bytes -= slot.mapping.size
            slot.users += 1
            slot.last_used = time.monotonic()
            self._slots.move_to_end(buffer_id)
            return slot

    def add(self, slot: CachedMapping) -> list[CachedMapping]:
        """Cache a new slot (with its first user); returns the slots evicted for room."""
        with self._lock:
            if self._gone.pop(slot.buffer_id, 0) is None:  # released before it was added
                slot.forgotten = slot.released = True
            old = self._slots.get(slot.buffer_id)
            if old is not None:  # mapped again while forgotten and in use: dropped when
                self._remove(old)  # its last user gives it back
                self._retired.add(old)
            slot.users += 1
            slot.last_used = time.monotonic()
            self._slots[slot.buffer_id] = slot
            self._by_key.setdefault(slot.key, set()).add(slot.buffer_id)
            return self._trim()

    def checkin(self, slot: CachedMapping) -> list[CachedMapping]:
        """One user less; returns the slots to drop now (over budget, forgotten)."""
        with self._lock:
            if self._slots.get(slot.buffer_id) is not slot:
                slot.users = max(0, slot.users - 1)
                if slot.users or slot not in self._retired:
                    return []  # not cached (any more): whoever removed it drops it
                self._retired.discard(slot)
                return [slot]
            slot.users -= 1
            slot.last_used = time.monotonic()
            self._slots.move_to_end(slot.buffer_id)
            if slot.users:
                return []
            if slot.forgotten:
                self._remove(slot)
                return [slot]
            self._idle_bytes += slot.mapping.size
            return self._trim()

    def forget(self, buffer_id: str) -> list[CachedMapping]:
        """Drop ``buffer_id`` (now if idle, else when its last user gives it back)."""
        with self._lock:
            slot = self._slots.get(buffer_id)
            return [] if slot is None else self._forget(slot)

    def released(self, buffer_id: str) -> None:
        """The daemon released ``buffer_id`` (a pushed ``released`` frame): unmapped and
        closed now if idle, else when its last user gives it back; no detach is owed for
        it (the worker's channel calls this while it reads: it makes no request)."""
        with self._lock:
            slot = self._slots.get(buffer_id)
            if slot is None:
                self._gone[buffer_id] = None
                if len(self._gone) > _GONE_KEPT:
                    self._gone.popitem(last=False)
                return
            slot.released = True
            if not self._forget(slot):
                return
        slot.mapping.unmap()

    def forget_keys(self, keys: list[str], keep: str | None = None) -> list[CachedMapping]:
        """Drop the slots cached under any of ``keys`` (but ``keep``, a buffer id): the
        daemon found none of them, or another entry under that key."""
        gone: list[CachedMapping] = []
        with self._lock:
            for key in keys:
                for buffer_id in list(self._by_key.get(key, ())):
                    slot = self._slots[buffer_id]
                    if buffer_id != keep and not slot.forgotten:
                        gone += self._forget(slot)
            return gone

    def expire(self, now: float | None = None) -> list[CachedMapping]:
        """The idle slots older than ``max_age_s`` (and any beyond the budget), removed."""
        with self._lock:
            return self._trim(time.monotonic() if now is None else now)

    def clear(self) -> list[CachedMapping]:
        """Every slot, removed (the worker is closing)."""
        with self._lock:
            slots = [*self._slots.values(), *self._retired]
            self._slots.clear()
            self._by_key.clear()
            self._retired.clear()
            self._idle_bytes = 0
            return slots

    def _forget(self, slot: CachedMapping) -> list[CachedMapping]:
        """(lock held) Mark ``slot`` forgotten; removed now if idle: ``[slot]``."""
        slot.forgotten = True
        if slot.users:
            return []  # removed when its last user gives it back
        self._idle_bytes -= slot.mapping.size
        self._remove(slot)
        return [slot]

    def _remove(self, slot: CachedMapping) -> None:
        """(lock held) Take ``slot`` out (its idle bytes already accounted for)."""
        del self._slots[slot.buffer_id]
        self._unindex(slot)

    def _unindex(self, slot: CachedMapping) -> None:
        ids = self._by_key.get(slot.key)
        if ids is not None:
            ids.discard(slot.buffer_id)
            if not ids:
                del self._by_key[slot.key]

    def _trim(self, now: float | None = None) -> list[CachedMapping]:
        """(lock held) Evict idle slots, oldest first: beyond ``max_bytes``, and (``now``
        given) those idle longer than ``max_age_s``. The slots are in the order of their
        last use, so the walk stops at the first idle slot that may stay."""
        gone: list[CachedMapping] = []
        idle = self._idle_bytes
        for slot in self._slots.values():
            if slot.users:
                continue
            aged = now is not None and now - slot.last_used > self.max_age_s
            if not (aged or idle > self.max_bytes):
                break
            idle -= slot.mapping.size
            gone.append(slot)
        for slot in gone:
            self._remove(slot)
        self._idle_bytes = idle
        return gone
