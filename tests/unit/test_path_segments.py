"""A path is routed as the client wrote it: one id per segment, or a 400 before routing.

The pure check (:func:`maasd.api.paths.segment_problem`) on its own, then the app
in-process: every route of the OpenAPI document that takes an id, with an id
that would have moved the request to another route, is refused 400 without a
service call. The same attacks through a real daemon (whose HTTP server decodes
``%2F``) are in ``tests/integration/test_api_paths.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from bad_paths import ENCODED, id_routes
from inprocess_api import ADMIN_KEY, ServiceCalls, auth, client, service, snapshot
from maasd.api.paths import query_problem, segment_problem
from maasd.core import Service


@pytest.mark.parametrize(
    "raw",
    [
        b"/",
        b"/healthz",
        b"/v1/buffers/0123456789abcdef0123456789abcdef",
        b"/v1/pools/node-0.a_b/reserve",
        b"/v1/tenants/acme%20corp",  # an escape that is not a separator is the id's own business
        b"/v1/buffers/%252F",  # double-encoded: the id is the text "%2F", one segment
        b"/schema/openapi.json",
        b"/v1/tenants/a..b",
    ],
)
def test_paths_that_are_routed(raw: bytes) -> None:
    assert segment_problem(raw) is None


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"/v1/tenants/t%2Fkeys%2Fk", "encoded '/'"),
        (b"/v1/tenants/t%2fkeys%2fk", "encoded '/'"),
        (b"/v1/buffers/%2F", "encoded '/'"),
        (b"/v1/buffers/", "empty path segment"),
        (b"/v1/tenants//keys", "empty path segment"),
        (b"//v1/buffers", "empty path segment"),
        (b"/v1/buffers/.", "'.' path segment"),
        (b"/v1/buffers/..", "'..' path segment"),
        (b"/v1/tenants/t/keys/%2E%2E", "'..' path segment"),
        (b"/v1/tenants/t/keys/%2e", "'.' path segment"),
        (b"/v1/hosts/a%00b", "NUL byte"),  # PostgreSQL's text cannot hold one
    ],
)
def test_paths_that_are_refused(raw: bytes, why: str) -> None:
    problem = segment_problem(raw)
    assert problem is not None
    assert why in problem, problem


@pytest.mark.parametrize(
    "query",
    [b"", b"drain=true", b"limit=5&tenant_id=t&before=9", b"held=true&tenant_id=", b"a=1;a=2"],
)
def test_queries_that_are_read(query: bytes) -> None:
    assert query_problem(query) is None


@pytest.mark.parametrize(
    ("query", "name"),
    [
        (b"drain=false&drain=true", "drain"),
        (b"drain=false&dr%61in=true", "drain"),  # one spelling percent-encoded
        (b"tenant_id=a&held=true&tenant_id=b", "tenant_id"),
        (b"drain&drain=true", "drain"),  # a bare name counts as given
    ],
)
def test_queries_that_are_refused(query: bytes, name: str) -> None:
    problem = query_problem(query)
    assert problem is not None
    assert repr(name) in problem, problem
    assert "more than once" in problem, problem


@pytest.mark.parametrize(
    ("raw", "query"),
    [
        (b"/v1/buffers/a%00b", b""),
        (b"/v1/tenants/t/keys/%00", b""),
        (b"/v1/buffers", b"tenant_id=a%00b"),
        (b"/v1/events", b"limit=5&tenant%00_id=x"),
    ],
)
def test_a_nul_byte_in_a_path_or_query_is_refused(raw: bytes, query: bytes) -> None:
    """PostgreSQL refuses a NUL in a text lookup with an error (a 500), not a miss."""
    problem = segment_problem(raw) or query_problem(query)
    assert problem is not None
    assert "NUL" in problem, problem


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("api-paths"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(svc: Service) -> Iterator[TestClient[Litestar]]:
    with client(svc) as c:
        yield c


def routes(api: TestClient[Litestar]) -> list[tuple[str, str]]:
    return id_routes(api.get("/schema/openapi.json").json())


def test_the_openapi_document_lists_the_routes_with_ids(api: TestClient[Litestar]) -> None:
    found = routes(api)
    assert ("DELETE", "/v1/tenants/{tenant_id}/keys/{key_id}") in found
    assert len(found) >= 13, found


# (httpx removes literal '.' and '..' segments before sending; the real daemon's test
# sends them as written.)
@pytest.mark.parametrize("hostile", [h.format(tid="x", kid="y") for h in ENCODED])
def test_an_id_that_is_not_one_segment_is_refused_without_a_service_call(
    api: TestClient[Litestar], svc: Service, monkeypatch: pytest.MonkeyPatch, hostile: str
) -> None:
    before = snapshot(svc)
    calls = ServiceCalls(svc, monkeypatch)
    for method, template in routes(api):
        path = re.sub(r"\{[^}]+\}", hostile, template, count=1)
        path = re.sub(r"\{[^}]+\}", "0" * 32, path)
        r = api.request(method, path, headers=auth(ADMIN_KEY))
        assert r.request.url.raw_path == path.encode()
        assert r.status_code == 400, (method, path, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["type"].endswith("/invalid-request"), r.text
        assert "one path segment" in r.json()["detail"]
    assert not calls.counts, calls.counts
    assert snapshot(svc) == before
