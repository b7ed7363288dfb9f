"""Which evictable buffers to release so that a reserve fits: a pure function.

A reserve may be short of the tenant's quota, of the tenant's buffer count
(``max_buffers``), of the pool's capacity, or of several. The candidates are
the **evictable, live** buffers that could help — the tenant's own (any pool)
and the pool's (any tenant) — least recently used first. :func:`choose_victims`
walks them in that order and takes each one that frees something still short,
until every shortfall is closed:

* a candidate that frees nothing still short is skipped (it stays): one of the
  tenant's own frees quota bytes and one buffer of its count, one in the pool
  frees capacity;
* as soon as every shortfall is closed, nothing more is taken;
* if they cannot be closed, ``unmet`` says which one (quota, then count, then
  capacity), and the caller changes nothing.

Taking every helpful candidate in order is exact for the question "can it
fit?": while a shortfall is open, every candidate that could reduce it is
taken, so the walk fails only if all of them together are not enough.

>>> c = [Candidate("a", "t", "p", 10), Candidate("b", "u", "q", 10), Candidate("c", "t", "q", 5)]
>>> choose_victims(c, tenant_id="t", pool_id="p", quota_short=12, capacity_short=0).ids
('a', 'c')
>>> choose_victims(c, tenant_id="t", pool_id="p", quota_short=16, capacity_short=0).unmet
'quota'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

__all__ = ["Candidate", "Victims", "choose_victims"]


class Candidate(NamedTuple):
    """An evictable live buffer, as the ledger lists it (LRU order is the caller's)."""

    id: str
    tenant_id: str
    pool_id: str
    size_bytes: int


class Victims(NamedTuple):
    """The outcome: the victims in LRU order, what they free, or which shortfall stays open.

    ``freed_quota``/``freed_capacity`` count the bytes the chosen victims give
    back to the tenant's quota and to the pool (a victim of both counts in both).
    When ``unmet`` is set the caller must evict nothing.
    """

    ids: tuple[str, ...]
    freed_quota: int
    freed_capacity: int
    unmet: Literal["quota", "count", "capacity"] | None


def choose_victims(
    candidates: Iterable[Candidate],
    *,
    tenant_id: str,
    pool_id: str,
    quota_short: int,
    capacity_short: int,
    count_short: int = 0,
) -> Victims:
    """Choose victims among ``candidates`` (least recently used first) for every shortfall.

    ``quota_short``/``capacity_short`` are the bytes missing and ``count_short``
    the buffers over the tenant's cap (≤ 0: none missing) for the reserve of
    ``tenant_id`` in ``pool_id``.
    """
    need_t, need_p, need_c = quota_short, capacity_short, count_short
    chosen: list[str] = []
    freed_t = freed_p = 0
    if need_t > 0 or need_p > 0 or need_c > 0:
        for c in candidates:
            mine, here = c.tenant_id == tenant_id, c.pool_id == pool_id
            if not (((need_t > 0 or need_c > 0) and mine) or (need_p > 0 and here)):
                continue  # would free nothing that is short: leave it alone
            chosen.append(c.id)
            if mine:
                need_t -= c.size_bytes
                need_c -= 1
                freed_t += c.size_bytes
            if here:
                need_p -= c.size_bytes
                freed_p += c.size_bytes
            if need_t <= 0 and need_p <= 0 and need_c <= 0:
                break
    unmet: Literal["quota", "count", "capacity"] | None = (
        "quota" if need_t > 0 else "count" if need_c > 0 else "capacity" if need_p > 0 else None
    )
    return Victims(tuple(chosen), freed_t, freed_p, unmet)
