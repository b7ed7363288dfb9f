"""What an idle committed entry costs the daemon, counted from /proc over 1,000 entries.

One mapping (the daemon's writable one, made before the ``F_SEAL_FUTURE_WRITE`` seal:
the scrub at release writes through it), and no open file where the daemon may re-open
its mappings (``entry_fds = "auto"``: :mod:`maasd.allocator.parking`), else one (its
sealed memfd; ``entry_fds = "keep"``). A lookup's read-only fd is a re-open made for
that reply, closed once sent — kept only for the 32 hottest entries. docs/operations.md,
"Sizing a host". The region budget counts exactly that (:mod:`maasd.core.limits`), so it
must not be more.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import Daemon
from maasd.allocator import parking
from maasd.client import Worker
from maasd.core.rofds import HOT_READ_ONLY_FDS
from waiting import wait_until

ENTRIES = 1000
SIZE = 4096


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def rss_anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon line")


def settled(pid: int) -> tuple[int, int]:
    """The daemon's fds and mappings once they stop changing (released staging regions
    are scrubbed and closed in the background)."""
    last: list[tuple[int, int]] = []

    def still() -> bool:
        last.append((fds(pid), mappings(pid)))
        return len(last) >= 5 and len(set(last[-5:])) == 1

    wait_until(still, timeout=30, interval=0.2, message="the daemon's fds and maps settle")
    return last[-1]


@pytest.mark.parametrize(
    ("entry_fds", "fds_per_entry"),
    [
        pytest.param(
            "auto",
            0,
            marks=pytest.mark.skipif(not parking.can_park(), reason="no map_files re-open here"),
        ),
        ("keep", 1),
    ],
)
def test_an_idle_committed_entry_holds_one_mapping_and_at_most_one_fd(
    tmp_path: Path, entry_fds: str, fds_per_entry: int
) -> None:
    d = Daemon(tmp_path / "d", env={"MAASD_ENTRY_FDS": entry_fds}).start()
    try:
        assert d.proc is not None
        pid = d.proc.pid
        _tid, key = d.tenant("cost", 64 << 20)
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            with w.entry("warm-up", SIZE) as m:  # threads, caches, the connection
                m.array[:] = 1
            fd0, map0 = settled(pid)
            rss0 = rss_anon_bytes(pid)
            for i in range(ENTRIES):
                with w.entry(f"e{i}", SIZE) as m:
                    m.array[:8] = 7
            fd1, map1 = settled(pid)
            rss1 = rss_anon_bytes(pid)
            per_fd, per_map = (fd1 - fd0) / ENTRIES, (map1 - map0) / ENTRIES
            print(
                f"per idle entry: {per_fd:.3f} fds, {per_map:.3f} mappings, "
                f"{(rss1 - rss0) / ENTRIES:.0f} bytes of the daemon's anonymous RSS"
            )
            assert abs(per_fd - fds_per_entry) <= 0.01, f"{per_fd:.3f} fds per idle entry"
            assert 0.99 <= per_map <= 1.01, f"{per_map:.3f} mappings per idle entry"
            # The daemon's own memory per entry (its records, not the entry's pages): a
            # few KiB, reported in docs/operations.md; a bound loose enough for allocators.
            assert (rss1 - rss0) / ENTRIES < 64 << 10
            # A lookup's read-only fd is made for its reply and gone once sent; the
            # hottest HOT_READ_ONLY_FDS entries keep one (a hit then costs a dup).
            for i in range(0, ENTRIES, 10):
                hit = w.lookup([f"e{i}"])
                assert hit is not None
                hit.close()
                w.forget(hit.buffer_id)
            assert settled(pid)[0] <= fd1 + HOT_READ_ONLY_FDS
    finally:
        d.close()
