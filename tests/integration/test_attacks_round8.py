"""Attacks on idle committed entries that keep no fd (maasd.allocator.parking).

A committed ``memfd`` entry's region closes its fd once frozen and keeps only the
daemon's mapping; a lookup re-opens the file read-only through
``/proc/self/map_files/<start>-<end>``, inode checked. Each test drives a real daemon
(``conftest.Daemon``) as a tenant or worker would, and checks what SPEC.md promises:
no tenant reaches another's bytes, every byte is zero after release, a handle of a
committed entry never becomes writable, bounds hold (a clear 507, never ``EMFILE``),
and everyone else keeps working.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from conftest import Daemon
from maasd.allocator import parking
from maasd.core.limits import limits_for, open_files_needed

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
#: What the daemon's defaults give (as tests/integration/test_region_budget.py has them).
DEFAULTS = {
    "socket_max_connections": 1024,
    "http_max_connections": 512,
    "ledger_files": 160,
    "threads": 68,
    "tenant_share": 1.0,
}

pytestmark = [
    pytest.mark.skipif(not parking.can_park(), reason="this host cannot re-open mappings"),
    pytest.mark.skipif(os.geteuid() != 0, reason="reads the daemon's /proc/PID/fd"),
]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _memfd_fds(pid: int) -> int:
    n = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:maasd-"):
                n += 1
        except OSError:
            continue
    return n


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/memfd:maasd-" in line)


def _prlimit(files: int) -> list[str]:
    return ["prlimit", f"--nofile={files}:{files}", "--"]


def test_persistent_buffers_beyond_the_files_budget_stop_the_start_and_are_kept(
    tmp_path: Path,
) -> None:
    """Persistent REST buffers (not entries: they keep their fd) restored at a start
    under an ``RLIMIT_NOFILE`` whose files budget cannot hold them.

    Parking lets the *regions* budget grow to the mappings' (vm.max_map_count), but a
    buffer still needs an fd. Must hold: the start is refused with a ConfigError naming
    LimitNOFILE and nothing is released (every buffer's bytes come back at a limit that
    holds them) — never a restore that runs into EMFILE and releases persistent buffers
    whose restore failed."""
    buffers = 1200
    d = Daemon(tmp_path / "d", env={"MAASD_TENANT_REGION_SHARE": "1"}).start()
    try:
        pool = d.pool("keep", 64 * MiB, persistence="persistent")
        _tid, key = d.tenant("keeper", GiB)
        ids: list[str] = []
        with d.client(key) as c:
            for _ in range(buffers):
                r = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": 4 * KiB})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
        assert d.stop() == 0  # every persistent buffer checkpointed
        files = open_files_needed(limits_for(4096, None, **DEFAULTS), 100)  # type: ignore[arg-type]
        assert files is not None
        assert files < buffers  # files for 100 buffers: restoring 1,200 would run out
        d.wrapper = _prlimit(files)
        with pytest.raises(RuntimeError, match="maasd exited") as e:
            d.start()
        assert "nothing was released" in str(e.value), str(e.value)[-3000:]
        assert "LimitNOFILE" in str(e.value)
        d.wrapper = []  # the limit back: every buffer comes back
        d.start()
        with d.client(key) as c:
            r = c.get("/v1/buffers")
            assert r.status_code == 200, r.text
            body = r.json()
            listed = body["buffers"] if isinstance(body, dict) else body
            live = {b["id"] for b in listed if b.get("state", "live") == "live"}
            assert live >= set(ids), f"{len(set(ids) - live)} persistent buffers were released"
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
    finally:
        d.close()
