"""Pools in the ledger: each belongs to one host, with its usage (running totals on its row).

A pool's name is unique per host (``node0`` exists on every host); its id is
unique in the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import msgspec
import sqlalchemy as sa
from sqlalchemy import bindparam, delete, func, insert, select, update

from maasd.errors import NotFound, StateConflict
from maasd.store import schema
from maasd.store.base import Repository
from maasd.store.events import event, ins_event
from maasd.store.records import PoolRow

__all__ = ["PoolRepo", "lock_pool"]

_P = schema.pools
_B = schema.buffers

#: A pool's fixed properties (PoolRow's fields): every column but its running totals.
_row_cols = [c for c in _P.c if c.name not in schema.TOTALS]
_sel_pools = select(*_row_cols).where(_P.c.host == bindparam("host")).order_by(_P.c.name)
_sel_all_pools = select(*_row_cols).order_by(_P.c.host, _P.c.name)
_sel_pool = select(*_row_cols).where(_P.c.id == bindparam("p_id"))
# The running totals the ledger keeps on each pool's row (maasd.store.totals).
_sel_all_usage = select(_P.c.id, _P.c.used_bytes, _P.c.buffers)
_sel_pool_usage = _sel_all_usage.where(_P.c.host == bindparam("host"))
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
_lock_pool_name = select(_P.c.name, _P.c.host).where(_P.c.id == bindparam("p_id")).with_for_update()
_del_pool = delete(_P).where(_P.c.id == bindparam("p_id"))
_set_warm = update(_P).where(_P.c.id == bindparam("p_id")).values(warm_bytes=bindparam("warm"))
_set_disk = (
    update(_P)
    .where(_P.c.id == bindparam("p_id"))
    .values(disk_dir=bindparam("disk_dir"), disk_bytes=bindparam("disk_bytes"))
)
_E = schema.events
_sel_deleted = (
    select(_E.c.detail)
    .where(_E.c.kind == "pool_delete", _E.c.detail.in_(bindparam("details", expanding=True)))
    .distinct()
)


def deleted_detail(name: str, host: str) -> str:
    """The ``detail`` of a ``pool_delete`` event: the pool's name and host."""
    return f"{name} on {host}"


_count_pool_buffers = select(func.count()).select_from(_B).where(_B.c.pool_id == bindparam("p_id"))


class PoolRepo(Repository):
    """Adding, listing and deleting the pools of a host."""

    def add_pool(self, row: PoolRow) -> PoolRow:
        """Insert a pool. A taken ``(host, name)`` (or id), or a name that is another pool's
        id (references resolve ids first), raises :class:`StateConflict`."""
        try:
            with self._writing() as conn:
                if conn.execute(select(_P.c.id).where(_P.c.id == row.name)).first() is not None:
                    raise StateConflict(
                        f"{row.name!r} is the id of another pool: it cannot be a name"
                    )
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

    def all_pools(self) -> list[PoolRow]:
        """The pools of every host, by host then name."""
        return [PoolRow(*r) for r in self._read_rows(_sel_all_pools)]

    def pool_row(self, pool_id: str) -> PoolRow | None:
        """The pool with this id, on any host; ``None`` if there is none."""
        row = self._read_first(_sel_pool, {"p_id": pool_id})
        return None if row is None else PoolRow(*row)

    def usage_by_pool(self, host: str | None) -> dict[str, tuple[int, int]]:
        """``{pool_id: (used_bytes, buffers)}`` for every pool of ``host`` (``None``: of every
        host); all states count."""
        if host is None:
            return {r[0]: (r[1], r[2]) for r in self._read_rows(_sel_all_usage)}
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

    def set_pool_warm(self, pool_id: str, warm_bytes: int) -> None:
        """Set a pool's warm stock budget (the one property that follows its configuration)."""
        if self._single_count(_set_warm, {"p_id": pool_id, "warm": warm_bytes}) != 1:
            raise NotFound(f"pool {pool_id} not found")

    def set_pool_disk(self, pool_id: str, disk_dir: str | None, disk_bytes: int) -> None:
        """Set a pool's disk tier (it follows its configuration: it binds no buffer)."""
        params = {"p_id": pool_id, "disk_dir": disk_dir, "disk_bytes": disk_bytes}
        if self._single_count(_set_disk, params) != 1:
            raise NotFound(f"pool {pool_id} not found")

    def delete_pool(self, pool_id: str, *, now: float | None = None) -> None:
        """Delete an empty pool: :class:`NotFound` if unknown, :class:`StateConflict` if it holds buffers."""
        with self._writing() as conn:
            found = conn.execute(_lock_pool_name, {"p_id": pool_id}).first()
            if found is None:
                raise NotFound(f"pool {pool_id} not found")
            n = conn.execute(_count_pool_buffers, {"p_id": pool_id}).scalar_one()
            if n:
                raise StateConflict(f"pool {pool_id} still holds {n} buffer(s)")
            conn.execute(_del_pool, {"p_id": pool_id})
            conn.execute(
                ins_event,
                event(
                    "pool_delete",
                    time.time() if now is None else now,
                    pool_id=pool_id,
                    detail=deleted_detail(found.name, found.host),
                ),
            )

    def deleted_pools(self, host: str, names: Collection[str]) -> set[str]:
        """Which of ``names`` were pools of ``host`` that someone deleted (the audit trail's
        ``pool_delete`` events say so): default pools stay deleted across restarts."""
        if not names:
            return set()
        by_detail = {deleted_detail(n, host): n for n in names}
        rows = self._read_rows(_sel_deleted, {"details": list(by_detail)})
        return {by_detail[r[0]] for r in rows}
