"""The pure parts of a ``publish``: the source check, the read, the fds' frame, the scratch.

Through the daemon: ``tests/integration/test_publish.py``.
"""

from __future__ import annotations

import fcntl
import os
import socket

import numpy as np
import pytest

from maasd.broker.connection import Connection
from maasd.client import Scratch
from maasd.core.publish import _reader, check_source
from maasd.errors import InvalidRequest, StateConflict
from maasd.protocol import FrameReader, Lookup, Publish, encode_frame

PAGE = os.sysconf("SC_PAGE_SIZE")


def _memfd(size: int, byte: int = 7) -> int:
    fd = os.memfd_create("unit-publish", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.pwrite(fd, bytes([byte]) * size, 0)
    return fd


# --- the source ------------------------------------------------------------------------------


def test_a_readable_memfd_long_enough_passes_whatever_its_seals() -> None:
    fd = _memfd(2 * PAGE)
    try:
        check_source(fd, 2 * PAGE)
        check_source(fd, 1)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
        check_source(fd, 2 * PAGE)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            check_source(ro, PAGE)  # a read-only re-open (an entry's handle is one)
        finally:
            os.close(ro)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: os.pipe()[0], "not a regular file"),
        (lambda: socket.socket().detach(), "not a regular file"),
        (lambda: os.open(__file__, os.O_RDONLY), "no seals"),  # a file of the checkout's disk
        (lambda: os.open("/dev/null", os.O_RDONLY), "not a regular file"),
    ],
)
def test_anything_but_a_shmem_file_is_refused(make, says: str) -> None:
    fd = make()
    try:
        with pytest.raises(InvalidRequest, match=says):
            check_source(fd, 1)
    finally:
        os.close(fd)


def test_a_write_only_a_short_or_a_closed_fd_is_refused() -> None:
    fd = _memfd(PAGE)
    wo = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
    try:
        with pytest.raises(InvalidRequest, match="writing only"):
            check_source(wo, PAGE)
        with pytest.raises(InvalidRequest, match=f"holds {PAGE} bytes, fewer than"):
            check_source(fd, PAGE + 1)
    finally:
        os.close(wo)
        os.close(fd)
    with pytest.raises(InvalidRequest, match="cannot be used"):
        check_source(fd, 1)


def test_the_read_fills_exactly_the_size_and_a_memfd_that_shrank_is_a_conflict() -> None:
    fd = _memfd(3 * PAGE, byte=9)
    try:
        dest = bytearray(4 * PAGE)
        _reader(fd, 3 * PAGE - 5)(memoryview(dest))
        assert dest[: 3 * PAGE - 5] == b"\x09" * (3 * PAGE - 5)
        assert not any(dest[3 * PAGE - 5 :])
        os.ftruncate(fd, PAGE)  # the writer cut it after the check
        with pytest.raises(StateConflict, match=f"{PAGE} of {3 * PAGE} bytes"):
            _reader(fd, 3 * PAGE)(memoryview(bytearray(3 * PAGE)))
    finally:
        os.close(fd)


# --- whose frame the fds are -------------------------------------------------------------


def _pair() -> tuple[Connection, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Connection(a, "unit"), b


def _send(peer: socket.socket, data: bytes, fds: list[int]) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, np.array(fds, dtype=np.int32).tobytes())]
    assert peer.sendmsg([data], anc if fds else []) == len(data)


def _frames(conn: Connection, data: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
    """Feed ``data`` and take every whole frame with its fds, as the broker does."""
    out = []
    body = conn.reader.next_frame(data)
    while body is not None:
        out.append((body, conn.inbound.take(conn.reader.last_start, conn.reader.next_start)))
        body = conn.reader.next_frame()
    return out


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_fds_go_to_the_last_frame_that_begins_within_their_read() -> None:
    conn, peer = _pair()
    memfd = _memfd(PAGE)
    try:
        lookup = encode_frame(Lookup(keys=["k"]))
        publish = encode_frame(Publish(key="k", size_bytes=PAGE))
        _send(peer, lookup, [])
        _send(peer, publish, [memfd])  # read together: the kernel glues them
        data = conn.receive(1 << 16)
        frames = _frames(conn, data)
        assert [len(f) for _, f in frames] == [0, 1]  # the lookup none, the publish its one
        got = frames[1][1][0]
        assert os.fstat(got).st_ino == os.fstat(memfd).st_ino
        os.close(got)
        assert not conn.inbound
    finally:
        conn.close()
        peer.close()
        os.close(memfd)


def test_fds_within_whose_read_no_frame_begins_are_closed_and_a_second_batch_at_once() -> None:
    conn, peer = _pair()
    memfd = _memfd(PAGE)
    try:
        publish = encode_frame(Publish(key="k", size_bytes=PAGE))
        _send(peer, publish[:5], [])
        assert _frames(conn, conn.receive(1 << 16)) == []
        _send(peer, publish[5:], [memfd])  # the tail of a frame begun before
        data = conn.receive(1 << 16)
        received = conn.inbound.waiting
        assert len(received) == 1
        assert _frames(conn, data) == [(publish[4:], ())]
        assert not conn.inbound
        assert not any(_open(fd) for fd in received)
        # a batch while one waits: closed at once
        _send(peer, publish[:5], [memfd])
        conn.receive(1 << 16)
        waiting = conn.inbound.waiting
        assert len(waiting) == 1
        _send(peer, b"\0", [memfd])
        conn.receive(1 << 16)
        assert conn.inbound.waiting == waiting
    finally:
        conn.close()  # and what waits is closed with it
        peer.close()
        os.close(memfd)
    assert not any(_open(fd) for fd in waiting)


def test_the_reader_counts_stream_offsets() -> None:
    r = FrameReader()
    one, two = encode_frame(Lookup(keys=["a"])), encode_frame(Lookup(keys=["bb"]))
    assert (r.end_offset, r.next_start, r.last_start) == (0, 0, -1)
    assert r.next_frame(one + two[:3]) == one[4:]
    assert (r.last_start, r.next_start, r.end_offset) == (0, len(one), len(one) + 3)
    assert r.next_frame(two[3:]) == two[4:]
    assert (r.last_start, r.next_start) == (len(one), len(one) + len(two))


# --- the scratch ---------------------------------------------------------------------------


def test_a_scratch_grows_by_a_quarter_at_least_and_keeps_its_memfd() -> None:
    with Scratch() as s:
        with pytest.raises(ValueError, match="ensure"):
            _ = s.array
        a = s.ensure(100)
        assert (s.size, len(a), a.flags.writeable) == (PAGE, PAGE, True)
        a[:3] = [1, 2, 3]
        fd = s.fd
        assert s.ensure(PAGE) is s.array  # no growth: the same mapping
        s.ensure(10 * PAGE)
        assert (s.fd, s.size) == (fd, 10 * PAGE)
        assert s.array[:3].tolist() == [1, 2, 3]  # the file grew; its bytes stay
        s.ensure(11 * PAGE)
        assert s.size == 13 * PAGE  # 10 + a quarter, rounded up to pages
        assert os.fstat(fd).st_size == 13 * PAGE
    assert s.closed
    s.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        s.ensure(1)
