"""The hostile request bodies (each must get a 4xx and change nothing), one table per body, for the API tests.

Shared by the tests through a real daemon (``integration/test_api_bad_input.py``)
and the in-process ones (``unit/test_api_bodies.py``); import as ``from
bad_bodies import RESERVE_BAD`` (``tests/`` is on pytest's ``pythonpath``).
Each table is ``[(case, body)]``; a body is JSON-encoded unless it is a
:class:`Raw`, which is sent as-is.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx

from maasd.bounds import MAX_LOOKUP_KEYS

KiB, MiB = 1 << 10, 1 << 20


class Raw:
    """A body sent as-is (bytes), with an explicit content type (``None``: no header)."""

    def __init__(self, content: bytes, content_type: str | None = "application/json") -> None:
        self.content, self.content_type = content, content_type

    def __repr__(self) -> str:
        return f"Raw({self.content[:24]!r}…, {self.content_type})"


def send(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, Raw):
        headers = {"content-type": body.content_type} if body.content_type else {}
        return c.request(method, path, content=body.content, headers=headers)
    return c.request(
        method,
        path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


def assert_problem_4xx(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, f"{r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert {"type", "title", "status", "detail"} <= body.keys(), body
    assert body["status"] == r.status_code
    assert isinstance(body["detail"], str)
    assert body["detail"]
    return body


DEEP = b"[" * 20_000 + b"]" * 20_000  # 40 KB: under the body limit, deeper than any decoder stack
DEEP_OBJECT = b'{"size_bytes":' + b'{"a":' * 6000 + b"1" + b"}" * 6001


def _common_bad_bodies() -> list[tuple[str, Any]]:
    """Bodies bad for any JSON-object route."""
    return [
        ("malformed-json", Raw(b'{"size_bytes": ')),
        ("unquoted-key", Raw(b"{size_bytes: 4096}")),
        ("trailing-garbage", Raw(b'{"size_bytes": 4096} x')),
        ("nan", Raw(b'{"size_bytes": NaN}')),
        ("invalid-utf8", Raw(b'{"label": "\xff\xfe"}')),
        ("json-array", [{"size_bytes": 4096}]),
        ("empty-array", []),
        ("json-scalar", 4096),
        ("json-string", "size_bytes"),
        ("json-null", None),
        ("empty-body", Raw(b"")),
        ("whitespace-body", Raw(b"   ")),
        ("text-plain", Raw(b'{"size_bytes": 4096}', "text/plain")),
        ("form-encoded", Raw(b"size_bytes=4096", "application/x-www-form-urlencoded")),
        ("no-content-type", Raw(b'{"size_bytes": 4096}', None)),
        ("over-64KiB", {"size_bytes": 4096, "label": "x" * (65 * KiB)}),
        ("deeply-nested-array", Raw(DEEP)),
        ("deeply-nested-object", Raw(DEEP_OBJECT)),
    ]


RESERVE_BAD: list[tuple[str, Any]] = [
    ("missing-size", {}),
    ("neither-size", {"ttl_s": 60, "label": "x"}),
    ("both-sizes", {"size_bytes": 4096, "size_gb": 0.001}),
    ("size-zero", {"size_bytes": 0}),
    ("size-negative", {"size_bytes": -4096}),
    ("size-2^63", {"size_bytes": 2**63}),
    ("size-2^64", {"size_bytes": 2**64}),
    ("size-huge-int", {"size_bytes": 10**40}),
    ("size-float", {"size_bytes": 4096.5}),
    ("size-float-integral", {"size_bytes": 4096.0}),
    ("size-string", {"size_bytes": "4096"}),
    ("size-bool", {"size_bytes": True}),
    ("size-null", {"size_bytes": None}),
    ("size-list", {"size_bytes": [4096]}),
    ("size-object", {"size_bytes": {"n": 4096}}),
    ("gb-zero", {"size_gb": 0}),
    ("gb-negative", {"size_gb": -1.0}),
    ("gb-huge", {"size_gb": 1e30}),
    ("gb-2^33", {"size_gb": 2.0**33}),
    ("gb-string", {"size_gb": "1"}),
    ("gb-bool", {"size_gb": True}),
    ("gb-null", {"size_gb": None}),
    ("gb-infinity", Raw(b'{"size_gb": Infinity}')),
    ("gb-1e400", Raw(b'{"size_gb": 1e400}')),
    ("unknown-field", {"size_bytes": 4096, "colour": "red"}),
    ("unknown-field-null", {"size_bytes": 4096, "pool": None}),
    ("tenant-id-field", {"size_bytes": 4096, "tenant_id": "0" * 32}),
    ("persistence-bad-enum", {"size_bytes": 4096, "persistence": "forever"}),
    ("persistence-case", {"size_bytes": 4096, "persistence": "Volatile"}),
    ("persistence-int", {"size_bytes": 4096, "persistence": 1}),
    ("evictable-string", {"size_bytes": 4096, "evictable": "yes"}),
    ("evictable-int", {"size_bytes": 4096, "evictable": 1}),
    ("evictable-null", {"size_bytes": 4096, "evictable": None}),
    ("label-129", {"size_bytes": 4096, "label": "l" * 129}),
    ("label-int", {"size_bytes": 4096, "label": 7}),
    ("key-513", {"size_bytes": 4096, "key": "k" * 513}),
    ("key-empty", {"size_bytes": 4096, "key": ""}),
    ("key-list", {"size_bytes": 4096, "key": ["a"]}),
    ("ttl-zero", {"size_bytes": 4096, "ttl_s": 0}),
    ("ttl-negative", {"size_bytes": 4096, "ttl_s": -60}),
    ("ttl-over-max", {"size_bytes": 4096, "ttl_s": 10**8}),
    ("ttl-2^63", {"size_bytes": 4096, "ttl_s": 2**63}),
    ("ttl-float", {"size_bytes": 4096, "ttl_s": 1.5}),
    ("ttl-string", {"size_bytes": 4096, "ttl_s": "60"}),
    ("ttl-bool", {"size_bytes": 4096, "ttl_s": True}),
    ("ttl-null", {"size_bytes": 4096, "ttl_s": None}),
    ("latency-negative", {"size_bytes": 4096, "latency_us": -1}),
    ("latency-string", {"size_bytes": 4096, "latency_us": "1"}),
    ("latency-2^64", {"size_bytes": 4096, "latency_us": 2**64}),
    ("latency-1e400", Raw(b'{"size_bytes": 4096, "latency_us": 1e400}')),
    ("latency-bool", {"size_bytes": 4096, "latency_us": True}),
    ("source-bad-enum", {"size_bytes": 4096, "latency_us": 1, "latency_source": "guessed"}),
    ("source-case", {"size_bytes": 4096, "latency_us": 1, "latency_source": "Measured"}),
    ("source-null", {"size_bytes": 4096, "latency_us": 1, "latency_source": None}),
    ("source-int", {"size_bytes": 4096, "latency_us": 1, "latency_source": 1}),
    ("source-without-ceiling", {"size_bytes": 4096, "latency_source": "measured"}),
    ("numa-negative", {"size_bytes": 4096, "numa_node": -1}),
    ("numa-string", {"size_bytes": 4096, "numa_node": "0"}),
    ("numa-huge", {"size_bytes": 4096, "numa_node": 2**40}),
    # a field twice: the decoder kept the last value, a proxy or a log may keep the first
    ("size-twice", Raw(b'{"size_bytes": 4096, "size_bytes": 8192}')),
    ("size-twice-escaped", Raw(b'{"size_bytes": 4096, "size_\\u0062ytes": 8192}')),
    *_common_bad_bodies(),
]


def pool_body(**over: Any) -> dict[str, Any]:
    return {
        "name": f"bad-{secrets.token_hex(3)}",
        "numa_node": 0,
        "capacity_bytes": 1 * MiB,
        **over,
    }


POOL_BAD: list[tuple[str, Any]] = [
    ("missing-name", {"numa_node": 0, "capacity_bytes": MiB}),
    ("missing-node", {"name": "bad-x", "capacity_bytes": MiB}),
    ("missing-capacity", {"name": "bad-x", "numa_node": 0}),
    ("name-empty", pool_body(name="")),
    ("name-space", pool_body(name="has space")),
    ("name-slash", pool_body(name="a/b")),
    ("name-65", pool_body(name="n" * 65)),
    ("name-leading-dot", pool_body(name=".hidden")),
    ("name-int", pool_body(name=5)),
    ("node-negative", pool_body(numa_node=-1)),
    ("node-string", pool_body(numa_node="0")),
    ("node-huge", pool_body(numa_node=2**63)),
    ("node-7", pool_body(numa_node=7)),
    ("capacity-zero", pool_body(capacity_bytes=0)),
    ("capacity-negative", pool_body(capacity_bytes=-1)),
    ("capacity-2^63", pool_body(capacity_bytes=2**63)),
    ("capacity-2^64", pool_body(capacity_bytes=2**64)),
    ("capacity-2^63-1", pool_body(capacity_bytes=2**63 - 1)),
    ("capacity-float", pool_body(capacity_bytes=1.5)),
    ("capacity-string", pool_body(capacity_bytes="1048576")),
    ("capacity-bool", pool_body(capacity_bytes=True)),
    ("backing-bad", pool_body(backing="disk")),
    ("persistence-bad", pool_body(persistence="sometimes")),
    ("scrub-bad", pool_body(scrub="shred")),
    ("prefault-string", pool_body(prefault="yes")),
    ("latency-negative", pool_body(latency_us=-1)),
    ("latency-float", pool_body(latency_us=0.5)),
    ("spill-dir-volatile", pool_body(spill_dir="/tmp/x")),
    ("spill-dir-empty", pool_body(persistence="persistent", spill_dir="")),
    ("unknown-field", pool_body(colour="red")),
    ("id-field", pool_body(id="0" * 32)),
    (
        "capacity-twice",
        Raw(
            b'{"name": "bad-twice", "numa_node": 0, "capacity_bytes": 4096, "capacity_bytes": 8192}'
        ),
    ),
    *_common_bad_bodies(),
]


TENANT_BAD: list[tuple[str, Any]] = [
    ("missing-name", {"quota_bytes": MiB}),
    ("missing-quota", {"name": "bad-t"}),
    ("name-empty", {"name": "", "quota_bytes": MiB}),
    ("name-space", {"name": "a b", "quota_bytes": MiB}),
    ("name-65", {"name": "n" * 65, "quota_bytes": MiB}),
    ("name-null", {"name": None, "quota_bytes": MiB}),
    ("quota-negative", {"name": "bad-t", "quota_bytes": -1}),
    ("quota-2^63", {"name": "bad-t", "quota_bytes": 2**63}),
    ("quota-2^64", {"name": "bad-t", "quota_bytes": 2**64}),
    ("quota-float", {"name": "bad-t", "quota_bytes": 1.5}),
    ("quota-string", {"name": "bad-t", "quota_bytes": "1"}),
    ("quota-bool", {"name": "bad-t", "quota_bytes": False}),
    ("unknown-field", {"name": "bad-t", "quota_bytes": MiB, "admin": True}),
    ("api-key-field", {"name": "bad-t", "quota_bytes": MiB, "api_key": "mine"}),
    ("quota-twice", Raw(b'{"name": "bad-t", "quota_bytes": 1, "quota_bytes": 99999999}')),
    *_common_bad_bodies(),
]


TENANT_PATCH_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("negative", {"quota_bytes": -1}),
    ("2^64", {"quota_bytes": 2**64}),
    ("string", {"quota_bytes": "1"}),
    ("null", {"quota_bytes": None}),
    ("null-with-cap", {"quota_bytes": None, "max_buffers": 5}),
    ("cap-zero", {"max_buffers": 0}),
    ("cap-negative", {"max_buffers": -1}),
    ("cap-huge", {"max_buffers": 2**40}),
    ("cap-string", {"max_buffers": "5"}),
    ("cap-float", {"max_buffers": 5.0}),
    ("cap-bool", {"max_buffers": True}),
    ("cap-null", {"max_buffers": None}),
    ("good-quota-bad-cap", {"quota_bytes": MiB, "max_buffers": 0}),
    ("rename", {"name": "other"}),
    ("unknown-field", {"quota_bytes": MiB, "name": "other"}),
    ("quota-twice", Raw(b'{"quota_bytes": 1, "quota_bytes": 99999999}')),
    *_common_bad_bodies(),
]


PIN_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("node-negative", {"numa_node": -1}),
    ("node-string", {"numa_node": "0"}),
    ("node-float", {"numa_node": 0.0}),
    ("node-bool", {"numa_node": False}),
    ("node-null", {"numa_node": None}),
    ("node-2^64", {"numa_node": 2**64}),
    ("node-1024", {"numa_node": 1024}),
    ("node-7", {"numa_node": 7}),
    ("unknown-field", {"numa_node": 0, "migrate": False}),
    ("node-twice", Raw(b'{"numa_node": 0, "numa_node": 0}')),
    *_common_bad_bodies(),
]


RENEW_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("ttl-zero", {"ttl_s": 0}),
    ("ttl-negative", {"ttl_s": -1}),
    ("ttl-over-max", {"ttl_s": 10**8}),
    ("ttl-2^64", {"ttl_s": 2**64}),
    ("ttl-float", {"ttl_s": 60.5}),
    ("ttl-string", {"ttl_s": "60"}),
    ("ttl-bool", {"ttl_s": True}),
    ("ttl-null", {"ttl_s": None}),
    ("unknown-field", {"ttl_s": 60, "forever": True}),
    ("ttl-twice", Raw(b'{"ttl_s": 60, "ttl_s": 120}')),
    *_common_bad_bodies(),
]


LOOKUP_BAD: list[tuple[str, Any]] = [
    ("empty-object", {}),
    ("keys-empty", {"keys": []}),
    ("keys-string", {"keys": "held"}),
    ("keys-null", {"keys": None}),
    ("keys-int-item", {"keys": [1]}),
    ("keys-null-item", {"keys": ["held", None]}),
    ("keys-empty-item", {"keys": [""]}),
    ("keys-513", {"keys": ["k" * 513]}),
    ("keys-1025", {"keys": [f"k{i}" for i in range(MAX_LOOKUP_KEYS + 1)]}),
    ("keys-object", {"keys": {"held": 1}}),
    ("unknown-field", {"keys": ["held"], "tenant_id": "0" * 32}),
    ("keys-twice", Raw(b'{"keys": ["nope"], "keys": ["held"]}')),
    *_common_bad_bodies(),
]
