"""What must still hold after any attack on a real daemon: healthy, nothing leaked, others served.

:func:`after_attack` checks, in order: the daemon is alive; ``/healthz`` tells the
truth (200 ``ok`` with every component healthy); another tenant can still reserve,
attach (over the socket) and release; and the ledger equals the live memfds —
every buffer row of the ledger (a REST buffer or a socket entry) has its region in
the daemon (its memfd mapped once, ``/proc/PID/maps``: an idle entry may hold no fd),
and no buffer or entry memfd is mapped or open without a row (a committed entry's
read-only fds, kept for the hottest: only of a row).

Used by ``tests/integration/test_hardening.py`` and ``tests/soak/soak.py``.
"""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx

from maasd.client import Worker

if TYPE_CHECKING:
    from conftest import Daemon

#: The name of a buffer's or an entry's memfd: ``maasd-`` and the first 8 hex digits of
#: its id (a REST reserve, a staged or a restored entry: maasd.core.reserve), or
#: ``maasd-e-`` and those (an entry's sealed copy, made at its commit: maasd.core.entries).
_REGION_MEMFD = re.compile(r"^/memfd:(maasd-(?:e-)?([0-9a-f]{8}))(?: \(deleted\))?$")


def _fd_links(pid: int) -> Iterator[tuple[str, str]]:
    """Each open fd of process ``pid`` (its number in /proc/PID/fd) and where it points
    (root may read them: the daemon is not dumpable, so only root can)."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            yield name, os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile


def daemon_fds(pid: int) -> list[str]:
    """Where each open fd of process ``pid`` points."""
    return [link for _, link in _fd_links(pid)]


def memfd_of(pid: int, buffer_id: str) -> str:
    """The fd number (as in /proc/PID/fd) of the buffer's memfd in process ``pid``."""
    for name, link in _fd_links(pid):
        if f"maasd-{buffer_id[:8]}" in link:
            return name
    raise AssertionError(f"no memfd of buffer {buffer_id} in process {pid}")


def buffer_memfds(pid: int) -> Counter[str]:
    """The daemon's open buffer memfds (``maasd-XXXXXXXX``, not an entry's copy), by name."""
    names = (_REGION_MEMFD.match(link) for link in daemon_fds(pid))
    return Counter(m.group(1) for m in names if m and not m.group(1).startswith("maasd-e-"))


def _read_only(pid: int, fd: str) -> bool | None:
    """Whether the fd was opened ``O_RDONLY`` (``None``: closed meanwhile)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as info:
            flags = next(line for line in info if line.startswith("flags:"))
    except (OSError, StopIteration):
        return None
    return int(flags.split()[1], 8) & os.O_ACCMODE == os.O_RDONLY


def region_memfds(pid: int) -> tuple[Counter[str], Counter[str]]:
    """The daemon's buffer and entry regions (both names), by name — counted by the
    daemon's own writable shared mapping of each (``/proc/PID/maps``): one per buffer
    row of the ledger, whether the region still holds its fd or, an idle entry, parked
    it (maasd.allocator.parking) — and its read-only fds, a committed entry's handle
    that the daemon keeps for the entries last looked up (maasd.core.rofds) or is
    sending."""
    regions: Counter[str] = Counter()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[1] == "rw-s":
                m = _REGION_MEMFD.match(parts[5].rstrip("\n"))
                if m is not None:
                    regions[m.group(1)] += 1
    read_only: Counter[str] = Counter()
    for fd, link in _fd_links(pid):
        m = _REGION_MEMFD.match(link)
        if m is not None and _read_only(pid, fd):
            read_only[m.group(1)] += 1
    return regions, read_only


def ledger_ids(daemon: Daemon) -> list[str]:
    """Every buffer row of the daemon's SQLite ledger, in any state (read-only, beside it)."""
    db = daemon.data_dir / "maasd.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM buffers")]
    finally:
        conn.close()


def ledger_matches_memfds(daemon: Daemon) -> tuple[bool, str]:
    """Whether the ledger's rows are exactly the daemon's buffer and entry memfds — one
    writable memfd a row, and a read-only one only of a row — and how not."""
    assert daemon.proc is not None
    want = Counter(i[:8] for i in ledger_ids(daemon))
    regions, read_only = region_memfds(daemon.proc.pid)
    have = Counter(name[-8:] for name in regions.elements())
    missing, extra = want - have, have - want
    orphans = sorted(name for name in read_only if name[-8:] not in want)
    if not missing and not extra and not orphans:
        return True, f"{sum(want.values())} buffers and entries"
    return False, (
        f"ledger has {sum(want.values())} rows, the daemon {sum(have.values())} buffer or "
        f"entry memfds; rows without memfd: {sorted(missing.elements())[:5]}, "
        f"memfds without row (or more than one of a row): "
        f"{sorted(n for n in regions if n[-8:] in extra)[:5]}, "
        f"read-only memfds without row: {orphans[:5]}"
    )


def wait_ledger_matches_memfds(daemon: Daemon, timeout: float = 15.0) -> None:
    """The ledger equals the memfds once released regions are reclaimed (in the background)."""
    deadline = time.monotonic() + timeout
    ok, why = ledger_matches_memfds(daemon)
    while not ok and time.monotonic() < deadline:
        time.sleep(0.1)
        ok, why = ledger_matches_memfds(daemon)
    assert ok, why


def tenant_usage(daemon: Daemon, key: str) -> dict[str, Any]:
    """``GET /v1/usage`` of the tenant of ``key`` (it must answer 200)."""
    with daemon.client(key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        return dict(r.json())


def healthz(daemon: Daemon) -> tuple[int, dict[str, object]]:
    r = httpx.get(f"{daemon.url}/healthz", timeout=10)
    return r.status_code, r.json()


def another_tenant_works(daemon: Daemon) -> None:
    """A fresh tenant reserves, attaches over the socket, reads zeros, writes, releases."""
    _, key = daemon.tenant(f"bystander-{secrets.token_hex(2)}", 16 << 20)
    with daemon.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": 64 << 10})
        assert r.status_code == 201, r.text
        buf = r.json()
        with Worker(daemon.socket_path, key) as w:
            m = w.attach(buf["id"])
            try:
                assert m.size == 64 << 10
                assert not m.array.any()
                m.array[:] = 5
            finally:
                m.close()
        assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204


def after_attack(daemon: Daemon, *, bystander: bool = True) -> None:
    """Everything :mod:`hardening` promises, or an assertion that says what broke."""
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, f"the daemon died:\n{daemon.log()}"
    status, body = healthz(daemon)
    assert (status, body.get("status")) == (200, "ok"), body
    if bystander:
        another_tenant_works(daemon)
    wait_ledger_matches_memfds(daemon)
