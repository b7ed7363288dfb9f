"""Attacks on the socket's ``publish``: the writer's own fd, sent with the frame, read by
the daemon into a sealed entry.

Each test drives a real daemon (``conftest.Daemon``) as a hostile tenant would — with
fds of every kind, frames and fds split and stalled, and the client library misused —
and checks what SPEC.md promises: bad input is a 4xx that changes nothing (invariant 7),
nothing a worker sends harms the daemon or another tenant (invariant 9), and the
ledger, the usage and the daemon's open files are left as they were.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import pytest

from hardening import after_attack, tenant_usage
from maasd.client import ConnectionFailed, Scratch, Worker
from maasd.protocol import Error, Lookup, Publish, Published
from rawentries import connect, pattern

PAGE = mmap.PAGESIZE
MiB = 1 << 20


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("attack-publish", os.MFD_CLOEXEC)
    os.pwrite(fd, data, 0)
    return fd


# --- fds the daemon cannot read ----------------------------------------------------------


def test_a_memfd_reopened_with_no_read_access_is_a_400_never_a_500(daemon: Any) -> None:
    """``open(…, O_WRONLY | O_RDWR)`` (access mode 3: neither read nor write, Linux's
    mode for ioctls) of the writer's memfd: a shmem file that answers ``F_GET_SEALS``,
    long enough, not write-only — but ``pread`` fails on it (EBADF).

    Must hold (invariant 7): a 400 that says the fd is not open for reading, nothing
    reserved or left behind, no error logged as a daemon fault."""
    _, key = daemon.tenant("no-access", 16 * MiB)
    memfd = _memfd(pattern(PAGE, seed=1))
    neither = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY | os.O_RDWR)
    r = connect(daemon, key)
    try:
        before = tenant_usage(daemon, key)
        reply, fds = r.call_fds(Publish(key="neither:a", size_bytes=PAGE), [neither])
        assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status == 400, reply
        assert "reading" in reply.detail, reply.detail
        assert tenant_usage(daemon, key) == before
        miss, _ = r.call(Lookup(keys=["neither:a"]))
        assert isinstance(miss, Error)
        assert miss.status == 404
        # the connection is fine: the same memfd open for reading publishes
        reply, _ = r.call_fds(Publish(key="neither:b", size_bytes=PAGE), [memfd])
        assert isinstance(reply, Published), reply
    finally:
        r.close()
        os.close(neither)
        os.close(memfd)
    assert "unexpected error" not in daemon.log()
    after_attack(daemon)


# --- the client, misused -------------------------------------------------------------------


def test_publishing_a_closed_scratch_or_fd_leaves_the_worker_connected(daemon: Any) -> None:
    """``Worker.publish`` of a :class:`Scratch` already closed, or of an fd number that is
    not open (a writer's bookkeeping bug): nothing can be sent.

    Must hold: the call raises at once (``ValueError``), the worker's connection stays
    usable (no ``ConnectionFailed``, no wait for an answer that never comes) and the
    next publish of a good scratch works; a bool is no fd (``TypeError``)."""
    _, key = daemon.tenant("client-misuse", 16 * MiB)
    closed = Scratch(PAGE)
    closed.close()
    spare = 1 << 20  # an fd number nobody holds (over any RLIMIT_NOFILE of a test run)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(spare)
    with Worker(daemon.socket_path, key) as w, Scratch(PAGE) as good:
        for source in (closed, spare, -1):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="closed|not open"):
                w.publish("misuse:a", source, PAGE)
            assert time.monotonic() - t0 < 0.5
        with pytest.raises(TypeError):
            w.publish("misuse:a", True, PAGE)
        try:
            assert w.lookup(["misuse:a"]) is None
            entry = w.publish("misuse:a", good, PAGE)
        except ConnectionFailed as exc:  # pragma: no cover - the failure this test is about
            pytest.fail(f"the worker's connection broke: {exc}")
        assert entry.size_bytes == PAGE
