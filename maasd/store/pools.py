"""Pools in the ledger: each belongs to one host, with its usage summed at read time."""

from __future__ import annotations

import time

import msgspec
import sqlalchemy as sa
from sqlalchemy import bindparam, delete, func, insert, select, update

from maasd.errors import NotFound, StateConflict
from maasd.store import schema
from maasd.store.base import Connections, used
from maasd.store.events import event, ins_event
from maasd.store.records import PoolRow

__all__ = ["PoolRepo", "lock_pool"]

_P = schema.pools
_B = schema.buffers

_sel_pools = select(_P).where(_P.c.host == bindparam("host")).order_by(_P.c.name)
_sel_pool_usage = (
    select(_P.c.id, used(_B.c.size_bytes), func.count(_B.c.id))
    .select_from(_P.outerjoin(_B, _B.c.pool_id == _P.c.id))
    .where(_P.c.host == bindparam("host"))
    .group_by(_P.c.id)
)
#: Lock a pool's row (PostgreSQL) and read what a reserve decides by: its capacity, its
#: name (for messages) and whether it is being deleted.
lock_pool = (
    select(_P.c.capacity_bytes, _P.c.name, _P.c.deleting_at)
    .where(_P.c.id == bindparam("p_id"))
    .with_for_update()
)
_mark_deleting = (
    update(_P)
    .where(_P.c.id == bindparam("p_id"), _P.c.deleting_at.is_(None))
    .values(deleting_at=bindparam("now"))
)
_del_pool = delete(_P).where(_P.c.id == bindparam("p_id"))
_count_pool_buffers = select(func.count()).select_from(_B).where(_B.c.pool_id == bindparam("p_id"))


class PoolRepo(Connections):
    """Adding, listing and deleting the pools of a host."""

    def add_pool(self, row: PoolRow) -> PoolRow:
        """Insert a pool. A taken ``(host, name)`` (or id) raises :class:`StateConflict`."""
        try:
            with self._writing() as conn:
                conn.execute(insert(_P), msgspec.structs.asdict(row))
                conn.execute(
                    ins_event,
                    event(
                        "pool_create",
                        row.created_at,
                        pool_id=row.id,
                        nbytes=row.capacity_bytes,
                        detail=row.name,
                    ),
                )
        except sa.exc.IntegrityError as exc:
            raise StateConflict(f"a pool named {row.name!r} already exists on {row.host}") from exc
        return row

    def pools(self, host: str) -> list[PoolRow]:
        """The pools of ``host``, by name."""
        return [PoolRow(*r) for r in self._read_rows(_sel_pools, {"host": host})]

    def usage_by_pool(self, host: str) -> dict[str, tuple[int, int]]:
        """``{pool_id: (used_bytes, buffers)}`` for every pool of ``host`` (all states count)."""
        return {r[0]: (r[1], r[2]) for r in self._read_rows(_sel_pool_usage, {"host": host})}

    def mark_pool_deleting(self, pool_id: str, *, now: float | None = None) -> float:
        """Start (or resume) a pool's drain: from the commit on no reserve lands in it.

        Returns the pool's ``deleting_at`` (the first mark's, when resumed).
        :class:`NotFound` if unknown.
        """
        at = time.time() if now is None else now
        with self._writing() as conn:
            if conn.execute(lock_pool, {"p_id": pool_id}).first() is None:
                raise NotFound(f"pool {pool_id} not found")
            conn.execute(_mark_deleting, {"p_id": pool_id, "now": at})
            marked = conn.execute(lock_pool, {"p_id": pool_id}).one()
        return float(marked[2])

    def delete_pool(self, pool_id: str, *, now: float | None = None) -> None:
        """Delete an empty pool: :class:`NotFound` if unknown, :class:`StateConflict` if it holds buffers."""
        with self._writing() as conn:
            if conn.execute(lock_pool, {"p_id": pool_id}).first() is None:
                raise NotFound(f"pool {pool_id} not found")
            n = conn.execute(_count_pool_buffers, {"p_id": pool_id}).scalar_one()
            if n:
                raise StateConflict(f"pool {pool_id} still holds {n} buffer(s)")
            conn.execute(_del_pool, {"p_id": pool_id})
            conn.execute(
                ins_event,
                event("pool_delete", time.time() if now is None else now, pool_id=pool_id),
            )
