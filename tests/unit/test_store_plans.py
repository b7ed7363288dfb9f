"""The ledger's hot queries read an index in the order they need (SQLite's query plans).

An eviction scan must cost O(victims), not O(entries): the candidates come off an
index already in least-recently-used order, never sorted in a temporary B-tree;
the reserve reads the tenant's and the pool's usage from their rows (running totals),
never summed over the buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from maasd.store import Store
from maasd.store import buffers as repo

PARAMS = {"p_tenant": "t", "p_pool": "p", "p_host": "h", "p_key": "k"}


def plan(engine: sa.Engine, stmt: sa.Select) -> list[str]:
    compiled = stmt.compile(engine)
    assert compiled.positiontup is not None
    args = tuple(PARAMS.get(k, compiled.params.get(k)) for k in compiled.positiontup)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", args).all()
    return [str(r[3]) for r in rows]


@pytest.fixture
def engine(tmp_path: Path) -> sa.Engine:
    url = f"sqlite:///{tmp_path / 'maasd.db'}"
    store = Store(url)
    store.upgrade()  # the migrations' indexes, as a daemon's ledger has them
    store.dispose()
    return sa.create_engine(url)


@pytest.mark.parametrize("name", ["_sel_cand_tenant", "_sel_cand_pool"])
def test_eviction_candidates_come_off_an_index_in_lru_order(engine: sa.Engine, name: str) -> None:
    steps = plan(engine, getattr(repo, name))
    assert not any("TEMP B-TREE" in s for s in steps), steps
    assert any("last_used_at" in s for s in steps), steps


@pytest.mark.parametrize("name", ["_lock_tenant_totals", "_lock_pool_totals"])
def test_the_reserve_reads_its_totals_by_key_never_over_the_buffers(
    engine: sa.Engine, name: str
) -> None:
    """O(1) in the buffers: the tenant's and the pool's row by id (their running totals),
    and the key check by the unique index on (tenant, host, key) — no sum, no scan."""
    steps = plan(engine, getattr(repo, name))
    assert steps, steps
    assert not any(s.startswith("SCAN") for s in steps), steps
    on_buffers = [s for s in steps if "buffers" in s]
    assert all(
        "uq_buffers_tenant_id_host_key (tenant_id=? AND host=? AND key=?)" in s for s in on_buffers
    ), steps
    assert len(on_buffers) == (1 if name == "_lock_pool_totals" else 0), steps
