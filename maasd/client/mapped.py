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

from maasd.client.mapping import BufferMapping

__all__ = ["MappedBuffers"]


class MappedBuffers:
    """Mappings by buffer id: the attached (a list each) and the staged (one each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[str, list[BufferMapping]] = {}
        self._staged: dict[str, BufferMapping] = {}

    def ids(self) -> list[str]:
        """Ids of the buffers mapped now (what the renewal thread renews)."""
        with self._lock:
            return [bid for bid, maps in self._mapped.items() if maps]

    def add(self, m: BufferMapping) -> None:
        with self._lock:
            self._mapped.setdefault(m.buffer_id, []).append(m)

    def take(self, buffer_id: str) -> list[BufferMapping]:
        """Every mapping of ``buffer_id``, no longer counted here (a detach of it)."""
        with self._lock:
            return self._mapped.pop(buffer_id, [])

    def remove(self, m: BufferMapping) -> bool:
        """Count one mapping out (its user closed it); False if it was not counted."""
        with self._lock:
            maps = self._mapped.get(m.buffer_id)
            if maps is None or m not in maps:
                return False
            maps.remove(m)
            if not maps:
                del self._mapped[m.buffer_id]
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
        return maps
