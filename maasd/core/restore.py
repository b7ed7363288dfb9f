"""Entries read back from a slower tier into a committed entry here, and an entry's bytes
read out for one: the seam the disk tier's promotion and the L2 tier share.

    materialise   the reserve of a put (Reserves.reserve, kind "entry": quota,
                  ``max_buffers``, capacity and eviction as for any entry), into a region
                  sealed F_SEAL_FUTURE_WRITE from the start: no worker ever holds it
                  writable, so the daemon writes the bytes through its own mapping
                  (the disk tier decrypts straight into it) and commits it in place,
                  without a copy; a failure releases it (Entries.release_staged)
    read          a committed entry's bytes, under its lock (L2's write-behind)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from maasd.core.auth import require_tenant
from maasd.core.entries import DEFAULT_ENTRY_TTL_S, Entries
from maasd.core.holders import Holders
from maasd.core.regions import Regions
from maasd.core.reserve import Reserves
from maasd.errors import StateConflict
from maasd.models import BufferInfo, Principal, ReserveSpec
from maasd.store import BufferRepo

__all__ = ["Restores"]


class Restores:
    """Committed entries made here from bytes a tier holds, and an entry's bytes read out."""

    def __init__(
        self,
        store: BufferRepo,
        regions: Regions,
        holders: Holders,
        reserves: Reserves,
        entries: Entries,
    ) -> None:
        self._buffer_rows = store
        self._regions = regions
        self._holders = holders
        self._reserves = reserves
        self._entries = entries

    def materialise(self, who: Principal, key: str, data: memoryview) -> str:
        """A committed entry of ``key`` holding ``data`` (read back from L2); its id.

        The reserve of a put (quota, ``max_buffers``, capacity and eviction as for any
        entry), into a region sealed ``F_SEAL_FUTURE_WRITE`` from the start: no worker
        ever holds it writable, so the daemon writes ``data`` through its own mapping and
        commits the region in place, without a copy. Raises what a put raises
        (DuplicateKey when the key is here already, QuotaExceeded, PoolExhausted …).
        """

        def fill(view: memoryview) -> None:
            view[: len(data)] = data

        return self.materialise_with(who, key, len(data), fill).id

    def materialise_with(
        self,
        who: Principal,
        key: str,
        size: int,
        fill: Callable[[memoryview], None],
        *,
        pool: str | None = None,
        ttl_s: int | None = None,
    ) -> BufferInfo:
        """:meth:`materialise`, with ``fill`` writing the bytes into the region's mapping
        (the disk tier decrypts straight into it; a publish reads the writer's memfd into
        it), in ``pool`` if given, leased ``ttl_s`` (a put's default if ``None``). What
        ``fill`` raises releases the entry (scrubbed) and is raised. The entry as
        reserved (its id, size and node)."""
        tenant_id = require_tenant(who)
        spec = ReserveSpec(
            size_bytes=size,
            pool=pool,
            # The daemon's own choice (a copy's length, kept from when it was put): never
            # longer than a reserve may ask for now, which a restore could not grant.
            ttl_s=min(DEFAULT_ENTRY_TTL_S if ttl_s is None else ttl_s, self._reserves.max_ttl_s),
            key=key,
            evictable=True,
        )
        info = self._reserves.reserve(who, spec, kind="entry", frozen=True)
        try:
            self._publish(info.id, fill)
        except Exception:
            self._entries.release_staged(tenant_id, info.id, "commit_failed")
            raise
        return info

    def _publish(self, buffer_id: str, fill: Callable[[memoryview], None]) -> None:
        with self._regions.buffer_lock(buffer_id):
            held = self._regions.held(buffer_id)
            if held is None or held.live:
                raise StateConflict(f"entry {buffer_id} was released before its commit")
            region = held.region
            view = region.view()
            try:
                fill(view)
            finally:
                view.release()
            self._holders.watch(buffer_id, region.fd, region.size, held.tenant_id, held.pool_id)
            if (
                self._buffer_rows.commit(
                    buffer_id, time.time(), durable=self._entries.durable(held)
                )
                is None
            ):
                self._holders.forget(buffer_id)
                raise StateConflict(f"entry {buffer_id} was released before its commit")
            self._regions.commit(buffer_id, region)

    def read(self, buffer_id: str, tenant_id: str, key: str, head: int) -> bytearray | None:
        """``head`` free bytes, then the bytes of the committed entry ``buffer_id`` of this
        tenant and key; None if it is not (or no longer) that. Read under the entry's lock,
        so a release cannot scrub it halfway through (L2 would get a mix of it and zeros)."""
        with self._regions.buffer_lock(buffer_id):
            held = self._regions.held(buffer_id)
            if (
                held is None
                or not held.committed
                or held.tenant_id != tenant_id
                or held.key != key
                or held.region.closed
            ):
                return None
            buf = bytearray(head + held.region.size)
            held.region.read_into(memoryview(buf)[head:])
            return buf
