"""Tenants: creating and deleting them, their quotas, their keys, their use, the audit trail."""

from __future__ import annotations

import time

from maasd.core.auth import Auth, require_tenant
from maasd.core.release import Releaser
from maasd.errors import NotFound
from maasd.models import Event, KeyInfo, NewTenant, Principal, TenantInfo, Usage, rfc3339
from maasd.store import ACCOUNTED_STATES, Store, TenantRow
from maasd.tenancy import keys

__all__ = ["Tenants", "tenant_info"]


def tenant_info(row: TenantRow) -> TenantInfo:
    """The API record of a tenant, with its usage."""
    return TenantInfo(
        id=row.id,
        name=row.name,
        quota_bytes=row.quota_bytes,
        used_bytes=row.used_bytes,
        buffers=row.buffers,
        created_at=rfc3339(row.created_at),
    )


class Tenants:
    """The admin's tenant use-cases, and a tenant's view of its own use."""

    def __init__(self, store: Store, auth: Auth, releaser: Releaser) -> None:
        self._store = store
        self._auth = auth
        self._releaser = releaser

    def create(self, name: str, quota_bytes: int) -> NewTenant:
        """A new tenant and its first key (shown only here). :class:`StateConflict` if the
        name is taken."""
        now = time.time()
        tenant_id = keys.new_id()
        token, key_id = keys.new_token(), keys.new_id()
        self._store.add_tenant(tenant_id, name, quota_bytes, now)
        self._store.add_key(key_id, tenant_id, keys.digest(token), now)
        return NewTenant(
            id=tenant_id,
            name=name,
            quota_bytes=quota_bytes,
            used_bytes=0,
            api_key=token,
            key_id=key_id,
        )

    def infos(self) -> list[TenantInfo]:
        return [tenant_info(t) for t in self._store.tenants()]

    def info(self, id_or_name: str) -> TenantInfo:
        """One tenant by id (preferred) or name; :class:`NotFound` otherwise."""
        row = self._store.tenant(id_or_name)
        if row is None:
            raise NotFound(f"no tenant {id_or_name!r}")
        return tenant_info(row)

    def set_quota(self, id_or_name: str, quota_bytes: int) -> TenantInfo:
        """Change the quota; lowering it below use is allowed (it blocks new reserves)."""
        t = self.info(id_or_name)
        self._store.set_quota(t.id, quota_bytes)
        return self.info(t.id)

    def delete(self, id_or_name: str) -> None:
        """Revoke the tenant's keys, release (scrub) all its buffers, delete it."""
        t = self.info(id_or_name)
        self._store.revoke_keys(t.id)
        self._auth.forget_keys()
        for row in self._store.buffers(tenant_id=t.id, states=ACCOUNTED_STATES):
            self._releaser.release_row(row, reason="tenant_delete")
        self._store.delete_tenant(t.id)

    def issue_key(self, id_or_name: str) -> KeyInfo:
        """A new key for the tenant (shown only here)."""
        t = self.info(id_or_name)
        now = time.time()
        token, key_id = keys.new_token(), keys.new_id()
        self._store.add_key(key_id, t.id, keys.digest(token), now)
        return KeyInfo(id=key_id, api_key=token, created_at=rfc3339(now))

    def revoke_key(self, id_or_name: str, key_id: str) -> None:
        """Revoke one key: refused at once, here and (PostgreSQL) on every host."""
        t = self.info(id_or_name)
        revoked = self._store.revoke_key(t.id, key_id)
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
            for e in self._store.events(limit, tenant_id=tenant_id, before=before)
        ]

    def usage(self, who: Principal) -> Usage:
        """The calling tenant's quota and use."""
        t = self.info(require_tenant(who))
        return Usage(
            tenant_id=t.id, quota_bytes=t.quota_bytes, used_bytes=t.used_bytes, buffers=t.buffers
        )
