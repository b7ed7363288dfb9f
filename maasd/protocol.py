"""The wire protocol of the local data plane (docs/client.md, "Wire protocol"), shared by broker and client.

A frame is a 4-byte big-endian length followed by that many bytes of one
msgpack map, a msgspec tagged union on ``"op"``::

    worker                                   daemon
    hello    {api_key}               ->
                                     <-      welcome  {tenant_id, pid}
    attach   {buffer_id}             ->
                                     <-      attached {buffer_id, size_bytes, numa_node}
                                             + the buffer's memfd (SCM_RIGHTS, same sendmsg)
    detach   {buffer_id}             ->
                                     <-      ok       {}
    renew    {buffer_id, ttl_s}      ->
                                     <-      ok       {}

    the entry fast path (one round trip each)
    lookup   {keys}                  ->      keys ordered short → long, 1..1024 of them
                                     <-      found    {key, buffer_id, size_bytes, numa_node}
                                             + a READ-ONLY fd of the longest committed entry
    put      {key, size_bytes, pool?, ttl_s?}  ->
                                     <-      reserved {buffer_id, size_bytes, numa_node}
                                             + a writable fd, for this connection only
    commit   {buffer_id}             ->      the entry becomes immutable, its key visible
                                     <-      ok       {}
    abort    {buffer_id}             ->      the staged entry is released (scrubbed)
                                     <-      ok       {}
    publish  {key, size_bytes, pool?, ttl_s?}  ->
             + the writer's own memfd holding the bytes (SCM_RIGHTS, same sendmsg)
                                     <-      published {buffer_id, size_bytes, numa_node}
                                             a committed entry: the daemon read the first
                                             size_bytes of the memfd into a fresh sealed
                                             region of its own (no fd comes back)

    (any)                            <-      error    {status, title, detail, type}

    pushed by the daemon, between replies, unasked
                                     <-      released {buffer_id}
                                             an entry this connection holds (looked up
                                             or attached) was released or evicted: it
                                             reads zeros; unmap it and close its fd
                                             now (until then its pages stay counted in
                                             the tenant's quota); no detach is owed

A ``lookup`` miss is a 404 error frame, with no fd. ``attach`` of a committed entry
sends a read-only fd too. A ``put`` that cannot be served answers as a REST reserve
of an evictable keyed buffer would (409 quota / duplicate key, 507 …); a ``commit``
or ``abort`` of an entry this connection did not put answers 409 (404 for another
tenant's or an unknown id); a ``commit`` that cannot be honoured answers 409/507 and
leaves nothing behind. A ``publish`` is a ``put`` and a ``commit`` in one round trip,
its bytes read by the daemon from the memfd the writer sends with the frame (a memfd or
another shmem file, opened for reading, holding at least ``size_bytes``; anything else,
no fd or more than one answers 400 and changes nothing); a ``publish`` whose memfd
shrinks while it is read answers 409 and leaves nothing behind. An entry whose writer's connection closes before its commit
is released. A malformed frame (wrong types, no or more than 1024 keys, a size of 0,
negative or beyond 2^63 − 1, an unknown field, a field named twice) answers 400; the
connection stays.

This module imports only msgspec and the standard library so that the client
(which must not import the server) can share it. The pure parts —
:func:`encode_frame`, :class:`FrameReader`, :func:`decode_request`,
:func:`decode_reply` — never touch a socket; :func:`send_message` and
:func:`recv_message` are the small socket helpers both sides use.

Example::

    >>> frame = encode_frame(Attach(buffer_id="b1"))
    >>> reader = FrameReader()
    >>> [decode_request(body) for body in reader.feed(frame)]
    [Attach(buffer_id='b1')]
"""

from __future__ import annotations

import array
import os
import socket
import struct
from collections.abc import Iterable

import msgspec

from maasd.bounds import ApiKey, EntryKey, EntryKeys, Id, PositiveBytes, Ref, TtlS

__all__ = [
    "HEADER",
    "MAX_FD_PER_MESSAGE",
    "MAX_FRAME",
    "Abort",
    "Attach",
    "Attached",
    "Commit",
    "Detach",
    "Error",
    "Found",
    "FrameError",
    "FrameReader",
    "FrameTooLarge",
    "Hello",
    "Lookup",
    "Ok",
    "Publish",
    "Published",
    "Put",
    "Renew",
    "Released",
    "Reply",
    "Request",
    "Reserved",
    "Welcome",
    "decode_reply",
    "decode_request",
    "encode_frame",
    "fds_from_ancillary",
    "recv_message",
    "send_message",
]

#: Largest frame body accepted or produced, in bytes (a longer announced length is refused).
MAX_FRAME = 64 * 1024
#: The length prefix: 4 bytes, big-endian, unsigned.
HEADER = struct.Struct(">I")
#: A reply carries at most one fd; receivers make room for a few more so that a
#: misbehaving peer's extra fds are received (and closed) instead of truncated.
MAX_FD_PER_MESSAGE = 4

# Strings and numbers are bounded by maasd.bounds' types, the same as REST's, so that a
# decoded frame can never make the service do work proportional to an attacker-chosen
# size (the frame cap bounds it too).


class FrameError(Exception):
    """Raised for bytes that are not a valid frame of this protocol.

    (Named ``ProtocolError`` before; that name is the client's —
    :class:`maasd.client.ProtocolError`, an answer it cannot understand — and stays here
    only as a deprecated alias.)
    """


class FrameTooLarge(FrameError):
    """Raised when a length prefix announces more than :data:`MAX_FRAME` bytes.

    Raised as soon as the 4-byte prefix is seen, before any of the body is read
    or buffered, so a hostile length never costs memory.
    """

    def __init__(self, length: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
        self.length = length


# --- requests (worker -> daemon): strict, unknown fields are a bad frame -----


class Hello(msgspec.Struct, tag="hello", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """First frame of every connection: authenticates it with a tenant key."""

    api_key: ApiKey


class Attach(msgspec.Struct, tag="attach", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Ask for the buffer's memfd; answered by :class:`Attached` plus the fd."""

    buffer_id: Id


class Detach(msgspec.Struct, tag="detach", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Tell the daemon one attachment of this connection is over."""

    buffer_id: Id


class Renew(msgspec.Struct, tag="renew", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Extend the buffer's lease to ``ttl_s`` seconds from now."""

    buffer_id: Id
    ttl_s: TtlS


class Lookup(msgspec.Struct, tag="lookup", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Find the longest of ``keys`` (ordered short → long) with a committed entry;
    answered by :class:`Found` plus a read-only fd, or a 404 error frame."""

    keys: EntryKeys


class Put(
    msgspec.Struct,
    tag="put",
    tag_field="op",
    forbid_unknown_fields=True,
    frozen=True,
    omit_defaults=True,  # a field left out is one the daemon's repeat check need not parse
):
    """Reserve an entry under ``key`` to write; answered by :class:`Reserved` plus a
    writable fd. ``pool`` is an id or name (``None``: the pool with most free space)."""

    key: EntryKey
    size_bytes: PositiveBytes
    pool: Ref | None = None
    ttl_s: TtlS | None = None


class Commit(msgspec.Struct, tag="commit", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Make an entry this connection put immutable and visible to lookups; :class:`Ok`."""

    buffer_id: Id


class Abort(msgspec.Struct, tag="abort", tag_field="op", forbid_unknown_fields=True, frozen=True):
    """Release an entry this connection put and has not committed; :class:`Ok`."""

    buffer_id: Id


class Publish(
    msgspec.Struct,
    tag="publish",
    tag_field="op",
    forbid_unknown_fields=True,
    frozen=True,
    omit_defaults=True,  # as Put
):
    """Publish the first ``size_bytes`` of the memfd sent with this frame (SCM_RIGHTS) as a
    committed entry under ``key``: a :class:`Put` and a :class:`Commit` in one round trip,
    the bytes read by the daemon into a region no worker ever held. Answered by
    :class:`Published` (no fd). ``pool`` and ``ttl_s`` as for a put."""

    key: EntryKey
    size_bytes: PositiveBytes
    pool: Ref | None = None
    ttl_s: TtlS | None = None


Request = Hello | Attach | Detach | Renew | Lookup | Put | Commit | Abort | Publish


# --- replies (daemon -> worker): lenient, so a newer daemon may add fields ---


class Welcome(msgspec.Struct, tag="welcome", tag_field="op", frozen=True):
    """Answer to :class:`Hello`.

    ``tenant_id`` is ``None`` for the admin key; ``pid`` is the peer pid the
    daemon recorded with ``SO_PEERCRED`` (as seen in the daemon's pid namespace).
    """

    tenant_id: str | None
    pid: int | None = None


class Attached(msgspec.Struct, tag="attached", tag_field="op", frozen=True):
    """Answer to :class:`Attach`; the memfd travels in the same ``sendmsg``. ``ttl_s`` is
    the lease the buffer was reserved with, what a worker renews it to while it is
    attached (0 from a daemon older than it)."""

    buffer_id: str
    size_bytes: int
    numa_node: int
    ttl_s: int = 0


class Found(msgspec.Struct, tag="found", tag_field="op", frozen=True):
    """Answer to :class:`Lookup`: the key that matched; a read-only fd of the committed
    entry travels in the same ``sendmsg``."""

    key: str
    buffer_id: str
    size_bytes: int
    numa_node: int


class Reserved(msgspec.Struct, tag="reserved", tag_field="op", frozen=True):
    """Answer to :class:`Put`; the entry's writable fd travels in the same ``sendmsg``."""

    buffer_id: str
    size_bytes: int
    numa_node: int


class Published(msgspec.Struct, tag="published", tag_field="op", frozen=True):
    """Answer to :class:`Publish`: the committed entry (immutable, visible to lookups),
    with what a REST buffer record says of it (empty from a daemon older than them)."""

    buffer_id: str
    size_bytes: int
    numa_node: int
    tenant_id: str = ""
    pool_id: str = ""
    persistence: str = ""
    created_at: str = ""
    expires_at: str = ""


class Ok(msgspec.Struct, tag="ok", tag_field="op", frozen=True):
    """Answer to :class:`Detach`, :class:`Renew`, :class:`Commit` and :class:`Abort`."""


class Error(msgspec.Struct, tag="error", tag_field="op", frozen=True):
    """A failed request, shaped like an RFC 9457 problem (``type`` is optional)."""

    status: int
    title: str
    detail: str = ""
    type: str | None = None


class Released(msgspec.Struct, tag="released", tag_field="op", frozen=True):
    """Pushed, not an answer: an entry this connection holds was released (or evicted).

    Its pages are zeroed but stay resident, counted in its tenant's quota, until every
    fd and mapping of it is gone; the daemon has dropped this connection's attachments
    of it. A worker unmaps and closes what it holds of it, then reads on: the reply it
    waits for follows.
    """

    buffer_id: str


Reply = Welcome | Attached | Found | Reserved | Published | Ok | Error | Released

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_frame(msg: Request | Reply) -> bytes:
    """Return ``msg`` as one frame: length prefix plus msgpack body.

    Raises :class:`FrameTooLarge` if the body would exceed :data:`MAX_FRAME`.
    """
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(len(body))
    return HEADER.pack(len(body)) + body


def decode_request(body: bytes | memoryview) -> Request:
    """Decode one frame body sent by a worker.

    Raises ``msgspec.DecodeError`` (a ``ValidationError`` for a well-formed map
    of the wrong shape) with msgspec's message, e.g.
    ``Expected `str`, got `int` - at `$.buffer_id```. A map that names a field twice
    is a ``ValidationError`` too (:func:`_refuse_repeated_fields`).
    """
    req: Request = _request_decoder.decode(body)
    _refuse_repeated_fields(body, req)
    return req


def _map_length(body: bytes | memoryview) -> int:
    """The entry count a msgpack map's header announces (``body`` decoded as one)."""
    first = body[0]
    if first == 0xDE:
        return int.from_bytes(body[1:3], "big")
    if first == 0xDF:
        return int.from_bytes(body[1:5], "big")
    return first & 0x0F  # a fixmap: 0x80 | count


#: Per request type: the map entries a frame of it names at least (its tag and required
#: fields), and its optional fields (each ``None`` by default).
_NAMED = {
    kind: (
        1 + sum(1 for f in msgspec.structs.fields(kind) if f.default is msgspec.NODEFAULT),
        tuple(f.name for f in msgspec.structs.fields(kind) if f.default is not msgspec.NODEFAULT),
    )
    for kind in (Hello, Attach, Detach, Renew, Lookup, Put, Commit, Abort, Publish)
}


def _refuse_repeated_fields(body: bytes | memoryview, req: Request) -> None:
    """``ValidationError`` if the map ``req`` was decoded from names a field twice: msgspec,
    like most decoders, keeps the last value, so ``put`` with ``size_bytes`` 4096 then
    1 GiB reserved 1 GiB where a proxy or a log that keeps the first saw 4096 (REST
    refuses such a body alike, ``maasd.api.strict``).

    Unknown fields were refused already, so a map of distinct names has one entry per
    field ``req`` got from it: compared with the header's count, in O(1). Only a map that
    also gives an optional field as ``nil`` (its default) is decoded a second time.

    >>> once = msgspec.msgpack.encode({"op": "attach", "buffer_id": "b"})
    >>> _refuse_repeated_fields(once, Attach(buffer_id="b"))
    >>> twice = b"\\x83" + once[1:] + msgspec.msgpack.encode("buffer_id") + b"\\xa1a"
    >>> _refuse_repeated_fields(twice, Attach(buffer_id="a"))
    Traceback (most recent call last):
    ...
    msgspec.ValidationError: a field of the map is given more than once
    """
    least, optional = _NAMED[type(req)]
    first = body[0]
    given = first & 0x0F if first < 0x90 else _map_length(body)  # a fixmap: 0x80 | count
    if given <= least:  # the common case, a frame of its required fields only
        return
    named = least + sum(1 for name in optional if getattr(req, name) is not None)
    if given > named and len(msgspec.msgpack.decode(body)) < given:
        raise msgspec.ValidationError("a field of the map is given more than once")


def decode_reply(body: bytes | memoryview) -> Reply:
    """Decode one frame body sent by the daemon (raises ``msgspec.DecodeError``)."""
    return _reply_decoder.decode(body)


class FrameReader:
    """Incremental frame splitter: feed it bytes as they arrive, get whole frame bodies.

    >>> r = FrameReader()
    >>> r.feed(b"\\x00\\x00")
    []
    >>> r.feed(b"\\x00\\x01\\x80")
    [b'\\x80']

    Frames are split lazily: :meth:`next_frame` takes one frame off the buffered
    bytes and leaves the rest as bytes, so a burst of tiny frames costs its bytes
    and no more. :meth:`feed` and :meth:`next_frame` raise :class:`FrameTooLarge`
    when they reach a length prefix over ``max_frame`` (before any of that body
    is buffered); the reader is then unusable (the stream has no way to
    resynchronise) and the connection should be closed.
    """

    __slots__ = ("_buf", "_failed", "_start", "last_start", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._failed = False
        #: the stream offset of the first buffered byte (bytes returned in frames before it)
        self._start = 0
        #: the stream offset at which the frame last returned began (it ended where
        #: :attr:`next_start` is now)
        self.last_start = -1

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as part of a whole frame."""
        return len(self._buf)

    @property
    def end_offset(self) -> int:
        """The stream offset the next byte fed will have (every byte fed so far counts)."""
        return self._start + len(self._buf)

    @property
    def next_start(self) -> int:
        """The stream offset of the next frame to be returned (of the first byte buffered)."""
        return self._start

    @property
    def has_frame(self) -> bool:
        """Whether :meth:`next_frame` would return a frame (or raise :class:`FrameTooLarge`)."""
        buf = self._buf
        if len(buf) < HEADER.size:
            return False
        (length,) = HEADER.unpack_from(buf, 0)
        return length > self.max_frame or len(buf) >= HEADER.size + length

    def feed(self, data: bytes | bytearray | memoryview = b"") -> list[bytes]:
        """Add ``data``; return every whole frame body not returned before, in order."""
        self._append(data)
        out = []
        while (body := self._take()) is not None:
            out.append(body)
        return out

    def next_frame(self, data: bytes | bytearray | memoryview = b"") -> bytes | None:
        """Add ``data``; return the oldest whole frame body not returned before, or ``None``."""
        self._append(data)
        return self._take()

    def _append(self, data: bytes | bytearray | memoryview) -> None:
        if self._failed:
            raise FrameError("stream already failed: an earlier frame was too large")
        self._buf += data

    def _take(self) -> bytes | None:
        buf = self._buf
        size = HEADER.size
        if len(buf) < size:
            return None
        (length,) = HEADER.unpack_from(buf, 0)
        if length > self.max_frame:
            self._failed = True
            buf.clear()
            raise FrameTooLarge(length)
        end = size + length
        if len(buf) < end:
            return None
        with memoryview(buf) as view:
            body = bytes(view[size:end])
        del buf[:end]  # O(1) at the front of a bytearray
        self.last_start = self._start
        self._start += end
        return body


# --- socket helpers ----------------------------------------------------------


def send_message(sock: socket.socket, msg: Request | Reply, fds: Iterable[int] = ()) -> None:
    """Send one frame, with ``fds`` as SCM_RIGHTS ancillary data of the same ``sendmsg``.

    The fds are duplicated into the peer by the kernel; the caller still owns
    (and must close) its own copies.
    """
    frame = encode_frame(msg)
    fd_list = list(fds)
    if fd_list:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fd_list).tobytes())]
        sent = sock.sendmsg([frame], anc)
        if sent < len(frame):
            # The ancillary data went with the first byte; the rest is plain data.
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


# Both computed once: ``socket.MSG_CTRUNC`` is an enum.IntFlag, and ``int & flag`` goes
# through enum's Python ``__and__`` (~0.9 µs, once per received frame); CMSG_SPACE is a call.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FD_PER_MESSAGE * 4)


def fds_from_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an ``SCM_RIGHTS`` message of ``recvmsg``'s ancillary data carried."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
            fds.extend(arr)
    return fds


def _recv_chunk(sock: socket.socket, bufsize: int, cmsg_space: int, fds: list[int]) -> bytes:
    """One ``recvmsg``: the descriptors that came with it go onto ``fds`` (so the caller
    closes them on error too); truncated ancillary data is a :class:`FrameError`."""
    data, ancdata, msg_flags, _addr = sock.recvmsg(bufsize, cmsg_space, socket.MSG_CMSG_CLOEXEC)
    fds.extend(fds_from_ancillary(ancdata))
    if msg_flags & _MSG_CTRUNC:
        raise FrameError("ancillary data truncated: peer sent too many fds")
    return data


def recv_message(
    sock: socket.socket, reader: FrameReader, *, bufsize: int = 65536
) -> tuple[bytes | None, list[int]]:
    """Read until ``reader`` yields one whole frame; return ``(body, fds)``.

    ``fds`` are all descriptors that arrived while reading (close-on-exec); the
    caller owns them. ``body`` is ``None`` when the peer closed the connection
    before a whole frame arrived. Frames beyond the first in the same read stay
    in ``reader`` for the next call. Raises
    :class:`FrameTooLarge` (closing any fds received) and ``OSError``.
    """
    body = reader.next_frame()
    fds: list[int] = []
    try:
        while body is None:
            data = _recv_chunk(sock, bufsize, _CMSG_SPACE, fds)
            if not data:
                return None, fds
            body = reader.next_frame(data)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return body, fds


def __getattr__(name: str) -> object:
    """``ProtocolError``, the old name of :class:`FrameError`, still answers, with a
    :class:`DeprecationWarning`."""
    if name == "ProtocolError":
        import warnings

        warnings.warn(
            "maasd.protocol.ProtocolError is deprecated: use maasd.protocol.FrameError",
            DeprecationWarning,
            stacklevel=2,
        )
        return FrameError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
