"""Every bound a request must meet, and every default both sides share, declared once.

Both edges decode with these types, strictly and once: the REST bodies
(:mod:`maasd.api.schemas`) and the socket frames (:mod:`maasd.protocol`). The
layers below them (service, store, allocator) keep the *rules* — quota, the
daemon's ``max_ttl_s``, whether a NUMA node exists — and trust the *shape*.

Only msgspec and the standard library are imported here, so the client (which
never imports the server) shares the same bounds through :mod:`maasd.protocol`.

>>> import msgspec
>>> msgspec.json.decode(b'"acme"', type=Name)
'acme'
>>> try:
...     msgspec.json.decode(b'"acme\\\\n"', type=Name)
... except msgspec.ValidationError:
...     print("refused")
refused
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Literal

import msgspec

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_TTL_S",
    "DEFAULT_URL",
    "MAX_BUFFERS",
    "MAX_BYTES",
    "MAX_EVENTS",
    "MAX_ID",
    "MAX_KEY",
    "MAX_LABEL",
    "MAX_LOOKUP_KEYS",
    "MAX_NAME",
    "MAX_NODE",
    "MAX_SIZE_GIB",
    "MAX_WIRE_INT",
    "ID_PATTERN",
    "NAME_PATTERN",
    "NAME_RULE",
    "NO_NUL_PATTERN",
    "NO_NUL_RULE",
    "PATH_PATTERN",
    "PATH_RULE",
    "ApiKey",
    "Backing",
    "BufferKind",
    "BufferState",
    "Bytes",
    "EntryKey",
    "EntryAbortReason",
    "EntryKeys",
    "LookupKey",
    "EventKind",
    "EventLimit",
    "Id",
    "Label",
    "LatencyCeilingUs",
    "LatencySource",
    "LatencyUs",
    "MaxBuffers",
    "Name",
    "NodeId",
    "Persistence",
    "PositiveBytes",
    "Ref",
    "ReleaseReason",
    "ScrubMode",
    "SizeGiB",
    "SpillDir",
    "StoredKeys",
    "TtlS",
    "bytes_of_gib",
    "default_data_dir",
    "worker_socket",
]

#: Where the daemon's REST API listens unless told otherwise (``Settings.host``, ``.port``),
#: so where its clients look first (``maasctl``, ``maasd worker``: ``MAASD_URL``).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7878
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
#: A lease's length when none is asked for: a REST reserve's, a socket put's, and the
#: clients' (``Client.reserve``/``renew``, the ``Worker``'s renewals, ``maasd.llama``'s saves).
DEFAULT_TTL_S = 600


def default_data_dir() -> str:
    """The daemon's data dir unless told otherwise (``Settings.data_dir``, ``MAASD_DATA_DIR``):
    ``/var/lib/maasd`` as root, else ``$XDG_STATE_HOME/maasd`` or ``~/.local/state/maasd``.
    Its worker socket is ``maasd.sock`` in it (:func:`worker_socket`)."""
    if os.geteuid() == 0:
        return "/var/lib/maasd"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "maasd")


def worker_socket(data_dir: str | None = None) -> str:
    """The daemon's worker socket unless told otherwise (``Settings.socket``): ``maasd.sock``
    in ``data_dir`` — by default the one a client on this host assumes, ``MAASD_DATA_DIR``,
    else :func:`default_data_dir` (where ``maasd worker``, ``maasctl entries`` look)."""
    if data_dir is None:
        data_dir = os.environ.get("MAASD_DATA_DIR") or default_data_dir()
    return os.path.join(data_dir, "maasd.sock")


#: Largest byte count anywhere (sizes, quotas, capacities): it must fit an ``off_t``.
MAX_BYTES = (1 << 63) - 1
#: Largest NUMA node id accepted (Linux's MAX_NUMNODES is at most 1024).
MAX_NODE = 1023
#: Largest plain integer on the wire (TTLs, latency classes): a signed 32-bit int.
MAX_WIRE_INT = 2**31
#: Names of pools and tenants: 1..64 characters, a letter or digit first.
MAX_NAME = 64
#: What an id looks like (``maasd.tenancy.keys.new_id``): 32 lowercase hex characters.
ID_PATTERN = r"[0-9a-f]{32}"
#: ``(?!\n)$`` and not a bare ``$``: Python's ``$`` also matches before a trailing
#: newline, so ``"acme\n"`` would pass. (``\Z`` would say the same, but JSON Schema
#: regexes are ECMA-262, which has no ``\Z``; the lookahead means the same in both.)
#: (A name equal to another tenant's or pool's id is refused by the ledger, 409: references
#: — ``/v1/tenants/{ref}``, maasctl's NAME|ID — resolve ids first.)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(?!\n)$"
#: :data:`NAME_PATTERN` in words, for the message that refuses a name.
NAME_RULE = "a name: 1 to 64 letters, digits, '.', '_' or '-', beginning with a letter or a digit"
#: A buffer's free-text label.
MAX_LABEL = 128
#: A buffer's (prefix-cache) key.
MAX_KEY = 512
#: Keys in one lookup, ordered short → long (the longest held is found).
MAX_LOOKUP_KEYS = 1024
#: Ids (buffers, pools, tenants, keys) and "id or name" references. Ours are 32 hex
#: characters; a longer one cannot exist, but it is a 404, not a 400.
MAX_ID = 256
#: API keys as presented (ours are 49 characters).
MAX_API_KEY = 1024
#: ``size_gb`` is in GiB and must stay below 2^63 bytes.
MAX_SIZE_GIB = 2.0**33
#: A tenant's cap on its buffers at once (``max_buffers``).
MAX_BUFFERS = 1 << 24
#: Events in one page of the audit trail.
MAX_EVENTS = 1000
#: A spill directory path (Linux's PATH_MAX).
MAX_PATH = 4096
#: An absolute path without a NUL byte (the kernel refuses those; Python raises on them).
#: ``\x00`` means the same to Python's ``re`` and to JSON Schema's ECMA-262 regexes.
PATH_PATTERN = r"^/[^\x00]*$"
#: :data:`PATH_PATTERN` in words.
PATH_RULE = "an absolute path (beginning with '/') without a NUL character (\\u0000)"
#: Text the ledger stores or is asked about (labels, keys, ids, references): no NUL byte.
#: PostgreSQL's text cannot hold one — its driver refuses the whole statement, a 500 —
#: and SQLite's would then hold what PostgreSQL's cannot: refused on both, a 400.
NO_NUL_PATTERN = r"^[^\x00]*$"
#: :data:`NO_NUL_PATTERN` in words.
NO_NUL_RULE = "text without a NUL character (\\u0000)"

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=MAX_NAME)]
NodeId = Annotated[int, msgspec.Meta(ge=0, le=MAX_NODE)]
#: A byte count that may be 0 (quotas).
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
#: A byte count that must be > 0 (sizes, capacities).
PositiveBytes = Annotated[int, msgspec.Meta(gt=0, le=MAX_BYTES)]
SizeGiB = Annotated[float, msgspec.Meta(gt=0, lt=MAX_SIZE_GIB)]
LatencyUs = Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]
#: A reserve's latency ceiling: whole µs, or fractional ones (measured classes are).
LatencyCeilingUs = Annotated[float, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]
#: A lease length as asked for; the daemon's ``max_ttl_s`` is a rule, checked below.
TtlS = Annotated[int, msgspec.Meta(ge=1, le=MAX_WIRE_INT)]
Label = Annotated[str, msgspec.Meta(max_length=MAX_LABEL, pattern=NO_NUL_PATTERN)]
EntryKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY, pattern=NO_NUL_PATTERN)]
#: A socket lookup's keys: answered from memory (and L2), never by the ledger, so a NUL
#: byte in one only misses; unchecked for it, since a pattern on up to 1024 keys would
#: cost the worker's hot path several times the decode itself.
LookupKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY)]
EntryKeys = Annotated[list[LookupKey], msgspec.Meta(min_length=1, max_length=MAX_LOOKUP_KEYS)]
#: A REST lookup's keys, which the ledger is asked about.
StoredKeys = Annotated[list[EntryKey], msgspec.Meta(min_length=1, max_length=MAX_LOOKUP_KEYS)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID, pattern=NO_NUL_PATTERN)]
#: An id or a name (pools, tenants).
Ref = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID, pattern=NO_NUL_PATTERN)]
ApiKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_API_KEY)]
MaxBuffers = Annotated[int, msgspec.Meta(ge=1, le=MAX_BUFFERS)]
EventLimit = Annotated[int, msgspec.Meta(ge=1, le=MAX_EVENTS)]
SpillDir = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH, pattern=PATH_PATTERN)]

# -- Closed vocabularies: every value these fields can take, declared once. -----------------
# The server's records, its ledger rows and the allocator use them as they are; the client
# (which may grow older than the daemon) takes them for what it sends.

#: What a pool's memory is: ordinary shared memory, or huge pages.
Backing = Literal["memfd", "hugetlb"]
#: Whether a pool's buffers survive a restart (checkpointed to its spill dir) or not.
Persistence = Literal["volatile", "persistent"]
#: Which latency a reserve's ``latency_us`` is held against: the pool's declared class,
#: or the one the daemon measured of its node (docs/allocator.md, "Latency classes").
LatencySource = Literal["declared", "measured"]
#: How a released buffer is made to read zero: overwritten, or its pages punched out.
ScrubMode = Literal["zero", "punch"]
#: A buffer's state in the ledger: ``reserving`` (admitted, its region being made),
#: ``staged`` (a socket entry not yet committed), ``live``, ``releasing`` (being scrubbed).
BufferState = Literal["reserving", "staged", "live", "releasing"]
#: How a buffer was made: a REST reserve (``buffer``) or a socket put (``entry``).
BufferKind = Literal["buffer", "entry"]
#: Why a staged entry was released before its commit (``maasd_entry_aborts``' reason).
EntryAbortReason = Literal["abort", "disconnect", "commit_failed"]
#: Why a buffer ended: the kind of the event its release records, and the ``reason``
#: label of ``maasd_release``.
ReleaseReason = Literal[
    EntryAbortReason,
    "release",
    "expire",
    "evict",
    "tenant_delete",
    "pool_drain",
    "shutdown",
    "recover",
    "reserve_failed",
]
#: The kinds of the audit trail's events: every release reason, and the changes to
#: buffers, tenants, keys, pools and hosts.
EventKind = Literal[
    ReleaseReason,
    "reserve",
    "tenant_create",
    "tenant_delete",
    "quota_set",
    "max_buffers_set",
    "disk_quota_set",
    "key_issue",
    "key_revoke",
    "pool_create",
    "pool_delete",
    "host_forget",
]


def explain(message: str) -> str:
    """A msgspec validation ``message`` with :data:`NAME_PATTERN`, :data:`PATH_PATTERN`
    and :data:`NO_NUL_PATTERN` said in words.

    >>> try:
    ...     msgspec.json.decode(b'{"name": "no/slash"}', type=dict[str, Name])
    ... except msgspec.ValidationError as e:
    ...     print(explain(str(e)).endswith("beginning with a letter or a digit - at `$[...]`"))
    True
    """
    message = message.replace(f"`str` matching regex {NAME_PATTERN!r}", NAME_RULE)
    message = message.replace(f"`str` matching regex {PATH_PATTERN!r}", PATH_RULE)
    return message.replace(f"`str` matching regex {NO_NUL_PATTERN!r}", NO_NUL_RULE)


def bytes_of_gib(gib: float) -> int:
    """``gib`` GiB (2^30 bytes) as a whole number of bytes, rounded up; at least 1.

    The caller has decoded ``gib`` as :data:`SizeGiB` (finite, > 0, < 2^33).

    >>> bytes_of_gib(0.5), bytes_of_gib(1e-12)
    (536870912, 1)
    """
    return max(1, math.ceil(gib * (1 << 30)))
