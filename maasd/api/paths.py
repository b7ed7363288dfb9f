"""One id per path segment, as the client wrote it — or a 400 before routing.

The HTTP server decodes a request path's percent-escapes before the app sees
it, so ``DELETE /v1/tenants/T%2Fkeys%2FK`` reached the router as
``/v1/tenants/T/keys/K``: another route, which revoked a key. The router also
folds ``//`` into ``/`` and drops a trailing ``/``, so an empty id moved a
request to its collection's route (``GET /v1/buffers/`` listed every buffer),
and ``.``/``..`` segments mean something to every URL library but the router.
A client that puts a user-supplied id into a path can therefore be steered to
another route.

:func:`one_segment_per_id` wraps the app in front of its router and refuses,
with a 400 problem, any path whose *raw* form (``scope["raw_path"]``, the
bytes on the wire) has an empty segment, a ``.`` or ``..`` segment (also
percent-encoded), or an encoded ``/`` (``%2F``) in a segment. No id or name
of the daemon can be any of these (ids are hex, names start with a letter or
digit), so nothing a well-behaved client sends is refused.

A NUL byte (``%00``) in a segment or in the query string is refused too: no id,
name or reference holds one, and PostgreSQL cannot even be asked about one (its
driver refuses the statement), which answered 500 for ``GET /v1/buffers/%00``.

>>> segment_problem(b"/v1/buffers/0f3a")
>>> segment_problem(b"/v1/tenants/t%2Fkeys%2Fk")
"an encoded '/' (%2F) in the path segment 't%2Fkeys%2Fk'"
>>> segment_problem(b"/v1/buffers/")
'an empty path segment'
>>> segment_problem(b"/v1/hosts/a%00b")
"a NUL byte (%00) in the path segment 'a%00b'"
>>> query_problem(b"tenant_id=%00")
'a NUL byte (%00) in the query string'
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes

import msgspec

from maasd.errors import InvalidRequest
from maasd.problems import problem_of

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

__all__ = ["one_segment_per_id", "query_problem", "segment_problem"]

_MEDIA_TYPE = b"application/problem+json"


def segment_problem(raw_path: bytes) -> str | None:
    """Why ``raw_path`` cannot be routed as written, or ``None`` when it can."""
    if raw_path == b"/":
        return None
    if not (b"%" in raw_path or b"//" in raw_path or b"/." in raw_path or raw_path[-1:] == b"/"):
        return None  # the common case, at the cost of three searches
    for segment in raw_path[1:].split(b"/"):
        if not segment:
            return "an empty path segment"
        text = unquote_to_bytes(segment)
        if b"/" in text:
            return f"an encoded '/' (%2F) in the path segment {segment.decode(errors='replace')!r}"
        if text in (b".", b".."):
            return f"a {text.decode()!r} path segment"
        if b"\0" in text:
            return f"a NUL byte (%00) in the path segment {segment.decode(errors='replace')!r}"
    return None


def query_problem(query: bytes) -> str | None:
    """Why ``query`` (a raw query string) cannot be taken, or ``None`` when it can."""
    if b"%00" in query or b"\0" in query:
        return "a NUL byte (%00) in the query string"
    return None


def one_segment_per_id(app: ASGIApp) -> ASGIApp:
    """``app`` behind a check of the raw path (:func:`segment_problem`): a 400 problem if it fails."""

    async def checked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # (the ASGI raw_path has no query string, but some test transports include it)
            raw = (scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
            why = segment_problem(raw)
            if why is not None:
                await _refuse(send, f"{why}: ids and names are one path segment each")
                return
            why = query_problem(scope.get("query_string", b""))
            if why is not None:
                await _refuse(send, f"{why}: no id or name holds one")
                return
        await app(scope, receive, send)

    return checked


async def _refuse(send: Send, detail: str) -> None:
    body = msgspec.json.encode(problem_of(InvalidRequest(detail)))
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", _MEDIA_TYPE),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
