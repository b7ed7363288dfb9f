"""The running totals of a tenant's and a pool's buffers, and the check that they hold.

``tenants.used_bytes``/``buffers`` and ``pools.used_bytes``/``buffers`` are the
bytes and count of their buffers in every state
(:data:`~maasd.store.schema.ACCOUNTED_STATES`). No code writes them: triggers on
``buffers`` (migration 0007) change them in the statement that inserts or deletes a
row, so a total and its rows are never seen apart (in any snapshot, on any host).
A reserve reads them from the rows it locks (:mod:`maasd.store.buffers`): O(1) in
the number of buffers, where it used to sum them.

:meth:`TotalsRepo.check_totals` compares every total with its rows (one statement:
one snapshot) and, told to, repairs one that drifted — under the row's lock, so
that concurrent reserves and releases stay exact. Every migration run ends with it
(:meth:`~maasd.store.Store.upgrade`: each daemon start, ``maasd migrate``): a drift
is a bug, logged as an error, and mended.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

from sqlalchemy import BigInteger, bindparam, cast, func, select, update

from maasd.store import schema
from maasd.store.base import Repository, used

__all__ = ["Drift", "TotalsRepo", "drifts"]

logger = logging.getLogger(__name__)

_T, _P, _B = schema.tenants, schema.pools, schema.buffers
Scope = Literal["tenant", "pool"]


def _counted(column: Any) -> Any:
    """``COUNT(column)`` as a BigInteger (0 for a tenant or pool without buffers)."""
    return cast(func.count(column), BigInteger)


_sel_tenant_check = (
    select(_T.c.id, _T.c.used_bytes, _T.c.buffers, used(_B.c.size_bytes), _counted(_B.c.id))
    .select_from(_T.outerjoin(_B, _B.c.tenant_id == _T.c.id))
    .group_by(_T.c.id, _T.c.used_bytes, _T.c.buffers)
)
_sel_pool_check = (
    select(_P.c.id, _P.c.used_bytes, _P.c.buffers, used(_B.c.size_bytes), _counted(_B.c.id))
    .select_from(_P.outerjoin(_B, _B.c.pool_id == _P.c.id))
    .group_by(_P.c.id, _P.c.used_bytes, _P.c.buffers)
)


def _repair(table: Any, column: Any) -> tuple[Any, Any]:
    """Lock one tenant's (pool's) row, then set its totals to what its rows say."""
    lock = select(table.c.id).where(table.c.id == bindparam("p_id")).with_for_update()
    rows = _B.c.tenant_id if column == "tenant_id" else _B.c.pool_id
    stmt = (
        update(table)
        .where(table.c.id == bindparam("p_id"))
        .values(
            used_bytes=select(used(_B.c.size_bytes)).where(rows == table.c.id).scalar_subquery(),
            buffers=select(func.count())
            .select_from(_B)
            .where(rows == table.c.id)
            .scalar_subquery(),
        )
    )
    return lock, stmt


_REPAIR = {"tenant": _repair(_T, "tenant_id"), "pool": _repair(_P, "pool_id")}


class Drift(NamedTuple):
    """A total that disagrees with its rows: ``(bytes, count)`` stored and counted."""

    scope: Scope
    id: str
    stored: tuple[int, int]
    counted: tuple[int, int]

    def __str__(self) -> str:
        (sb, sn), (cb, cn) = self.stored, self.counted
        return (
            f"{self.scope} {self.id}: its totals say {sb} bytes in {sn} buffers, "
            f"its rows {cb} bytes in {cn}"
        )


def drifts(scope: Scope, rows: Iterable[tuple[str, int, int, int, int]]) -> list[Drift]:
    """Of ``(id, stored bytes, stored count, counted bytes, counted count)`` rows, the
    ones whose totals disagree with their rows, by id.

    >>> drifts("pool", [("a", 10, 1, 10, 1), ("b", 4, 1, 0, 0)])
    [Drift(scope='pool', id='b', stored=(4, 1), counted=(0, 0))]
    """
    found = [
        Drift(scope, i, (int(sb), int(sn)), (int(cb), int(cn)))
        for i, sb, sn, cb, cn in rows
        if (int(sb), int(sn)) != (int(cb), int(cn))
    ]
    return sorted(found, key=lambda d: d.id)


class TotalsRepo(Repository):
    """Checking (and repairing) the running totals against the rows they count."""

    def check_totals(self, *, repair: bool = False) -> list[Drift]:
        """Every tenant's and pool's totals that disagree with their rows (tenants first).

        O(buffers): for a start or a check, not for a request. ``repair``: each one
        found is set to what its rows say, in a transaction that holds its row's lock
        (what every reserve and release of it waits for); the drifts returned are the
        ones found before.
        """
        found = drifts("tenant", self._read_rows(_sel_tenant_check))
        found += drifts("pool", self._read_rows(_sel_pool_check))
        if repair:
            for d in found:
                lock, stmt = _REPAIR[d.scope]
                with self._writing() as conn:
                    if conn.execute(lock, {"p_id": d.id}).first() is not None:
                        conn.execute(stmt, {"p_id": d.id})
        return found

    def mend_totals(self) -> list[Drift]:
        """:meth:`check_totals` with ``repair``, each drift logged as an error (a bug)."""
        found = self.check_totals(repair=True)
        for drift in found:
            logger.error("ledger usage totals drifted, mended: %s", drift)
        return found
