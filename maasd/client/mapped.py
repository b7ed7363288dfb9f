"""``MappedBuffers``: the buffers a worker maps and the entries it is writing, under one lock.

A worker's mappings are used from the caller's threads and from its renewal thread
(which renews what is attached), so the two tables and their lock live together here
and nowhere else: *attached* buffers (``Worker.attach``; one buffer may be mapped more
than once, each mapping one attachment the daemon counts) and *staged* entries
(``Worker.put``, until their commit or abort). Nothing here talks to the daemon: the
worker sends the detach, commit or abort for what it takes out.
"""

from __future__ import annotations

import threading

from maasd.bounds import DEFAULT_TTL_S
from maasd.client.mapping import BufferMapping
from maasd.client.renewal import LeaseRenewer

__all__ = ["MappedBuffers"]


class MappedBuffers:
    """Mappings by buffer id: the attached (a list each) and the staged (one each).

    Each attached mapping is watched by ``renewer`` (if set) from its :meth:`add` until
    it is counted out, under the same lock: the renewer keeps an attached buffer leased
    (to :meth:`lease`) exactly while some mapping of it is counted here. ``ttl_s`` is
    the worker's: what every buffer is renewed to if given.
    """

    def __init__(self, ttl_s: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.renewer: LeaseRenewer | None = None
        self._lock = threading.Lock()
        self._mapped: dict[str, list[BufferMapping]] = {}
        self._staged: dict[str, BufferMapping] = {}
        #: buffer_id -> the lease the daemon said it was reserved with (while mapped)
        self._ttl: dict[str, int] = {}

    def ids(self) -> list[str]:
        """Ids of the buffers mapped now."""
        with self._lock:
            return [bid for bid, maps in self._mapped.items() if maps]

    def add(self, m: BufferMapping, ttl_s: int = 0) -> None:
        """Count one mapping in; ``ttl_s``: the lease its buffer was reserved with (0: not
        known)."""
        with self._lock:
            self._mapped.setdefault(m.buffer_id, []).append(m)
            if ttl_s:
                self._ttl[m.buffer_id] = ttl_s
            if self.renewer is not None:
                self.renewer.watch(m.buffer_id, self._lease(m.buffer_id))

    def lease(self, buffer_id: str) -> int:
        """What ``buffer_id`` is renewed to: the worker's ``ttl_s`` if given, else the
        lease it was reserved with (as the daemon said at its attach), else
        ``DEFAULT_TTL_S`` (not attached here, or a daemon that did not say)."""
        with self._lock:
            return self._lease(buffer_id)

    def _lease(self, buffer_id: str) -> int:
        if self.ttl_s is not None:
            return self.ttl_s
        return self._ttl.get(buffer_id) or DEFAULT_TTL_S

    def _unwatch(self, buffer_id: str, n: int = 1) -> None:
        if self.renewer is not None:
            for _ in range(n):
                self.renewer.unwatch(buffer_id)

    def take(self, buffer_id: str) -> list[BufferMapping]:
        """Every mapping of ``buffer_id``, no longer counted here (a detach of it)."""
        with self._lock:
            self._ttl.pop(buffer_id, None)
            maps = self._mapped.pop(buffer_id, [])
            self._unwatch(buffer_id, len(maps))
            return maps

    def remove(self, m: BufferMapping) -> bool:
        """Count one mapping out (its user closed it); False if it was not counted."""
        with self._lock:
            maps = self._mapped.get(m.buffer_id)
            if maps is None or m not in maps:
                return False
            maps.remove(m)
            self._unwatch(m.buffer_id)
            if not maps:
                del self._mapped[m.buffer_id]
                self._ttl.pop(m.buffer_id, None)
            return True

    def stage(self, m: BufferMapping) -> None:
        with self._lock:
            self._staged[m.buffer_id] = m

    def unstage(self, buffer_id: str) -> BufferMapping | None:
        """The staged mapping of a put entry being committed or aborted, if it is here."""
        with self._lock:
            return self._staged.pop(buffer_id, None)

    def clear(self) -> list[BufferMapping]:
        """Every mapping, attached and staged, taken out (the worker is closing)."""
        with self._lock:
            maps = [m for ms in self._mapped.values() for m in ms]
            maps += self._staged.values()
            self._mapped.clear()
            self._staged.clear()
            self._ttl.clear()
        return maps
