"""Pure: the Redis key names of a tenant's L2 entries, and the value each one holds.

Every key of a tenant carries its id in a hash tag, so that a tenant's keys share one
slot (the scripts of :mod:`maasd.l2.client` touch several of them at once)::

    {prefix}:{<tenant id>}:e:<entry key>   an entry's value (below), with a TTL
    {prefix}:{<tenant id>}:lru             sorted set: entry keys by last write or hit
    {prefix}:{<tenant id>}:sizes           hash: entry key -> bytes of its value
    {prefix}:{<tenant id>}:bytes           the sum of those sizes (the tenant's cap is on it)

A value is a fixed header, the namespace it was written under, then the entry's bytes::

    magic "maasdL2\\0" | version u16 | flags u16 | tenant length u16 | key length u16 |
    data length u64 | XXH3-128 of all that follows the checksum field and of the
    header before it | tenant id | entry key | data

:func:`decode` refuses (:class:`Refused`, with a ``reason`` for the metrics) a value that
is not of this format, whose embedded tenant or key is not the one it was read under,
whose length disagrees with its header or passes the caller's bound, or whose checksum
does not match. The checksum finds corruption and truncation, not forgery: anyone who
can write to Redis can write a value that passes it (docs/scale-out.md, "Security").
"""

from __future__ import annotations

import struct

import xxhash

__all__ = [
    "GONE",
    "HEADER",
    "MAGIC",
    "VERSION",
    "Keys",
    "Refused",
    "SUM_AT",
    "checked",
    "decode",
    "digest",
    "encode_into",
    "value_size",
]

MAGIC = b"maasdL2\0"
VERSION = 1
#: magic, version, flags, tenant length, key length, data length, then the checksum.
_FIXED = struct.Struct("<8sHHHHQ")
_SUM_BYTES = 16
HEADER = _FIXED.size + _SUM_BYTES
#: Where a value's checksum lies (``SUM_AT`` to ``HEADER``): its identity, for a delete of
#: that very value (:func:`digest`).
SUM_AT = _FIXED.size

#: Why a value read back is refused (the ``reason`` label of ``maasd_l2_refused``).
REASONS = ("format", "namespace", "size", "checksum")


class Refused(Exception):
    """A value read from L2 that the daemon will not use; ``reason`` is one of REASONS.

    ``keep``: the value may well be fine for another daemon (one with a larger bound),
    so it stays in L2; any other refused value is dropped from it.
    """

    def __init__(self, reason: str, detail: str, *, keep: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.keep = keep


#: What a store answers when its tenant was deleted (by any host): nothing is left.
GONE = -2


class Keys:
    """The Redis key names of one tenant's part of L2."""

    __slots__ = ("_base", "bytes", "gone", "lru", "sizes")

    def __init__(self, prefix: str, tenant_id: str) -> None:
        self._base = f"{prefix}:{{{tenant_id}}}:"
        self.lru = self._base + "lru"
        self.sizes = self._base + "sizes"
        self.bytes = self._base + "bytes"
        self.gone = self._base + "gone"  # the tenant was deleted (a store is undone)

    def entry(self, key: str) -> str:
        return f"{self._base}e:{key}"


def value_size(tenant_id: str, key: str, data_len: int) -> int:
    """The bytes of the value that holds ``data_len`` bytes of an entry."""
    return HEADER + len(tenant_id.encode()) + len(key.encode()) + data_len


def encode_into(buf: bytearray, tenant_id: str, key: str) -> memoryview:
    """Write the header of the value in ``buf`` around the entry's bytes already at its end.

    ``buf`` is :func:`value_size` long; the caller filled its last bytes with the data
    (one copy: straight from the region). Returns a view of the whole value.
    """
    tenant, name = tenant_id.encode(), key.encode()
    head = HEADER + len(tenant) + len(name)
    data_len = len(buf) - head
    if data_len < 0:
        raise ValueError("buffer shorter than the header")
    view = memoryview(buf)
    fixed = _FIXED.pack(MAGIC, VERSION, 0, len(tenant), len(name), data_len)
    view[: _FIXED.size] = fixed
    view[HEADER : HEADER + len(tenant)] = tenant
    view[HEADER + len(tenant) : head] = name
    view[_FIXED.size : HEADER] = _checksum(fixed, view[HEADER:])
    return view


def decode(value: bytes, tenant_id: str, key: str, max_bytes: int) -> memoryview:
    """The entry's bytes in ``value`` (a view, no copy), read under ``tenant_id``/``key``.

    Raises :class:`Refused` for anything but a value :func:`encode_into` wrote for this
    very tenant and key, intact, of at most ``max_bytes`` bytes of data.
    """
    if len(value) < HEADER:
        raise Refused("format", f"{len(value)} bytes: shorter than a header")
    magic, version, _flags, tenant_len, key_len, data_len = _FIXED.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise Refused("format", "not a maasd L2 value of this version")
    head = HEADER + tenant_len + key_len
    if data_len == 0:
        raise Refused("size", "no data: no entry is empty")
    if data_len > max_bytes:
        raise Refused("size", f"{data_len} bytes of data: more than the {max_bytes} allowed")
    if len(value) != head + data_len:
        raise Refused("size", f"{len(value)} bytes, the header says {head + data_len}")
    view = memoryview(value)
    if (
        view[HEADER : HEADER + tenant_len] != tenant_id.encode()
        or view[HEADER + tenant_len : head] != key.encode()
    ):
        raise Refused("namespace", "written under another tenant or key than it was read from")
    if view[_FIXED.size : HEADER] != _checksum(view[: _FIXED.size], view[HEADER:]):
        raise Refused("checksum", "checksum mismatch")
    return view[head:]


def checked(value: bytes | int | None, tenant_id: str, key: str, max_bytes: int) -> memoryview:
    """:func:`decode` of what a fetch read: ``value``, or its length only (an ``int``: longer
    than the daemon reads back, not read — refused but kept, another daemon may read it),
    or ``None``: the key holds another type than a string (nothing a daemon wrote)."""
    if value is None:
        raise Refused("format", "another type than a string value")
    if isinstance(value, int):
        raise Refused("size", f"{value} bytes: more than this daemon reads back", keep=True)
    return decode(value, tenant_id, key, max_bytes)


def digest(value: bytes | memoryview) -> bytes:
    """The checksum field of ``value`` (one :func:`encode_into` wrote): what tells this
    value from another under the same key (another host's write, a newer one), so that a
    delete can drop this one only. Two values of the same tenant, key and bytes have the
    same digest — the same value."""
    if len(value) < HEADER:
        raise ValueError("shorter than a header")
    return bytes(value[SUM_AT:HEADER])


def _checksum(fixed: bytes | memoryview, rest: memoryview) -> bytes:
    h = xxhash.xxh3_128()
    h.update(fixed)
    h.update(rest)
    return h.digest()
