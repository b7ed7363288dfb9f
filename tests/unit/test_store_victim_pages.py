"""An evicting reserve reads the candidates a page at a time, only as many as its victims
need: O(victims), not O(evictable rows) — counted in statements read, not in time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger import buf, make_pool, make_tenant, reserve_live
from maasd.store import Store
from maasd.store import buffers as repo

pytest_plugins = ("ledger",)


class Reads:
    """How many candidate pages (the reserve's one paged query) a store read."""

    def __init__(self) -> None:
        self.pages = 0


@pytest.fixture
def reads(store: Store) -> Iterator[Reads]:
    seen = Reads()
    marker = "LIMIT"

    def after(*event: Any) -> None:  # conn, cursor, statement, parameters, context, many
        statement = str(event[2])
        if statement.lstrip().startswith("SELECT") and marker in statement:
            seen.pages += 1

    sa.event.listen(store.engine, "after_cursor_execute", after)
    yield seen
    sa.event.remove(store.engine, "after_cursor_execute", after)


def test_one_victim_among_hundreds_reads_one_page(store: Store, reads: Reads) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    rows = [reserve_live(store, buf(t, pool, 10, evictable=True)) for _ in range(5 * repo._PAGE)]
    store.tenants.update_tenant(t.id, max_buffers=len(rows))
    reads.pages = 0
    victims = store.reserves.begin_reserve(buf(t, pool, 10))
    assert [v.id for v in victims] == [rows[0].id]  # the least recently used
    assert reads.pages == 1


def test_victims_beyond_a_page_read_the_next_pages_in_lru_order(store: Store, reads: Reads) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=100 * 10)
    rows = [reserve_live(store, buf(t, pool, 10, evictable=True)) for _ in range(100)]
    need = repo._PAGE + 3  # a shortfall of that many buffers' bytes
    reads.pages = 0
    victims = store.reserves.begin_reserve(buf(t, pool, need * 10))
    assert [v.id for v in victims] == [r.id for r in rows[:need]]
    assert reads.pages == 2


def test_held_ones_go_last_yet_only_as_far_as_needed(store: Store, reads: Reads) -> None:
    pool, t = make_pool(store, capacity=1 << 30), make_tenant(store, quota=1 << 30)
    rows = [reserve_live(store, buf(t, pool, 10, evictable=True)) for _ in range(3 * repo._PAGE)]
    store.tenants.update_tenant(t.id, max_buffers=len(rows))
    held = {r.id for r in rows[:5]}  # the five oldest are attached somewhere
    reads.pages = 0
    victims = store.reserves.begin_reserve(buf(t, pool, 10), prefer_not=held)
    assert [v.id for v in victims] == [rows[5].id]
    assert reads.pages == 1
    # when only held ones are left, they are taken after all (in LRU order)
    store.reserves.finish_release(victims[0].id, "evict", record=False)
    store.reserves.finish_release(reads_row(store, t.id), "reserve_failed")
    store.tenants.update_tenant(t.id, max_buffers=len(rows) - 1 - 2)  # 3 over the cap
    victims = store.reserves.begin_reserve(buf(t, pool, 10), prefer_not={r.id for r in rows})
    assert [v.id for v in victims] == [r.id for r in rows if r.id != rows[5].id][:3]


def reads_row(store: Store, tenant_id: str) -> str:
    """The id of the tenant's one buffer still reserving."""
    (row,) = store.buffers.buffers(tenant_id=tenant_id, states=["reserving"])
    return row.id
