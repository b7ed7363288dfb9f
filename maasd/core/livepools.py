"""The pools live in this process: each one's ledger row and its in-process allocator.

Owned by :class:`maasd.core.pools.Pools`, the one use-case module that adds and removes
them (load, create, delete, a fence); every other part only reads them — by id, by
name, or all. Its lock is a leaf of the lock order (:mod:`maasd.core.regions`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from maasd.allocator import MemoryPool
from maasd.errors import NotFound
from maasd.store import PoolRow

__all__ = ["LivePool", "LivePools"]


@dataclass
class LivePool:
    """A pool of this host: its ledger row and its in-process allocator."""

    row: PoolRow
    pool: MemoryPool


class LivePools:
    """The live pools of this host, by id (a leaf lock: held only for dict operations)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, LivePool] = {}

    def add(self, live: LivePool) -> None:
        with self._lock:
            self._pools[live.row.id] = live

    def remove(self, pool_id: str) -> None:
        with self._lock:
            self._pools.pop(pool_id, None)

    def get(self, pool_id: str) -> LivePool | None:
        """The live pool with this id, or ``None``."""
        with self._lock:
            return self._pools.get(pool_id)

    def named(self, id_or_name: str) -> LivePool | None:
        """The live pool with this id (preferred) or name, or ``None``."""
        with self._lock:
            live = self._pools.get(id_or_name)
            if live is None:
                live = next((p for p in self._pools.values() if p.row.name == id_or_name), None)
        return live

    def find(self, id_or_name: str) -> LivePool:
        """:meth:`named`, for a caller that answers a miss with :class:`NotFound` (404)."""
        live = self.named(id_or_name)
        if live is None:
            raise NotFound(f"no pool {id_or_name!r}")
        return live

    def all(self) -> list[LivePool]:
        with self._lock:
            return list(self._pools.values())
