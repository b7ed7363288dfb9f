"""Which entries are worth a disk write, and which the disk tier keeps: pure, no I/O.

Two parts, both by bytes (entries are KV states of very different sizes):

* :class:`Admission` — the demotion filter. DRAM eviction (the ledger's LRU by last use)
  hands every victim here; it is demoted only if it was *used again* after it was put
  (a lookup hit, counted by :meth:`Admission.hit`), or its key was dropped once before
  and came back (the *ghost*, a bounded FIFO of recently dropped keys — the key was
  recomputed, so it is a second use). An entry seen once is not worth an SSD write:
  a scan of one-off prompts never reaches the disk (Dynamo's KVBM waits for a second hit
  before it writes, too).
* :class:`S3Fifo` — the disk tier's own eviction, S3-FIFO (Yang et al., SOSP '23): a
  small FIFO (10 % of the bytes) that new entries enter, a main FIFO that entries used
  while in the small one move to, and the ghost of keys evicted from the small one; the
  main queue's head is reinserted while it has uses left (up to 3), else evicted.
  It is scan-resistant like ARC at a FIFO's cost, and its victim choice can be kept to
  one tenant's entries (a tenant at its disk quota evicts its own, by the same rules).

:class:`Lru` is the baseline the replay (``tests/bench/bench_tiers.py``) compares with.
Keys are any hashable; the daemon uses its disk entries' ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["MAX_FREQ", "Admission", "Evicted", "Lru", "S3Fifo"]

#: Uses an entry may bank in S3-FIFO's main queue (each saves it from one eviction).
MAX_FREQ = 3
#: The small queue's share of the bytes.
SMALL_SHARE = 0.1


@dataclass(frozen=True)
class Evicted:
    """An entry a cache gave up: its key, size and the uses it had banked."""

    key: Hashable
    size: int
    uses: int


class _Ghost:
    """A bounded FIFO of keys (no bytes): what was dropped recently."""

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """Whether ``key`` was there (it is not any more)."""
        return self._keys.pop(key, 0) is None

    def __len__(self) -> int:
        return len(self._keys)


class Admission:
    """The demotion filter: worth a disk write = used again, or seen dropped before."""

    def __init__(self, ghost_keys: int = 4096) -> None:
        self._uses: dict[Hashable, int] = {}
        self._ghost = _Ghost(ghost_keys)

    def hit(self, key: Hashable) -> None:
        """A use of ``key`` after its put (a lookup hit, or its promotion)."""
        self._uses[key] = min(self._uses.get(key, 0) + 1, MAX_FREQ)

    def forget(self, key: Hashable) -> None:
        """The entry ended other than by eviction (released, deleted): no ghost."""
        self._uses.pop(key, None)

    def evicted(self, key: Hashable) -> bool:
        """DRAM evicted ``key``: whether to demote it (else it is dropped, and ghosted)."""
        came_back = self._ghost.take(key)
        if self._uses.pop(key, 0) > 0 or came_back:
            return True
        self._ghost.add(key)
        return False

    def __len__(self) -> int:
        return len(self._uses)


class Lru:
    """Plain LRU by bytes: the baseline."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._items: OrderedDict[Hashable, int] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def hit(self, key: Hashable) -> bool:
        if key not in self._items:
            return False
        self._items.move_to_end(key)
        return True

    def insert(self, key: Hashable, size: int) -> list[Evicted]:
        """Add ``key`` (absent); what had to go to make room (``key`` itself if it is
        larger than the whole cache)."""
        if size > self.capacity:
            return [Evicted(key, size, 0)]
        out: list[Evicted] = []
        while self.used + size > self.capacity:
            old, old_size = self._items.popitem(last=False)
            self.used -= old_size
            out.append(Evicted(old, old_size, 0))
        self._items[key] = size
        self.used += size
        return out

    def remove(self, key: Hashable) -> int | None:
        size = self._items.pop(key, None)
        if size is not None:
            self.used -= size
        return size


class S3Fifo:
    """S3-FIFO by bytes (see the module docstring)."""

    def __init__(self, capacity: int, ghost_keys: int = 4096) -> None:
        self.capacity = capacity
        self.used = 0
        self._small: OrderedDict[Hashable, list[int]] = OrderedDict()  # key -> [size, uses]
        self._main: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._small_bytes = 0
        self._ghost = _Ghost(ghost_keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def hit(self, key: Hashable) -> bool:
        item = self._small.get(key) or self._main.get(key)
        if item is None:
            return False
        item[1] = min(item[1] + 1, MAX_FREQ)
        return True

    def insert(self, key: Hashable, size: int) -> list[Evicted]:
        """Add ``key`` (absent): into the main queue if it is a ghost, else the small one.
        Returns what had to go to make room (``key`` itself if it can never fit)."""
        if size > self.capacity:
            return [Evicted(key, size, 0)]
        out: list[Evicted] = []
        while self.used + size > self.capacity:
            victim = self.evict_one()
            assert victim is not None  # used > 0 here
            out.append(victim)
        if self._ghost.take(key):
            self._main[key] = [size, 0]
        else:
            self._small[key] = [size, 0]
            self._small_bytes += size
        self.used += size
        return out

    def remove(self, key: Hashable) -> int | None:
        item = self._small.pop(key, None)
        if item is not None:
            self._small_bytes -= item[0]
        else:
            item = self._main.pop(key, None)
        if item is None:
            return None
        self.used -= item[0]
        return item[0]

    def evict_one(self, among: Callable[[Hashable], bool] | None = None) -> Evicted | None:
        """Evict one entry by the S3-FIFO rules, only from those ``among`` accepts (all by
        default); ``None`` if there is none."""
        if among is None:
            if self._small and (self._small_bytes >= SMALL_SHARE * self.capacity or not self._main):
                found = self._from_small(None)
                if found is not None:
                    return found
            return self._from_main(None)
        return self._from_small(among) or self._from_main(among)

    def _from_small(self, among: Callable[[Hashable], bool] | None) -> Evicted | None:
        if among is None:  # the head, in order: O(1) per entry passed
            while self._small:
                key, (size, uses) = self._small.popitem(last=False)
                found = self._leave_small(key, size, uses)
                if found is not None:
                    return found
                if self._small_bytes < SMALL_SHARE * self.capacity:
                    return self._from_main(None)
            return None
        for key in [k for k in self._small if among(k)]:
            size, uses = self._small.pop(key)
            found = self._leave_small(key, size, uses)
            if found is not None:
                return found
        return None

    def _leave_small(self, key: Hashable, size: int, uses: int) -> Evicted | None:
        """``key`` left the small queue: into the main one if it was used there (None),
        else evicted and ghosted."""
        self._small_bytes -= size
        if uses > 0:
            self._main[key] = [size, 0]
            return None
        self.used -= size
        self._ghost.add(key)
        return Evicted(key, size, uses)

    def _from_main(self, among: Callable[[Hashable], bool] | None) -> Evicted | None:
        # Each entry passed over gives up a use, so at most MAX_FREQ + 1 rounds of the
        # queue find one (if there is any candidate at all).
        if among is None:
            while self._main:
                key, item = self._main.popitem(last=False)
                if item[1] > 0:
                    item[1] -= 1
                    self._main[key] = item
                    continue
                self.used -= item[0]
                return Evicted(key, item[0], 0)
            return None
        for _ in range(MAX_FREQ + 1):
            for key in [k for k in self._main if among(k)]:
                item = self._main[key]
                if item[1] > 0:
                    item[1] -= 1
                    self._main.move_to_end(key)
                    continue
                del self._main[key]
                self.used -= item[0]
                return Evicted(key, item[0], 0)
        return None
