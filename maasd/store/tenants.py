"""Tenants and their API keys in the ledger. Tenants are global: shared by every host."""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy import bindparam, delete, func, insert, or_, select, update

from maasd.errors import InvalidRequest, NotFound, StateConflict
from maasd.store import schema
from maasd.store.base import Repository, violation
from maasd.store.events import event, ins_event
from maasd.store.records import KeyRow, TenantRow

__all__ = ["TenantRepo", "lock_tenant"]

_T = schema.tenants
_K = schema.api_keys
_B = schema.buffers

# Tenants: each row carries its usage (the running totals, maasd.store.totals), in the
# field order of TenantRow.
_sel_tenant = select(_T).where(or_(_T.c.id == bindparam("ref"), _T.c.name == bindparam("ref")))
_sel_tenants = select(_T).order_by(_T.c.name)
#: Lock a tenant's row (PostgreSQL) and read what a reserve decides by: its quota, its
#: buffer cap (``None``: the daemon's default) and whether it is being deleted.
lock_tenant = (
    select(_T.c.quota_bytes, _T.c.max_buffers, _T.c.deleting_at)
    .where(_T.c.id == bindparam("p_id"))
    .with_for_update()
)
_set_quota = update(_T).where(_T.c.id == bindparam("p_id")).values(quota_bytes=bindparam("quota"))
_set_max_buffers = (
    update(_T).where(_T.c.id == bindparam("p_id")).values(max_buffers=bindparam("cap"))
)
_set_disk_quota = (
    update(_T).where(_T.c.id == bindparam("p_id")).values(disk_quota_bytes=bindparam("disk"))
)
# The first delete marks the tenant; a delete resumed (again, or after a restart) keeps
# the first mark.
_mark_deleting = (
    update(_T)
    .where(_T.c.id == bindparam("p_id"), _T.c.deleting_at.is_(None))
    .values(deleting_at=bindparam("now"))
)
_sel_deleting = select(_T.c.id).where(_T.c.deleting_at.is_not(None)).order_by(_T.c.deleting_at)
_del_tenant = delete(_T).where(_T.c.id == bindparam("p_id"))
_sel_serving = select(_T.c.id).where(
    _T.c.id.in_(bindparam("ids", expanding=True)), _T.c.deleting_at.is_(None)
)
_count_tenant_buffers = (
    select(func.count()).select_from(_B).where(_B.c.tenant_id == bindparam("p_id"))
)

# Keys
_ins_key = insert(_K)
_sel_key_by_digest = (
    select(_K)
    .select_from(_K.join(_T, _T.c.id == _K.c.tenant_id))
    .where(_K.c.digest == bindparam("digest"), _K.c.revoked_at.is_(None))
)
_revoke_key = (
    update(_K)
    .where(
        _K.c.id == bindparam("key_id"),
        _K.c.tenant_id == bindparam("p_tenant"),
        _K.c.revoked_at.is_(None),
    )
    .values(revoked_at=bindparam("now"))
)
_revoke_keys = (
    update(_K)
    .where(_K.c.tenant_id == bindparam("p_tenant"), _K.c.revoked_at.is_(None))
    .values(revoked_at=bindparam("now"))
)
_del_keys = delete(_K).where(_K.c.tenant_id == bindparam("p_id"))


class TenantRepo(Repository):
    """Tenants (with their usage) and their keys."""

    # ------------------------------------------------------------ tenants
    def add_tenant(
        self, id: str, name: str, quota_bytes: int, now: float, disk_quota_bytes: int | None = None
    ) -> TenantRow:
        """Insert a tenant (``disk_quota_bytes`` ``None``: the default disk quota). A taken
        name, or one that is another tenant's id (references resolve ids first: it would
        stand for that one), raises :class:`StateConflict`."""
        if disk_quota_bytes is not None and disk_quota_bytes < 0:
            raise InvalidRequest(f"disk_quota_bytes must be ≥ 0, got {disk_quota_bytes}")
        try:
            with self._writing() as conn:
                if conn.execute(select(_T.c.id).where(_T.c.id == name)).first() is not None:
                    raise StateConflict(
                        f"{name!r} is the id of another tenant: it cannot be a name"
                    )
                conn.execute(
                    insert(_T),
                    {
                        "id": id,
                        "name": name,
                        "quota_bytes": quota_bytes,
                        "created_at": now,
                        "disk_quota_bytes": disk_quota_bytes,
                    },
                )
                conn.execute(
                    ins_event,
                    event("tenant_create", now, tenant_id=id, nbytes=quota_bytes, detail=name),
                )
        except sa.exc.IntegrityError as exc:
            raise StateConflict(f"a tenant named {name!r} already exists") from exc
        return TenantRow(
            id=id,
            name=name,
            quota_bytes=quota_bytes,
            created_at=now,
            disk_quota_bytes=disk_quota_bytes,
        )

    def tenant(self, id_or_name: str) -> TenantRow | None:
        """The tenant with this id (preferred) or name, with its usage; else ``None``."""
        rows = self._read_rows(_sel_tenant, {"ref": id_or_name})
        if not rows:
            return None
        best = next((r for r in rows if r.id == id_or_name), rows[0])
        return TenantRow(*best)

    def tenants(self) -> list[TenantRow]:
        """Every tenant with its usage, by name."""
        return [TenantRow(*r) for r in self._read_rows(_sel_tenants)]

    def set_quota(self, tenant_id: str, quota_bytes: int) -> None:
        """Change a tenant's quota (lowering it below use is allowed). :class:`NotFound` if unknown."""
        self.update_tenant(tenant_id, quota_bytes=quota_bytes)

    def update_tenant(
        self,
        tenant_id: str,
        *,
        quota_bytes: int | None = None,
        max_buffers: int | None = None,
        disk_quota_bytes: int | None = None,
    ) -> None:
        """Change a tenant's quota, buffer cap and/or disk quota in one transaction, one
        event each.

        Lowering one below current use is allowed: it blocks new reserves until use
        falls below it (the disk quota: it holds from the next demotion on).
        :class:`NotFound` if unknown; :class:`InvalidRequest` for no value, a negative
        quota or a cap below 1.
        """
        if quota_bytes is None and max_buffers is None and disk_quota_bytes is None:
            raise InvalidRequest("give quota_bytes, max_buffers or disk_quota_bytes")
        for field, value in (("quota_bytes", quota_bytes), ("disk_quota_bytes", disk_quota_bytes)):
            if value is not None and value < 0:
                # a negative quota would make every usage sum "over quota"
                raise InvalidRequest(f"{field} must be ≥ 0, got {value}")
        if max_buffers is not None and max_buffers < 1:
            raise InvalidRequest(f"max_buffers must be ≥ 1, got {max_buffers}")
        now = time.time()
        with self._writing() as conn:
            if conn.execute(lock_tenant, {"p_id": tenant_id}).first() is None:
                raise NotFound(f"tenant {tenant_id} not found")
            if quota_bytes is not None:
                conn.execute(_set_quota, {"p_id": tenant_id, "quota": quota_bytes})
                conn.execute(
                    ins_event, event("quota_set", now, tenant_id=tenant_id, nbytes=quota_bytes)
                )
            if max_buffers is not None:
                conn.execute(_set_max_buffers, {"p_id": tenant_id, "cap": max_buffers})
                conn.execute(
                    ins_event,
                    event("max_buffers_set", now, tenant_id=tenant_id, detail=str(max_buffers)),
                )
            if disk_quota_bytes is not None:
                conn.execute(_set_disk_quota, {"p_id": tenant_id, "disk": disk_quota_bytes})
                conn.execute(
                    ins_event,
                    event("disk_quota_set", now, tenant_id=tenant_id, nbytes=disk_quota_bytes),
                )

    def mark_tenant_deleting(self, tenant_id: str, *, now: float | None = None) -> int:
        """Start (or resume) a tenant's delete: mark it deleting and revoke its keys, atomically.

        From the commit on, the reserve transaction refuses the tenant
        (:meth:`~maasd.store.buffers.ReserveRepo.begin_reserve`) and its keys are
        unknown. Returns how many keys were revoked. :class:`NotFound` if unknown.
        """
        at = time.time() if now is None else now
        with self._writing() as conn:
            if conn.execute(lock_tenant, {"p_id": tenant_id}).first() is None:
                raise NotFound(f"tenant {tenant_id} not found")
            conn.execute(_mark_deleting, {"p_id": tenant_id, "now": at})
            n = int(conn.execute(_revoke_keys, {"p_tenant": tenant_id, "now": at}).rowcount)
            if n:
                conn.execute(
                    ins_event, event("key_revoke", at, tenant_id=tenant_id, detail=f"all {n}")
                )
        return n

    def deleting_tenants(self) -> list[str]:
        """The ids of tenants whose delete started and has not finished, oldest first."""
        return [r[0] for r in self._read_rows(_sel_deleting)]

    def serving(self, tenant_ids: list[str]) -> set[str]:
        """Of ``tenant_ids``, those that exist and are not being deleted."""
        return {r[0] for r in self._read_rows(_sel_serving, {"ids": tenant_ids})}

    def delete_tenant(self, tenant_id: str, *, now: float | None = None) -> None:
        """Delete a tenant and its keys.

        The caller releases (scrubs) its buffers first; if any remain this
        raises :class:`StateConflict` and changes nothing. :class:`NotFound` if unknown.
        """
        with self._writing() as conn:
            if conn.execute(lock_tenant, {"p_id": tenant_id}).first() is None:
                raise NotFound(f"tenant {tenant_id} not found")
            n = conn.execute(_count_tenant_buffers, {"p_id": tenant_id}).scalar_one()
            if n:
                raise StateConflict(f"tenant {tenant_id} still holds {n} buffer(s)")
            conn.execute(_del_keys, {"p_id": tenant_id})
            conn.execute(_del_tenant, {"p_id": tenant_id})
            conn.execute(
                ins_event,
                event("tenant_delete", time.time() if now is None else now, tenant_id=tenant_id),
            )

    # --------------------------------------------------------------- keys
    def add_key(self, id: str, tenant_id: str, digest: bytes, now: float) -> KeyRow:
        """Store a key's digest for a tenant. :class:`NotFound` if the tenant is unknown."""
        row = KeyRow(id=id, tenant_id=tenant_id, digest=digest, created_at=now)
        try:
            with self._writing() as conn:
                conn.execute(
                    _ins_key,
                    {
                        "id": id,
                        "tenant_id": tenant_id,
                        "digest": digest,
                        "created_at": now,
                        "revoked_at": None,
                    },
                )
                conn.execute(ins_event, event("key_issue", now, tenant_id=tenant_id, detail=id))
        except sa.exc.IntegrityError as exc:
            v = violation(exc)
            if v.kind == "foreign_key":
                raise NotFound(f"tenant {tenant_id} not found") from exc
            raise StateConflict(f"key already exists: {v.message}") from exc
        return row

    def key_by_digest(self, digest: bytes) -> KeyRow | None:
        """The unrevoked key with this digest whose tenant exists, else ``None``."""
        row = self._read_first(_sel_key_by_digest, {"digest": digest})
        return None if row is None else KeyRow(*row)

    def revoke_key(self, tenant_id: str, key_id: str, *, now: float | None = None) -> bool:
        """Revoke one key of this tenant. ``False`` if unknown, foreign or already revoked."""
        at = time.time() if now is None else now
        params = {"p_tenant": tenant_id, "key_id": key_id, "now": at}
        with self._writing() as conn:
            if conn.execute(_revoke_key, params).rowcount != 1:
                return False
            conn.execute(ins_event, event("key_revoke", at, tenant_id=tenant_id, detail=key_id))
        return True

    def revoke_keys(self, tenant_id: str, *, now: float | None = None) -> int:
        """Revoke every live key of a tenant; returns how many were revoked."""
        at = time.time() if now is None else now
        with self._writing() as conn:
            n = int(conn.execute(_revoke_keys, {"p_tenant": tenant_id, "now": at}).rowcount)
            if n:
                conn.execute(
                    ins_event, event("key_revoke", at, tenant_id=tenant_id, detail=f"all {n}")
                )
        return n
