"""Typed exceptions of the maasd client, raised from REST problems and socket error frames.

The tree::

    MaasdClientError            base: .status, .title, .detail, .type, .problem (the dict)
    ├── BadRequest              400  malformed body or bad field
    ├── Unauthorized            401  missing, unknown or revoked key
    ├── Forbidden               403  a tenant key on an admin route
    ├── NotFound                404  unknown id, or another tenant's
    ├── Conflict                409  clashes with current state
    │   ├── QuotaExceeded       409  ``type`` ends in ``quota-exceeded``
    │   ├── DuplicateKey        409  ``type`` ends in ``duplicate-key``
    │   └── StateConflict       409  ``type`` ends in ``state-conflict``
    ├── Unprocessable           422  no resource of this daemon could ever satisfy it
    │   ├── QosUnmet            422  ``type`` ends in ``qos-unmet``
    │   ├── PlacementError      422  ``type`` ends in ``placement-error``
    │   └── TooLarge            422  ``type`` ends in ``too-large``
    ├── PoolExhausted           507  the pool could hold it, but is full now
    ├── ServerError             any other 5xx
    ├── ConnectionFailed        transport failure: refused, timeout, socket closed (status 0)
    └── ProtocolError           the daemon answered something this client cannot understand

Example::

    try:
        client.reserve(size_bytes=1 << 30)
    except QuotaExceeded as exc:
        print(exc.status, exc.detail)   # 409 "tenant t-1 would use …"

Any other status becomes a plain :class:`MaasdClientError`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadRequest",
    "Conflict",
    "ConnectionFailed",
    "DuplicateKey",
    "Forbidden",
    "MaasdClientError",
    "NotFound",
    "PlacementError",
    "PoolExhausted",
    "ProtocolError",
    "QosUnmet",
    "QuotaExceeded",
    "ServerError",
    "StateConflict",
    "TooLarge",
    "Unauthorized",
    "Unprocessable",
    "error_from_problem",
]


class MaasdClientError(Exception):
    """Base of every error the client raises; carries the RFC 9457 problem details."""

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


class Unauthorized(MaasdClientError):
    """401: no key, an unknown key, or a key revoked (also while a Worker is connected)."""


class Forbidden(MaasdClientError):
    """403: a tenant key used for an admin-only operation."""


class NotFound(MaasdClientError):
    """404: an unknown id, or one that belongs to another tenant (indistinguishable)."""


class Conflict(MaasdClientError):
    """409: the request clashes with current state."""


class QuotaExceeded(Conflict):
    """409: the tenant's live buffers plus this one would exceed its quota."""


class DuplicateKey(Conflict):
    """409: a live buffer of the tenant already carries this key."""


class StateConflict(Conflict):
    """409: the object's state forbids it (non-empty pool, volatile checkpoint, taken name)."""


class Unprocessable(MaasdClientError):
    """422: well-formed, but no resource of this daemon could ever satisfy it."""


class QosUnmet(Unprocessable):
    """422: no pool meets the latency / persistence / NUMA node asked for."""


class PlacementError(Unprocessable):
    """422: a NUMA node that does not exist, or pages the kernel would not move there."""


class TooLarge(Unprocessable):
    """422: larger than the pool's whole capacity."""


class PoolExhausted(MaasdClientError):
    """507: the pool could hold the request in principle, but is full now."""


class ServerError(MaasdClientError):
    """Any 5xx other than 507."""


class ConnectionFailed(MaasdClientError):
    """The daemon could not be reached, timed out, or closed the connection (status 0)."""

    def __init__(self, detail: str) -> None:
        super().__init__(0, "Connection failed", detail, "about:blank")


class ProtocolError(MaasdClientError):
    """The daemon's answer could not be understood (not JSON, wrong shape, missing fd)."""

    def __init__(self, detail: str, status: int = 0) -> None:
        super().__init__(status, "Protocol error", detail, "about:blank")


_BY_STATUS: dict[int, type[MaasdClientError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: Unprocessable,
    507: PoolExhausted,
}

#: (status, last segment of ``type``) -> a more specific class.
_BY_TYPE: dict[tuple[int, str], type[MaasdClientError]] = {
    (409, "quota-exceeded"): QuotaExceeded,
    (409, "duplicate-key"): DuplicateKey,
    (409, "state-conflict"): StateConflict,
    (422, "qos-unmet"): QosUnmet,
    (422, "placement-error"): PlacementError,
    (422, "too-large"): TooLarge,
}


def _slug(type_: str) -> str:
    # "https://…/problems/quota-exceeded", "urn:maasd:problem:quota-exceeded", "…#quota-exceeded"
    for sep in "/:#":
        type_ = type_.rsplit(sep, 1)[-1]
    return type_


def error_from_problem(status: int, problem: Any) -> MaasdClientError:
    """Build the typed exception for an error ``status`` and its (possibly absent) problem dict."""
    if not isinstance(problem, dict):
        problem = {}
    title = problem.get("title")
    detail = problem.get("detail")
    type_ = problem.get("type")
    title = title if isinstance(title, str) else f"HTTP {status}"
    detail = detail if isinstance(detail, str) else ""
    type_ = type_ if isinstance(type_, str) else "about:blank"
    cls = _BY_TYPE.get((status, _slug(type_)))
    if cls is None:
        cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if 500 <= status < 600 else MaasdClientError
    full = dict(problem)
    full.setdefault("status", status)
    full.setdefault("title", title)
    full.setdefault("type", type_)
    full.setdefault("detail", detail)
    return cls(status, title, detail, type_, full)
