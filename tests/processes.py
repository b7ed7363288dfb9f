"""Ending a process a test started: signal it, wait, and never leave it running."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess


def signal_and_wait(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> int:
    """Send ``sig`` (if it still runs) and wait → its exit code. Past ``timeout`` it is
    killed and :class:`subprocess.TimeoutExpired` raised: not ending in time is an error."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


__all__ = ["fd_table", "running", "signal_and_wait"]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def fd_table() -> frozenset[tuple[str, str]]:
    """This process's open fds, each with what it points at, after a collection: so that
    an fd an earlier test left to the collector (or one a thread of it closes) is not
    taken for a leak or a double close. ``fd_table() <= before`` is "nothing leaked": a
    leaked fd that took a freed number still differs in what it points at (its inode).

    Files under ``/proc`` and ``/sys`` are left out: a background thread (the warm stock
    reading ``/proc/meminfo``, the topology) holds one for the moment of a read, and no
    test here is about leaking them."""
    gc.collect()
    table = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed since
            path = f"/proc/self/fd/{fd}"
            target = os.readlink(path)
            if target.startswith(("/proc/", "/sys/")):
                continue
            # the inode too: every memfd of one name reads the same
            table.add((fd, f"{target} ino {os.stat(path).st_ino}"))
    return frozenset(table)
