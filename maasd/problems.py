"""The one error contract of maasd: every failure → ``(status, type, title, detail)``.

Used by both faces: the REST API answers RFC 9457 ``application/problem+json``
(:mod:`maasd.api.problems`), the socket broker answers ``error`` frames with the
same four fields. A client therefore sees the same status and ``type`` for the
same failure on either face, and ``maasd.client.errors`` maps them back to
typed exceptions (a test keeps its table equal to :func:`catalog`).

Plain data, no web framework: the API and the broker each turn a
:class:`Problem` into their own wire shape.

>>> from maasd import errors
>>> problem_of(errors.QuotaExceeded("tenant t uses 9 of 10 bytes")).type
'https://maasd.dev/problems/quota-exceeded'
>>> problem_of(errors.QuotaExceeded("x")).status
409
"""

from __future__ import annotations

import msgspec

from maasd import errors

__all__ = [
    "PROBLEM_BASE",
    "STATUS",
    "Problem",
    "catalog",
    "http_problem",
    "problem_of",
    "status_of",
]

#: Prefix of every problem ``type``; the last segment is the error's ``code``.
PROBLEM_BASE = "https://maasd.dev/problems/"

#: error class → status, checked in order with ``isinstance`` (subclasses such as
#: QuotaExceeded or PoolExhausted inherit their parent's status). Anything not
#: listed — BackingError, ConfigError, any other exception — reaching a caller is a
#: bug of the daemon: 500, logged, with no internals in the answer.
STATUS: tuple[tuple[type[errors.MaasdError], int], ...] = (
    (errors.InvalidRequest, 400),
    (errors.Unauthorized, 401),
    (errors.Forbidden, 403),
    (errors.NotFound, 404),
    (errors.Conflict, 409),
    (errors.Unprocessable, 422),
    (errors.LimitExceeded, 429),
    (errors.InsufficientStorage, 507),
)

#: Problems that only the HTTP layer produces (no maasd error class stands behind
#: them): status → (code, title).
HTTP_ONLY: dict[int, tuple[str, str]] = {
    405: ("method-not-allowed", "Method not allowed"),
    413: ("body-too-large", "Request body too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
}

#: The answer to anything unexpected (a bug): no internals leak into it.
INTERNAL = ("internal", "Internal error", "an unexpected error occurred; see the daemon log")


class Problem(msgspec.Struct, frozen=True):
    """RFC 9457 problem details, as both faces send them."""

    type: str
    title: str
    status: int
    detail: str


def status_of(exc: BaseException) -> int:
    """The status for ``exc``: its class's row of :data:`STATUS`, else 500."""
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def problem_of(exc: BaseException) -> Problem:
    """The problem a caller sees for ``exc``; unexpected errors become a bland 500."""
    status = status_of(exc)
    if status == 500 or not isinstance(exc, errors.MaasdError):
        code, title, detail = INTERNAL
        return Problem(type=PROBLEM_BASE + code, title=title, status=500, detail=detail)
    return Problem(type=PROBLEM_BASE + exc.code, title=exc.title, status=status, detail=exc.detail)


def http_problem(status: int, detail: str) -> Problem:
    """A problem for a status the HTTP layer produced itself (see :data:`HTTP_ONLY`)."""
    code, title = HTTP_ONLY.get(status, INTERNAL[:2])
    return Problem(type=PROBLEM_BASE + code, title=title, status=status, detail=detail or title)


def _leaves(cls: type[errors.MaasdError]) -> list[type[errors.MaasdError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _leaves(sub))]


def catalog() -> dict[str, int]:
    """Every problem ``code`` the daemon can answer, with its status (for clients and docs).

    >>> catalog()["pool-exhausted"], catalog()["body-too-large"]
    (507, 413)
    """
    out = {
        cls.code: status_of(cls()) for cls in _leaves(errors.MaasdError) if status_of(cls()) != 500
    }
    out.update({code: status for status, (code, _title) in HTTP_ONLY.items()})
    out[INTERNAL[0]] = 500
    return out
