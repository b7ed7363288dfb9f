"""The audit trail: one row per reserve, release (and why), key, quota and pool change.

Events are written by the other repositories, inside the transaction of the
change they record (so a change and its event commit together); this module
builds their rows and reads them back.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, insert, select

from maasd.models import EventKind
from maasd.store import schema
from maasd.store.base import Repository
from maasd.store.records import BufferRow, EventRow

__all__ = ["EVENT_COLUMNS", "EventRepo", "buffer_event", "event", "ins_event"]

_E = schema.events

#: Insert one event (a dict of :func:`event`) or many (a list of them).
ins_event = insert(_E)
#: The columns an event row gives (:func:`event`'s keys): the id is the database's.
EVENT_COLUMNS = ("at", "kind", "tenant_id", "buffer_id", "pool_id", "bytes", "detail")
_sel_events = select(_E).order_by(_E.c.id.desc()).limit(bindparam("limit"))


def event(
    kind: EventKind,
    at: float,
    *,
    tenant_id: str | None = None,
    buffer_id: str | None = None,
    pool_id: str | None = None,
    nbytes: int | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The values of one event row."""
    return {
        "at": at,
        "kind": kind,
        "tenant_id": tenant_id,
        "buffer_id": buffer_id,
        "pool_id": pool_id,
        "bytes": nbytes,
        "detail": detail,
    }


def buffer_event(
    kind: EventKind, at: float, row: BufferRow, detail: str | None = None
) -> dict[str, Any]:
    """The values of an event about ``row`` (its tenant, pool and size)."""
    return event(
        kind,
        at,
        tenant_id=row.tenant_id,
        buffer_id=row.id,
        pool_id=row.pool_id,
        nbytes=row.size_bytes,
        detail=detail,
    )


class EventRepo(Repository):
    """Reading the audit trail."""

    def events(
        self, limit: int = 100, *, tenant_id: str | None = None, before: int | None = None
    ) -> list[EventRow]:
        """The newest ``limit`` events, newest first; only ``tenant_id``'s when given, and
        only those older than event id ``before`` (to page back)."""
        stmt = _sel_events
        params: dict[str, Any] = {"limit": limit}
        if tenant_id is not None:
            stmt = stmt.where(_E.c.tenant_id == bindparam("p_tenant"))
            params["p_tenant"] = tenant_id
        if before is not None:
            stmt = stmt.where(_E.c.id < bindparam("before"))
            params["before"] = before
        return [EventRow(*r) for r in self._read_rows(stmt, params)]
