"""The lookup order across every tier: DRAM → local disk → L2 → miss (docs/operations.md).

Two daemons sharing a PostgreSQL ledger and a Redis L2 (tests/l2hosts.py, as test_l2.py);
host B's pool has a disk tier. A prefix held in B's DRAM, one on B's disk (and in L2 as
well: the disk answers first), one only in L2 (committed on A), and one nowhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from l2hosts import SMALL_DB_POOL, commit, two_hosts
from maasd.client import Worker
from redisdb import RedisServer
from waiting import wait_until

MiB = 1 << 20


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, l2_ledger_url: str, redis_server: RedisServer
) -> Iterator[tuple[Daemon, Daemon, Path]]:
    names = ("tier-a", "tier-b")
    with two_hosts(tmp_path_factory, names, l2_ledger_url, redis_server, SMALL_DB_POOL) as (a, b):
        disk = tmp_path_factory.mktemp("tier-b-disk")
        b.pool("tiered", 8 * MiB, disk_dir=str(disk), disk_bytes=64 * MiB, prefault=False)
        yield a, b, disk


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
        # A demotion is counted when admitted, its file written behind it; an entry is
        # promotable once written (counted in the write bytes after): till then a lookup
        # finds it where it still is. On a loaded host the writer may lag: wait for all.
        wait_until(
            lambda: (
                b.metric("maasd_disk_write_bytes_total", pool="tiered")
                >= MiB * b.metric("maasd_disk_demotions_total", pool="tiered")
            ),
            timeout=60,
        )
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
