"""Typed exceptions of the maasd client, raised from REST problems and socket error frames.

The tree (the daemon's problem ``code`` — the last segment of a problem's ``type`` —
and its status; :data:`PROBLEMS` is the table, kept equal to the daemon's
``maasd.problems.catalog()`` by a test)::

    MaasdClientError              base: .status, .title, .detail, .type, .problem (the dict)
    ├── BadRequest                400  invalid-request: malformed body or bad field
    ├── Unauthorized              401  unauthorized: missing, unknown or revoked key
    ├── Forbidden                 403  forbidden: a tenant key on an admin route
    ├── NotFound                  404  not-found: unknown id, or another tenant's
    ├── MethodNotAllowed          405  method-not-allowed
    ├── Conflict                  409  conflict: clashes with current state
    │   ├── QuotaExceeded         409  quota-exceeded
    │   ├── BufferCountExceeded   409  buffer-count-exceeded: at the tenant's max_buffers
    │   ├── DuplicateKey          409  duplicate-key
    │   └── StateConflict         409  state-conflict
    ├── BodyTooLarge              413  body-too-large
    ├── UnsupportedMediaType      415  unsupported-media-type
    ├── Unprocessable             422  unprocessable: no resource could ever satisfy it
    │   ├── QosUnmet              422  qos-unmet
    │   ├── PlacementError        422  placement-error
    │   └── TooLarge              422  too-large
    ├── LimitExceeded             429  limit-exceeded: a per-tenant or per-peer cap
    ├── InsufficientStorage       507  insufficient-storage: could be met, but not now
    │   ├── PoolExhausted         507  pool-exhausted: the pool is full now
    │   ├── ResourceLimit         507  resource-limit: the daemon is at a limit of its own
    │   └── LedgerUnavailable     507  ledger-unavailable: its database cannot be reached now
    ├── ServerError               any other 5xx
    │   └── InternalError         500  internal: a bug of the daemon (see its log)
    ├── ConnectionFailed          transport failure: refused, timeout, socket closed (status 0)
    └── ProtocolError             the daemon answered something this client cannot understand

Not in the tree, because it is raised before anything is sent: :class:`InvalidReference`,
a ``ValueError`` for an id or name that cannot be one URL path segment (empty, ``.``,
``..``, or containing ``/``) — so that ``release("..")`` can never become ``DELETE /v1``.

A problem whose ``type`` is unknown to this client (a newer daemon) still gets the
class of its status (``Conflict`` for any 409, ``InsufficientStorage`` for any
507, …); any other status becomes a plain :class:`MaasdClientError`.

Example::

    try:
        client.reserve(size_bytes=1 << 30)
    except QuotaExceeded as exc:
        print(exc.status, exc.detail)   # 409 "tenant t-1 would use …"
    except InsufficientStorage:         # the pool is full, or the daemon at a limit: retry later
        ...
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "PROBLEMS",
    "BadRequest",
    "BodyTooLarge",
    "BufferCountExceeded",
    "Conflict",
    "ConnectionFailed",
    "DuplicateKey",
    "Forbidden",
    "InsufficientStorage",
    "InternalError",
    "InvalidReference",
    "LedgerUnavailable",
    "LimitExceeded",
    "MaasdClientError",
    "MethodNotAllowed",
    "NotFound",
    "PlacementError",
    "PoolExhausted",
    "ProtocolError",
    "QosUnmet",
    "QuotaExceeded",
    "ResourceLimit",
    "ServerError",
    "StateConflict",
    "TooLarge",
    "Unauthorized",
    "UnsupportedMediaType",
    "Unprocessable",
    "catalog",
    "error_from_problem",
]


class MaasdClientError(Exception):
    """Base of every error the client raises; carries the RFC 9457 problem details.

    ``code`` is the problem code the class stands for (the last segment of ``type``).
    """

    code: ClassVar[str] = ""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str = "",
        type: str | None = None,
        problem: dict[str, Any] | None = None,
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.type = type or "about:blank"
        self.problem: dict[str, Any] = (
            problem
            if problem is not None
            else {
                "type": self.type,
                "title": title,
                "status": status,
                "detail": detail,
            }
        )
        text = f"{status} {title}" if status else title
        if detail and detail != title:
            text += f": {detail}"
        super().__init__(text)


class BadRequest(MaasdClientError):
    """400: the request body or a field was malformed."""

    code = "invalid-request"


class Unauthorized(MaasdClientError):
    """401: no key, an unknown key, or a key revoked (also while a Worker is connected)."""

    code = "unauthorized"


class Forbidden(MaasdClientError):
    """403: a tenant key used for an admin-only operation."""

    code = "forbidden"


class NotFound(MaasdClientError):
    """404: an unknown id, or one that belongs to another tenant (indistinguishable)."""

    code = "not-found"


class MethodNotAllowed(MaasdClientError):
    """405: the route exists but not with this method (a client bug, or a path that met
    another route)."""

    code = "method-not-allowed"


class Conflict(MaasdClientError):
    """409: the request clashes with current state."""

    code = "conflict"


class QuotaExceeded(Conflict):
    """409: the tenant's live buffers plus this one would exceed its quota."""

    code = "quota-exceeded"


class BufferCountExceeded(Conflict):
    """409: the tenant holds its ``max_buffers`` live buffers already (after the daemon
    evicted what it could of the tenant's evictable entries)."""

    code = "buffer-count-exceeded"


class DuplicateKey(Conflict):
    """409: a live buffer of the tenant already carries this key."""

    code = "duplicate-key"


class StateConflict(Conflict):
    """409: the object's state forbids it (non-empty pool, volatile checkpoint, taken name)."""

    code = "state-conflict"


class BodyTooLarge(MaasdClientError):
    """413: the request body is larger than the daemon accepts."""

    code = "body-too-large"


class UnsupportedMediaType(MaasdClientError):
    """415: the request body is not JSON."""

    code = "unsupported-media-type"


class Unprocessable(MaasdClientError):
    """422: well-formed, but no resource of this daemon could ever satisfy it."""

    code = "unprocessable"


class QosUnmet(Unprocessable):
    """422: no pool meets the latency / persistence / NUMA node asked for."""

    code = "qos-unmet"


class PlacementError(Unprocessable):
    """422: a NUMA node that does not exist, or pages the kernel would not move there."""

    code = "placement-error"


class TooLarge(Unprocessable):
    """422: larger than the pool's whole capacity."""

    code = "too-large"


class LimitExceeded(MaasdClientError):
    """429: a per-tenant or per-peer cap (connections, requests in flight); close some, retry."""

    code = "limit-exceeded"


class InsufficientStorage(MaasdClientError):
    """507: the request is valid and could be met, but not now. Retry later."""

    code = "insufficient-storage"


class PoolExhausted(InsufficientStorage):
    """507: the pool could hold the request in principle, but is full now."""

    code = "pool-exhausted"


class ResourceLimit(InsufficientStorage):
    """507: the daemon is at a limit of its own (open files, threads, mappings);
    ``detail`` names it."""

    code = "resource-limit"


class LedgerUnavailable(InsufficientStorage):
    """507: the daemon's ledger database cannot be reached now; nothing changed, retry."""

    code = "ledger-unavailable"


class ServerError(MaasdClientError):
    """Any 5xx other than 507."""


class InternalError(ServerError):
    """500: an unexpected error in the daemon; the answer has no internals, its log has."""

    code = "internal"


class ConnectionFailed(MaasdClientError):
    """The daemon could not be reached, timed out, or closed the connection (status 0).

    ``timed_out`` tells a timeout (the daemon may be busy) from a refusal (it is not there).
    """

    def __init__(self, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(0, "Connection failed", detail, "about:blank")
        self.timed_out = timed_out


class ProtocolError(MaasdClientError):
    """The daemon's answer could not be understood (not JSON, wrong shape, missing fd)."""

    def __init__(self, detail: str, status: int = 0) -> None:
        super().__init__(status, "Protocol error", detail, "about:blank")


class InvalidReference(ValueError):
    """An id or name that cannot be sent as one URL path segment: empty, ``.`` or ``..``
    (which HTTP clients and servers normalise away), or containing ``/`` (which the daemon's
    server decodes from ``%2F`` back into a path separator). No id or name of maasd looks
    like that, so the request would at best be a 404 and at worst reach another route."""


#: problem code → (status, class): every problem the daemon can answer. Equal, code for
#: code and status for status, to ``maasd.problems.catalog()`` (tests/unit/test_client_parity.py).
PROBLEMS: dict[str, tuple[int, type[MaasdClientError]]] = {
    cls.code: (status, cls)
    for status, cls in (
        (400, BadRequest),
        (401, Unauthorized),
        (403, Forbidden),
        (404, NotFound),
        (405, MethodNotAllowed),
        (409, Conflict),
        (409, QuotaExceeded),
        (409, BufferCountExceeded),
        (409, DuplicateKey),
        (409, StateConflict),
        (413, BodyTooLarge),
        (415, UnsupportedMediaType),
        (422, Unprocessable),
        (422, QosUnmet),
        (422, PlacementError),
        (422, TooLarge),
        (429, LimitExceeded),
        (507, InsufficientStorage),
        (507, PoolExhausted),
        (507, ResourceLimit),
        (507, LedgerUnavailable),
        (500, InternalError),
    )
}

#: status → the class of a problem whose ``type`` this client does not know.
_BY_STATUS: dict[int, type[MaasdClientError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: Conflict,
    413: BodyTooLarge,
    415: UnsupportedMediaType,
    422: Unprocessable,
    429: LimitExceeded,
    507: InsufficientStorage,
}


def catalog() -> dict[str, int]:
    """Every problem code this client has a class for, with its status.

    >>> catalog()["pool-exhausted"], catalog()["buffer-count-exceeded"]
    (507, 409)
    """
    return {code: status for code, (status, _cls) in PROBLEMS.items()}


def _slug(type_: str) -> str:
    # "https://…/problems/quota-exceeded", "urn:maasd:problem:quota-exceeded", "…#quota-exceeded"
    for sep in "/:#":
        type_ = type_.rsplit(sep, 1)[-1]
    return type_


def _class_for(status: int, type_: str) -> type[MaasdClientError]:
    known = PROBLEMS.get(_slug(type_))
    if known is not None and known[0] == status:
        return known[1]
    by_status = _BY_STATUS.get(status)
    if by_status is not None:
        return by_status
    return ServerError if 500 <= status < 600 else MaasdClientError


def error_from_problem(status: int, problem: Any) -> MaasdClientError:
    """Build the typed exception for an error ``status`` and its (possibly absent) problem dict.

    >>> type(error_from_problem(507, {"type": "https://maasd.dev/problems/resource-limit"}))
    <class 'maasd.client.errors.ResourceLimit'>
    """
    if not isinstance(problem, dict):
        problem = {}
    title = problem.get("title")
    detail = problem.get("detail")
    type_ = problem.get("type")
    title = title if isinstance(title, str) else f"HTTP {status}"
    detail = detail if isinstance(detail, str) else ""
    type_ = type_ if isinstance(type_, str) else "about:blank"
    cls = _class_for(status, type_)
    full = dict(problem)
    full.setdefault("status", status)
    full.setdefault("title", title)
    full.setdefault("type", type_)
    full.setdefault("detail", detail)
    return cls(status, title, detail, type_, full)
