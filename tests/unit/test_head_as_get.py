"""HEAD is GET without the body (RFC 9110 §9.3.2; docs/api.md, "HEAD"), in-process.

litestar routes a HEAD to none of its GET handlers, so a load balancer probing
``HEAD /healthz`` (HAProxy's ``option httpchk HEAD``) got 405 and took the daemon out.
:func:`maasd.serving.head_as_get` hands the app the GET: the same status — 503 for an
unhealthy ``/healthz`` too —, the same headers, the same authentication, no body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from litestar import Litestar, get
from litestar.response import Stream
from litestar.testing import TestClient

from inprocess_api import ADMIN_KEY, auth, client, service
from maasd.api.health import of_checks
from maasd.core import Service
from maasd.serving import head_as_get


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("api-head"))
    yield s
    s.close()


def _same_but_the_body(c: TestClient[Litestar], path: str, **kw: object) -> int:
    got = c.get(path, **kw)  # type: ignore[arg-type]
    head = c.head(path, **kw)  # type: ignore[arg-type]
    assert head.status_code == got.status_code, (path, head.status_code, got.text)
    assert head.content == b""
    for name in ("content-type", "content-length", "allow", "www-authenticate"):
        assert head.headers.get(name) == got.headers.get(name), (path, name)
    return head.status_code


def test_head_answers_every_get_route_as_get_does(svc: Service) -> None:
    with client(svc) as c:
        assert _same_but_the_body(c, "/healthz") == 200
        assert _same_but_the_body(c, "/docs") == 200
        # authenticated like GET: no key, a tenant's key where the admin's is needed
        assert _same_but_the_body(c, "/v1/pools") == 401
        assert _same_but_the_body(c, "/metrics") == 401
        assert _same_but_the_body(c, "/v1/pools", headers=auth(ADMIN_KEY)) == 200
        assert _same_but_the_body(c, "/metrics", headers=auth(ADMIN_KEY)) == 200
        assert _same_but_the_body(c, "/v1/usage", headers=auth("maasd_nope")) == 401
        # what GET cannot do, HEAD cannot either
        assert _same_but_the_body(c, "/nope") == 404
        assert _same_but_the_body(c, "/v1/buffers/", headers=auth(ADMIN_KEY)) == 400
        r = c.head("/v1/reserve", headers=auth(ADMIN_KEY))  # a POST route
        assert (r.status_code, r.content) == (405, b"")
        assert "POST" in r.headers["allow"]


@pytest.mark.parametrize(
    ("checks", "degraded", "status"),
    [
        ({"broker": lambda: (True, "")}, {}, 200),
        ({"broker": lambda: (True, "")}, {"ledger": lambda: (False, "locked")}, 200),
        ({"broker": lambda: (False, "accept thread is not running")}, {}, 503),
    ],
    ids=["ok", "degraded", "unhealthy"],
)
def test_head_healthz_has_the_status_of_get(svc: Service, checks, degraded, status) -> None:
    with client(svc, health=of_checks(checks), degraded=of_checks(degraded)) as c:
        assert _same_but_the_body(c, "/healthz") == status


def test_a_streamed_answer_is_sent_without_any_of_its_chunks() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"one ", b"two ", b"three"):
            yield part

    @get("/stream", sync_to_thread=False)
    def stream() -> Stream:
        return Stream(chunks(), media_type="text/plain")

    app = Litestar([stream])
    app.asgi_handler = head_as_get(app.asgi_handler)
    with TestClient(app) as c:
        assert c.get("/stream").content == b"one two three"
        r = c.head("/stream")
        assert (r.status_code, r.content) == (200, b"")
        assert r.headers["content-type"].startswith("text/plain")
