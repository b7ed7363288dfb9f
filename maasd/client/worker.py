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
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
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
    Slot,
)
from maasd.client.errors import (
    ConnectionFailed,
    MaasdClientError,
    NotFound,
    ProtocolError,
    Unauthorized,
)
from maasd.client.mapping import BufferMapping, Mapping

__all__ = ["BufferMapping", "Entry", "EntryMapping", "Mapping", "Worker"]

#: Idle entry mappings are aged out at most this often (on lookups and renewals).
SWEEP_INTERVAL_S = 1.0

logger = logging.getLogger(__name__)


def _check_memfd_size(fd: int, size_bytes: int) -> None:
    """Mapping past the end of the file would SIGBUS on first touch: refuse a short memfd."""
    st_size = os.fstat(fd).st_size
    if st_size < size_bytes:
        raise ProtocolError(f"memfd is {st_size} bytes, daemon said {size_bytes}")


def _read_only_fd(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


class Worker:
    """A connection to the daemon's handle socket, authenticated with ``api_key``.

    ``ttl_s`` is the lease the background thread renews attached buffers to,
    every ``renew_interval_s`` seconds (default ``ttl_s / 3``; ``0`` disables
    renewal). ``timeout`` bounds each request/response on the socket.
    ``cache_bytes`` and ``cache_age_s`` bound the mapping cache of looked-up entries:
    idle mappings beyond that many bytes, or idle for longer, are unmapped (detached).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        api_key: str,
        *,
        renew_interval_s: float | None = None,
        ttl_s: int = DEFAULT_TTL_S,
        timeout: float = 30.0,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_age_s: float = DEFAULT_CACHE_AGE_S,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.ttl_s = ttl_s
        self.renew_interval_s = ttl_s / 3 if renew_interval_s is None else renew_interval_s
        self.cache = MappingCache(cache_bytes, cache_age_s)
        self._maps_lock = threading.Lock()
        self._mappings: dict[str, list[BufferMapping]] = {}
        self._staged: dict[str, BufferMapping] = {}
        self._swept = time.monotonic()
        self._closed = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._channel = Channel(self.socket_path, timeout)
        reply = self._channel.hello(api_key)
        self._channel.read_when_idle(self.cache.released)  # released: unmapped at once
        self.tenant_id: str | None = reply.tenant_id
        #: This process's pid as the daemon recorded it (SO_PEERCRED).
        self.peer_pid: int | None = reply.pid
        if self.renew_interval_s > 0:
            self._renewer = threading.Thread(
                target=self._renew_loop, name="maasd-worker-renew", daemon=True
            )
            self._renewer.start()

    # --- buffers -----------------------------------------------------------------

    def attach(self, buffer_id: str) -> BufferMapping:
        """Receive the buffer's memfd and map it (MAP_SHARED; read-write, or read-only for
        a committed entry, whose fd the daemon sends read-only).

        Raises :class:`~maasd.client.errors.NotFound` for an unknown or foreign id.
        """
        reply, fd = self._one_fd(protocol.Attach(buffer_id=buffer_id), protocol.Attached)
        try:
            _check_memfd_size(fd, reply.size_bytes)
            writable = not _read_only_fd(fd)
            m = BufferMapping(
                self, reply.buffer_id, fd, reply.size_bytes, reply.numa_node, writable=writable
            )
        except BaseException:
            os.close(fd)
            self._detach_quietly(buffer_id, True)
            raise
        with self._maps_lock:
            self._mappings.setdefault(buffer_id, []).append(m)
        return m

    def detach(self, buffer_id: str) -> None:
        """Close this worker's mappings of the buffer and tell the daemon.

        With no mapping of it here, the daemon answers 404 (``NotFound``).
        """
        with self._maps_lock:
            maps = self._mappings.pop(buffer_id, [])
        for m in maps:
            m._close_local()
        for _ in range(max(len(maps), 1)):
            self._request(protocol.Detach(buffer_id=buffer_id))

    def renew(self, buffer_id: str, ttl_s: int | None = None) -> None:
        """Extend the buffer's lease to ``ttl_s`` (default: the worker's ``ttl_s``) from now."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        self._request(protocol.Renew(buffer_id=buffer_id, ttl_s=ttl))

    @property
    def attached(self) -> list[str]:
        """Ids of the buffers this worker currently maps."""
        with self._maps_lock:
            return [bid for bid, maps in self._mappings.items() if maps]

    # --- entries -----------------------------------------------------------------

    def lookup(self, keys: Iterable[str]) -> EntryMapping | None:
        """The committed entry of the longest of ``keys`` (ordered short → long), mapped
        read-only; ``None`` on a miss. One round trip; a hit extends the entry's lease.

        A second lookup of an entry still in the mapping cache reuses its mapping (the
        new fd is closed at once). Close the answer (or use ``with``) when done with it.
        """
        self._sweep()
        wanted = list(keys)
        try:
            reply, fd = self._one_fd(protocol.Lookup(keys=wanted), protocol.Found)
        except NotFound:
            if len(self.cache):  # what was cached under these keys is released
                self._drop(self.cache.forget_keys(wanted))
            return None
        slot = self.cache.checkout(reply.buffer_id)
        if slot is not None:
            os.close(fd)
            return EntryMapping(slot, self._give_back)
        if len(self.cache):  # a new entry under this key: an older one is released
            self._drop(self.cache.forget_keys([reply.key], keep=reply.buffer_id))
        try:
            _check_memfd_size(fd, reply.size_bytes)
            m = BufferMapping(
                None, reply.buffer_id, fd, reply.size_bytes, reply.numa_node, writable=False
            )
        except BaseException:
            os.close(fd)
            self._detach_quietly(reply.buffer_id, True)
            raise
        slot = Slot(m, reply.key)
        self._drop(self.cache.add(slot))
        return EntryMapping(slot, self._give_back)

    def forget(self, buffer_id: str) -> None:
        """Drop an entry from the mapping cache (unmapped once no one uses it): for an
        entry that reads as released (zeros), so the next lookup maps afresh."""
        self._drop(self.cache.forget(buffer_id))

    def put(
        self, key: str, size_bytes: int, *, pool: str | None = None, ttl_s: int | None = None
    ) -> BufferMapping:
        """Reserve an entry under ``key`` to write: a writable mapping, seen by no one
        else until :meth:`commit` (``pool``: id or name; ``ttl_s``: its lease).

        Raises what a reserve raises: ``DuplicateKey`` (another worker has, or is
        writing, that key), ``QuotaExceeded``, ``PoolExhausted`` …
        """
        put = protocol.Put(key=key, size_bytes=size_bytes, pool=pool, ttl_s=ttl_s)
        reply, fd = self._one_fd(put, protocol.Reserved)
        try:
            _check_memfd_size(fd, reply.size_bytes)
            m = BufferMapping(
                None, reply.buffer_id, fd, reply.size_bytes, reply.numa_node, key=key, populate=True
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(MaasdClientError):
                self._request(protocol.Abort(buffer_id=reply.buffer_id))
            raise
        with self._maps_lock:
            self._staged[m.buffer_id] = m
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
        self._closed = True
        self._stop.set()
        # Wake a renewal blocked in recv, then wait for it to leave the lock.
        self._channel.shutdown()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(5.0)
        with self._maps_lock:
            maps = [m for ms in self._mappings.values() for m in ms]
            maps += self._staged.values()
            self._mappings.clear()
            self._staged.clear()
        maps += [slot.mapping for slot in self.cache.clear()]
        for m in maps:
            m._close_local()
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
        with self._maps_lock:
            m = self._staged.pop(buffer_id, None)
        try:
            # Unmapped while the daemon copies: the unmap of a 9 MiB mapping (~0.2 ms)
            # overlaps the commit instead of following its answer.
            self._request(op(buffer_id=buffer_id), None if m is None else m._close_local)
        finally:
            if m is not None:
                m._close_local()
        return buffer_id, m

    def _detach_quietly(self, buffer_id: str, attached: bool) -> None:
        if not attached or self._closed or self._channel.broken is not None:
            return
        try:
            self._request(protocol.Detach(buffer_id=buffer_id))
        except MaasdClientError as exc:
            logger.debug("detach of %s failed: %s", buffer_id, exc)

    def _mapping_closed(self, m: BufferMapping) -> None:
        with self._maps_lock:
            maps = self._mappings.get(m.buffer_id)
            if maps is None or m not in maps:
                return
            maps.remove(m)
            if not maps:
                del self._mappings[m.buffer_id]
        self._detach_quietly(m.buffer_id, True)

    def _give_back(self, slot: Slot) -> None:
        self._drop(self.cache.checkin(slot))

    def _drop(self, slots: list[Slot]) -> None:
        """Unmap what the cache let go of; detach each unless the daemon released it."""
        for slot in slots:
            slot.mapping._close_local()
            self._detach_quietly(slot.buffer_id, not slot.released)

    def _sweep(self, force: bool = False) -> None:
        """Age idle entry mappings out (at most every SWEEP_INTERVAL_S unless ``force``)."""
        now = time.monotonic()
        if force or now - self._swept >= SWEEP_INTERVAL_S:
            self._swept = now
            self._drop(self.cache.expire(now))

    def _renew_loop(self) -> None:
        gone: set[str] = set()
        while not self._stop.wait(self.renew_interval_s):
            self._sweep()
            for buffer_id in self.attached:
                if buffer_id in gone or self._stop.is_set():
                    continue
                try:
                    self.renew(buffer_id)
                except NotFound:
                    # Released or expired: a stale mapping now reads zeros.
                    logger.warning("lease renewal: buffer %s is gone", buffer_id)
                    gone.add(buffer_id)
                except (ConnectionFailed, Unauthorized) as exc:
                    if not self._closed:
                        logger.warning("lease renewal stopped: %s", exc)
                    return
                except MaasdClientError as exc:
                    logger.warning("lease renewal of %s failed: %s", buffer_id, exc)
