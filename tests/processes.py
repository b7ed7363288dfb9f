"""Ending a process a test started: signal it, wait, and never leave it running."""

from __future__ import annotations

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


__all__ = ["signal_and_wait"]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
