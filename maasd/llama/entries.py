"""Where ``KVStore`` gets its entries from: the seam between the store and the daemon.

:class:`EntryTransport` is what :class:`~maasd.llama.store.KVStore` needs of maasd — create a
keyed entry and map it writable, publish it, open the longest published entry of a list
of keys, let go of it — and two classes do it:

* :class:`SocketEntries` (the default): the worker socket's entry fast path, one round
  trip per operation and no REST call — ``publish`` (the entry written into a scratch
  memfd of the worker's, which the daemon copies into a region of its own: immutable
  from then on, kernel-enforced), ``lookup`` (a read-only fd of the longest committed
  entry, mapped once and kept in the worker's mapping cache; a hit extends the entry's
  lease in the daemon).
* :class:`RestEntries`: a REST reserve / lookup / release and a socket attach / renew,
  for a daemon without the fast path. Its entries stay writable by the tenant's
  workers, so a restore from them verifies the state checksum (``immutable = False``).

Every error raised here is the client's (:mod:`maasd.client.errors`) or an ``OSError``:
``maasd.llama`` builds on the client only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from maasd.client import errors as ce
from maasd.client.scratch import Scratch

__all__ = [
    "Published",
    "CLIENT_ERRORS",
    "DEFAULT_SCRATCH_KEEP_BYTES",
    "DUPLICATE_KEY",
    "Draft",
    "EntryTransport",
    "RestEntries",
    "SocketEntries",
    "close_quietly",
    "entry_id",
]

logger = logging.getLogger(__name__)

#: A reserve whose key another live buffer of the tenant already carries.
DUPLICATE_KEY: tuple[type[BaseException], ...] = (ce.DuplicateKey,)
#: Everything a call to the daemon may raise: its answers and the transport's.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (ce.MaasdClientError, OSError)


class MappingLike(Protocol):
    """A worker's mapping of a buffer (``maasd.client.BufferMapping``, ``EntryMapping``)."""

    @property
    def array(self) -> npt.NDArray[np.uint8]: ...

    @property
    def size(self) -> int: ...

    def close(self) -> None: ...


class Record(Protocol):
    """An entry as the store holds it between two calls of the transport: its key (and an
    id, ``.id`` or ``.buffer_id``: :func:`entry_id`)."""

    @property
    def key(self) -> str | None: ...


class Published(Record, Protocol):
    """An entry once published — what :meth:`~maasd.llama.store.KVStore.save` answers:
    a ``maasd.client.Buffer`` over either transport."""

    @property
    def id(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...


class RestBuffer(Published, Protocol):
    """A buffer as REST answers it (``maasd.client.Buffer``)."""


class MappedEntry(MappingLike, Record, Protocol):
    """An entry mapped by a worker: a put's staged entry (``BufferMapping``) or a lookup's
    hit (``EntryMapping``)."""

    @property
    def buffer_id(self) -> str: ...


#: What an :class:`EntryTransport` hands out for a written entry, and takes back.
W = TypeVar("W", bound=Record)
#: What an :class:`EntryTransport` hands out for an entry it opened, and takes back.
R = TypeVar("R", bound=Record)


class ClientLike(Protocol):
    """The part of ``maasd.client.Client`` :class:`RestEntries` uses."""

    def reserve(
        self,
        *,
        size_bytes: int,
        key: str | None,
        evictable: bool,
        ttl_s: int,
        pool: str | None = ...,
    ) -> RestBuffer: ...

    def lookup(self, keys: list[str]) -> RestBuffer | None: ...

    def release(self, buffer_id: str) -> None: ...


class WorkerLike(Protocol):
    """The part of ``maasd.client.Worker`` :class:`RestEntries` uses."""

    def attach(self, buffer_id: str) -> MappingLike: ...

    def renew(self, buffer_id: str, ttl_s: int | None = ...) -> None: ...


class SocketWorkerLike(Protocol):
    """The part of ``maasd.client.Worker`` :class:`SocketEntries` uses: ``publish`` a
    scratch memfd's bytes as a committed entry, ``lookup`` and ``forget`` one."""

    def publish(
        self,
        key: str,
        source: Scratch | int,
        size_bytes: int,
        *,
        pool: str | None = ...,
        ttl_s: int | None = ...,
    ) -> Published: ...

    def lookup(self, keys: list[str]) -> MappedEntry | None: ...

    def forget(self, buffer_id: str) -> None: ...


class EntryTransport(Protocol[W, R]):
    """What a ``KVStore`` needs of the daemon. A transport hands out entry records — ``W``
    for one it created, ``R`` for one it opened (each with a ``.key`` and an id, see
    :func:`entry_id`) — and is handed back the same; mappings have ``.array``/``.size``."""

    #: whether a published entry's bytes can never change (no state checksum needed)
    immutable: bool

    def create(self, key: str, size_bytes: int, ttl_s: int) -> tuple[W, MappingLike]:
        """A new evictable entry under ``key``, mapped writable; raises ``DuplicateKey``."""
        ...

    def publish(self, buf: W) -> Published:
        """Make a fully written entry available to readers → the published entry."""
        ...

    def discard(self, buf: W) -> None:
        """Drop an entry that will never be published (best effort)."""
        ...

    def open_longest(self, keys: list[str]) -> tuple[R, MappingLike] | None:
        """The entry of the longest published key (keys ordered short → long), mapped;
        None on a miss or when it went away before it could be mapped."""
        ...

    def done(self, buf: R, mapping: MappingLike, *, stale: bool) -> None:
        """The reader is done with an entry it opened; ``stale``: it read as released."""
        ...

    def keep(self, buf: R, ttl_s: int) -> None:
        """A hit: keep ``buf`` alive for about ``ttl_s`` more (best effort)."""
        ...


def entry_id(buf: object) -> str:
    """The buffer id of an entry record (``Buffer.id``, ``Entry.id``, ``EntryMapping.buffer_id``)."""
    return str(getattr(buf, "id", None) or getattr(buf, "buffer_id", ""))


def close_quietly(mapping: MappingLike) -> None:
    """Close a mapping (unmap, and detach in the daemon), ignoring any error.

    Callers drop their numpy views first, so the unmap is not deferred.
    """
    with contextlib.suppress(Exception):
        mapping.close()


def lease_left(buf: object) -> float:
    """Seconds left on a buffer's lease, from its RFC 3339 ``expires_at`` (0 if unknown)."""
    try:
        expires_at = buf.expires_at  # type: ignore[attr-defined]  # a Buffer's; else 0
        return datetime.fromisoformat(expires_at).timestamp() - time.time()
    except (AttributeError, TypeError, ValueError):
        return 0.0


#: Saves up to this size write into a scratch memfd kept from one save to the next; a
#: larger state gets one of its own, let go once it is published.
DEFAULT_SCRATCH_KEEP_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Draft:
    """An entry being written (:class:`SocketEntries`): its key, size and lease, and the
    scratch memfd it is written in."""

    key: str
    size_bytes: int
    ttl_s: int
    scratch: Scratch


class _ScratchMapping:
    """A :class:`Draft`'s scratch as a mapping (``MappingLike``); closing it lets go of a
    scratch that is not kept."""

    def __init__(self, scratch: Scratch, size: int, keep: bool) -> None:
        self._scratch = scratch
        self._keep = keep
        self.array = scratch.ensure(size)
        self.size = scratch.size

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        if not self._keep:
            self._scratch.close()


class SocketEntries:
    """:class:`EntryTransport` over a ``Worker``'s entry fast path (docs/client.md, "Entries"): no
    REST call. A save writes the entry into a scratch memfd of this process (kept from one
    save to the next, up to ``scratch_keep_bytes``), and one ``publish`` round trip makes
    the daemon copy it into a sealed entry; its opened entries are lookup hits."""

    immutable = True

    def __init__(
        self,
        worker: SocketWorkerLike,
        *,
        pool: str | None = None,
        scratch_keep_bytes: int = DEFAULT_SCRATCH_KEEP_BYTES,
    ) -> None:
        self.worker = worker
        self.pool = pool
        self.scratch_keep_bytes = scratch_keep_bytes
        self._scratch: Scratch | None = None

    def create(self, key: str, size_bytes: int, ttl_s: int) -> tuple[Draft, MappingLike]:
        keep = size_bytes <= self.scratch_keep_bytes
        if not keep:
            scratch = Scratch(name="maasd-kv-save")
        else:
            if self._scratch is None or self._scratch.closed:
                self._scratch = Scratch(name="maasd-kv-save")
            scratch = self._scratch
        return Draft(key, size_bytes, ttl_s, scratch), _ScratchMapping(scratch, size_bytes, keep)

    def publish(self, buf: Draft) -> Published:
        return self.worker.publish(
            buf.key, buf.scratch, buf.size_bytes, pool=self.pool, ttl_s=buf.ttl_s
        )

    def discard(self, buf: Draft) -> None:
        """Nothing to do: the daemon has nothing of an entry before its publish."""

    def close(self) -> None:
        """Let go of the kept scratch memfd (the next save makes one again)."""
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def open_longest(self, keys: list[str]) -> tuple[MappedEntry, MappingLike] | None:
        hit = self.worker.lookup(keys)
        return None if hit is None else (hit, hit)

    def done(self, buf: MappedEntry, mapping: MappingLike, *, stale: bool) -> None:
        mapping.close()  # back to the worker's mapping cache
        if stale:  # released since it was mapped: map afresh next time
            self.worker.forget(entry_id(buf))

    def keep(self, buf: MappedEntry, ttl_s: int) -> None:
        """Nothing to do: the daemon extended the lease when the lookup hit."""


class RestEntries:
    """:class:`EntryTransport` over a ``Client`` (REST) and a ``Worker`` (socket) of one tenant."""

    immutable = False

    def __init__(self, client: ClientLike, worker: WorkerLike, *, pool: str | None = None) -> None:
        self.client = client
        self.worker = worker
        self.pool = pool

    def create(self, key: str, size_bytes: int, ttl_s: int) -> tuple[RestBuffer, MappingLike]:
        buf = self.client.reserve(
            size_bytes=size_bytes, key=key, evictable=True, ttl_s=ttl_s, pool=self.pool
        )
        try:
            return buf, self.worker.attach(buf.id)
        except BaseException:
            self.discard(buf)
            raise

    def publish(self, buf: RestBuffer) -> Published:
        # Today an entry is visible from its reserve on; its magic, written last, is what
        # tells a reader it is complete.
        return buf

    def discard(self, buf: RestBuffer) -> None:
        with contextlib.suppress(Exception):
            self.client.release(buf.id)

    def open_longest(self, keys: list[str]) -> tuple[RestBuffer, MappingLike] | None:
        buf = self.client.lookup(keys)
        if buf is None:
            return None
        try:
            return buf, self.worker.attach(buf.id)
        except CLIENT_ERRORS as exc:  # evicted or expired since the lookup
            logger.info("kv entry %s gone before attach: %s", buf.id, exc)
            return None

    def done(self, buf: RestBuffer, mapping: MappingLike, *, stale: bool) -> None:
        del buf, stale
        close_quietly(mapping)

    def keep(self, buf: RestBuffer, ttl_s: int) -> None:
        # Only once half of the lease is gone, so a hot prefix costs no ledger write per hit.
        if lease_left(buf) < ttl_s / 2:
            with contextlib.suppress(Exception):
                self.worker.renew(buf.id, ttl_s)
