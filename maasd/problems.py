"""The one mapping from :mod:`maasd.errors` to statuses and problem ``type`` URIs.

Shared by the REST API (RFC 9457 problem details, :mod:`maasd.api.problems`)
and the socket broker (``error`` frames), so a client sees the same status and
``type`` for the same failure on either face. Plain data: no web framework.
"""

from __future__ import annotations

from maasd import errors

#: Prefix of every problem ``type``; the last segment is the error's ``code``.
PROBLEM_BASE = "https://maasd.dev/problems/"

#: error class → status, checked in order with ``isinstance`` (subclasses such as
#: QuotaExceeded or QosUnmet inherit their parent's status). Anything not listed
#: is unexpected: 500.
STATUS: tuple[tuple[type[errors.MaasdError], int], ...] = (
    (errors.InvalidRequest, 400),
    (errors.Unauthorized, 401),
    (errors.Forbidden, 403),
    (errors.NotFound, 404),
    (errors.Conflict, 409),
    (errors.Unprocessable, 422),
    (errors.PoolExhausted, 507),
)


def status_of(exc: BaseException) -> int:
    """The status for ``exc``: its class's row of :data:`STATUS`, else 500."""
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def type_of(exc: errors.MaasdError) -> str:
    return PROBLEM_BASE + exc.code
