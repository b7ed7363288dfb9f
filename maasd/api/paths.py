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
percent-encoded), an encoded ``/`` (``%2F``) in a segment, or a NUL (``%00``,
which PostgreSQL refuses in a lookup with an error, not a miss). No id or name
of the daemon can be any of these (ids are hex, names start with a letter or
digit), so nothing a well-behaved client sends is refused.

The query string gets the same treatment: a parameter given twice
(``DELETE /v1/pools/p?drain=false&drain=true``) was read as its last value, so
a proxy or log that reads the first saw another request than the daemon ran.
No parameter of the API takes a list, so :func:`query_problem` refuses a
repeated one (also when one spelling is percent-encoded), or one with a NUL,
with the same 400.

No id, name or reference holds a NUL, and PostgreSQL cannot even be asked about
one (its driver refuses the statement): ``GET /v1/buffers/%00`` answered 500.

>>> segment_problem(b"/v1/buffers/0f3a")
>>> segment_problem(b"/v1/tenants/t%2Fkeys%2Fk")
"an encoded '/' (%2F) in the path segment 't%2Fkeys%2Fk'"
>>> segment_problem(b"/v1/buffers/")
'an empty path segment'
>>> segment_problem(b"/v1/hosts/a%00b")
"a NUL byte (%00) in the path segment 'a%00b'"
>>> query_problem(b"tenant_id=%00")
"a NUL byte (%00) in the query parameter 'tenant_id'"
>>> query_problem(b"drain=false&dr%61in=true")
"the query parameter 'drain' given more than once"
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote_to_bytes

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
        if b"\x00" in text:
            return f"a NUL byte (%00) in the path segment {segment.decode(errors='replace')!r}"
        if text in (b".", b".."):
            return f"a {text.decode()!r} path segment"
    return None


def query_problem(query_string: bytes) -> str | None:
    """Why ``query_string`` cannot be read as written (a parameter given twice, a NUL
    byte), or ``None`` when it can."""
    if b"&" not in query_string and b"%" not in query_string:
        return None  # the common case: at most one parameter, nothing encoded
    seen: set[str] = set()
    for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            return f"a NUL byte (%00) in the query parameter {name!r}"
        if name in seen:
            return f"the query parameter {name!r} given more than once"
        seen.add(name)
    return None


def one_segment_per_id(app: ASGIApp) -> ASGIApp:
    """``app`` behind a check of the raw path (:func:`segment_problem`) and of the query
    string (:func:`query_problem`): a 400 problem if either fails."""

    async def checked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # (the ASGI raw_path has no query string, but some test transports include it)
            raw = (scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
            why = segment_problem(raw)
            if why is not None:
                await _refuse(send, f"{why}: ids and names are one path segment each")
                return
            why = query_problem(scope.get("query_string") or b"")
            if why is not None:
                await _refuse(send, f"{why}: a parameter takes one value, without NUL")
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
