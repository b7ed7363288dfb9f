"""The lookup order across every tier: DRAM → local disk → L2 → miss (docs/operations.md).

Two daemons sharing a PostgreSQL ledger and a Redis L2 (as tests/integration/test_l2.py);
host B's pool has a disk tier. A prefix held in B's DRAM, one on B's disk (and in L2 as
well: the disk answers first), one only in L2 (committed on A), and one nowhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Daemon
from maasd.client import Worker
from pgdb import PG_URL, fresh_pg_database
from redisdb import REDIS_SERVER, RedisServer
from waiting import wait_until

MiB = 1 << 20


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon, Path]]:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server or valkey-server on PATH (apt-get install redis-server)")
    pytest.importorskip("redis", reason="needs the l2 extra (redis-py)")
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    with fresh_pg_database() as url:
        daemons = [
            Daemon(
                tmp_path_factory.mktemp(name),
                env={
                    "MAASD_DB_URL": url,
                    "MAASD_NODE_NAME": name,
                    "MAASD_L2_URL": redis.url,
                    "MAASD_DB_POOL_SIZE": "4",
                    "MAASD_DB_MAX_OVERFLOW": "8",
                },
            )
            for name in ("tier-a", "tier-b")
        ]
        try:
            for d in daemons:
                d.start()
            disk = tmp_path_factory.mktemp("tier-b-disk")
            daemons[1].pool(
                "tiered", 8 * MiB, disk_dir=str(disk), disk_bytes=64 * MiB, prefault=False
            )
            yield daemons[0], daemons[1], disk
        finally:
            for d in daemons:
                d.close()
            redis.stop()


def commit(w: Worker, key: str, data: bytes, pool: str | None = None) -> None:
    m = w.put(key, len(data), pool=pool)
    m.array[: len(data)] = np.frombuffer(data, np.uint8)
    w.commit(m)


def test_a_prefix_is_found_on_each_tier_in_order(hosts: tuple[Daemon, Daemon, Path]) -> None:
    a, b, disk = hosts
    tid, key = a.tenant("tiers", quota_bytes=64 * MiB)
    on_disk, in_l2 = os.urandom(MiB), os.urandom(MiB)
    with Worker(b.socket_path, key) as wb:
        # DRAM: answered from B's memory, no other tier asked.
        commit(wb, "p:dram", os.urandom(MiB), pool="tiered")
        hit = wb.lookup(["p:dram"])
        assert hit is not None
        hit.close()
        # Disk: used once, then evicted from B's DRAM by fillers; it is in L2 too (every
        # commit is written behind), but the disk answers first.
        commit(wb, "p:disk", on_disk, pool="tiered")
        hit = wb.lookup(["p:disk"])
        assert hit is not None
        hit.close()
        # Out of this worker's mapping cache too: an entry a connection holds is evicted
        # last (it would free nothing), and this one must go.
        wb.forget(hit.buffer_id)
        for i in range(9):
            commit(wb, f"p:fill{i}", os.urandom(MiB), pool="tiered")
        wait_until(lambda: b.metric("maasd_disk_demotions_total", pool="tiered") >= 1, timeout=20)
        assert any(f.suffix == ".ent" for f in disk.iterdir())
        l2_hits = b.metric("maasd_l2_lookups_total", outcome="hit")
        hit = wb.lookup(["p:nothing", "p:disk"])
        assert hit is not None
        assert hit.key == "p:disk"
        assert bytes(hit.array[:MiB]) == on_disk
        hit.close()
        assert b.metric("maasd_disk_promotions_total", pool="tiered") == 1
        assert b.metric("maasd_l2_lookups_total", outcome="hit") == l2_hits
    # L2: committed on A only; B restores it from Redis.
    with Worker(a.socket_path, key) as wa:
        commit(wa, "p:l2", in_l2)
    wait_until(lambda: a.metric("maasd_l2_writes_total", outcome="ok") >= 1, timeout=20)
    with Worker(b.socket_path, key) as wb:

        def restored() -> bool:
            found = wb.lookup(["p:l2"])
            if found is None:
                return False
            found.close()
            return True

        wait_until(restored)
        assert b.metric("maasd_l2_lookups_total", outcome="hit") == l2_hits + 1
        assert b.metric("maasd_disk_promotions_total", pool="tiered") == 1
        # Nowhere: a miss, counted once.
        misses = b.metric("maasd_entry_lookups_total", tenant=tid, outcome="miss")
        assert wb.lookup(["p:nowhere"]) is None
        assert b.metric("maasd_entry_lookups_total", tenant=tid, outcome="miss") == misses + 1
