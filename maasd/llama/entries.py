"""Where ``KVStore`` gets its entries from: the seam between the store and the daemon.

:class:`Entries` is what :class:`~maasd.llama.store.KVStore` needs of maasd — create a
keyed entry and map it writable, publish it, open the longest committed entry of a list
of keys, keep an entry in use alive — and :class:`RestEntries` does it with today's
client calls (a REST reserve / lookup / release, a socket attach / renew). A transport
that does one socket round trip per operation replaces this class alone.

Every error raised here is the client's (:mod:`maasd.client.errors`) or an ``OSError``:
``maasd.llama`` builds on the client only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import datetime
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from maasd.client import errors as ce

__all__ = ["CLIENT_ERRORS", "DUPLICATE_KEY", "Entries", "RestEntries", "close_quietly"]

logger = logging.getLogger(__name__)

#: A reserve whose key another live buffer of the tenant already carries.
DUPLICATE_KEY: tuple[type[BaseException], ...] = (ce.DuplicateKey,)
#: Everything a call to the daemon may raise: its answers and the transport's.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (ce.MaasdClientError, OSError)


class MappingLike(Protocol):
    """A worker's mapping of a buffer (``maasd.client.Mapping``)."""

    @property
    def array(self) -> npt.NDArray[np.uint8]: ...

    @property
    def size(self) -> int: ...

    def close(self) -> None: ...


class ClientLike(Protocol):
    """The part of ``maasd.client.Client`` entries use."""

    def reserve(self, *, size_bytes: int, key: str | None, evictable: bool, ttl_s: int) -> Any: ...

    def lookup(self, keys: list[str]) -> Any: ...

    def release(self, buffer_id: str) -> Any: ...


class WorkerLike(Protocol):
    """The part of ``maasd.client.Worker`` entries use."""

    def attach(self, buffer_id: str) -> Any: ...

    def renew(self, buffer_id: str, ttl_s: int | None = ...) -> Any: ...


class Entries(Protocol):
    """What a ``KVStore`` needs of the daemon; buffers are ``maasd.client.Buffer``-like
    (``.id``, ``.key``, ``.size_bytes``)."""

    def create(self, key: str, size_bytes: int, ttl_s: int) -> tuple[Any, MappingLike]:
        """A new evictable entry under ``key``, mapped writable; raises ``DuplicateKey``."""
        ...

    def publish(self, buf: Any) -> Any:
        """Make a fully written entry available to readers → the buffer."""
        ...

    def discard(self, buf: Any) -> None:
        """Drop an entry that will never be published (best effort)."""
        ...

    def existing(self, key: str) -> Any | None:
        """The live entry under ``key``, or None."""
        ...

    def open_longest(self, keys: list[str]) -> tuple[Any, MappingLike] | None:
        """The entry of the longest live key (keys ordered short → long), mapped; None on a
        miss or when it went away before it could be mapped."""
        ...

    def keep(self, buf: Any, ttl_s: int) -> None:
        """A hit: keep ``buf`` alive for about ``ttl_s`` more (best effort)."""
        ...


def close_quietly(mapping: Any) -> None:
    """Close a mapping (unmap, and detach in the daemon), ignoring any error.

    Callers drop their numpy views first, so the unmap is not deferred.
    """
    with contextlib.suppress(Exception):
        mapping.close()


def lease_left(buf: Any) -> float:
    """Seconds left on a buffer's lease, from its RFC 3339 ``expires_at`` (0 if unknown)."""
    try:
        return datetime.fromisoformat(buf.expires_at).timestamp() - time.time()
    except (AttributeError, TypeError, ValueError):
        return 0.0


class RestEntries:
    """:class:`Entries` over a ``Client`` (REST) and a ``Worker`` (socket) of one tenant."""

    def __init__(self, client: ClientLike, worker: WorkerLike) -> None:
        self.client = client
        self.worker = worker

    def create(self, key: str, size_bytes: int, ttl_s: int) -> tuple[Any, MappingLike]:
        buf = self.client.reserve(size_bytes=size_bytes, key=key, evictable=True, ttl_s=ttl_s)
        try:
            return buf, self.worker.attach(buf.id)
        except BaseException:
            self.discard(buf)
            raise

    def publish(self, buf: Any) -> Any:
        # Today an entry is visible from its reserve on; its magic, written last, is what
        # tells a reader it is complete.
        return buf

    def discard(self, buf: Any) -> None:
        with contextlib.suppress(Exception):
            self.client.release(buf.id)

    def existing(self, key: str) -> Any | None:
        return self.client.lookup([key])

    def open_longest(self, keys: list[str]) -> tuple[Any, MappingLike] | None:
        buf = self.client.lookup(keys)
        if buf is None:
            return None
        try:
            return buf, self.worker.attach(buf.id)
        except CLIENT_ERRORS as exc:  # evicted or expired since the lookup
            logger.info("kv entry %s gone before attach: %s", buf.id, exc)
            return None

    def keep(self, buf: Any, ttl_s: int) -> None:
        # Only once half of the lease is gone, so a hot prefix costs no ledger write per hit.
        if lease_left(buf) < ttl_s / 2:
            with contextlib.suppress(Exception):
                self.worker.renew(buf.id, ttl_s)
