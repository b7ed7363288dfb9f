"""Hostile request bodies for ``maasd router`` (each must get a clear 4xx and leave the
router healthy), one table, in the style of ``bad_bodies.py``.

Shared by the unit test of the router's body check (``unit/test_router_guards.py``) and
the test through a real router and llama-server (``integration/test_router_bodies.py``).
Each row is ``(case, path, raw body bytes)``: raw, because several of these bodies are
not what ``json.dumps`` would ever write.
"""

from __future__ import annotations

from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

BAD_BODIES: list[tuple[str, str, bytes]] = [
    ("not-json", COMPLETIONS, b"{not json"),
    ("empty", COMPLETIONS, b""),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}'),
    ("json-array", COMPLETIONS, b'[{"prompt": "a"}]'),
    ("json-null", COMPLETIONS, b"null"),
    ("token-over-int64", COMPLETIONS, b'{"prompt": [1099511627776]}'),
    ("token-over-int32", COMPLETIONS, b'{"prompt": [2147483648]}'),
    ("negative-token", COMPLETIONS, b'{"prompt": [2, -5]}'),
    ("boolean-token", COMPLETIONS, b'{"prompt": [2, true]}'),
    ("float-token", COMPLETIONS, b'{"prompt": [2, 1.5]}'),
    ("lone-surrogate", COMPLETIONS, b'{"prompt": "a\\ud800"}'),
    ("lone-surrogate-key", COMPLETIONS, b'{"prompt": "a", "\\udfff": 1}'),
    ("nan", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}'),
    ("infinity", COMPLETIONS, b'{"prompt": "a", "temperature": -Infinity}'),
    ("huge-float", COMPLETIONS, b'{"prompt": "a", "temperature": 1e999}'),
    ("deeply-nested", COMPLETIONS, DEEP),
    ("chat-no-messages", CHAT, b'{"model": "x"}'),
    ("chat-messages-not-a-list", CHAT, b'{"messages": "hello"}'),
    ("chat-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
    ("chat-nan", CHAT, b'{"messages": [{"role": "user", "content": "a"}], "top_p": NaN}'),
]


def send(c: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return c.post(path, content=raw, headers={"content-type": "application/json"})


def assert_error_4xx(r: httpx.Response) -> dict[str, Any]:
    """An OpenAI-style error (what OpenAI clients parse): a 4xx, ``{"error": {"message",
    "type", "code"}}`` with a message that says something."""
    assert 400 <= r.status_code < 500, f"{r.status_code} {r.text[:300]}"
    body = r.json()
    err = body["error"]
    assert isinstance(err["message"], str)
    assert err["message"]
    assert err["code"] == r.status_code
    out: dict[str, Any] = err
    return out
