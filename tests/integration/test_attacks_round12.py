"""Attacks on two changes: a spill filesystem not mounted at start (SPEC §2 invariant 6,
``maasd.core.spillfs``) and the REST keep-alive of ``http_keepalive_s`` against the
connection cap (invariant 9, ``maasd.api.server``).

A spill "disk" is a tmpfs bind-mounted on the spill directory (as in
``test_spill_unmounted.py``): unmounting it hides its checkpoint files from the daemon, as
a disk that fstab failed to mount does. After every restart the ledger must equal the
live buffers (:func:`recovered.ledger_totals`).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from rawentries import connect, pattern, put_committed
from recovered import ledger_totals, read_buffer, spill_ids, write_buffer
from sockpeer import lookup, miss

MiB = 1 << 20

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


# --- a spill disk that can be unmounted ------------------------------------------------


class Disk:
    """A tmpfs (the disk) bind-mounted on ``spill``, which can be unmounted and mounted again."""

    def __init__(self, base: Path) -> None:
        self.store = base / "disk"
        self.spill = base / "spill"
        self.store.mkdir(parents=True)
        self.spill.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(self.store)]
        ).returncode:
            pytest.skip("cannot mount a tmpfs here")
        self.mount()

    def mount(self) -> None:
        subprocess.run(["mount", "--bind", str(self.store), str(self.spill)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", str(self.spill)], check=True)

    def close(self) -> None:
        for path in (self.spill, self.spill, self.store):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


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
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        d.start()
    out = str(e.value)
    assert "Traceback" not in out
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
    d.start()
    assert read_buffer(d, key, bid) == b"\x5a" * MiB
    ledger_totals(d)
    assert d.stop() == 0, d.log()


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
    d.start()
    assert read_buffer(d, key, bid) == b"\x3c" * MiB
    ledger_totals(d)
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
    if how != "directory":
        assert str(disk.spill) in json.loads(record.read_text())
    # The disk gone at the next start: recorded again, so the start stops.
    assert d.stop() == 0, d.log()
    if how != "directory":
        disk.umount()
        refused(d)
        disk.mount()
        d.start()
        assert read_buffer(d, key, bid) == b"\x77" * MiB
        ledger_totals(d)
        assert d.stop() == 0, d.log()
