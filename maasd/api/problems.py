"""RFC 9457 problem answers for :mod:`maasd.errors` (via :mod:`maasd.problems`) and framework errors.

Every error the API answers is ``application/problem+json`` with ``type``,
``title``, ``status`` and ``detail``; ``type`` is ``PROBLEM_BASE + code`` so a
client can branch on its last segment (``…/quota-exceeded``,
``…/pool-exhausted``).
"""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

from maasd import errors
from maasd.problems import PROBLEM_BASE, status_of

logger = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"

_GENERIC = {
    400: ("bad-request", "Bad request"),
    401: ("unauthorized", "Unauthorized"),
    403: ("forbidden", "Forbidden"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    413: ("too-large", "Request body too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
    429: ("too-many-requests", "Too many requests"),
}


class Problem(msgspec.Struct, frozen=True):
    type: str
    title: str
    status: int
    detail: str


#: What each error status means on this API (the OpenAPI ``description`` of the response).
MEANING = {
    400: "Malformed body, bad field, unknown field or bad parameter",
    401: "Missing, unknown or revoked API key",
    403: "A tenant key on an admin route, or the admin key on a tenant-only route",
    404: "Unknown id, or an id that belongs to another tenant (indistinguishable)",
    409: "Quota exceeded, duplicate key, or a state conflict (taken name, non-empty pool, "
    "volatile checkpoint)",
    413: "Request body over 64 KiB",
    422: "QoS no pool meets, a NUMA node that does not exist, or larger than the pool",
    507: "The pool could hold the request but is full now",
}


def responses(*codes: int) -> dict[int, ResponseSpec]:
    """OpenAPI declarations of the problem answers a route can give (``responses=`` of a handler)."""
    return {
        code: ResponseSpec(
            data_container=Problem,
            description=MEANING[code],
            media_type=MEDIA_TYPE,
            generate_examples=False,
        )
        for code in codes
    }


def problem(status: int, code: str, title: str, detail: str) -> Response[Problem]:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(
        Problem(type=PROBLEM_BASE + code, title=title, status=status, detail=detail),
        status_code=status,
        media_type=MEDIA_TYPE,
        headers=headers,
    )


def from_maasd_error(_: Request, exc: errors.MaasdError) -> Response[Problem]:
    status = status_of(exc)
    if status >= 500 and status != 507:
        logger.error("internal error: %s", exc.detail, exc_info=exc)
    return problem(status, exc.code, exc.title, exc.detail)


def from_http_exception(_: Request, exc: HTTPException) -> Response[Problem]:
    status = exc.status_code
    code, title = _GENERIC.get(status, ("http-error", "HTTP error"))
    detail = exc.detail or title
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        detail = "; ".join(_describe(e) for e in exc.extra)
    return problem(status, code, title, detail)


def from_recursion(request: Request, exc: RecursionError) -> Response[Problem]:
    """A JSON body nested deeper than the decoder's stack (``[[[[…]]]]`` well under 64 KiB).

    The framework decodes the body before the handler runs, so this surfaces as a bare
    ``RecursionError``; it is the client's input, not a fault of ours. Any other
    ``RecursionError`` is still an internal error.
    """
    if "deserializ" in str(exc):
        return problem(
            400, "bad-request", "Bad request", "malformed JSON: the body is nested too deeply"
        )
    return from_unexpected(request, exc)


def from_unexpected(_: Request, exc: Exception) -> Response[Problem]:
    logger.exception("unhandled error", exc_info=exc)
    return problem(
        500, "internal", "Internal error", "an unexpected error occurred; see the daemon log"
    )


def _describe(entry: object) -> str:
    if isinstance(entry, dict):
        msg, key = entry.get("message", ""), entry.get("key")
        if key == "data" and msg == "'data'":  # the framework's KeyError for an absent body
            return "the request body is empty; expected a JSON object"
        return f"{msg} - at {key}" if key and key != "data" else str(msg)
    return str(entry)


HANDLERS = {
    errors.MaasdError: from_maasd_error,
    HTTPException: from_http_exception,
    RecursionError: from_recursion,
    Exception: from_unexpected,
}
