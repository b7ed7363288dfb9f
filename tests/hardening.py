"""What must still hold after any attack on a real daemon (SPEC §2.7, §2.9).

:func:`after_attack` checks, in order: the daemon is alive; ``/healthz`` tells the
truth (200 ``ok`` with every component healthy); another tenant can still reserve,
attach (over the socket) and release; and the ledger equals the live memfds —
every buffer row of the ledger has its memfd open in the daemon
(``/proc/PID/fd``), and no buffer memfd is open without a row.

Used by ``tests/integration/test_hardening.py`` and ``tests/soak/soak.py``.
"""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
import time
from collections import Counter
from typing import TYPE_CHECKING

import httpx

from maasd.client import Worker

if TYPE_CHECKING:
    from conftest import Daemon

#: The name a buffer's memfd gets (``maasd-`` and the first 8 hex digits of its id).
_BUFFER_MEMFD = re.compile(r"^/memfd:(maasd-[0-9a-f]{8})(?: \(deleted\))?$")


def daemon_fds(pid: int) -> list[str]:
    """Where each open fd of process ``pid`` points (root may read them: the daemon is not
    dumpable, so only root can)."""
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return out


def memfd_of(pid: int, buffer_id: str) -> str:
    """The fd number (as in /proc/PID/fd) of the buffer's memfd in process ``pid``."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if f"maasd-{buffer_id[:8]}" in link:
            return name
    raise AssertionError(f"no memfd of buffer {buffer_id} in process {pid}")


def buffer_memfds(pid: int) -> Counter[str]:
    """The daemon's open buffer memfds, by name."""
    names = (_BUFFER_MEMFD.match(link) for link in daemon_fds(pid))
    return Counter(m.group(1) for m in names if m)


def ledger_ids(daemon: Daemon) -> list[str]:
    """Every buffer row of the daemon's SQLite ledger, in any state (read-only, beside it)."""
    db = daemon.data_dir / "maasd.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM buffers")]
    finally:
        conn.close()


def ledger_matches_memfds(daemon: Daemon) -> tuple[bool, str]:
    """Whether the ledger's buffers are exactly the daemon's buffer memfds, and how not."""
    assert daemon.proc is not None
    want = Counter(f"maasd-{i[:8]}" for i in ledger_ids(daemon))
    have = buffer_memfds(daemon.proc.pid)
    if want == have:
        return True, f"{sum(want.values())} buffers"
    return False, (
        f"ledger has {sum(want.values())} rows, the daemon {sum(have.values())} buffer memfds; "
        f"rows without memfd: {sorted((want - have).elements())[:5]}, "
        f"memfds without row: {sorted((have - want).elements())[:5]}"
    )


def wait_ledger_matches_memfds(daemon: Daemon, timeout: float = 15.0) -> None:
    """The ledger equals the memfds once released regions are reclaimed (in the background)."""
    deadline = time.monotonic() + timeout
    ok, why = ledger_matches_memfds(daemon)
    while not ok and time.monotonic() < deadline:
        time.sleep(0.1)
        ok, why = ledger_matches_memfds(daemon)
    assert ok, why


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
