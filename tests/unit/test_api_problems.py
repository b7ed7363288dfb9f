"""One error contract, in-process: every error answer is a problem of ``maasd.problems``.

The slugs the HTTP layer adds (404 and 405 for routing, 413, a bad parameter),
the bland 500 of a bug, ``/healthz`` with a failing component, and the slug
table of docs/api.md checked against :func:`maasd.problems.catalog`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from inprocess_api import ADMIN_KEY, auth, client, service, snapshot
from maasd.api.health import of_checks
from maasd.core import Service
from maasd.problems import PROBLEM_BASE, catalog

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("api-problems"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(svc: Service) -> Iterator[TestClient[Litestar]]:
    with client(svc) as c:
        c.headers.update(auth(ADMIN_KEY))
        yield c


def problem(r, status: int, slug: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["type"] == PROBLEM_BASE + slug, body
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    return body


@pytest.mark.parametrize("path", ["/nope", "/v1", "/v1/nope", "/v2/pools", "/v1/pools/node0/nope"])
def test_unknown_route_is_a_404_problem(api: TestClient[Litestar], path: str) -> None:
    body = problem(api.get(path), 404, "not-found")
    assert path in body["detail"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/usage", {"GET"}),
        ("DELETE", "/healthz", {"GET"}),
        ("POST", "/metrics", {"GET"}),
        ("PATCH", "/v1/pools", {"GET", "POST"}),
        ("GET", "/v1/reserve", {"POST"}),
    ],
)
def test_wrong_method_is_a_405_problem(
    api: TestClient[Litestar], method: str, path: str, allowed: set[str]
) -> None:
    r = api.request(method, path)
    body = problem(r, 405, "method-not-allowed")
    assert method in body["detail"]
    assert allowed <= {m.strip() for m in r.headers["allow"].split(",")}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/v1/pools/node0?drain=maybe"),
        ("DELETE", "/v1/pools/node0?drain=2"),
        ("GET", "/v1/events?limit=0"),
        ("GET", "/v1/events?limit=1001"),
        ("GET", "/v1/events?limit=ten"),
        ("GET", "/v1/events?before=-1"),
        ("GET", "/v1/events?before=99999999999999999999999"),
    ],
)
def test_bad_query_parameter_is_invalid_request(
    svc: Service, api: TestClient[Litestar], method: str, path: str
) -> None:
    before = snapshot(svc)
    name = path.split("?")[1].split("=")[0]
    body = problem(api.request(method, path), 400, "invalid-request")
    assert name in body["detail"]
    assert snapshot(svc) == before


def test_413_is_body_too_large(api: TestClient[Litestar]) -> None:
    r = api.post("/v1/pools", content=b"{" + b" " * (65 * 1024) + b"}")
    problem(r, 413, "body-too-large")


def test_a_bug_is_a_bland_500(
    svc: Service, api: TestClient[Litestar], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("internal state: /secret/path")

    monkeypatch.setattr(svc, "pools", broken)
    body = problem(api.get("/v1/pools"), 500, "internal")
    assert "secret" not in body["detail"]


def test_healthz_ok_is_exactly_the_spec_answer(svc: Service) -> None:
    for health in (None, of_checks({}), of_checks({"broker": lambda: (True, "")})):
        with client(svc, health=health) as c:
            r = c.get("/healthz")
        assert r.status_code == 200
        assert r.json() == {"status": "ok"}


def test_healthz_with_a_failing_component_is_503(svc: Service) -> None:
    def raises() -> tuple[bool, str]:
        raise OSError("no such thread")

    health = of_checks(
        {
            "broker": lambda: (False, "accept thread is not running"),
            "ledger": lambda: (True, ""),
            "flaky": raises,
        }
    )
    with client(svc, health=health) as c:
        r = c.get("/healthz")
        assert r.status_code == 503
        assert r.headers["content-type"].startswith("application/json")
        assert r.json() == {
            "status": "unhealthy",
            "components": {
                "broker": {"ok": False, "detail": "accept thread is not running"},
                "ledger": {"ok": True, "detail": "ok"},
                "flaky": {
                    "ok": False,
                    "detail": "the check itself failed: OSError: no such thread",
                },
            },
        }
        # the API itself still answers
        assert c.get("/v1/pools", headers=auth(ADMIN_KEY)).status_code == 200


def test_healthz_when_the_health_callable_itself_raises(svc: Service) -> None:
    def broken() -> dict[str, tuple[bool, str]]:
        raise RuntimeError("boom")

    with client(svc, health=broken) as c:
        r = c.get("/healthz")
    assert r.status_code == 503
    assert r.json()["components"]["health"]["ok"] is False


def test_docs_slug_table_is_the_catalog() -> None:
    """docs/api.md lists every problem ``type`` the daemon can answer, with its status."""
    rows = re.findall(r"^\| (\d{3}) \| `([a-z-]+)` \|", DOCS.read_text(), flags=re.MULTILINE)
    documented = {slug: int(status) for status, slug in rows}
    assert len(rows) == len(documented), "a slug is listed twice"
    assert documented == catalog()


def test_the_507_description_names_every_507_problem() -> None:
    """A 507 means "not now, nothing changed" for several reasons; the OpenAPI text of the
    status names each of them by its code, so none is left out when one is added."""
    from maasd.api.problems import MEANING

    base = "insufficient-storage"  # the base of the 507s, never raised itself
    codes = [code for code, status in catalog().items() if status == 507 and code != base]
    assert {"pool-exhausted", "resource-limit", "ledger-unavailable"} <= set(codes)
    for code in codes:
        assert f"({code})" in MEANING[507], code


def test_a_client_gone_mid_body_is_answered_quietly(
    svc: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """The ASGI server's ``http.disconnect`` before the body's end is a client gone: a 400
    nobody reads, and no error logged; the body's other refusals answer as before."""
    import anyio

    from maasd.api.app import create_app

    app = create_app(svc)

    def post(messages: list[dict]) -> tuple[int, list[str]]:
        sent: list[dict] = []

        async def receive() -> dict:
            return messages.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/pools", "raw_path": b"/v1/pools",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2), "state": {},
            "headers": [
                (b"host", b"maasd"), (b"content-type", b"application/json"),
                (b"content-length", b"64"), (b"authorization", f"Bearer {ADMIN_KEY}".encode()),
            ],
        }  # fmt: skip
        caplog.clear()
        with caplog.at_level("ERROR", logger="maasd"):
            anyio.run(app, scope, receive, send)  # type: ignore[arg-type]
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], [r.getMessage() for r in caplog.records]

    status, logged = post(
        [{"type": "http.request", "body": b'{"name": ', "more_body": True},
         {"type": "http.disconnect"}]
    )  # fmt: skip
    assert (status, logged) == (400, [])
    status, logged = post(
        [{"type": "http.request", "body": b'{"name": ', "more_body": True},
         {"type": "http.request", "body": b"x" * 65 * 1024, "more_body": True}]
    )  # fmt: skip
    assert status == 413  # a litestar HTTPException of its own still answers as before
