"""``Worker``: the local data plane (docs/client.md) — buffers' memfds mapped as numpy arrays.

Example::

    from maasd.client import Client, Worker

    buf = Client(url, key).reserve(size_bytes=64 << 20)
    with Worker("/var/lib/maasd/maasd.sock", key) as w:
        m = w.attach(buf.id)          # the memfd arrives over SCM_RIGHTS, mapped MAP_SHARED
        m.array[:5] = [1, 2, 3, 4, 5]  # numpy uint8, zero-copy, writable
        ...                            # leases of attached buffers renew in the background

        with w.entry("model:prefix", 1 << 20) as e:   # put: a writable staged entry
            e.array[:5] = 7                          # committed (immutable) on success
        hit = w.lookup(["model:pre", "model:prefix"])  # one round trip: read-only fd
        if hit is not None:
            with hit:
                print(hit.key, hit.array[:5])        # read-only numpy view
    # leaving the block closes every mapping and the connection

Every process that attaches the same buffer maps the same pages: a write by
one is seen by all. One lock serialises request/response on the socket, so a
``Worker`` may be shared by threads (the renewal thread is one of them).

The worker asks the daemon; each piece of its state has one owner it calls:

    Channel       (client/channel.py)     the socket: one request at a time, pushed frames
    MappedBuffers   (client/mapped.py) attached buffers and staged puts, one lock
    EntryMaps     (client/entry_maps.py)  looked-up entries' mappings (the MappingCache)
    LeaseRenewer  (client/renewal.py)     the thread renewing what is attached
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from maasd import protocol
from maasd.bounds import DEFAULT_TTL_S
from maasd.client.channel import Channel
from maasd.client.channel import R as _R
from maasd.client.entries import (
    DEFAULT_CACHE_AGE_S,
    DEFAULT_CACHE_BYTES,
    Entry,
    EntryMapping,
    MappingCache,
)
from maasd.client.entry_maps import EntryMaps
from maasd.client.errors import ConnectionFailed, MaasdClientError, NotFound
from maasd.client.mapped import MappedBuffers
from maasd.client.mapping import BufferMapping, Mapping, check_memfd_size
from maasd.client.renewal import LeaseRenewer
from maasd.client.scratch import Scratch, source_fd
from maasd.client.types import Buffer

__all__ = ["BufferMapping", "Entry", "EntryMapping", "Mapping", "Worker"]

logger = logging.getLogger(__name__)


def _read_only_fd(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


class Worker:
    """A connection to the daemon's handle socket, authenticated with ``api_key``.

    A thread renews each attached buffer, before its lease ends, to ``ttl_s`` or else its
    own lease (docs/client.md; ``renew_interval_s`` caps the period, ``0`` disables it).
    ``timeout`` bounds each request/response on the socket.
    ``cache_bytes`` and ``cache_age_s`` bound the mapping cache of looked-up entries:
    idle mappings beyond that many bytes, or idle for longer, are unmapped (detached).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        api_key: str,
        *,
        renew_interval_s: float | None = None,
        ttl_s: int | None = None,
        timeout: float = 30.0,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_age_s: float = DEFAULT_CACHE_AGE_S,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.ttl_s = ttl_s
        self.renew_interval_s = renew_interval_s
        self.cache = MappingCache(cache_bytes, cache_age_s)
        self._entries = EntryMaps(self.cache, self._detach_quietly)
        self._maps = MappedBuffers(ttl_s)
        self._closed = False
        self._renewer: LeaseRenewer | None = None
        self._channel = Channel(self.socket_path, timeout)
        reply = self._channel.hello(api_key)
        self._channel.read_when_idle(self.cache.released)  # released: unmapped at once
        self.tenant_id: str | None = reply.tenant_id
        #: This process's pid as the daemon recorded it (SO_PEERCRED).
        self.peer_pid: int | None = reply.pid
        if renew_interval_s is None or renew_interval_s > 0:  # each round ages entry maps
            round_s = renew_interval_s or (ttl_s or DEFAULT_TTL_S) / 3
            self._renewer = LeaseRenewer(round_s, self.renew, self._entries.sweep, renew_interval_s)
            self._maps.renewer = self._renewer
            self._renewer.start()

    # --- buffers -----------------------------------------------------------------

    def attach(self, buffer_id: str) -> BufferMapping:
        """Receive the buffer's memfd and map it (MAP_SHARED; read-write, or read-only for
        a committed entry, whose fd the daemon sends read-only).

        Raises :class:`~maasd.client.errors.NotFound` for an unknown or foreign id.
        """
        reply, fd = self._one_fd(protocol.Attach(buffer_id=buffer_id), protocol.Attached)
        try:
            check_memfd_size(fd, reply.size_bytes)
            writable = not _read_only_fd(fd)
            m = BufferMapping(
                self._mapping_closed,
                reply.buffer_id,
                fd,
                reply.size_bytes,
                reply.numa_node,
                writable=writable,
            )
        except BaseException:
            os.close(fd)
            self._detach_quietly(buffer_id, True)
            raise
        self._maps.add(m, reply.ttl_s)
        return m

    def detach(self, buffer_id: str) -> None:
        """Close this worker's mappings of the buffer and tell the daemon.

        With no mapping of it here, the daemon answers 404 (``NotFound``).
        """
        maps = self._maps.take(buffer_id)
        for m in maps:
            m.unmap()
        for _ in range(max(len(maps), 1)):
            self._request(protocol.Detach(buffer_id=buffer_id))

    def renew(self, buffer_id: str, ttl_s: int | None = None) -> None:
        """Set the lease to end ``ttl_s`` s from now (default: what the thread renews it to)."""
        ttl = self._maps.lease(buffer_id) if ttl_s is None else ttl_s
        self._request(protocol.Renew(buffer_id=buffer_id, ttl_s=ttl))

    @property
    def attached(self) -> list[str]:
        """Ids of the buffers this worker currently maps."""
        return self._maps.ids()

    # --- entries -----------------------------------------------------------------

    def lookup(self, keys: Iterable[str]) -> EntryMapping | None:
        """The committed entry of the longest of ``keys`` (ordered short → long), mapped
        read-only; ``None`` on a miss. One round trip; a hit extends the entry's lease.

        A second lookup of an entry still in the mapping cache reuses its mapping (the
        new fd is closed at once). Close the answer (or use ``with``) when done with it.
        """
        entries = self._entries
        entries.sweep()
        wanted = list(keys)
        try:
            reply, fd = self._one_fd(protocol.Lookup(keys=wanted), protocol.Found)
        except NotFound:
            entries.missed(wanted)
            return None
        return entries.found(reply, fd)

    def forget(self, buffer_id: str) -> None:
        """Drop an entry from the mapping cache (unmapped once no one uses it): for an
        entry that reads as released (zeros), so the next lookup maps afresh."""
        self._entries.forget(buffer_id)

    def put(
        self, key: str, size_bytes: int, *, pool: str | None = None, ttl_s: int | None = None
    ) -> BufferMapping:
        """Reserve an entry under ``key`` to write: a writable mapping, seen by no one
        else until :meth:`commit` (``pool``: id or name; ``ttl_s``: its lease). Raises
        what a reserve raises: ``DuplicateKey``, ``QuotaExceeded``, ``PoolExhausted`` …"""
        put = protocol.Put(key=key, size_bytes=size_bytes, pool=pool, ttl_s=ttl_s)
        reply, fd = self._one_fd(put, protocol.Reserved)
        try:
            check_memfd_size(fd, reply.size_bytes)
            m = BufferMapping(
                None, reply.buffer_id, fd, reply.size_bytes, reply.numa_node, key=key, populate=True
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(MaasdClientError):
                self._request(protocol.Abort(buffer_id=reply.buffer_id))
            raise
        self._maps.stage(m)
        return m

    def commit(self, entry: str | BufferMapping) -> Entry:
        """Make a put entry immutable and visible to lookups; the writable mapping is
        closed (the daemon scrubs what it mapped: the entry lives on in a sealed copy)."""
        buffer_id, m = self._settle(entry, protocol.Commit)
        key = "" if m is None or m.key is None else m.key
        size, node = (0, 0) if m is None else (m.size, m.numa_node)
        return Entry(id=buffer_id, key=key, size_bytes=size, numa_node=node)

    def abort(self, entry: str | BufferMapping) -> None:
        """Release a put entry that will not be committed (scrubbed); its mapping is closed."""
        self._settle(entry, protocol.Abort)

    def publish(
        self,
        key: str,
        source: Scratch | int,
        size_bytes: int,
        *,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> Buffer:
        """Publish ``size_bytes`` of ``source`` (a :class:`Scratch` or a memfd's fd) as a
        committed entry under ``key``: a put and a commit in one round trip; ``source``
        stays the caller's (docs/client.md, "Publishing an entry"). The entry's record
        (what ``Client.buffer`` would answer: keyed, evictable, live). ``ValueError``
        (nothing sent) for a closed scratch or an fd not open."""
        fd = source_fd(source)
        msg = protocol.Publish(key=key, size_bytes=size_bytes, pool=pool, ttl_s=ttl_s)
        return _published(key, self._channel.request_reply(msg, protocol.Published, fds=(fd,)))

    @contextlib.contextmanager
    def entry(
        self, key: str, size_bytes: int, *, pool: str | None = None, ttl_s: int | None = None
    ) -> Iterator[BufferMapping]:
        """``put`` an entry and yield its writable mapping; commit it when the block ends,
        abort it if the block raises."""
        m = self.put(key, size_bytes, pool=pool, ttl_s=ttl_s)
        try:
            yield m
        except BaseException:
            with contextlib.suppress(MaasdClientError):
                self.abort(m)
            raise
        self.commit(m)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop renewing, close every mapping made by this worker, close the connection.

        The daemon releases the entries put and not committed, and drops the attachments.
        """
        if self._closed:
            return
        renewer = self._renewer
        if renewer is not None:
            renewer.stop()
        self._closed = True
        # Wake a renewal blocked in recv, then wait for it to leave the lock.
        self._channel.shutdown()
        if renewer is not None:
            renewer.join(5.0)
        for m in self._maps.clear() + self._entries.clear():
            m.unmap()
        self._channel.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------

    def _request(
        self, msg: protocol.Request, meanwhile: Callable[[], object] | None = None
    ) -> tuple[protocol.Reply, list[int]]:
        if self._closed and not isinstance(msg, protocol.Hello):
            raise ConnectionFailed("worker is closed")
        return self._channel.request(msg, meanwhile)

    def _one_fd(self, msg: protocol.Request, kind: type[_R]) -> tuple[_R, int]:
        if self._closed:
            raise ConnectionFailed("worker is closed")
        return self._channel.request_fd(msg, kind)

    def _settle(
        self, entry: str | BufferMapping, op: type[protocol.Commit | protocol.Abort]
    ) -> tuple[str, BufferMapping | None]:
        """Commit or abort a put entry: its id and its staged mapping (closed now, which
        ever way the request ends: the daemon scrubs what it mapped)."""
        buffer_id = entry if isinstance(entry, str) else entry.buffer_id
        m = self._maps.unstage(buffer_id)
        try:
            # Unmapped while the daemon copies: the unmap of a 9 MiB mapping (~0.2 ms)
            # overlaps the commit instead of following its answer.
            self._request(op(buffer_id=buffer_id), None if m is None else m.unmap)
        finally:
            if m is not None:
                m.unmap()
        return buffer_id, m

    def _detach_quietly(self, buffer_id: str, attached: bool) -> None:
        if not attached or self._closed or self._channel.broken is not None:
            return
        try:
            self._request(protocol.Detach(buffer_id=buffer_id))
        except MaasdClientError as exc:
            logger.debug("detach of %s failed: %s", buffer_id, exc)

    def _mapping_closed(self, m: BufferMapping) -> None:
        """A mapping of :meth:`attach` closed by its user: one attachment less."""
        if self._maps.remove(m):
            self._detach_quietly(m.buffer_id, True)


def _published(key: str, r: protocol.Published) -> Buffer:
    """A publish's answer as the entry's record (a REST ``Buffer``: keyed, evictable, live)."""
    return Buffer(
        id=r.buffer_id,
        tenant_id=r.tenant_id,
        pool_id=r.pool_id,
        size_bytes=r.size_bytes,
        numa_node=r.numa_node,
        persistence=r.persistence,
        key=key,
        evictable=True,
        state="live",
        created_at=r.created_at or None,
        expires_at=r.expires_at or None,
    )
