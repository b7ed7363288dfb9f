"""A pool's disk tier through a real daemon and a real directory (docs/operations.md).

Entries that eviction takes out of DRAM are demoted to the pool's ``disk_dir``
(encrypted, a key per entry held in memory), and a socket lookup from another process
promotes them back: the same bytes, a read-only sealed fd, counted as a hit. Release and
tenant deletion erase them; a corrupt file is a miss; a full disk never fails a DRAM op;
a SIGKILL leaves nothing restorable behind; a tenant's disk quota holds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon
from rawentries import (
    FILE_OVERHEAD,
    churn_concurrently,
    connect,
    demote_one,
    disk_files,
    entry_file_bytes,
    entry_files,
    pattern,
    probe,
    put_committed,
    tier_pool,
    wait_written,
)
from sockpeer import lookup, miss
from waiting import wait_until

MiB = 1 << 20
TESTS = Path(__file__).resolve().parents[1]


def test_demote_then_promote_from_another_process(disk_daemon: Daemon, tmp_path: Path) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    tenant_id, key = d.tenant(quota_bytes=64 * MiB)
    data = pattern(MiB, 99)
    r = demote_one(d, key, pool, data, fill=9)
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) == 1, timeout=20)
    wait_written(d, pool)
    assert len(entry_files(disk)) == 1
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="cold") >= 1  # the fillers
    (name,) = entry_files(disk)
    raw = (disk / name).read_bytes()
    assert data[:4096] not in raw  # ciphertext on disk
    hits = d.metric("maasd_entry_lookups_total", tenant=tenant_id, outcome="hit")
    got = probe(d, key, ["nope", "hot"])
    assert got["reply"] == "Found", got
    assert got["key"] == "hot"
    assert got["mode"] == "rdonly"
    assert got["before"] == got["after"] == hashlib.sha256(data).hexdigest()
    assert d.metric("maasd_disk_promotions_total", pool=pool) == 1
    assert d.metric("maasd_entry_lookups_total", tenant=tenant_id, outcome="hit") == hits + 1
    assert d.metric("maasd_entry_lookups_total", tenant=tenant_id, outcome="miss") == 0
    assert d.metric("maasd_disk_read_bytes_total", pool=pool) == len(raw)
    assert d.metric("maasd_disk_write_bytes_total", pool=pool) == len(raw)
    listed = {p["name"]: p for p in d.admin.get("/v1/pools").json()}[pool]
    tier = listed["disk"]
    assert tier["entries"] == 1  # the copy stays on disk
    assert tier["used_bytes"] == MiB
    assert tier["promotions"] == 1
    assert tier["demotions"] == 1
    assert tier["write_bytes"] == tier["read_bytes"] == len(raw)
    assert tier["drops"]["cold"] >= 1
    r.close()


def test_release_and_tenant_delete_erase_the_file(disk_daemon: Daemon, tmp_path: Path) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    tenant_id, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 1), fill=8)
    wait_written(d, pool)
    # Promoted, then released by its owner: the copy on disk goes with it.
    hit, fd = lookup(r, ["hot"])
    os.close(fd)
    assert d.client(key).delete(f"/v1/buffers/{hit.buffer_id}").status_code == 204
    wait_until(lambda: disk_files(disk) == [])
    assert listed_entries(d, pool) == 0
    # Demoted again (a new entry of the key), then its tenant deleted: erased too.
    r.close()
    written = d.metric("maasd_disk_write_bytes_total", pool=pool)
    r = demote_one(d, key, pool, pattern(MiB, 2), fill=8)
    wait_written(d, pool, written)
    r.close()
    assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
    wait_until(lambda: disk_files(disk) == [])
    assert listed_entries(d, pool) == 0


def listed_entries(d: Daemon, pool: str) -> int:
    return int({p["name"]: p for p in d.admin.get("/v1/pools").json()}[pool]["disk"]["entries"])


def test_a_corrupt_file_is_a_miss_and_is_dropped(disk_daemon: Daemon, tmp_path: Path) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 3), fill=8)
    wait_written(d, pool)
    (name,) = disk_files(disk)
    raw = bytearray((disk / name).read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (disk / name).write_bytes(raw)
    miss(r, ["hot"])
    assert disk_files(disk) == []
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="corrupt") == 1
    assert d.healthy()
    put_committed(r, "after", pattern(MiB, 4), pool)  # DRAM still serves
    _, fd = lookup(r, ["after"])
    os.close(fd)
    r.close()


def test_a_full_disk_never_fails_a_dram_operation(disk_daemon: Daemon, tmp_path: Path) -> None:
    d, disk = disk_daemon, tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=False
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        pool = tier_pool(d, disk, disk_bytes=512 * MiB)  # more than the disk has
        _, key = d.tenant(quota_bytes=256 * MiB)
        r = connect(d, key)
        for i in range(24):  # each looked up once: every eviction is worth a write
            put_committed(r, f"e{i}", pattern(MiB, i), pool)
            _, fd = lookup(r, [f"e{i}"])
            os.close(fd)
        wait_until(lambda: d.metric("maasd_disk_drops_total", pool=pool, reason="full") >= 1)
        assert d.healthy()
        r.close()
        assert not [f for f in disk_files(disk) if f.endswith(".tmp")]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_sigkill_during_demotions_leaves_nothing_behind(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    d, disk = fresh_daemon.start(), tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB, disk_bytes=256 * MiB)
    _, key = d.tenant(quota_bytes=256 * MiB)
    r = connect(d, key)
    for i in range(40):
        put_committed(r, f"e{i}", pattern(MiB, i), pool)
        _, fd = lookup(r, [f"e{i}"])
        os.close(fd)
    d.kill()  # writes in flight, files being renamed: whatever the moment
    d.start()
    assert disk_files(disk) == []  # the keys died: nothing is restorable, nothing left
    listed = {p["name"]: p for p in d.admin.get("/v1/pools").json()}[pool]
    assert listed["disk"]["entries"] == 0
    assert listed["used_bytes"] == 0  # no accounting leak in DRAM either
    r2 = connect(d, key)
    miss(r2, ["e0"])
    r2.close()


def test_disk_quota_holds_under_concurrent_demotions(disk_daemon: Daemon, tmp_path: Path) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=16 * MiB, disk_bytes=256 * MiB)
    # disk_quota_factor 4: this tenant may hold 4 * 6 MiB = 24 MiB on disk (and each of
    # the three writers holds at most one staged MiB of its DRAM quota at a time).
    _, key = d.tenant(quota_bytes=6 * MiB)
    seen: list[int] = []
    churn_concurrently(
        d, key, pool, entries=16, demotions=25, sample=lambda: seen.append(entry_file_bytes(disk))
    )
    assert max(seen) <= 24 * (MiB + FILE_OVERHEAD)
    assert int(d.metric("maasd_disk_bytes", pool=pool)) <= 24 * MiB
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="evicted") >= 1


def maasctl(d: Daemon, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env.update(MAASD_URL=d.url, MAASD_ADMIN_KEY=d.admin_key, COLUMNS="220", NO_COLOR="1")
    env["PYTHONPATH"] = str(TESTS.parent)
    p = subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_maasctl_creates_a_tiered_pool_and_status_shows_the_tier(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    d, disk = disk_daemon, tmp_path / "cli-disk"
    out = maasctl(
        d, "pools", "create", "tiered", "--node", "0", "--capacity", "8MiB",
        "--disk", "64MiB", "--disk-dir", str(disk), "--no-prefault",
    )  # fmt: skip
    assert "tiered" in out
    assert disk.is_dir()
    _, key = d.tenant(quota_bytes=64 * MiB)
    demote_one(d, key, "tiered", pattern(MiB, 7), fill=9).close()
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool="tiered") == 1, timeout=20)
    status = maasctl(d, "status")
    assert "Disk tiers" in status
    assert "cold" in status  # the fillers, dropped by the policy
    tier_table = status[status.index("Disk tiers") :]
    row = next(line for line in tier_table.splitlines() if "tiered" in line)
    assert "1 MiB" in row, row


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"disk_dir": "relative/dir", "disk_bytes": MiB}, 400),
        ({"disk_dir": "/tmp/x"}, 400),  # a directory without bytes
        ({"disk_bytes": -1}, 400),
        ({"disk_bytes": "lots"}, 400),
        ({"disk_dir": "/proc/maasd-cannot", "disk_bytes": MiB}, 400),
    ],
)
def test_bad_disk_tiers_are_refused_and_nothing_changes(
    daemon: Daemon, fields: dict[str, Any], status: int
) -> None:
    before = daemon.admin.get("/v1/pools").json()
    body = {"name": "bad-tier", "numa_node": 0, "capacity_bytes": 4 * MiB, **fields}
    r = daemon.admin.post("/v1/pools", json=body)
    assert r.status_code == status, r.text
    assert daemon.admin.get("/v1/pools").json() == before
    assert daemon.healthy()


def test_two_pools_cannot_share_a_disk_dir(daemon: Daemon, tmp_path: Path) -> None:
    shared = str(tmp_path / "one-dir")
    daemon.pool("first-tier", 4 * MiB, disk_dir=shared, disk_bytes=MiB)
    r = daemon.admin.post(
        "/v1/pools",
        json={"name": "second-tier", "numa_node": 0, "capacity_bytes": 4 * MiB,
              "disk_dir": shared, "disk_bytes": MiB},
    )  # fmt: skip
    assert r.status_code == 409, r.text
    assert daemon.admin.delete("/v1/pools/first-tier").status_code == 204


def test_a_configured_tier_is_made_and_emptied_at_start(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    disk = tmp_path / "conf-disk"
    disk.mkdir()
    (disk / "0123.ent").write_bytes(b"a past run's ciphertext")
    (disk / ".0123.ent.tmp").write_bytes(b"torn")
    (disk / "notes.txt").write_text("not the daemon's")
    config = tmp_path / "maasd.toml"
    config.write_text(
        "[[pools]]\n"
        'name = "conf"\nnuma_node = 0\ncapacity_bytes = "8MiB"\nprefault = false\n'
        f'disk_dir = "{disk}"\ndisk_bytes = "32MiB"\n'
    )
    fresh_daemon.env["MAASD_CONFIG"] = str(config)
    d = fresh_daemon.start()
    (pool,) = [p for p in d.admin.get("/v1/pools").json() if p["name"] == "conf"]
    assert pool["disk_dir"] == str(disk)
    assert pool["disk_bytes"] == 32 * MiB
    assert pool["disk"]["entries"] == 0
    assert disk_files(disk) == ["notes.txt"]
