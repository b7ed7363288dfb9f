"""Tenants: creating and deleting them, their quotas and caps, their keys, their use, the
audit trail.

Deleting a tenant never stops half-way (docs/operations.md)::

    ledger: deleting_at set, keys revoked (one transaction)   from here: 401, no reserve
    memory: every buffer released (scrubbed) — also those whose reserve is in flight,
            which lose their compare-and-set to ``live`` and scrub their own region
    ledger: tenant and keys deleted once it holds no buffer

A daemon that stops in the middle finishes the delete when it starts again
(:meth:`Tenants.finish_deletes`).

With several daemons on one ledger each host scrubs only its own memory: the host that
took the DELETE releases the buffers it holds, every other host releases its share at its
next reaper pass (:meth:`Tenants.finish_deletes`, every ``reaper_interval_s``), and
whichever host releases the last buffer deletes the tenant. The DELETE waits a bounded
time for that (``remote_wait_s``) and answers 204 either way: from the first step on the
tenant can do nothing. A host that is down keeps its share, and the tenant its row, until
it starts again (recovery) or is forgotten (``maasctl hosts forget``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection

from maasd.bounds import MAX_BYTES
from maasd.core.auth import Auth, require_tenant
from maasd.core.release import HELD_GRACE_S, HeldOpen, Releaser
from maasd.errors import NotFound, StateConflict
from maasd.models import Event, KeyInfo, NewTenant, Principal, TenantInfo, Usage, rfc3339
from maasd.store import ACCOUNTED_STATES, BufferRepo, EventRepo, TenantRepo, TenantRow
from maasd.tenancy import keys

__all__ = ["Tenants", "tenant_info"]

logger = logging.getLogger(__name__)


def disk_quota(row: TenantRow, factor: int) -> int:
    """The tenant's disk quota in force: its own, or ``factor`` × its quota — at most
    :data:`~maasd.bounds.MAX_BYTES`, as every byte count of the API (a quota near 2^63
    must not answer a disk quota no 64-bit integer holds)."""
    if row.disk_quota_bytes is not None:
        return row.disk_quota_bytes
    return min(factor * row.quota_bytes, MAX_BYTES)


def tenant_info(
    row: TenantRow, default_max_buffers: int, held: int = 0, *, disk_factor: int = 4,
    disk_used: int = 0,
) -> TenantInfo:  # fmt: skip
    """The API record of a tenant, with its usage (``held``: bytes of it still held after
    their release; ``disk_used``: its bytes on the disk tiers), the buffer cap and the disk
    quota in force."""
    return TenantInfo(
        id=row.id,
        name=row.name,
        quota_bytes=row.quota_bytes,
        used_bytes=row.used_bytes,
        buffers=row.buffers,
        created_at=rfc3339(row.created_at),
        max_buffers=row.max_buffers if row.max_buffers is not None else default_max_buffers,
        held_bytes=held,
        disk_quota_bytes=disk_quota(row, disk_factor),
        disk_used_bytes=disk_used,
    )


class Tenants:
    """The admin's tenant use-cases, and a tenant's view of its own use.

    ``default_max_buffers`` is the cap of a tenant that has none of its own; ``host`` is
    this daemon's host (it releases only the buffers it holds); ``remote_wait_s`` bounds
    how long a DELETE waits for other hosts to release theirs.
    """

    def __init__(
        self,
        store: TenantRepo,
        buffer_rows: BufferRepo,
        events: EventRepo,
        auth: Auth,
        releaser: Releaser,
        default_max_buffers: int,
        *,
        host: str,
        remote_wait_s: float = 5.0,
        held: Callable[[], dict[str, int]] = dict,
        disk_factor: int = 4,
        disk_used: Callable[[], dict[str, int]] = dict,
        on_deleted: Callable[[str], None] = lambda _tenant_id: None,
    ) -> None:
        self._tenant_rows = store
        self._buffer_rows = buffer_rows  # what a deleted tenant still holds here
        self._events = events  # the audit trail, a tenant's own part of it
        self._auth = auth
        self._releaser = releaser
        self._default_max_buffers = default_max_buffers
        self._host = host
        self._remote_wait_s = remote_wait_s
        #: bytes held after their release, per tenant (maasd.core.holders)
        self._held = held
        #: the default disk quota's multiple of the quota; bytes on the disk tiers, per tenant
        self._disk_factor = disk_factor
        self._disk_used = disk_used
        #: a deleted tenant's entries on the disk tiers erased (their ``drop_tenant``)
        self._on_deleted = on_deleted

    def create(self, name: str, quota_bytes: int, disk_quota_bytes: int | None = None) -> NewTenant:
        """A new tenant and its first key (shown only here). :class:`StateConflict` if the
        name is taken. ``disk_quota_bytes`` ``None``: the default disk quota."""
        now = time.time()
        tenant_id = keys.new_id()
        token, key_id = keys.new_token(), keys.new_id()
        row = self._tenant_rows.add_tenant(tenant_id, name, quota_bytes, now, disk_quota_bytes)
        self._tenant_rows.add_key(key_id, tenant_id, keys.digest(token), now)
        return NewTenant(
            id=tenant_id,
            name=name,
            quota_bytes=quota_bytes,
            used_bytes=0,
            api_key=token,
            key_id=key_id,
            disk_quota_bytes=disk_quota(row, self._disk_factor),
        )

    def _info(self, row: TenantRow, held: dict[str, int], disk: dict[str, int]) -> TenantInfo:
        return tenant_info(
            row, self._default_max_buffers, held.get(row.id, 0),
            disk_factor=self._disk_factor, disk_used=disk.get(row.id, 0),
        )  # fmt: skip

    def infos(self) -> list[TenantInfo]:
        held, disk = self._held(), self._disk_used()
        return [self._info(t, held, disk) for t in self._tenant_rows.tenants()]

    def info(self, id_or_name: str) -> TenantInfo:
        """One tenant by id (preferred) or name; :class:`NotFound` otherwise."""
        row = self._tenant_rows.tenant(id_or_name)
        if row is None:
            raise NotFound(f"no tenant {id_or_name!r}")
        return self._info(row, self._held(), self._disk_used())

    def update(
        self,
        id_or_name: str,
        *,
        quota_bytes: int | None = None,
        max_buffers: int | None = None,
        disk_quota_bytes: int | None = None,
    ) -> TenantInfo:
        """Change the quota, the buffer cap and/or the disk quota, atomically (one event
        each).

        Lowering one below current use is allowed: it blocks new reserves until use
        falls below it; a disk quota holds from the next demotion of the tenant's on.
        At least one must be given (:class:`InvalidRequest`).
        """
        t = self.info(id_or_name)
        self._tenant_rows.update_tenant(
            t.id, quota_bytes=quota_bytes, max_buffers=max_buffers,
            disk_quota_bytes=disk_quota_bytes,
        )  # fmt: skip
        return self.info(t.id)

    def set_quota(self, id_or_name: str, quota_bytes: int) -> TenantInfo:
        """Change the quota; lowering it below use is allowed (it blocks new reserves)."""
        return self.update(id_or_name, quota_bytes=quota_bytes)

    def delete(self, id_or_name: str) -> None:
        """Mark the tenant deleting and revoke its keys, release (scrub) every buffer it
        holds here — also those whose reserve is in flight — and delete it once no host
        holds any (waiting up to ``remote_wait_s`` for the others); then every entry of it
        on the disk tiers is erased."""
        t = self.info(id_or_name)
        self._tenant_rows.mark_tenant_deleting(t.id)
        self._auth.forget_keys()
        self._release_and_wait(t.id)
        self._on_deleted(t.id)

    def _release_and_wait(self, tenant_id: str) -> None:
        """This host's share released, then up to ``remote_wait_s`` for the other hosts'."""
        try:
            if self._finish_delete(tenant_id):
                return
        except HeldOpen:
            return  # deleting (keys revoked, nothing new admitted); ends when they go
        deadline = time.monotonic() + self._remote_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if self._tenant_rows.tenant(tenant_id) is None:
                return
        logger.warning(
            "tenant %s: deleting; other hosts still hold some of its buffers "
            "(each releases its own at its next reaper pass)",
            tenant_id,
        )

    def finish_deletes(self) -> int:
        """Release this host's share of every tenant being deleted, and delete those no host
        holds anything of any more (at start, and at every reaper pass). Returns how many
        tenants were deleted."""
        done = 0
        for tenant_id in self._tenant_rows.deleting_tenants():
            logger.info("finishing the delete of tenant %s", tenant_id)
            with contextlib.suppress(HeldOpen):  # still held: the next pass, then
                done += self._finish_delete(tenant_id, grace=0)
        return done

    def forget_deleted(self, tenant_ids: Collection[str]) -> int:
        """Of ``tenant_ids`` (tenants this host keeps something of outside the ledger: its
        disk tiers' entries), those deleted or being deleted — through any daemon: the one
        that took the DELETE erases its own at once, every other learns of it here, at a
        reaper pass — have it erased (``on_deleted``). How many."""
        if not tenant_ids:
            return 0
        gone = set(tenant_ids) - self._tenant_rows.serving(sorted(tenant_ids))
        for tenant_id in gone:
            logger.info("erasing what this host keeps of deleted tenant %s", tenant_id)
            self._on_deleted(tenant_id)
        return len(gone)

    def _finish_delete(self, tenant_id: str, *, grace: float = HELD_GRACE_S) -> bool:
        """Release the deleting tenant's buffers on this host, then delete it if no host
        holds any. True if the tenant is gone."""
        gone = True

        def delete_if_empty() -> None:
            nonlocal gone
            try:
                self._tenant_rows.delete_tenant(tenant_id)
            except StateConflict:
                if self._buffer_rows.buffers(tenant_id=tenant_id, states=None, host=self._host):
                    raise  # ours, released meanwhile or raced: another pass
                gone = False  # other hosts' share: theirs to release

        try:
            self._releaser.release_all(
                lambda: self._buffer_rows.buffers(
                    tenant_id=tenant_id, states=ACCOUNTED_STATES, host=self._host
                ),
                delete_if_empty,
                reason="tenant_delete",
                what=f"tenant {tenant_id}",
                grace=grace,
            )
        except HeldOpen as e:  # counted until they go; the reaper's pass then ends it
            if grace > 0:
                logger.warning("deleting: %s", e.detail)
            raise
        return gone

    def issue_key(self, id_or_name: str) -> KeyInfo:
        """A new key for the tenant (shown only here)."""
        t = self.info(id_or_name)
        now = time.time()
        token, key_id = keys.new_token(), keys.new_id()
        self._tenant_rows.add_key(key_id, t.id, keys.digest(token), now)
        return KeyInfo(id=key_id, api_key=token, created_at=rfc3339(now))

    def revoke_key(self, id_or_name: str, key_id: str) -> None:
        """Revoke one key: refused at once, here and (PostgreSQL) on every host."""
        t = self.info(id_or_name)
        revoked = self._tenant_rows.revoke_key(t.id, key_id)
        self._auth.forget_keys()
        if not revoked:
            raise NotFound(f"no active key {key_id!r} for tenant {t.name}")

    def events(
        self, limit: int = 100, tenant: str | None = None, before: int | None = None
    ) -> list[Event]:
        """The audit trail, newest first: every reserve, release and why, key and quota change.

        ``tenant`` (id or name) keeps that tenant's events; ``before`` (an event id)
        pages back.
        """
        tenant_id = self.info(tenant).id if tenant is not None else None
        return [
            Event(
                id=e.id,
                at=rfc3339(e.at),
                kind=e.kind,
                tenant_id=e.tenant_id,
                buffer_id=e.buffer_id,
                pool_id=e.pool_id,
                bytes=e.bytes,
                detail=e.detail,
            )
            for e in self._events.events(limit, tenant_id=tenant_id, before=before)
        ]

    def usage(self, who: Principal) -> Usage:
        """The calling tenant's quota and use."""
        t = self.info(require_tenant(who))
        return Usage(
            tenant_id=t.id,
            quota_bytes=t.quota_bytes,
            used_bytes=t.used_bytes,
            buffers=t.buffers,
            max_buffers=t.max_buffers,
            held_bytes=t.held_bytes,
            disk_quota_bytes=t.disk_quota_bytes,
            disk_used_bytes=t.disk_used_bytes,
        )
