"""The socket wire protocol: frames, the tagged union, the fd-passing helpers."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import os
import socket
import struct
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from maasd.protocol import (
    HEADER,
    MAX_FRAME,
    Abort,
    Attach,
    Attached,
    Commit,
    Detach,
    Error,
    Found,
    FrameError,
    FrameReader,
    FrameTooLarge,
    Hello,
    Lookup,
    Ok,
    Put,
    Renew,
    Reply,
    Request,
    Reserved,
    Welcome,
    decode_reply,
    decode_request,
    encode_frame,
    recv_message,
    send_message,
)

# --- strategies (local: protocol-only) ----------------------------------------

#: Text the ledger stores or is asked about: any but a NUL byte (bounds.NO_NUL_PATTERN).
stored_text = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
ids = st.text(stored_text, min_size=1, max_size=64)
requests = st.one_of(
    st.builds(Hello, api_key=st.text(min_size=1, max_size=128)),
    st.builds(Attach, buffer_id=ids),
    st.builds(Detach, buffer_id=ids),
    st.builds(Renew, buffer_id=ids, ttl_s=st.integers(1, 2**31)),
    st.builds(Lookup, keys=st.lists(st.text(min_size=1, max_size=32), min_size=1, max_size=8)),
    st.builds(
        Put,
        key=st.text(stored_text, min_size=1, max_size=64),
        size_bytes=st.integers(1, 2**63 - 1),
        pool=st.none() | ids,
        ttl_s=st.none() | st.integers(1, 2**31),
    ),
    st.builds(Commit, buffer_id=ids),
    st.builds(Abort, buffer_id=ids),
)
replies = st.one_of(
    st.builds(Welcome, tenant_id=st.none() | ids, pid=st.none() | st.integers(0, 2**31)),
    st.builds(
        Attached,
        buffer_id=ids,
        size_bytes=st.integers(0, 2**63 - 1),
        numa_node=st.integers(0, 1024),
    ),
    st.just(Ok()),
    st.builds(
        Found,
        key=ids,
        buffer_id=ids,
        size_bytes=st.integers(0, 2**63 - 1),
        numa_node=st.integers(0, 1024),
    ),
    st.builds(
        Reserved,
        buffer_id=ids,
        size_bytes=st.integers(0, 2**63 - 1),
        numa_node=st.integers(0, 1024),
    ),
    st.builds(
        Error,
        status=st.integers(100, 599),
        title=st.text(max_size=64),
        detail=st.text(max_size=256),
        type=st.none() | st.text(max_size=64),
    ),
)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


# --- frames --------------------------------------------------------------------


class TestEncodeFrame:
    def test_prefix_is_big_endian_body_length(self):
        frame = encode_frame(Attach(buffer_id="b1"))
        (length,) = struct.unpack(">I", frame[:4])
        assert length == len(frame) - 4
        assert msgspec.msgpack.decode(frame[4:]) == {"op": "attach", "buffer_id": "b1"}

    def test_every_message_is_a_map_tagged_op(self):
        cases: list[tuple[Request | Reply, str]] = [
            (Hello(api_key="k"), "hello"),
            (Attach(buffer_id="b"), "attach"),
            (Detach(buffer_id="b"), "detach"),
            (Renew(buffer_id="b", ttl_s=5), "renew"),
            (Lookup(keys=["a", "ab"]), "lookup"),
            (Put(key="k", size_bytes=4096), "put"),
            (Commit(buffer_id="b"), "commit"),
            (Abort(buffer_id="b"), "abort"),
            (Found(key="k", buffer_id="b", size_bytes=4096, numa_node=0), "found"),
            (Reserved(buffer_id="b", size_bytes=4096, numa_node=0), "reserved"),
            (Welcome(tenant_id="t", pid=3), "welcome"),
            (Ok(), "ok"),
            (Attached(buffer_id="b", size_bytes=4096, numa_node=0), "attached"),
            (Error(status=404, title="Not found", detail="x"), "error"),
        ]
        for msg, op in cases:
            assert msgspec.msgpack.decode(encode_frame(msg)[4:])["op"] == op

    def test_oversized_body_is_refused(self):
        with pytest.raises(FrameTooLarge):
            encode_frame(Error(status=500, title="x", detail="d" * MAX_FRAME))

    def test_a_nul_byte_in_what_the_ledger_is_asked_is_a_bad_frame(self):
        """PostgreSQL's text cannot hold one; a lookup's keys (memory and L2 only) may."""
        for msg in (
            Attach(buffer_id="a\x00"),
            Renew(buffer_id="\x00", ttl_s=5),
            Put(key="k\x00", size_bytes=4096),
            Put(key="k", size_bytes=4096, pool="node0\x00"),
        ):
            with pytest.raises(msgspec.ValidationError, match="regex"):
                decode_request(encode_frame(msg)[4:])
        assert decode_request(encode_frame(Lookup(keys=["k\x00"]))[4:]) == Lookup(keys=["k\x00"])

    @given(requests)
    def test_request_round_trip(self, msg):
        body = FrameReader().feed(encode_frame(msg))
        assert [decode_request(b) for b in body] == [msg]

    @given(replies)
    def test_reply_round_trip(self, msg):
        body = FrameReader().feed(encode_frame(msg))
        assert [decode_reply(b) for b in body] == [msg]


class TestFrameReader:
    @given(st.lists(requests, max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
    def test_any_chunking_yields_the_same_frames(self, msgs, cuts):
        stream = b"".join(encode_frame(m) for m in msgs)
        reader = FrameReader()
        got: list[Request] = []
        for chunk in split_at(stream, cuts):
            got.extend(decode_request(b) for b in reader.feed(chunk))
        assert got == msgs
        assert reader.pending == 0

    def test_partial_header_and_body_wait(self):
        frame = encode_frame(Attach(buffer_id="abc"))
        reader = FrameReader()
        assert reader.feed(frame[:2]) == []
        assert reader.feed(frame[2:6]) == []
        assert reader.pending == 6
        assert reader.feed(frame[6:]) == [frame[4:]]

    def test_next_frame_keeps_the_rest(self):
        a, b = encode_frame(Ok()), encode_frame(Attach(buffer_id="x"))
        reader = FrameReader()
        assert reader.next_frame(a + b) == a[4:]
        assert reader.next_frame() == b[4:]
        assert reader.next_frame() is None

    def test_oversize_length_raises_before_the_body(self):
        reader = FrameReader()
        with pytest.raises(FrameTooLarge) as info:
            reader.feed(HEADER.pack(MAX_FRAME + 1))  # only the prefix: no body at all
        assert info.value.length == MAX_FRAME + 1
        assert reader.pending == 0
        with pytest.raises(FrameError):  # no resynchronising a broken stream
            reader.feed(encode_frame(Ok()))

    def test_huge_length_does_not_allocate(self):
        with pytest.raises(FrameTooLarge):
            FrameReader().feed(b"\xff\xff\xff\xff" + b"x" * 100)

    def test_exactly_max_frame_is_accepted(self):
        body = b"\x00" * MAX_FRAME
        assert FrameReader().feed(HEADER.pack(MAX_FRAME) + body) == [body]

    def test_empty_frame_is_a_frame(self):
        (body,) = FrameReader().feed(HEADER.pack(0))
        with pytest.raises(msgspec.DecodeError):
            decode_request(body)

    @hsettings(max_examples=300)
    @given(st.binary(max_size=512), st.lists(st.integers(0, 600), max_size=6))
    def test_garbage_never_escapes_the_documented_errors(self, data, cuts):
        reader = FrameReader()
        with contextlib.suppress(FrameError):  # FrameTooLarge: the stream is over
            for chunk in split_at(data, cuts):
                for body in reader.feed(chunk):
                    with contextlib.suppress(msgspec.DecodeError):
                        assert isinstance(decode_request(body), Hello | Attach | Detach | Renew)


class TestDecode:
    @pytest.mark.parametrize(
        ("obj", "fragment"),
        [
            ({"op": "attach", "buffer_id": 5}, "$.buffer_id"),
            ({"op": "attach"}, "buffer_id"),
            ({"op": "launch", "buffer_id": "b"}, "launch"),
            ({"buffer_id": "b"}, "op"),
            ({"op": "attach", "buffer_id": "b", "extra": 1}, "extra"),
            ({"op": "renew", "buffer_id": "b", "ttl_s": "10"}, "$.ttl_s"),
            ({"op": "hello", "api_key": ""}, "$.api_key"),
            ({"op": "attach", "buffer_id": "b" * 300}, "$.buffer_id"),
            ([1, 2, 3], "object"),
        ],
    )
    def test_bad_requests_say_what_is_wrong(self, obj, fragment):
        with pytest.raises(msgspec.ValidationError) as info:
            decode_request(msgspec.msgpack.encode(obj))
        assert fragment in str(info.value)

    def test_replies_tolerate_new_fields(self):
        body = msgspec.msgpack.encode({"op": "ok", "new_field": 1})
        assert decode_reply(body) == Ok()

    def test_an_attached_without_a_lease_is_one_from_an_older_daemon(self):
        old = {"op": "attached", "buffer_id": "b", "size_bytes": 5, "numa_node": 0}
        assert decode_reply(msgspec.msgpack.encode(old)) == Attached(
            buffer_id="b", size_bytes=5, numa_node=0, ttl_s=0
        )
        new = Attached(buffer_id="b", size_bytes=5, numa_node=0, ttl_s=3)
        assert decode_reply(encode_frame(new)[4:]) == new

    def test_replies_are_not_requests(self):
        with pytest.raises(msgspec.ValidationError):
            decode_request(encode_frame(Ok())[4:])
        with pytest.raises(msgspec.ValidationError):
            decode_reply(encode_frame(Attach(buffer_id="b"))[4:])

    def test_error_type_is_optional(self):
        body = msgspec.msgpack.encode({"op": "error", "status": 404, "title": "Not found"})
        assert decode_reply(body) == Error(status=404, title="Not found", detail="", type=None)


# --- the socket helpers ---------------------------------------------------------


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, content)
    return fd


class TestSocketHelpers:
    def test_fd_travels_with_its_frame(self):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = _memfd(b"hello")
        try:
            send_message(a, Attached(buffer_id="b", size_bytes=5, numa_node=0), [fd])
            body, fds = recv_message(b, FrameReader())
            assert body is not None
            assert decode_reply(body) == Attached(buffer_id="b", size_bytes=5, numa_node=0)
            assert len(fds) == 1
            assert os.pread(fds[0], 5, 0) == b"hello"
            # received close-on-exec
            assert fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            os.close(fds[0])
        finally:
            os.close(fd)
            a.close()
            b.close()

    def test_no_fd_means_no_ancillary_data(self):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            send_message(a, Error(status=404, title="Not found"))
            body, fds = recv_message(b, FrameReader())
            assert fds == []
            assert isinstance(decode_reply(body or b""), Error)

    def test_eof_and_pipelined_frames(self):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with b:
            a.sendall(encode_frame(Ok()) + encode_frame(Welcome(tenant_id="t")))
            a.close()
            reader = FrameReader()
            first, _ = recv_message(b, reader)
            second, _ = recv_message(b, reader)
            third, _ = recv_message(b, reader)
            assert decode_reply(first or b"") == Ok()
            assert decode_reply(second or b"") == Welcome(tenant_id="t")
            assert third is None

    def test_oversize_from_peer_raises(self):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            a.sendall(HEADER.pack(MAX_FRAME + 1))
            with pytest.raises(FrameTooLarge):
                recv_message(b, FrameReader())


def test_client_and_protocol_import_nothing_from_the_server():
    code = (
        "import sys, maasd.client, maasd.protocol;"
        "print(sorted(m for m in sys.modules if m.startswith('maasd')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    # maasd.bounds: the request bounds both edges decode with (msgspec and stdlib only)
    allowed = {"maasd", "maasd.protocol", "maasd.bounds", "maasd.client"}
    assert {m for m in loaded if not m.startswith("maasd.client.")} <= allowed, loaded


@pytest.mark.parametrize(
    "body",
    [
        {"op": "put", "key": "k", "size_bytes": 0},
        {"op": "put", "key": "k", "size_bytes": -1},
        {"op": "put", "key": "k", "size_bytes": 2**64 - 1},
        {"op": "put", "key": "", "size_bytes": 1},
        {"op": "put", "key": "k", "size_bytes": 1, "ttl_s": 0},
        {"op": "put", "key": "k", "size_bytes": 1, "x": 1},
        {"op": "renew", "buffer_id": "b", "ttl_s": 0},
        {"op": "renew", "buffer_id": "b", "ttl_s": 2**31 + 1},
        {"op": "renew", "buffer_id": "b", "ttl_s": -(2**63)},
        {"op": "renew", "buffer_id": "", "ttl_s": 60},
        {"op": "hello", "api_key": "k" * 1025},
        {"op": "lookup", "keys": []},
        {"op": "lookup", "keys": ["k"] * 1025},
        {"op": "lookup", "keys": [""]},
        {"op": "commit", "buffer_id": ""},
        {"op": "abort", "buffer_id": 1},
    ],
)
def test_entry_requests_are_decoded_with_the_shared_bounds(body):
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode(body))


def test_1024_lookup_keys_and_the_largest_size_are_accepted():
    keys = [f"k{i}" for i in range(1024)]
    assert decode_request(encode_frame(Lookup(keys=keys))[4:]) == Lookup(keys=keys)
    big = Put(key="k", size_bytes=2**63 - 1)
    assert decode_request(encode_frame(big)[4:]) == big


def test_the_old_name_of_a_frame_error_still_answers_with_a_deprecation_warning() -> None:
    import maasd.protocol

    with pytest.warns(DeprecationWarning, match="use maasd.protocol.FrameError"):
        old = maasd.protocol.ProtocolError
    assert old is FrameError
    assert issubclass(FrameTooLarge, old)


def _pairs(*pairs: tuple[str, object], header: bytes | None = None) -> bytes:
    """A msgpack map of ``pairs`` as written (a name may repeat), under a fixmap header
    unless ``header`` is given (a map16 or map32 of the same count)."""
    body = header if header is not None else bytes([0x80 | len(pairs)])
    for name, value in pairs:
        body += msgspec.msgpack.encode(name) + msgspec.msgpack.encode(value)
    return body


@pytest.mark.parametrize(
    "pairs",
    [
        (("op", "hello"), ("api_key", "a"), ("api_key", "b")),
        (("op", "attach"), ("buffer_id", "a"), ("buffer_id", "a")),
        (("op", "lookup"), ("keys", ["a"]), ("keys", ["a", "b"])),
        (("op", "put"), ("key", "k"), ("size_bytes", 1), ("size_bytes", 2)),
        (("op", "put"), ("key", "k"), ("size_bytes", 1), ("pool", None), ("pool", "p")),
        (("op", "put"), ("key", "k"), ("size_bytes", 1), ("pool", None), ("pool", None)),
        (("op", "publish"), ("key", "k"), ("size_bytes", 1), ("ttl_s", 1), ("ttl_s", 1)),
        (("op", "commit"), ("op", "commit"), ("buffer_id", "b")),
    ],
)
def test_a_map_naming_a_field_twice_is_a_bad_frame(pairs):
    with pytest.raises(msgspec.ValidationError, match="more than once"):
        decode_request(_pairs(*pairs))


def test_a_map_of_distinct_names_is_decoded_under_any_header_and_with_nil_defaults():
    put = (("op", "put"), ("key", "k"), ("size_bytes", 1), ("pool", None), ("ttl_s", None))
    assert decode_request(_pairs(*put)) == Put(key="k", size_bytes=1)
    assert decode_request(_pairs(*put, header=b"\xde\x00\x05")) == Put(key="k", size_bytes=1)
    assert decode_request(_pairs(*put[:3], header=b"\xdf\x00\x00\x00\x03")) == Put(
        key="k", size_bytes=1
    )
    assert decode_request(encode_frame(Lookup(keys=["a"] * 1024))[4:]) == Lookup(keys=["a"] * 1024)
