"""The socket's ``publish`` through a real daemon: a committed entry from the writer's own
memfd in one round trip — what it makes, what it counts, and what it refuses.

A writer sends the memfd with the frame (SCM_RIGHTS); the daemon checks it, reads it
into a sealed region of its own and commits that. Hostile fds and frames (none, two, a
pipe, a file on disk, a write-only re-open, a short memfd, an fd that comes with another
frame or in the middle of one) answer 400 or are closed unread, and leave nothing: no
row, no usage, no fd in the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Any

import numpy as np
import pytest

from hardening import after_attack, daemon_fds, tenant_usage
from maasd.client import BadRequest, DuplicateKey, QuotaExceeded, Scratch, Worker
from maasd.protocol import Error, Found, Hello, Lookup, Publish, Published, Welcome, encode_frame
from rawentries import connect, pattern
from sockpeer import Raw
from waiting import wait_until

MiB = 1 << 20
PAGE = mmap.PAGESIZE


@pytest.fixture
def tenant(daemon: Any) -> tuple[str, str]:
    return daemon.tenant("publish", 16 * MiB)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("test-publish", os.MFD_CLOEXEC)
    os.pwrite(fd, data, 0)
    return fd


def _daemon_fd_count(daemon: Any) -> int:
    """The daemon's fds but its own files in its data dir: a peer's fd kept would be a
    socket or a memfd, while the ledger's pool may open a connection (SQLite: the file,
    its WAL and its shm) whenever its background work and a request overlap, which a
    loaded host makes likely at any time."""
    own = f"{daemon.data_dir}/"
    return sum(not link.startswith(own) for link in daemon_fds(daemon.proc.pid))


def test_a_published_entry_is_found_read_only_and_owes_nothing_to_the_scratch(daemon, tenant):
    """Another worker finds the bytes, read-only and sealed; rewriting the scratch after
    the publish changes nothing in the entry; the quota counts the entry alone."""
    tid, key = tenant
    data = pattern(3 * PAGE + 100, seed=1)
    with Worker(daemon.socket_path, key) as w, Worker(daemon.socket_path, key) as r:
        with Scratch() as scratch:
            view = scratch.ensure(len(data))
            view[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            entry = w.publish("pub:a", scratch, len(data))
            assert (entry.key, entry.size_bytes) == ("pub:a", 4 * PAGE)
            view[:] = 0xEE  # the writer's memory, not the entry's
            hit = r.lookup(["pub:a"])
            assert hit is not None
            with hit:
                assert hit.buffer_id == entry.id
                assert hit.array[: len(data)].tobytes() == data
                assert not hit.array[len(data) :].any()
                assert not hit.array.flags.writeable
                for attempt in (
                    lambda: os.pwrite(hit.fd, b"x", 0),
                    lambda: mmap.mmap(hit.fd, PAGE, flags=mmap.MAP_SHARED),
                ):
                    with pytest.raises(OSError) as e:  # noqa: PT011 - its errno, below
                        attempt()
                    assert e.value.errno in (errno.EBADF, errno.EPERM, errno.EACCES)
        usage = tenant_usage(daemon, key)
        assert (usage["used_bytes"], usage["buffers"]) == (4 * PAGE, 1)
    assert daemon.metric("maasd_entry_publishes_total", tenant=tid, outcome="ok") == 1


def test_publish_keeps_a_puts_rules_duplicates_quota_and_eviction(daemon):
    """A key taken answers 409 (DuplicateKey) with nothing changed; past the quota the
    tenant's own oldest entries make room, and a publish bigger than the quota is 409."""
    _tid, key = daemon.tenant("publish-rules", 4 * MiB)
    with Worker(daemon.socket_path, key) as w, Scratch(5 * MiB) as scratch:
        w.publish("rules:0", scratch, MiB)
        before = tenant_usage(daemon, key)
        with pytest.raises(DuplicateKey):
            w.publish("rules:0", scratch, MiB)
        assert tenant_usage(daemon, key) == before
        for i in range(1, 6):  # 6 MiB through a 4 MiB quota: the oldest go
            scratch.array[:8] = i
            w.publish(f"rules:{i}", scratch, MiB)
        usage = tenant_usage(daemon, key)
        assert usage["used_bytes"] <= 4 * MiB
        assert w.lookup(["rules:0"]) is None
        hit = w.lookup(["rules:5"])
        assert hit is not None
        with hit:
            assert hit.array[:8].tolist() == [5] * 8
        with pytest.raises(QuotaExceeded):
            w.publish("rules:big", scratch, 5 * MiB)
    assert daemon.healthy()


def test_many_publishes_leave_the_daemon_no_fd_of_the_writers(daemon, tenant):
    """The writer's memfd is read and closed each time: the daemon's open files go back
    to what they were once the entries are released."""
    _tid, key = tenant
    with Worker(daemon.socket_path, key) as w:
        baseline = _daemon_fd_count(daemon)
        with Scratch(64 << 10) as scratch:
            ids = [w.publish(f"fds:{i}", scratch, 64 << 10).id for i in range(40)]
    c = daemon.client(key)
    for buffer_id in ids:
        assert c.delete(f"/v1/buffers/{buffer_id}").status_code == 204
    wait_until(lambda: _daemon_fd_count(daemon) <= baseline, timeout=60)


def test_a_publish_of_a_memfd_the_writer_keeps_writing_commits_what_was_read(daemon, tenant):
    """The writer's own fd stays open and writable after the answer; writes to it then
    never reach the entry (a fresh region of the daemon's, sealed)."""
    _tid, key = tenant
    fd = _memfd(pattern(PAGE, seed=2))
    try:
        with Worker(daemon.socket_path, key) as w:
            e = w.publish("keep:a", fd, PAGE)
            os.pwrite(fd, b"\xff" * PAGE, 0)
            hit = w.lookup(["keep:a"])
            assert hit is not None
            with hit:
                assert hit.buffer_id == e.id
                assert hit.array.tobytes() == pattern(PAGE, seed=2)
    finally:
        os.close(fd)


# --- hostile fds and frames ------------------------------------------------------------------


def _refused(r: Any, fds: list[int], size: int = PAGE, key: str = "bad:x") -> Error:
    reply, got = r.call_fds(Publish(key=key, size_bytes=size), fds)
    assert got == []
    assert isinstance(reply, Error), reply
    return reply


def test_fds_that_are_no_readable_memfd_answer_400_and_change_nothing(daemon, tenant):
    _tid, key = tenant
    r = connect(daemon, key)
    before = tenant_usage(daemon, key)
    baseline = _daemon_fd_count(daemon)
    memfd = _memfd(b"x" * PAGE)
    pipe_r, pipe_w = os.pipe()
    on_disk = os.open(__file__, os.O_RDONLY)  # a file of the checkout's file system
    write_only = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY)
    cases = {
        "no fd": ([], "exactly one fd"),
        "two fds": ([memfd, memfd], "more than one was"),
        "a pipe": ([pipe_r], "not a regular file"),
        "a file on disk": ([on_disk], "no seals"),
        "a write-only re-open": ([write_only], "writing only"),
        "a short memfd": ([memfd], "fewer than size_bytes"),
    }
    try:
        for what, (fds, says) in cases.items():
            size = 2 * PAGE if what == "a short memfd" else PAGE
            reply = _refused(r, fds, size)
            assert reply.status == 400, (what, reply)
            assert says in reply.detail, (what, reply.detail)
    finally:
        for fd in (memfd, pipe_r, pipe_w, write_only, on_disk):
            os.close(fd)
    assert tenant_usage(daemon, key) == before
    assert r.call(Lookup(keys=["bad:x"]))[0].status == 404  # nothing published
    wait_until(lambda: _daemon_fd_count(daemon) <= baseline + 1, timeout=60)  # + r's socket
    r.sock.close()
    after_attack(daemon)


def test_fds_that_come_with_another_frame_or_mid_frame_are_closed_unread(daemon, tenant):
    """An fd on a lookup frame is closed and the lookup served; an fd sent with the second
    half of a publish frame is that frame's if the daemon reads both halves at once (the
    kernel glues bytes sent before fds to them), else closed, the publish answering 400
    for want of one; fds on a hello are closed too. Either way the daemon keeps none."""
    _tid, key = tenant
    memfd = _memfd(pattern(PAGE, seed=3))
    try:
        with Worker(daemon.socket_path, key) as w:
            w.publish("mid:a", memfd, PAGE)
        baseline = _daemon_fd_count(daemon)
        r = connect(daemon, key)
        reply, fds = r.call_fds(Lookup(keys=["mid:a"]), [memfd, memfd, memfd])
        assert isinstance(reply, Found), reply
        for fd in fds:
            os.close(fd)
        frame = encode_frame(Publish(key="mid:b", size_bytes=PAGE))
        r.send_raw(frame[:3])
        r.send_fds(frame[3:], [memfd])
        reply, fds = r.recv()
        assert fds == []
        if isinstance(reply, Error):
            assert (reply.status, "exactly one fd" in reply.detail) == (400, True), reply
        else:
            assert isinstance(reply, Published), reply
        # a publish after all that is served, with its own fd
        reply, _ = r.call_fds(Publish(key="mid:c", size_bytes=PAGE), [memfd])
        assert isinstance(reply, Published), reply
        r.sock.close()
        wait_until(lambda: _daemon_fd_count(daemon) <= baseline, timeout=60)
        # fds sent with a hello
        raw = Raw(daemon.socket_path, timeout=30)
        reply, _ = raw.call_fds(Hello(api_key=key), [memfd, memfd])
        assert isinstance(reply, Welcome)
        raw.sock.close()
        wait_until(lambda: _daemon_fd_count(daemon) <= baseline, timeout=60)
    finally:
        os.close(memfd)
    after_attack(daemon)


def test_a_flood_of_fds_on_every_byte_parks_none_in_the_daemon(daemon, tenant):
    """A peer that sends fds with each byte of its frames (and more than the daemon takes
    at once) leaves it none: each is closed unless it came with a frame's first byte."""
    _tid, key = tenant
    memfds = [_memfd(b"z" * PAGE) for _ in range(8)]
    try:
        baseline = _daemon_fd_count(daemon)
        r = connect(daemon, key)
        frame = encode_frame(Publish(key="flood:a", size_bytes=PAGE))
        for i in range(len(frame)):
            r.send_fds(frame[i : i + 1], memfds)  # 8 fds per byte: over the 4 a read takes
        reply, _ = r.recv()
        assert isinstance(reply, Error | Published), reply
        r.sock.close()
        wait_until(lambda: _daemon_fd_count(daemon) <= baseline, timeout=60)
    finally:
        for fd in memfds:
            os.close(fd)
    after_attack(daemon)


def test_publishing_a_read_only_fd_of_an_entry_copies_it_under_a_new_key(daemon, tenant):
    """A looked-up entry's read-only fd is a memfd open for reading: publishing it makes a
    second entry with the same bytes (the tenant's own, under a key of its own)."""
    _tid, key = tenant
    with Worker(daemon.socket_path, key) as w, Scratch(PAGE) as s:
        s.array[:] = np.frombuffer(pattern(PAGE, seed=4), dtype=np.uint8)
        w.publish("copy:a", s, PAGE)
        hit = w.lookup(["copy:a"])
        assert hit is not None
        with hit:
            assert fcntl.fcntl(hit.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            w.publish("copy:b", hit.fd, PAGE)
        again = w.lookup(["copy:b"])
        assert again is not None
        with again:
            assert again.array.tobytes() == pattern(PAGE, seed=4)


def test_publish_without_a_worker_fd_over_the_client_is_a_bad_request(daemon, tenant):
    """The client sends what it is given: an fd that is not a memfd is the daemon's 400."""
    _tid, key = tenant
    pipe_r, pipe_w = os.pipe()
    try:
        with Worker(daemon.socket_path, key) as w:
            with pytest.raises(BadRequest, match="not a regular file"):
                w.publish("client:bad", pipe_r, PAGE)
            assert w.lookup(["client:bad"]) is None  # the connection stays usable
    finally:
        os.close(pipe_r)
        os.close(pipe_w)
