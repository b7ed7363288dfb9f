"""No worker action can fault the daemon: the hugetlb punch-and-hog attack.

A worker attaches its own hugetlb buffers, punches holes in them (the seals
allow ``FALLOC_FL_PUNCH_HOLE``), then another of its processes takes every free
huge page. Any touch of a hole through the daemon's mapping would now need a
huge page that does not exist, and the kernel would kill the daemon with
SIGBUS. Release, lease expiry, checkpoint and a placement count must each take
a path that cannot fault — against a real daemon, with real huge pages.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest

import hugepages
from maasd.allocator import _sys
from maasd.client import Worker
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20
HUGE = hugepages.HUGE
SIZE = 2 * HUGE  # each buffer: a punched huge page, then one still holding 0xA5


def daemon_memfds(d: Daemon) -> int:
    assert d.proc is not None
    fd_dir = f"/proc/{d.proc.pid}/fd"
    links = []
    for name in os.listdir(fd_dir):
        try:
            links.append(os.readlink(f"{fd_dir}/{name}"))
        except FileNotFoundError:  # closed meanwhile
            continue
    return sum(link.startswith("/memfd:maasd-") for link in links)


def punch(fd: int, offset: int, length: int) -> None:
    _sys.fallocate(fd, _sys.FALLOC_FL_PUNCH_HOLE | _sys.FALLOC_FL_KEEP_SIZE, offset, length)


def make_pool(d: Daemon, name: str, capacity: int, persistence: str = "volatile") -> None:
    body = {
        "name": name,
        "numa_node": 0,
        "capacity_bytes": capacity,
        "backing": "hugetlb",
        "persistence": persistence,
    }
    r = d.admin.post("/v1/pools", json=body)
    assert r.status_code == 201, r.text


def reserve(user: httpx.Client, pool: str, **extra: object) -> str:
    r = user.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": SIZE, **extra})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.hugetlb
def test_punch_and_hog_cannot_fault_the_daemon(fresh_daemon: Daemon) -> None:
    with hugepages.configured(16):
        d = fresh_daemon.start()
        make_pool(d, "huge", 8 * HUGE)
        make_pool(d, "huge-kept", 4 * HUGE, persistence="persistent")
        _, key = d.tenant("attacker", 256 * MiB)
        _, other_key = d.tenant("bystander", 256 * MiB)
        user, other = d.client(key), d.client(other_key)
        released = reserve(user, "huge")
        expiring = reserve(user, "huge")
        kept = reserve(user, "huge-kept", ttl_s=3600)
        expected = np.concatenate([np.zeros(HUGE, np.uint8), np.full(HUGE, 0xA5, np.uint8)])

        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            maps = {b: w.attach(b) for b in (released, expiring, kept)}
            for m in maps.values():
                m.array[:] = 0xA5
                punch(m.fd, 0, HUGE)  # the first huge page is a hole now
            with hugepages.Hog() as hog:
                assert hog.pages > 0
                assert hugepages.available() == 0, "the hog left huge pages free"
                # A hugetlb reserve now is a clean 507 (the kernel has no huge page left).
                r = other.post("/v1/pools/huge/reserve", json={"size_bytes": HUGE})
                assert r.status_code == 507, r.text
                assert r.json()["type"].endswith("pool-exhausted")

                # Checkpoint: reads the kept buffer, hole included.
                r = user.post(f"/v1/buffers/{kept}/checkpoint")
                assert r.status_code == 200, r.text
                assert r.json()["checksum"] == hashlib.sha256(expected.tobytes()).hexdigest()
                # Placement count (GET a buffer): reports the hole, populates nothing.
                r = user.get(f"/v1/buffers/{kept}")
                assert r.status_code == 200, r.text
                assert r.json()["placement"] == {"0": 1, "-2": 1}
                # Release.
                assert user.delete(f"/v1/buffers/{released}").status_code == 204
                # Lease expiry.
                assert user.post(f"/v1/buffers/{expiring}/renew", json={"ttl_s": 1}).is_success
                wait_until(
                    lambda: user.get(f"/v1/buffers/{expiring}").status_code == 404,
                    timeout=30,
                    message="the reaper released the expired buffer",
                )

                assert d.proc is not None
                assert d.proc.poll() is None, d.log()
                assert d.healthy()
                # Another tenant still reserves and attaches.
                r = other.post("/v1/pools/node0/reserve", json={"size_bytes": MiB})
                assert r.status_code == 201, r.text
                with Worker(d.socket_path, other_key, renew_interval_s=0) as w2:
                    m2 = w2.attach(r.json()["id"])
                    m2.array[:] = 7
                    assert int(m2.array.sum()) == 7 * MiB
                # The ledger equals the memfds the daemon holds.
                listed = d.admin.get("/v1/buffers").json()
                assert daemon_memfds(d) == len(listed) == 2

            # With the hog gone, the worker's stale mappings of the released buffers read zeros.
            for gone in (released, expiring):
                assert not maps[gone].array.any(), gone
            assert np.array_equal(maps[kept].array, expected)
        assert d.healthy()
        user.close()
        other.close()


@pytest.mark.hugetlb
def test_a_punched_hole_reads_zero_in_the_checkpoint_file(fresh_daemon: Daemon) -> None:
    """The checkpoint file holds zeros for the hole and the worker's bytes elsewhere."""
    with hugepages.configured(4):
        d = fresh_daemon.start()
        make_pool(d, "huge-kept", 4 * HUGE, persistence="persistent")
        _, key = d.tenant("holes", 64 * MiB)
        user = d.client(key)
        kept = reserve(user, "huge-kept", ttl_s=3600)
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            m = w.attach(kept)
            m.array[:] = 0x5A
            punch(m.fd, HUGE, HUGE)
            assert user.post(f"/v1/buffers/{kept}/checkpoint").status_code == 200
        spill = d.data_dir / "spill" / "huge-kept"
        (path,) = spill.iterdir()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
            assert data[:HUGE] == b"\x5a" * HUGE
            assert data[HUGE:] == bytes(HUGE)
        user.close()
