"""The one exception tree of maasd.

Every failure that a caller can act on is a :class:`MaasdError`. The tree::

    MaasdError                  base; never raised itself
    ├── InvalidRequest          a malformed, out-of-range or contradictory argument
    ├── Unauthorized            no credentials, an unknown key, or a revoked key
    ├── Forbidden               valid credentials that may not do this (tenant key on admin work)
    ├── NotFound                unknown id — or an id that belongs to another tenant
    ├── Conflict                the request is well-formed but clashes with current state
    │   ├── QuotaExceeded       the tenant's live buffers plus this one exceed its quota
    │   ├── BufferCountExceeded the tenant holds its ``max_buffers`` live buffers already
    │   ├── DuplicateKey        a live buffer of the tenant already carries this key
    │   └── StateConflict       wrong state: pool not empty, volatile checkpoint, taken name …
    ├── Unprocessable           no resource could ever satisfy the request as asked
    │   ├── QosUnmet            no pool meets the latency / persistence / node asked for
    │   ├── PlacementError      a NUMA node that does not exist (or cannot take the pages)
    │   └── TooLarge            larger than the pool's whole capacity
    ├── LimitExceeded           a per-tenant or per-peer cap (connections, requests in flight)
    ├── InsufficientStorage     the request could be met, but not now
    │   ├── PoolExhausted       the pool could hold it, but has too little free now
    │   ├── ResourceLimit       the daemon is at a limit of its own (open files, threads, …)
    │   └── LedgerUnavailable   the ledger database cannot be reached (or is busy) now
    ├── BackingError            the kernel refused a memory operation (errno and what was tried)
    └── ConfigError             the operator's configuration is unusable (never a request's fault)

This module knows nothing of HTTP. ``maasd.problems`` maps each class to a
status in one table, which the REST API turns into RFC 9457 problems and the
socket broker into error frames. ``code`` is the stable slug used as the last
path segment of a problem's ``type`` URI. ``ConfigError`` has no status: it
stops the daemon (or a CLI command) before anything is served.
"""

from __future__ import annotations

__all__ = [
    "BackingError",
    "BufferCountExceeded",
    "ConfigError",
    "Conflict",
    "DuplicateKey",
    "Forbidden",
    "InsufficientStorage",
    "InvalidRequest",
    "LedgerUnavailable",
    "LimitExceeded",
    "MaasdError",
    "NotFound",
    "PlacementError",
    "PoolExhausted",
    "QosUnmet",
    "QuotaExceeded",
    "ResourceLimit",
    "StateConflict",
    "TooLarge",
    "Unauthorized",
    "Unprocessable",
]


class MaasdError(Exception):
    """Base of every error maasd raises on purpose.

    ``detail`` is a sentence for a human that says what was wrong with *this*
    request; ``title`` is the short, fixed summary of the class.
    """

    code = "error"
    title = "maasd error"

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title


class InvalidRequest(MaasdError):
    """Raised for a bad argument: size ≤ 0, not an int, unknown enum, both or neither size field."""

    code = "invalid-request"
    title = "Invalid request"


class Unauthorized(MaasdError):
    """Raised when no key was given, or the key is unknown or revoked."""

    code = "unauthorized"
    title = "Unauthorized"


class Forbidden(MaasdError):
    """Raised when a tenant key is used for an admin-only operation."""

    code = "forbidden"
    title = "Forbidden"


class NotFound(MaasdError):
    """Raised for an unknown id, and for another tenant's id: the two are indistinguishable."""

    code = "not-found"
    title = "Not found"


class Conflict(MaasdError):
    """Raised when the request clashes with the current state of the ledger."""

    code = "conflict"
    title = "Conflict"


class QuotaExceeded(Conflict):
    """Raised when the tenant's live buffers plus the requested size would exceed its quota."""

    code = "quota-exceeded"
    title = "Quota exceeded"


class BufferCountExceeded(Conflict):
    """Raised when the tenant already holds its ``max_buffers`` live buffers (after evicting
    what it could of its own evictable ones)."""

    code = "buffer-count-exceeded"
    title = "Buffer count exceeded"


class DuplicateKey(Conflict):
    """Raised when a live buffer of the same tenant already carries the requested ``key``."""

    code = "duplicate-key"
    title = "Duplicate key"


class StateConflict(Conflict):
    """Raised for an operation the object's state forbids (non-empty pool, volatile checkpoint, taken name)."""

    code = "state-conflict"
    title = "State conflict"


class Unprocessable(MaasdError):
    """Raised when the request is well-formed but no resource of this daemon could ever satisfy it."""

    code = "unprocessable"
    title = "Unprocessable request"


class QosUnmet(Unprocessable):
    """Raised when no pool meets the requested latency class, persistence or NUMA node."""

    code = "qos-unmet"
    title = "QoS cannot be met"


class PlacementError(Unprocessable):
    """Raised for a NUMA node this host does not have, or pages the kernel would not move there."""

    code = "placement-error"
    title = "Placement failed"


class TooLarge(Unprocessable):
    """Raised when the requested size exceeds the pool's whole capacity (it could never fit)."""

    code = "too-large"
    title = "Request larger than the pool"


class LimitExceeded(MaasdError):
    """Raised when a per-tenant or per-peer cap is reached: connections on the worker socket,
    requests in flight. Others are not affected; the caller may retry after closing some."""

    code = "limit-exceeded"
    title = "Limit exceeded"


class InsufficientStorage(MaasdError):
    """Base of the "not now" errors: the request is valid and could be met, but not now."""

    code = "insufficient-storage"
    title = "Insufficient storage"


class PoolExhausted(InsufficientStorage):
    """Raised when the pool could hold the request in principle but has too little free now."""

    code = "pool-exhausted"
    title = "Pool exhausted"


class ResourceLimit(InsufficientStorage):
    """Raised when the daemon is at a limit of its own — open files, threads, mappings — that
    no single tenant's quota covers. ``detail`` names the limit."""

    code = "resource-limit"
    title = "Daemon resource limit"


class LedgerUnavailable(InsufficientStorage):
    """Raised when the ledger database cannot be reached now (PostgreSQL down or out of
    connections, SQLite locked past its busy timeout, the disk full). Nothing changed; the
    request may be retried. ``detail`` says what the database answered."""

    code = "ledger-unavailable"
    title = "Ledger unavailable"


class BackingError(MaasdError):
    """Raised when a memory syscall fails; carries the errno and the operation attempted.

    ``errno``: the kernel's answer; ``op``: the syscall that gave it (``"mmap"``,
    ``"fallocate"`` …), when one did — what a caller tells refusals apart by, never
    the detail's text.
    """

    code = "backing-error"
    title = "Memory backing failed"

    def __init__(
        self, detail: str = "", errno: int | None = None, *, op: str | None = None
    ) -> None:
        super().__init__(detail)
        self.errno = errno
        self.op = op


class ConfigError(MaasdError):
    """Raised for an unusable operator configuration: a bad setting, config file, database
    URL or admin key file. Never the fault of a request, so it has no HTTP status: it stops
    ``maasd serve`` (or a CLI command) with the message, before anything is served."""

    code = "config-error"
    title = "Configuration error"
