"""Entries through the test's own socket peer (:class:`sockpeer.Raw`), and a pool's disk tier.

The frames are the test's (not ``maasd.client``): :func:`put`, :func:`write` and
:func:`commit` step by step, :func:`put_committed` all at once, :func:`probe` a lookup
from another process (``tests/entry_probe.py``). Below them, a pool with a disk tier
(:func:`tier_pool`), an entry pushed out to it (:func:`demote_one`), the tier's files,
and writers demoting at once (:func:`churn_concurrently`). Import as
``from rawentries import connect, put_committed`` (``tests/`` is on pytest's pythonpath).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import Daemon
from maasd.protocol import Commit, Detach, Found, Lookup, Ok, Put, Reserved
from sockpeer import Raw, lookup
from waiting import wait_until

TESTS = Path(__file__).resolve().parent
MiB = 1 << 20
#: The ending of a demoted entry's file in a tier's directory.
SUFFIX = ".ent"
#: What an entry's file holds beyond the entry's bytes: the nonce and the tag.
FILE_OVERHEAD = 12 + 16


# --- entries, frame by frame ------------------------------------------------------------


def connect(d: Daemon, key: str) -> Raw:
    r = Raw(d.socket_path, timeout=30)
    r.hello(key)
    return r


def pattern(size: int, seed: int = 0) -> bytes:
    """``size`` bytes that differ with ``seed``: an entry's content, checkable later."""
    return hashlib.shake_256(f"entry-{seed}".encode()).digest(size)


def put(r: Raw, key: str, size: int, **kw: Any) -> tuple[Reserved, int]:
    """Reserve an entry (``kw``: the frame's ``pool``, ``ttl_s``): the reply and its fd."""
    reply, fds = r.call(Put(key=key, size_bytes=size, **kw))
    assert isinstance(reply, Reserved), reply
    assert len(fds) == 1
    return reply, fds[0]


def commit(r: Raw, buffer_id: str) -> None:
    assert r.call(Commit(buffer_id=buffer_id)) == (Ok(), [])


def write(fd: int, data: bytes) -> None:
    with mmap.mmap(fd, len(data)) as mm:
        mm[:] = data


def put_committed(r: Raw, key: str, data: bytes, pool: str | None = None) -> str:
    """Put ``data`` under ``key`` (in ``pool``, else where the daemon places it), write it
    through the fd, close the fd and commit: the entry's id."""
    reply, fd = put(r, key, len(data), pool=pool)
    write(fd, data)
    os.close(fd)
    commit(r, reply.buffer_id)
    return reply.buffer_id


def use_once(r: Raw, key: str) -> None:
    """One lookup (a second use: worth a disk write at eviction), then detach, so the
    entry is evictable like any other; a miss if it was evicted meanwhile."""
    reply, fds = r.call(Lookup(keys=[key]))
    for fd in fds:
        os.close(fd)
    if isinstance(reply, Found):
        assert r.call(Detach(buffer_id=reply.buffer_id)) == (Ok(), [])


def probe(d: Daemon, key: str, keys: list[str]) -> dict[str, Any]:
    """Look ``keys`` up from another process and try to write what comes back
    (tests/entry_probe.py): what it saw."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    args = {"socket": d.socket_path, "key": key, "keys": keys}
    p = subprocess.run(
        [sys.executable, str(TESTS / "entry_probe.py")],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout)
    return out


# --- a pool's disk tier -----------------------------------------------------------------


def tier_pool(d: Daemon, disk: Path, capacity: int = 8 * MiB, disk_bytes: int = 64 * MiB) -> str:
    """A new pool of ``capacity`` in DRAM with a tier of ``disk_bytes`` in ``disk``: its name."""
    name = f"dt{os.urandom(3).hex()}"
    info = d.pool(name, capacity, disk_dir=str(disk), disk_bytes=disk_bytes, prefault=False)
    assert info["disk_dir"] == str(disk)
    assert info["disk_bytes"] == disk_bytes
    return name


def demote_one(d: Daemon, key: str, pool: str, data: bytes, fill: int) -> Raw:
    """Put ``data`` under ``"hot"``, look it up once (a second use: worth a write) and let
    it go, then put ``fill`` more 1 MiB entries so that eviction takes it out of DRAM (an
    entry a connection still holds is evicted last: it would free nothing)."""
    r = connect(d, key)
    put_committed(r, "hot", data, pool)
    found, fd = lookup(r, ["hot"])
    os.close(fd)
    assert r.call(Detach(buffer_id=found.buffer_id)) == (Ok(), [])
    for i in range(fill):
        put_committed(r, f"filler-{i}", pattern(MiB, i), pool)
    return r


def wait_written(d: Daemon, pool: str, before: float = 0.0) -> None:
    """Until a demotion's file is written and promotable (its file appears a moment
    before: the writes metric counts it once a lookup can find it)."""
    metric = "maasd_disk_write_bytes_total"
    wait_until(lambda: d.metric(metric, pool=pool) > before, timeout=20)


def disk_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def entry_files(path: Path) -> list[str]:
    """The demoted entries' files in a tier's directory (not its temporary ones)."""
    return [name for name in disk_files(path) if name.endswith(SUFFIX)]


def entry_file_bytes(disk: Path) -> int:
    """The bytes of the tier's entry files now (a file erased meanwhile counts 0)."""
    total = 0
    for name in entry_files(disk):
        with contextlib.suppress(FileNotFoundError):
            total += (disk / name).stat().st_size
    return total


def churn_concurrently(
    d: Daemon,
    key: str,
    pool: str,
    *,
    entries: int,
    demotions: int,
    sample: Callable[[], object],
    writers: int = 3,
) -> None:
    """``writers`` threads, each on a connection of its own, put ``entries`` 1 MiB entries
    into ``pool`` and use each once (so each eviction is worth a disk write), while
    ``sample`` is called in a loop on a thread of its own; returns once the pool counts
    ``demotions``, the sampling stopped. A writer's error fails the caller."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            sample()

    def churn(n: int) -> None:
        try:
            r = connect(d, key)
            for i in range(entries):
                put_committed(r, f"w{n}-{i}", pattern(MiB, 100 * n + i), pool)
                use_once(r, f"w{n}-{i}")
            r.close()
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=churn, args=(n,)) for n in range(writers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) >= demotions)
    finally:
        stop.set()
        watcher.join()
