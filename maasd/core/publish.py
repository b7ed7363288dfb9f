"""A writer's own memfd published as a committed entry: the worker socket's ``publish``.

A ``put`` and a ``commit`` in one round trip, and no writable handle handed out::

    the fd      what the writer sent with the frame: checked (below), read, closed by
                the broker once the op ran — never mapped, never kept
    reserve     a put's (Reserves.reserve, kind "entry"): quota, ``max_buffers``, capacity,
                eviction and the pool's node as for any entry — into a region sealed
                F_SEAL_FUTURE_WRITE|SHRINK|GROW|SEAL from the start and fully populated
                (Restores.materialise_with): no worker ever holds it writable
    read        ``size_bytes`` of the writer's memfd ``pread`` into the region through the
                daemon's own mapping: one copy, as a commit's
    commit      in place (ledger: staged → live), the key published, the commit hook (L2)

Why this shape (docs/client.md, "Publishing an entry"): a writer fills memory of its own —
a memfd it created once and keeps mapped, or the file llama-server's slot save wrote
(``fopen("wb")`` truncates: no sealed memfd can be its target) — and the daemon copies it
into a region of its own, the same copy a commit makes from a staging region. The writer
saves the put's round trip and the first touch of a fresh staging mapping on every save;
the daemon one region per save (no staging region to fault in, then retire).

What the fd must be, checked before anything is reserved (400 otherwise, nothing
changed): a regular file that answers ``F_GET_SEALS`` — a memfd, or another shmem or
hugetlbfs file, whose ``pread`` never waits on a device, a network or another process —
open for reading, holding at least ``size_bytes``. Its pages are its writer's (its
memory, its cgroup), never the tenant's quota; the entry's are. A writer that truncates
it while it is read makes ``pread`` return short (a 409, nothing left behind), never a
fault in the daemon: it is read, never mapped. A writer that writes it meanwhile gets
the bytes it wrote, torn: its own entry's checksum tells.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable

from maasd.core.auth import require_tenant
from maasd.core.entries import Entries
from maasd.core.restore import Restores
from maasd.errors import InvalidRequest, StateConflict
from maasd.metrics import Metrics
from maasd.models import BufferInfo, Principal

__all__ = ["Publishes", "check_source"]


class Publishes:
    """The socket's ``publish``: a committed entry from the writer's memfd, in one step."""

    def __init__(self, restores: Restores, entries: Entries, metrics: Metrics) -> None:
        self._restores = restores
        self._entries = entries  # what a commit counts and hooks (L2's write-behind)
        self._metrics = metrics

    def publish(
        self,
        who: Principal,
        key: str,
        fd: int,
        size_bytes: int,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> BufferInfo:
        """The first ``size_bytes`` of ``fd`` as a committed entry under ``key`` → the entry.

        Raises InvalidRequest (the fd is not what the module docstring says), what a put
        raises (DuplicateKey, QuotaExceeded, PoolExhausted …), StateConflict (the memfd
        shrank while it was read: the entry is released). The caller closes ``fd``.
        """
        tenant_id = require_tenant(who)
        counter = self._metrics.entry_publishes
        try:
            check_source(fd, size_bytes)
            info = self._restores.materialise_with(
                who, key, size_bytes, _reader(fd, size_bytes), pool=pool, ttl_s=ttl_s
            )
        except Exception as e:
            counter.labels(tenant=tenant_id, outcome=getattr(e, "code", "error")).inc()
            raise
        counter.labels(tenant=tenant_id, outcome="ok").inc()
        self._entries.committed(tenant_id, key, info.id, info.size_bytes)
        return info


def check_source(fd: int, size_bytes: int) -> None:
    """Raise :class:`InvalidRequest` unless ``fd`` is a shmem file open for reading that
    holds at least ``size_bytes`` (module docstring: why each)."""
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise InvalidRequest(f"publish: the fd sent cannot be used ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest("publish needs a memfd: the fd sent is not a regular file")
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise InvalidRequest(
            "publish needs a memfd: the fd sent is a file of another kind (it has no seals)"
        ) from e
    access = flags & os.O_ACCMODE
    if access == os.O_WRONLY:
        raise InvalidRequest("publish: the memfd sent is open for writing only")
    if access not in (os.O_RDONLY, os.O_RDWR):  # 3: neither (a re-open for ioctls)
        raise InvalidRequest("publish: the memfd sent is not open for reading")
    if st.st_size < size_bytes:
        raise InvalidRequest(
            f"publish: the memfd holds {st.st_size} bytes, fewer than size_bytes {size_bytes}"
        )


def _reader(fd: int, size: int) -> Callable[[memoryview], None]:
    """``fill``: ``size`` bytes of ``fd`` read into the region's mapping."""

    def fill(view: memoryview) -> None:
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:size]], done)
            if n == 0:
                raise StateConflict(
                    f"publish: the memfd shrank while it was read ({done} of {size} bytes)"
                )
            done += n

    return fill
