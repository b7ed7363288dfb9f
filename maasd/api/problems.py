"""Every error answer of the REST API: RFC 9457 ``application/problem+json``.

The body is :class:`maasd.problems.Problem` — built by
:func:`maasd.problems.problem_of` for maasd's own errors and by
:func:`maasd.problems.http_problem` for what only HTTP knows (405, 413, 415) —
so the REST API and the socket broker answer the same failure with the same
``status`` and ``type``. The framework's own 4xx (a bad query parameter, an
unknown route) become the maasd error they mean; anything else is a bug: a bland
500, logged.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Mapping

from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

from maasd import errors
from maasd.api.requests import ClientGone
from maasd.api.schemas import MAX_BODY
from maasd.problems import HTTP_ONLY, PROBLEM_BASE, Problem, http_problem, problem_of, status_of

__all__ = [
    "HANDLERS",
    "MEANING",
    "MEDIA_TYPE",
    "PROBLEM_BASE",
    "answer",
    "responses",
    "status_of",
]

logger = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"

#: What each error status means on this API (the OpenAPI ``description`` of the response).
MEANING = {
    400: "Malformed body, bad field, unknown field or bad parameter",
    401: "Missing, unknown or revoked API key",
    403: "A tenant key on an admin route or on /metrics, the admin key on a tenant-only "
    "route, or the metrics key anywhere but /metrics",
    404: "Unknown id, or an id that belongs to another tenant (indistinguishable)",
    409: "Quota exceeded, duplicate key, or a state conflict (taken name, non-empty pool, "
    "volatile checkpoint)",
    413: "Request body over 64 KiB",
    422: "QoS no pool meets, a NUMA node that does not exist, or larger than the pool",
    507: "Not now, nothing changed: the pool could hold the request but is full now "
    "(pool-exhausted), the daemon is at a limit of its own such as open files or "
    "connections (resource-limit), or the ledger database cannot serve now "
    "(ledger-unavailable)",
}

#: A 4xx the framework raises itself → the maasd error it means.
_FRAMEWORK_4XX: dict[int, type[errors.MaasdError]] = {
    400: errors.InvalidRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    429: errors.LimitExceeded,
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


def answer(problem: Problem, headers: Mapping[str, str] | None = None) -> Response[Problem]:
    """``problem`` as an HTTP answer (a 401 also says which scheme: ``WWW-Authenticate: Bearer``)."""
    out = dict(headers or {})
    if problem.status == 401:
        out["WWW-Authenticate"] = "Bearer"
    return Response(problem, status_code=problem.status, media_type=MEDIA_TYPE, headers=out)


def from_maasd_error(request: Request, exc: errors.MaasdError) -> Response[Problem]:
    problem = problem_of(exc)
    if problem.status == 500:
        return from_unexpected(request, exc)
    return answer(problem)


def from_client_gone(request: Request, _: ClientGone) -> Response[Problem]:
    """Not a bug: the client left, or the server closed it at its body deadline
    (maasd.api.server). Nobody reads this answer; it only must not log an error."""
    logger.debug("client gone before its body was read: %s", request.url.path)
    return answer(problem_of(errors.InvalidRequest("the request body was not complete")))


def from_http_exception(request: Request, exc: HTTPException) -> Response[Problem]:
    status = exc.status_code
    detail = _detail(request, exc)
    if status in _FRAMEWORK_4XX:
        problem = problem_of(_FRAMEWORK_4XX[status](detail))
    elif status in HTTP_ONLY:
        problem = http_problem(status, detail)
    else:
        return from_unexpected(request, exc)
    # e.g. the ``Allow`` header of a 405
    return answer(problem, {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"})


def from_unexpected(_: Request, exc: Exception) -> Response[Problem]:
    limit = process_limit(exc)
    if limit is not None:
        _limit_log(limit)
        return answer(problem_of(errors.ResourceLimit(limit)))
    logger.error("unhandled error: %s", exc, exc_info=exc)
    return answer(problem_of(exc))


#: errnos that mean a process limit, not a bug: open files (the process's, the system's),
#: threads/processes (``EAGAIN`` from ``clone``), memory for a thread's stack.
_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


def process_limit(exc: BaseException) -> str | None:
    """What process limit ``exc`` is the kernel's refusal of (the detail of a 507
    ``resource-limit``), or ``None`` for anything else: a thread that could not start
    (the thread limit, RLIMIT_NPROC or ``kernel.threads-max``), a file that could not
    open. Looks into exception groups (anyio raises them) and the ``__cause__`` chain."""
    seen = 0
    todo: list[BaseException] = [exc]
    while todo and seen < 16:
        e = todo.pop()
        seen += 1
        # The one error told apart by its text: CPython's threading raises a bare
        # RuntimeError("can't start new thread") when pthread_create fails, with no errno
        # or subclass to tell it from any other RuntimeError.
        if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
            return "the daemon is at its thread limit (RLIMIT_NPROC); retry shortly"
        if (
            isinstance(e, OSError)
            and e.errno in _LIMIT_ERRNOS
            and not isinstance(e, BlockingIOError)
        ):
            return f"the daemon is at a resource limit ({e.strerror or e}); retry shortly"
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        if e.__cause__ is not None:
            todo.append(e.__cause__)
    return None


_limit_logged = [0.0, 0]  # when the last line was written, refusals since


def _limit_log(detail: str) -> None:
    """At most one warning a second for requests refused at a process limit (a flood of
    them must not write a line, let alone a traceback, each)."""
    now = time.monotonic()
    if now - _limit_logged[0] < 1.0:
        _limit_logged[1] += 1
        return
    logger.warning(
        "REST request refused at a process limit: %s",
        detail,
        extra={"suppressed": _limit_logged[1]},
    )
    _limit_logged[0], _limit_logged[1] = now, 0


def _detail(request: Request, exc: HTTPException) -> str:
    """What the framework's exception means for this request, in a sentence."""
    status = exc.status_code
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        return "; ".join(_describe(e) for e in exc.extra)
    if isinstance(exc, NotFoundException):
        return f"no route {request.url.path}"
    if status == 405:
        allowed = (exc.headers or {}).get("allow", "")
        return f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    if status == 413:
        return f"the request body is over {MAX_BODY // 1024} KiB"
    return exc.detail or HTTP_ONLY.get(status, ("", "bad request"))[1]


def _describe(entry: object) -> str:
    if isinstance(entry, dict):
        msg, key = str(entry.get("message", "")), entry.get("key")
        if key == "data":  # the one body problem the framework sees: there is none
            return "the request body is empty; expected a JSON object"
        return f"{msg} - at {key}" if key else msg
    return str(entry)


HANDLERS = {
    errors.MaasdError: from_maasd_error,
    ClientGone: from_client_gone,
    HTTPException: from_http_exception,
    Exception: from_unexpected,
}
