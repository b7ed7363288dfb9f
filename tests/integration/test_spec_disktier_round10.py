"""SPEC §12 (Tiers: DRAM, local disk, L2), checked word for word through a real daemon.

Each test quotes the sentence of SPEC §12 it checks. They use the real entry points
only: the REST API (pools, tenants, buffers, usage, metrics) and the worker socket
(put / commit / lookup frames), through the helpers of ``tests/rawentries.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from maasd.protocol import Detach, Lookup, Ok
from rawentries import (
    FILE_OVERHEAD,
    commit,
    connect,
    demote_one,
    entry_file_bytes,
    entry_files,
    pattern,
    put,
    put_committed,
    tier_pool,
    wait_written,
    write,
)
from sockpeer import lookup, miss
from waiting import wait_until

MiB = 1 << 20

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 1, 2, 4, 8
F_SEAL_FUTURE_WRITE = 16


def _usage(d: Daemon, key: str) -> dict:
    with d.client(key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        return dict(r.json())


def _pool(d: Daemon, name: str) -> dict:
    return {p["name"]: p for p in d.admin.get("/v1/pools").json()}[name]


def test_a_promotion_is_a_fresh_sealed_memfd_on_the_pools_node_counted_like_any_entry(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12: "a socket `lookup` that misses DRAM and hits disk promotes the entry into a
    fresh sealed memfd on the pool's node (counted like any entry) and answers it as a hit"."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    node = _pool(d, pool)["numa_node"]
    _, key = d.tenant(quota_bytes=64 * MiB)
    data = pattern(MiB, 42)
    r = connect(d, key)
    original = put_committed(r, "hot", data, pool)
    found, fd = lookup(r, ["hot"])
    os.close(fd)
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    for i in range(9):
        put_committed(r, f"filler-{i}", pattern(MiB, 100 + i), pool)
    wait_written(d, pool)
    with d.client(key) as c:
        ids = {b["id"] for b in c.get("/v1/buffers").json()}
    assert original not in ids  # out of DRAM: on disk only
    used_before = _usage(d, key)["used_bytes"]
    bufs_before = _usage(d, key)["buffers"]

    r2 = connect(d, key)  # another connection: nothing held from before
    hit, fd = lookup(r2, ["hot"])
    try:
        assert hit.key == "hot"
        assert hit.buffer_id != original  # a fresh buffer
        assert hit.numa_node == node  # on the pool's node
        assert hit.size_bytes == MiB
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")  # a memfd
        seals = fcntl.fcntl(fd, F_GET_SEALS)
        for s in (F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW):
            assert seals & s, f"seals {seals:#x} lack {s:#x}"
        assert seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE), f"seals {seals:#x}: writable"
        assert os.pread(fd, MiB, 0) == data
        # counted like any entry: the tenant's use and buffers, and the pool's
        u = _usage(d, key)
        assert u["used_bytes"] >= used_before  # (an eviction may have made room)
        with d.client(key) as c:
            mine = {b["id"]: b for b in c.get("/v1/buffers").json()}
        assert hit.buffer_id in mine, "the promoted entry is not listed as the tenant's buffer"
        assert mine[hit.buffer_id]["size_bytes"] == MiB
        assert mine[hit.buffer_id]["pool_id"] == _pool(d, pool)["id"]
        assert u["used_bytes"] == sum(b["size_bytes"] for b in mine.values())
        assert u["buffers"] == len(mine)
        assert bufs_before >= 1
        assert _pool(d, pool)["used_bytes"] <= _pool(d, pool)["capacity_bytes"]
    finally:
        os.close(fd)
        r.close()
        r2.close()


def test_a_promotion_that_dram_cannot_place_is_a_miss_and_never_overcommits(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 "(counted like any entry)" + invariant 1: a promotion into a pool that
    non-evictable buffers fill is a miss (404 frame, no fd); no over-commit."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 5), fill=9)
    wait_written(d, pool)
    r.close()
    with d.client(key) as c:  # fill the pool with non-evictable memory (evicts the fillers)
        res = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 8 * MiB})
        assert res.status_code == 201, res.text
    r2 = connect(d, key)
    miss(r2, ["hot"])
    p = _pool(d, pool)
    assert p["used_bytes"] <= p["capacity_bytes"]
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="unplaced") >= 1
    assert d.healthy()
    r2.close()


def test_a_demoted_entry_does_not_outlive_its_lease(disk_daemon: Daemon, tmp_path: Path) -> None:
    """§1/§5 + §12: a buffer lives "until their lease ends"; lease expiry is a release
    (invariant 4), and §12: "Release, eviction and tenant deletion drop the key ... the
    file is then unlinked". An entry put with ``ttl_s`` 4 and demoted before that must not
    be promoted back (nor its file kept) once its lease is over."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = connect(d, key)
    reply, fd = put(r, "short-lived", MiB, pool=pool, ttl_s=4)
    write(fd, pattern(MiB, 77))
    os.close(fd)
    commit(r, reply.buffer_id)
    t0 = time.monotonic()
    found, fd = lookup(r, ["short-lived"])  # a second use: worth a disk write
    os.close(fd)
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    for i in range(9):
        put_committed(r, f"filler-{i}", pattern(MiB, 200 + i), pool)
    wait_written(d, pool)
    assert time.monotonic() - t0 < 4, "too slow to demote before the lease ended"
    assert len(entry_files(disk)) == 1
    time.sleep(max(0.0, t0 + 4 + 3 - time.monotonic()))  # the lease is over (+ a reaper pass)
    r2 = connect(d, key)
    reply2, fds = r2.call(Lookup(keys=["short-lived"]))
    for f in fds:
        os.close(f)
    assert fds == [], f"an entry whose lease ended came back from disk: {reply2}"
    wait_until(lambda: entry_files(disk) == [], timeout=10)
    r.close()
    r2.close()


def test_a_pools_disk_bytes_bound_the_tier(disk_daemon: Daemon, tmp_path: Path) -> None:
    """§12: "Disk bytes are bounded per pool" (``disk_bytes``), the tenant's disk quota
    being far larger; evicted files are unlinked."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB, disk_bytes=4 * MiB)
    _, key = d.tenant(quota_bytes=256 * MiB)  # disk quota 4x: 1 GiB, not the bound
    r = connect(d, key)
    seen: list[int] = []
    for i in range(24):  # each looked up once: every eviction is worth a write
        put_committed(r, f"e{i}", pattern(MiB, 300 + i), pool)
        _, fd = lookup(r, [f"e{i}"])
        os.close(fd)
        seen.append(entry_file_bytes(disk))
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) >= 8, timeout=30)
    time.sleep(0.5)
    seen.append(entry_file_bytes(disk))
    assert max(seen) <= 4 * (MiB + FILE_OVERHEAD), seen
    assert d.metric("maasd_disk_bytes", pool=pool) <= 4 * MiB
    assert len(entry_files(disk)) <= 4
    assert _pool(d, pool)["disk"]["used_bytes"] <= 4 * MiB
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="evicted") >= 1
    r.close()


def test_a_failing_disk_never_fails_a_dram_operation(disk_daemon: Daemon, tmp_path: Path) -> None:
    """§12: "a full or failing disk never fails a DRAM operation": the tier's directory
    taken away under the daemon (its files gone, then a file in its place): an entry
    whose file is gone is a plain miss (404 frame), and puts, commits, lookups and
    releases in DRAM all still succeed; /healthz stays 200."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 9), fill=9)
    wait_written(d, pool)
    shutil.rmtree(disk)  # the disk "fails": its entries are gone
    disk.write_bytes(b"not a directory")  # and nothing can be written there any more
    try:
        reply, fds = r.call(Lookup(keys=["hot"]))
        for f in fds:
            os.close(f)
        assert (fds, getattr(reply, "status", None)) == ([], 404), reply
        for i in range(16):  # evictions that would demote: every write fails
            bid = put_committed(r, f"after-{i}", pattern(MiB, 400 + i), pool)
            hit, fd = lookup(r, [f"after-{i}"])
            os.close(fd)
            assert hit.buffer_id == bid
            assert r.call(Detach(buffer_id=bid)) == (Ok(), [])
        with d.client(key) as c:
            res = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB})
            assert res.status_code == 201, res.text
            assert c.delete(f"/v1/buffers/{res.json()['id']}").status_code == 204
        wait_until(
            lambda: d.metric("maasd_disk_drops_total", pool=pool, reason="io_error") >= 1,
            timeout=20,
        )
        assert d.healthy()
    finally:
        r.close()
        disk.unlink()


@contextlib.contextmanager
def _read_only_tier(d: Daemon, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A tier on a tmpfs of its own (which ``_remount`` can make read-only), unmounted after."""
    disk = tmp_path / "rodisk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk, tier_pool(d, disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _remount(disk: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True)


def test_a_disk_gone_read_only_never_fails_a_release_of_a_promoted_entry(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12: "a full or failing disk never fails a DRAM operation" + §4 "DELETE
    /v1/buffers/{id} ... → 204" + invariant 7 (no 5xx): the tier's filesystem goes
    read-only (what ext4/xfs do on an I/O error) while a promoted entry's copy is on it;
    releasing that DRAM entry still answers 204."""
    d = disk_daemon
    with _read_only_tier(d, tmp_path) as (disk, pool):
        _, key = d.tenant(quota_bytes=64 * MiB)
        r = demote_one(d, key, pool, pattern(MiB, 11), fill=9)
        wait_written(d, pool)
        hit, fd = lookup(r, ["hot"])  # promoted: its copy stays on disk
        os.close(fd)
        r.close()
        _remount(disk, "ro")
        with d.client(key) as c:
            res = c.delete(f"/v1/buffers/{hit.buffer_id}")
            after = c.get(f"/v1/buffers/{hit.buffer_id}").status_code
            ids = {b["id"] for b in c.get("/v1/buffers").json()}
        assert d.healthy()
        assert (res.status_code, after, hit.buffer_id in ids) == (204, 404, False), res.text


def test_a_disk_gone_read_only_never_fails_a_tenant_delete(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12: "a full or failing disk never fails a DRAM operation" + §4 "DELETE
    /v1/tenants/{id} ... → 204 (never a half-done 409)": the tenant's entry is on a tier
    whose filesystem went read-only; deleting the tenant still answers 204 and its DRAM
    buffers are gone."""
    d = disk_daemon
    with _read_only_tier(d, tmp_path) as (disk, pool):
        tenant_id, key = d.tenant(quota_bytes=64 * MiB)
        r = demote_one(d, key, pool, pattern(MiB, 12), fill=9)
        wait_written(d, pool)
        r.close()
        _remount(disk, "ro")
        res = d.admin.delete(f"/v1/tenants/{tenant_id}")
        gone = d.admin.get(f"/v1/tenants/{tenant_id}").status_code
        used = _pool(d, pool)["used_bytes"]
        assert d.healthy()
        assert (res.status_code, gone, used) == (204, 404, 0), res.text


def test_each_entry_on_disk_is_encrypted_with_a_key_of_its_own(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12: "Each entry on disk is encrypted with a key of its own": two entries of the
    same bytes give two unrelated files, neither holding the plaintext."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB)
    _, key = d.tenant(quota_bytes=64 * MiB)
    data = bytes(MiB)  # zeros: a keystream shows through at once
    r = connect(d, key)
    for k in ("twin-a", "twin-b"):
        put_committed(r, k, data, pool)
        found, fd = lookup(r, [k])
        os.close(fd)
        assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    for i in range(9):
        put_committed(r, f"filler-{i}", pattern(MiB, 500 + i), pool)
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) >= 2, timeout=20)
    wait_until(lambda: len(entry_files(disk)) == 2, timeout=20)
    a, b = ((disk / n).read_bytes() for n in entry_files(disk))
    assert bytes(4096) not in a
    assert bytes(4096) not in b
    assert a[:64] != b[:64]  # another nonce and keystream
    assert a[-16:] != b[-16:]  # another tag
    r.close()
