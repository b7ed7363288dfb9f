"""The hostile path ids: values that are not one path segment, and the routes to try them on.

Shared by the tests through a real daemon (``integration/test_api_paths.py``)
and the in-process ones (``unit/test_path_segments.py``); import as ``from
bad_paths import id_routes`` (``tests/`` is on pytest's ``pythonpath``).
"""

from __future__ import annotations

from typing import Any

#: Ids that an HTTP client can send as written; ``{tid}``/``{kid}`` name real ids.
ENCODED = ["{tid}%2Fkeys%2F{kid}", "x%2f..%2fy", "%2F", "%2E%2E", "%2e", "", "{tid}%00"]
#: Dot segments, which httpx (and every URL library) removes before sending.
DOTS = ["..", "."]


def id_routes(openapi: dict[str, Any]) -> list[tuple[str, str]]:
    """``(method, path template)`` of every route of an OpenAPI document that takes an id."""
    return [
        (method.upper(), path)
        for path, item in openapi["paths"].items()
        if "{" in path
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    ]
