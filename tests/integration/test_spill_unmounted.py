"""A persistent pool's spill filesystem not mounted when the daemon starts (SPEC §2
invariant 6; ``maasd.core.spillfs``).

The spill directory is a bind mount of a tmpfs (the "disk"): unmounting it leaves the
checkpoint files on the disk, out of the daemon's sight, as a disk that fstab failed to
mount does. Such a start used to release every persistent buffer (each checkpoint looked
missing) and, once the disk was back, remove their files as orphans. Now it stops with
one line, releasing nothing; the buffers come back once the disk is mounted; and
``--release-lost-checkpoints`` is the way out for a disk really lost.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from recovered import ledger_totals, read_buffer, spill_ids, write_buffer
from spilldisk import Disk

MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    d = Disk(tmp_path)
    yield d
    d.close()


def _checkpointed(d: Daemon, disk: Disk) -> tuple[str, dict[str, bytes]]:
    """A persistent pool spilling to ``disk``, and two buffers of a tenant written and
    checkpointed there: the tenant's key, and the buffers' contents."""
    d.pool("pers", 16 * MiB, persistence="persistent", spill_dir=str(disk.spill))
    _, key = d.tenant("spilled", 64 * MiB)
    saved = {}
    with d.client(key) as c:
        for n in range(2):
            b = c.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600}).json()
            data = bytes([n + 1]) * MiB
            write_buffer(d, key, b["id"], data)
            assert c.post(f"/v1/buffers/{b['id']}/checkpoint").status_code == 200
            saved[b["id"]] = data
    return key, saved


def _refused(d: Daemon) -> str:
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        d.start()
    return str(e.value)


def test_a_start_without_the_spill_filesystem_releases_nothing(
    fresh_daemon: Daemon, disk: Disk
) -> None:
    d = fresh_daemon.start()
    key, saved = _checkpointed(d, disk)
    assert d.stop() == 0, d.log()
    disk.umount()

    out = _refused(d)
    assert f"spill directory {disk.spill} is on another filesystem" in out
    assert "none of the 2 checkpoints" in out
    assert "--release-lost-checkpoints" in out
    assert "Traceback" not in out
    assert spill_ids(disk.store) == sorted(saved)  # nothing removed from the disk

    disk.mount()
    d.start()
    for bid, data in saved.items():
        assert read_buffer(d, key, bid) == data
    ledger_totals(d)
    assert d.stop() == 0, d.log()


def test_release_lost_checkpoints_is_the_way_out_for_a_disk_really_lost(
    fresh_daemon: Daemon, disk: Disk
) -> None:
    d = fresh_daemon.start()
    key, saved = _checkpointed(d, disk)
    d.kill()  # a crash, this time: the ledger names the checkpoints as they are
    disk.umount()

    d.args = ["--release-lost-checkpoints"]
    d.start()
    with d.client(key) as c:
        for bid in saved:
            assert c.get(f"/v1/buffers/{bid}").status_code == 404
        usage = c.get("/v1/usage").json()
    assert (usage["used_bytes"], usage["buffers"]) == (0, 0)
    assert "their buffers are released (--release-lost-checkpoints)" in d.log()
    ledger_totals(d)
    assert d.stop() == 0, d.log()

    # The flag is for one start; the disk found again later holds orphans, removed.
    d.args = []
    disk.mount()
    d.start()
    assert spill_ids(disk.store) == []
    assert d.stop() == 0, d.log()


def test_a_checkpoint_removed_by_hand_is_released_as_before(
    fresh_daemon: Daemon, disk: Disk
) -> None:
    """On the filesystem it was written to, a missing checkpoint is a file lost, not a disk:
    the start goes on and releases that buffer (and only it, were there others)."""
    d = fresh_daemon.start()
    key, saved = _checkpointed(d, disk)
    d.kill()
    for f in disk.store.iterdir():
        f.unlink()

    d.start()
    with d.client(key) as c:
        assert all(c.get(f"/v1/buffers/{bid}").status_code == 404 for bid in saved)
    ledger_totals(d)
    assert d.stop() == 0, d.log()
