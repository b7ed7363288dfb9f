"""Attacks on two changes: a spill filesystem not mounted at start (SPEC §2 invariant 6,
``maasd.core.spillfs``) and the REST keep-alive of ``http_keepalive_s`` against the
connection cap (invariant 9, ``maasd.api.server``).

A spill "disk" is a tmpfs bind-mounted on the spill directory (as in
``test_spill_unmounted.py``): unmounting it hides its checkpoint files from the daemon, as
a disk that fstab failed to mount does. After every restart the ledger must equal the
live buffers (:func:`recovered.ledger_totals`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from pgdb import PG_URL, fresh_pg_database
from rawentries import connect, pattern, put_committed
from recovered import ledger_totals, read_buffer, spill_ids, write_buffer
from sockpeer import lookup, miss
from spilldisk import Disk

MiB = 1 << 20

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


@pytest.fixture
def disks() -> Iterator[list[Disk]]:
    made: list[Disk] = []
    yield made
    for disk in made:
        disk.close()


def new_disk(disks: list[Disk], base: Path) -> Disk:
    disk = Disk(base)
    disks.append(disk)
    return disk


def refused(d: Daemon) -> str:
    """What a start that must stop said (its own part of the log): one line, no traceback."""
    before = d.log_path.stat().st_size if d.log_path.exists() else 0
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    out = d.log_path.read_bytes()[before:].decode(errors="replace")
    assert "Traceback" not in out, out
    assert "Error: cannot start: " in out, out
    return out


def buffer_in(d: Daemon, key: str, pool: str, data: bytes) -> str:
    """A buffer of ``pool`` written with ``data`` and checkpointed: its id."""
    with d.client(key) as c:
        r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": len(data), "ttl_s": 3600})
        assert r.status_code == 201, r.text
        bid = str(r.json()["id"])
        write_buffer(d, key, bid, data)
        assert c.post(f"/v1/buffers/{bid}/checkpoint").status_code == 200
    return bid


def entry_bytes(d: Daemon, key: str, entry_key: str, size: int) -> bytes:
    r = connect(d, key)
    try:
        _, fd = lookup(r, [entry_key])
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            data = bytes(mm)
        os.close(fd)
        return data
    finally:
        r.close()


def entry_missing(d: Daemon, key: str, entry_key: str) -> None:
    r = connect(d, key)
    try:
        miss(r, [entry_key])
    finally:
        r.close()


def back_intact(d: Daemon, key: str, bid: str, data: bytes, total: int | None = None) -> None:
    """Start the daemon: the buffer ``bid`` is back with ``data``, the ledger adds up
    (to ``total`` bytes, when given); then a graceful stop."""
    d.start()
    assert read_buffer(d, key, bid) == data
    counted = ledger_totals(d)
    assert total is None or counted == total, (counted, total)
    assert d.stop() == 0, d.log()


def gone(d: Daemon, key: str, bid: str) -> bool:
    with d.client(key) as c:
        return c.get(f"/v1/buffers/{bid}").status_code == 404


# --- 1. a spill filesystem not mounted at start ------------------------------------------


@root_only
def test_one_pool_without_its_disk_and_one_with_it(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """Pool ``pa`` spills to a disk that is not mounted at the next start, ``pb`` to its
    default dir. The refused start loses neither's data; the ``--release-lost-checkpoints``
    start releases ``pa``'s buffer and entry only, and ``pb``'s come back with their bytes."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    d.pool("pb", 16 * MiB, persistence="persistent")
    pb_spill = d.data_dir / "spill" / "pb"
    _, key = d.tenant("two", 64 * MiB)
    a_buf = buffer_in(d, key, "pa", b"\x0a" * MiB)
    b_buf = buffer_in(d, key, "pb", b"\x0b" * MiB)
    r = connect(d, key)
    put_committed(r, "ent-a", pattern(MiB, 1), "pa")
    put_committed(r, "ent-b", pattern(MiB, 2), "pb")
    r.close()
    assert d.stop() == 0, d.log()  # a graceful stop checkpoints the entries too
    a_files, b_files = spill_ids(disk.spill), spill_ids(pb_spill)
    assert len(a_files) == len(b_files) == 2
    disk.umount()

    out = refused(d)
    assert f"spill directory {disk.spill} is on another filesystem" in out
    assert str(pb_spill) not in out
    assert spill_ids(disk.store) == a_files
    assert spill_ids(pb_spill) == b_files

    d.args = ["--release-lost-checkpoints"]
    d.start()
    assert gone(d, key, a_buf)
    entry_missing(d, key, "ent-a")
    assert read_buffer(d, key, b_buf) == b"\x0b" * MiB
    assert entry_bytes(d, key, "ent-b", MiB) == pattern(MiB, 2)
    assert ledger_totals(d) == 2 * MiB
    with d.client(key) as c:
        assert c.get("/v1/usage").json()["used_bytes"] == 2 * MiB
    d.kill()

    d.args = []
    disk.mount()  # the disk found again: its files are orphans now
    d.start()
    assert spill_ids(disk.store) == []
    assert read_buffer(d, key, b_buf) == b"\x0b" * MiB
    assert entry_bytes(d, key, "ent-b", MiB) == pattern(MiB, 2)
    assert ledger_totals(d) == 2 * MiB
    assert d.stop() == 0, d.log()


@root_only
def test_a_spill_dir_that_is_a_symlink_to_the_mount_point(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    disk = new_disk(disks, tmp_path / "a")
    link = tmp_path / "spill-link"
    link.symlink_to(disk.spill)
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(link))
    _, key = d.tenant("link", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x5a" * MiB)
    d.kill()
    disk.umount()

    out = refused(d)
    assert "is on another filesystem" in out
    assert spill_ids(disk.store) == [bid]

    disk.mount()
    d.args = ["--release-lost-checkpoints"]  # with the disk there, nothing is lost
    back_intact(d, key, bid, b"\x5a" * MiB)


@root_only
def test_a_spill_dir_symlink_repointed_elsewhere_while_down(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The configured spill dir now leads to another filesystem that holds none of its
    checkpoints: the spill directory the ledger names is on another filesystem, so the
    start stops, releasing nothing (docs/operations.md), as for a mount missing."""
    disk = new_disk(disks, tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"  # the root filesystem of the test's tmp dir
    elsewhere.mkdir()
    link = tmp_path / "spill-link"
    link.symlink_to(disk.spill)
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(link))
    _, key = d.tenant("repointed", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x3c" * MiB)
    d.kill()
    link.unlink()
    link.symlink_to(elsewhere)

    out = refused(d)
    assert f"spill directory {link} is on another filesystem" in out
    assert spill_ids(disk.spill) == [bid]

    link.unlink()
    link.symlink_to(disk.spill)
    back_intact(d, key, bid, b"\x3c" * MiB)


@root_only
def test_a_spill_dir_replaced_by_a_symlink_elsewhere_while_down(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The mount point itself replaced by a symlink to an empty directory of another
    filesystem: the start stops, releasing nothing."""
    disk = new_disk(disks, tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("replaced", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x4d" * MiB)
    d.kill()
    disk.umount()
    disk.spill.rmdir()
    disk.spill.symlink_to(elsewhere)

    out = refused(d)
    assert f"spill directory {disk.spill} is on another filesystem" in out
    assert spill_ids(disk.store) == [bid]

    disk.spill.unlink()
    disk.spill.mkdir()
    disk.mount()
    back_intact(d, key, bid, b"\x4d" * MiB)


#: Root without the capabilities that override file modes: the daemon as its own user
#: meets a directory it may not read.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@root_only
def test_a_spill_disk_mounted_with_a_root_the_daemon_cannot_read(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The disk comes back owned by another user, mode 0700 (a chown gone wrong, a fresh
    filesystem): the checkpoints look missing on the same filesystem. The start stops,
    releasing nothing, and says why in one line; readable again, the buffer comes back.
    ``--release-lost-checkpoints`` then releases it and the start goes on (no traceback)."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon
    d.wrapper = NO_DAC
    d.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("unreadable", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x6e" * MiB)
    d.kill()
    owner = disk.spill.stat()
    os.chown(disk.spill, 65534, 65534)
    os.chmod(disk.spill, 0o700)

    out = refused(d)
    assert f"spill directory {disk.spill} cannot be read by the daemon" in out
    assert "Permission denied" in out
    assert spill_ids(disk.store) == [bid]

    os.chown(disk.spill, owner.st_uid, owner.st_gid)
    d.start()
    assert read_buffer(d, key, bid) == b"\x6e" * MiB
    assert ledger_totals(d) == MiB
    d.kill()

    os.chown(disk.spill, 65534, 65534)
    d.args = ["--release-lost-checkpoints"]
    before = d.log_path.stat().st_size
    d.start()
    assert gone(d, key, bid)
    assert ledger_totals(d) == 0
    assert "Traceback" not in d.log_path.read_bytes()[before:].decode(errors="replace")
    assert d.stop() == 0, d.log()


@root_only
def test_checkpoint_files_the_daemon_cannot_read(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The spill dir is readable but a checkpoint file is not (chowned to another user,
    mode 0600): restoring would release the buffer and remove the file as if it were
    corrupt. The start stops, releasing nothing; readable again, the buffer comes back."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon
    d.wrapper = NO_DAC
    d.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("unreadable-file", 64 * MiB)
    bids = [buffer_in(d, key, "pa", bytes([n]) * MiB) for n in (1, 2)]
    d.kill()
    (locked,) = [f for f in disk.spill.iterdir() if f.name.startswith(bids[0])]
    owner = locked.stat()
    os.chown(locked, 65534, 65534)
    locked.chmod(0o600)

    out = refused(d)
    assert f"1 checkpoints in spill directory {disk.spill} cannot be read" in out
    assert spill_ids(disk.store) == sorted(bids)

    os.chown(locked, owner.st_uid, owner.st_gid)
    d.start()
    for n, bid in zip((1, 2), bids, strict=True):
        assert read_buffer(d, key, bid) == bytes([n]) * MiB
    assert ledger_totals(d) == 2 * MiB
    assert d.stop() == 0, d.log()


def _spoil_record(record: Path, how: str) -> None:
    if how == "deleted":
        record.unlink()
    elif how == "garbage":
        record.write_bytes(b"\x00{not json")
    elif how == "wrong-shape":
        record.write_text(json.dumps({"/x": "y", "/z": [1]}))
    elif how == "list":
        record.write_text("[1, 2]")
    elif how == "directory":
        record.unlink()
        record.mkdir()
    else:
        raise AssertionError(how)


@root_only
@pytest.mark.parametrize("how", ["deleted", "garbage", "wrong-shape", "list", "directory"])
def test_a_spoiled_record_with_the_disk_mounted_starts_and_restores(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path, how: str
) -> None:
    """A record deleted, corrupted or made a directory while down costs nothing while the
    disk is there: the start restores, and (but for a directory) the record is rewritten."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("spoiled", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x77" * MiB)
    d.kill()
    record = d.data_dir / "spill-filesystems.json"
    assert str(disk.spill) in json.loads(record.read_text())
    _spoil_record(record, how)

    d.start()
    assert read_buffer(d, key, bid) == b"\x77" * MiB
    ledger_totals(d)
    said = f"{record} cannot be read" in d.log()
    assert said == (how != "deleted"), d.log()  # a spoiled record is said, not kept quiet
    if how != "directory":
        assert str(disk.spill) in json.loads(record.read_text())
    # The disk gone at the next start: recorded again, so the start stops.
    assert d.stop() == 0, d.log()
    if how != "directory":
        disk.umount()
        refused(d)
        disk.mount()
        back_intact(d, key, bid, b"\x77" * MiB)


@root_only
def test_the_disk_mounted_while_the_daemon_runs_after_a_start_without_it(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """A pool made while its disk was not mounted checkpoints onto the mount point's own
    directory; the disk mounted under the running daemon hides those files. A crash then:
    the start stops (the ledger's checkpoints are not on the filesystem there now), and
    releases nothing — unmounted again, the buffer comes back. A checkpoint after the mount
    goes to the disk, and the start after it restores from there."""
    disk = new_disk(disks, tmp_path / "a")
    disk.umount()
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("late", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x11" * MiB)
    disk.mount()
    d.kill()

    out = refused(d)
    assert "is on another filesystem" in out
    disk.umount()
    d.start()
    assert read_buffer(d, key, bid) == b"\x11" * MiB
    ledger_totals(d)

    disk.mount()  # while it runs, then a checkpoint: on the disk now
    write_buffer(d, key, bid, b"\x22" * MiB)
    with d.client(key) as c:
        assert c.post(f"/v1/buffers/{bid}/checkpoint").status_code == 200
    assert f"spill directory {disk.spill} is on another filesystem than recorded" in d.log()
    d.kill()
    assert spill_ids(disk.store) == [bid]
    back_intact(d, key, bid, b"\x22" * MiB)


@root_only
def test_a_graceful_stop_after_the_disk_went_away_during_the_run(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The disk unmounted under the running daemon: the shutdown checkpoint lands on the
    mount point's directory, and the next start (disk still away) restores that newest
    content; nothing is counted twice."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("away", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x01" * MiB)
    disk.umount()
    write_buffer(d, key, bid, b"\x02" * MiB)
    assert d.stop() == 0, d.log()
    assert f"spill directory {disk.spill} is on another filesystem than recorded" in d.log()
    assert spill_ids(disk.spill) == [bid]  # the mount point's own directory
    assert spill_ids(disk.store) == [bid]  # the older one, out of sight

    back_intact(d, key, bid, b"\x02" * MiB, total=MiB)


@root_only
def test_a_spill_dir_gone_during_the_run(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """The spill dir is a directory *on* the disk: unmounted, it does not exist. A REST
    checkpoint then is a 507 problem naming the spill dir (never a 5xx of another kind);
    a graceful stop keeps the last checkpoint; the start without the disk stops; with
    it, the buffer comes back as last checkpointed."""
    disk = new_disk(disks, tmp_path / "a")
    spill = disk.spill / "kv"
    spill.mkdir()
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(spill))
    _, key = d.tenant("gone", 64 * MiB)
    bid = buffer_in(d, key, "pa", b"\x31" * MiB)
    disk.umount()
    write_buffer(d, key, bid, b"\x32" * MiB)
    with d.client(key) as c:
        r = c.post(f"/v1/buffers/{bid}/checkpoint")
    assert r.status_code == 507, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert str(spill) in r.json()["detail"]
    ledger_totals(d)
    assert d.stop() == 0, d.log()

    out = refused(d)
    assert f"spill directory {spill} does not exist" in out
    disk.mount()
    back_intact(d, key, bid, b"\x31" * MiB, total=MiB)


@root_only
def test_a_tenant_deleted_while_its_disk_is_away(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """Deleting a tenant whose checkpoints are out of sight answers 204 and releases its
    buffers; their files, found again with the disk, are orphans removed at the next start."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    tid, key = d.tenant("deleted", 64 * MiB)
    buffer_in(d, key, "pa", b"\x41" * MiB)
    r = connect(d, key)
    put_committed(r, "ent", pattern(MiB, 4), "pa")
    r.close()
    _, other = d.tenant("kept", 64 * MiB)
    kept = buffer_in(d, other, "pa", b"\x42" * MiB)
    disk.umount()
    assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    assert ledger_totals(d) == MiB
    d.kill()

    disk.mount()
    d.start()
    assert spill_ids(disk.store) == [kept]
    assert read_buffer(d, other, kept) == b"\x42" * MiB
    assert ledger_totals(d) == MiB
    assert d.stop() == 0, d.log()


@pytest.fixture
def pg_url() -> Iterator[str]:
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        yield url


@root_only
def test_two_hosts_on_one_postgresql_ledger_each_check_their_own_disks(
    pg_url: str, disks: list[Disk], tmp_path: Path
) -> None:
    """Host A's disk is away. Host B, on the same ledger with its own data dir and a disk
    of its own, starts and restores its buffer (A's checkpoints are not B's to look at,
    nor to release or remove); A's start stops, releasing nothing; mounted, A restores."""
    hosts = {
        name: Daemon(
            tmp_path / name / "data",
            env={"MAASD_DB_URL": pg_url, "MAASD_NODE_NAME": f"host-{name}"},
        )
        for name in ("a", "b")
    }
    disk = {name: new_disk(disks, tmp_path / name) for name in hosts}
    try:
        a, b = hosts["a"].start(), hosts["b"].start()
        _, key = a.tenant("global", 64 * MiB)  # tenants are global: one key for both hosts
        bufs = {}
        for name, d in hosts.items():
            d.pool("pers", 16 * MiB, persistence="persistent", spill_dir=str(disk[name].spill))
            bufs[name] = buffer_in(d, key, "pers", bytes([ord(name)]) * MiB)
        a.kill()
        assert b.stop() == 0, b.log()
        disk["a"].umount()

        b.start()
        assert read_buffer(b, key, bufs["b"]) == b"b" * MiB
        assert spill_ids(disk["a"].store) == [bufs["a"]]
        ledger_totals(b)  # A's row still counts (a dead host's buffers do)
        assert b.stop() == 0, b.log()
        out = refused(a)
        assert f"spill directory {disk['a'].spill} is on another filesystem" in out
        assert str(disk["b"].spill) not in out

        disk["a"].mount()
        a.start()
        b.start()
        assert read_buffer(a, key, bufs["a"]) == b"a" * MiB
        assert read_buffer(b, key, bufs["b"]) == b"b" * MiB
        assert ledger_totals(a) == ledger_totals(b) == 2 * MiB
    finally:
        for d in hosts.values():
            d.close()


@root_only
def test_a_data_dir_on_the_missing_disk_with_a_postgresql_ledger(
    pg_url: str, disks: list[Disk], tmp_path: Path
) -> None:
    """The data dir (record, default spill dirs) is on the disk and the ledger is elsewhere
    (PostgreSQL): not mounted, the data dir is made afresh, without a record — the start
    must still stop (the spill dir the ledger names does not exist), releasing nothing."""
    disk = new_disk(disks, tmp_path / "a")
    d = Daemon(disk.spill / "data", env={"MAASD_DB_URL": pg_url, "MAASD_NODE_NAME": "host-d"})
    try:
        d.start()
        d.pool("pers", 16 * MiB, persistence="persistent")
        _, key = d.tenant("datadir", 64 * MiB)
        bid = buffer_in(d, key, "pers", b"\x66" * MiB)
        d.kill()
        disk.umount()

        out = refused(d)
        assert f"spill directory {d.data_dir / 'spill' / 'pers'} does not exist" in out
        subprocess.run(["rm", "-rf", str(disk.spill / "data")], check=True)  # the fresh one
        disk.mount()
        back_intact(d, key, bid, b"\x66" * MiB, total=MiB)
    finally:
        d.close()


@root_only
def test_a_tenant_deleted_through_another_host_while_the_disk_is_away(
    pg_url: str, disks: list[Disk], tmp_path: Path
) -> None:
    """Host A is down, its disk away; tenant T is deleted through host B (204; A's share
    waits for A). A's start stops, releasing nothing of tenant U either; mounted, A
    restores U's buffer, releases T's and removes its file, and T is gone."""
    hosts = {
        name: Daemon(
            tmp_path / name / "data",
            env={"MAASD_DB_URL": pg_url, "MAASD_NODE_NAME": f"host-{name}"},
        )
        for name in ("a", "b")
    }
    disk = new_disk(disks, tmp_path / "a")
    try:
        a, b = hosts["a"].start(), hosts["b"].start()
        a.pool("pers", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
        t_id, t_key = a.tenant("doomed", 64 * MiB)
        _, u_key = a.tenant("kept", 64 * MiB)
        t_buf = buffer_in(a, t_key, "pers", b"\x54" * MiB)
        u_buf = buffer_in(a, u_key, "pers", b"\x55" * MiB)
        a.kill()
        disk.umount()
        assert b.admin.delete(f"/v1/tenants/{t_id}").status_code == 204

        refused(a)
        assert spill_ids(disk.store) == sorted([t_buf, u_buf])
        disk.mount()
        a.start()
        assert read_buffer(a, u_key, u_buf) == b"\x55" * MiB
        assert spill_ids(disk.store) == [u_buf]
        assert a.admin.get(f"/v1/tenants/{t_id}").status_code == 404
        assert ledger_totals(a) == ledger_totals(b) == MiB
    finally:
        for d in hosts.values():
            d.close()


@root_only
def test_sigkill_while_checkpoints_are_written_then_restart(
    fresh_daemon: Daemon, disks: list[Disk], tmp_path: Path
) -> None:
    """Checkpoints of two buffers written in a loop, the daemon SIGKILLed at a random moment,
    three times: each restart restores every buffer whole (one of the versions written, all
    its bytes alike), leaves one file per buffer in the spill dir (no orphan), a record
    that parses, and ledger = live buffers."""
    disk = new_disk(disks, tmp_path / "a")
    d = fresh_daemon.start()
    d.pool("pa", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("killed", 64 * MiB)
    bids = [buffer_in(d, key, "pa", b"\x01" * MiB) for _ in range(2)]
    rng = random.Random(12)
    for _round in range(3):
        stop = threading.Event()

        def churn(stop: threading.Event = stop) -> None:
            version = 1
            while not stop.is_set():
                version = version % 250 + 1
                try:
                    for bid in bids:
                        write_buffer(d, key, bid, bytes([version]) * MiB)
                        with d.client(key) as c:
                            c.post(f"/v1/buffers/{bid}/checkpoint")
                except Exception:
                    return  # the daemon is gone

        t = threading.Thread(target=churn)
        t.start()
        time.sleep(rng.uniform(0.2, 1.5))
        d.kill()
        stop.set()
        t.join(60)
        d.start()
        for bid in bids:
            data = read_buffer(d, key, bid)
            assert data == data[:1] * MiB, "a restored buffer is not one version whole"
        assert ledger_totals(d) == 2 * MiB
        assert spill_ids(disk.spill) == sorted(bids)
        record = json.loads((d.data_dir / "spill-filesystems.json").read_text())
        assert str(disk.spill) in record
    assert d.stop() == 0, d.log()


# --- 2. REST keep-alive against the connection cap ---------------------------------------

CAP = 16
#: Far beyond any deadline or keep-alive here: a connection open after this has none.
NEVER_S = 60.0
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: maasd\r\n\r\n"


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of 16 REST connections at most, keeping an idle one 20 s (the default)."""
    d = Daemon(tmp_path_factory.mktemp("keepalive"), env={"MAASD_HTTP_MAX_CONNECTIONS": str(CAP)})
    d.start()
    yield d
    d.close()


def fds(d: Daemon) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def answered(s: socket.socket) -> bool:
    """Read one whole answer to a /healthz from ``s``: whether it was a 200 (False if the
    daemon closed the connection instead)."""
    got = b""
    try:
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                return False
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        return False
    return got.startswith(b"HTTP/1.1 200")


def kept_alive(d: Daemon) -> socket.socket:
    """A connection that asked /healthz once, without a key, and now idles (keep-alive)."""
    s = socket.create_connection(("127.0.0.1", d.port), timeout=NEVER_S)
    s.sendall(HEALTHZ)
    assert answered(s)
    return s


def closed_by_peer(s: socket.socket, wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if not select.select([s], [], [], max(deadline - time.monotonic(), 0.0))[0]:
            return False
        try:
            if not s.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True


def reserve_and_release(d: Daemon, key: str) -> None:
    with d.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB, "ttl_s": 60})
        assert r.status_code == 201, r.text
        assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204


def test_idle_keep_alive_connections_cannot_lock_tenants_out(capped: Daemon) -> None:
    """100 unauthenticated connections, each idle after one /healthz, kept open by a client
    that opens a new one for each the daemon closes: the daemon holds at most its cap of
    them (the oldest idle shed for each newcomer), its fds stay bounded, and a tenant's
    reserves on fresh connections all succeed meanwhile."""
    d = capped
    _, key = d.tenant("kept-out", 64 * MiB)
    reserve_and_release(d, key)
    baseline = fds(d)
    held = [kept_alive(d) for _ in range(100)]
    stop = threading.Event()
    most = [0]

    def hold_on() -> None:  # the attacker: every connection the daemon closes, opened again
        while not stop.is_set():
            for i, s in enumerate(held):
                if stop.is_set():
                    return
                if closed_by_peer(s):
                    s.close()
                    with contextlib.suppress(OSError, AssertionError):
                        held[i] = kept_alive(d)
            most[0] = max(most[0], fds(d))

    try:
        # The first 84 were shed to make room for the last 16.
        assert sum(closed_by_peer(s, 5.0) for s in held[:84]) == 84
        assert fds(d) <= baseline + CAP + 4
        attacker = threading.Thread(target=hold_on)
        attacker.start()
        for _ in range(20):
            reserve_and_release(d, key)
        stop.set()
        attacker.join(NEVER_S)
        assert most[0] <= baseline + 2 * CAP + 8, (most[0], baseline)
        assert d.metric("maasd_http_connections") <= CAP
    finally:
        stop.set()
        for s in held:
            s.close()
    assert d.healthy()


def test_a_connection_idle_past_the_keep_alive_is_closed(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "d", env={"MAASD_HTTP_KEEPALIVE_S": "1"})
    try:
        d.start()
        baseline = fds(d)
        conns = [kept_alive(d) for _ in range(8)]
        for s in conns:
            assert closed_by_peer(s, NEVER_S), "an idle connection outlived http_keepalive_s"
            s.close()
        assert fds(d) <= baseline
    finally:
        d.close()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "abc", "1e400"])
def test_a_keep_alive_that_is_not_a_finite_positive_number_is_one_line(
    tmp_path: Path, value: str
) -> None:
    d = Daemon(tmp_path / "d", env={"MAASD_HTTP_KEEPALIVE_S": value})
    p = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve"],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: settings: ")
    assert "http_keepalive_s" in lines[0]
    d.admin.close()


@pytest.mark.parametrize(
    "auth", ["", "Authorization: Bearer maasd_not_a_key\r\n"], ids=["no-key", "wrong-key"]
)
def test_bodies_sent_slowly_without_a_key_cannot_lock_tenants_out(
    capped: Daemon, auth: str
) -> None:
    """A local user without a key sends the cap's worth of POST heads whose bodies never
    finish: what it gets is a 401, and a connection answered is idle (shed at the cap),
    not busy until the body deadline: a tenant's reserve still gets through."""
    d = capped
    _, key = d.tenant("slow-bodies", 64 * MiB)
    head = (
        "POST /v1/reserve HTTP/1.1\r\nHost: maasd\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: 4096\r\n\r\n{{"
    ).encode()
    conns = []
    try:
        for _ in range(CAP * 2):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=NEVER_S)
            s.sendall(head)
            conns.append(s)
        for _ in range(5):
            reserve_and_release(d, key)
    finally:
        for s in conns:
            s.close()


def test_a_graceful_stop_is_not_held_up_by_idle_keep_alive_connections(
    fresh_daemon: Daemon,
) -> None:
    """SIGTERM with connections idle between requests (kept 20 s now): they are closed, and
    the stop checkpoints and exits 0 — the persistent buffer comes back."""
    d = Daemon(fresh_daemon.data_dir, env={"MAASD_HTTP_MAX_CONNECTIONS": str(CAP)})
    try:
        d.start()
        d.pool("pers", 16 * MiB, persistence="persistent")
        _, key = d.tenant("stopping", 64 * MiB)
        bid = buffer_in(d, key, "pers", b"\x01" * MiB)
        write_buffer(d, key, bid, b"\x02" * MiB)  # only the shutdown checkpoint has this
        idle = [kept_alive(d) for _ in range(CAP)]
        assert d.stop() == 0, d.log()
        assert all(closed_by_peer(s, NEVER_S) for s in idle)
        for s in idle:
            s.close()
        d.start()
        assert read_buffer(d, key, bid) == b"\x02" * MiB
        assert ledger_totals(d) == MiB
    finally:
        d.close()
