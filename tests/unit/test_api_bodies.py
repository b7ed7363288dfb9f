"""Bodies are decoded once, strictly, in-process: every hostile body gets a 4xx and changes nothing.

Each bad body of ``bad_bodies`` (the tables the daemon-level test sends too) is
answered with a problem, and changes nothing; where msgspec refuses the body, the
answer is a 400 whose ``detail`` is msgspec's own message. Then the limits around
the decoder (413, nesting), and what the OpenAPI document says of the bodies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from bad_bodies import (
    DEEP,
    DEEP_OBJECT,
    LOOKUP_BAD,
    PIN_BAD,
    POOL_BAD,
    RENEW_BAD,
    RESERVE_BAD,
    TENANT_BAD,
    TENANT_PATCH_BAD,
    Raw,
    assert_problem_4xx,
    send,
)
from inprocess_api import ADMIN_KEY, auth, client, service, snapshot
from maasd import bounds
from maasd.api import strict
from maasd.api.app import create_app
from maasd.api.schemas import (
    LookupBody,
    NoBody,
    PinBody,
    PoolReserveBody,
    RenewBody,
    ReserveBody,
    TenantBody,
    TenantPatchBody,
)
from maasd.core import Service
from maasd.errors import InvalidRequest
from maasd.models import PoolSpec

MiB = 1 << 20
JSON_TYPES = ("application/json",)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("api-bodies"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(svc: Service) -> Iterator[TestClient[Litestar]]:
    with client(svc) as c:
        yield c


@pytest.fixture(scope="module")
def victim(svc: Service, api: TestClient[Litestar]) -> dict[str, str]:
    """A tenant with one keyed buffer: the target of every bad body."""
    new = svc.tenants.create("victim", 16 * MiB)
    r = api.post("/v1/reserve", json={"size_bytes": MiB, "key": "held"}, headers=auth(new.api_key))
    assert r.status_code == 201, r.text
    return {"tid": new.id, "key": new.api_key, "bid": r.json()["id"]}


def raw_of(body: Any) -> bytes:
    return body.content if isinstance(body, Raw) else json.dumps(body).encode()


def msgspec_says(body: Any, kind: type[Any]) -> str | None:
    """What msgspec itself says of ``body`` as ``kind`` (None: it decodes), names in words."""
    try:
        msgspec.json.decode(raw_of(body), type=kind)
    except msgspec.ValidationError as e:
        return bounds.explain(str(e))
    except msgspec.DecodeError as e:
        return f"malformed JSON: {e}"
    return None


def check_refused(
    svc: Service,
    api: TestClient[Litestar],
    method: str,
    path: str,
    body: Any,
    kind: type[Any],
) -> dict[str, Any]:
    before = snapshot(svc)
    r = send(api, method, path, body)
    problem = assert_problem_4xx(r)
    assert snapshot(svc) == before
    content_type = body.content_type if isinstance(body, Raw) else "application/json"
    if len(raw_of(body)) > 64 * 1024:
        assert r.status_code == 413, problem
        assert problem["type"].endswith("/body-too-large")
    elif content_type not in JSON_TYPES:
        assert r.status_code == 400, problem
        assert problem["detail"].startswith("expected an application/json body"), problem
    elif not raw_of(body):
        assert r.status_code == 400, problem
        assert problem["detail"] == "the request body is empty; expected a JSON object"
    elif (said := msgspec_says(body, kind)) is not None:
        assert r.status_code == 400, problem
        assert problem["type"].endswith("/invalid-request")
        assert problem["detail"] == said
    # else: a well-formed body that a rule refuses (both sizes, node 7, …): any 4xx
    return problem


ROUTES: list[tuple[str, str, str, type[Any], list[tuple[str, Any]]]] = [
    ("tenant", "POST", "/v1/reserve", ReserveBody, RESERVE_BAD),
    ("tenant", "POST", "/v1/pools/node0/reserve", PoolReserveBody, RESERVE_BAD),
    ("admin", "POST", "/v1/pools", PoolSpec, POOL_BAD),
    ("admin", "POST", "/v1/tenants", TenantBody, TENANT_BAD),
    ("admin", "PATCH", "/v1/tenants/{tid}", TenantPatchBody, TENANT_PATCH_BAD),
    ("tenant", "PATCH", "/v1/buffers/{bid}/pin", PinBody, PIN_BAD),
    ("tenant", "POST", "/v1/buffers/{bid}/renew", RenewBody, RENEW_BAD),
    ("tenant", "POST", "/v1/buffers/lookup", LookupBody, LOOKUP_BAD),
]
CASES = [
    pytest.param(who, method, path, kind, body, id=f"{method} {path} {case}")
    for who, method, path, kind, table in ROUTES
    for case, body in table
]


@pytest.mark.parametrize(("who", "method", "path", "kind", "body"), CASES)
def test_bad_body_is_refused_and_changes_nothing(
    svc: Service,
    api: TestClient[Litestar],
    victim: dict[str, str],
    who: str,
    method: str,
    path: str,
    kind: type[Any],
    body: Any,
) -> None:
    key = victim["key"] if who == "tenant" else ADMIN_KEY
    api.headers.update(auth(key))
    try:
        check_refused(svc, api, method, path.format(**victim), body, kind)
    finally:
        del api.headers["Authorization"]


def test_lenient_values_are_refused(api: TestClient[Litestar], victim: dict[str, str]) -> None:
    """What the framework's own conversion would have let through."""
    for body, field in [
        ({"size_bytes": "4096"}, "size_bytes"),
        ({"size_bytes": 4096.0}, "size_bytes"),
        ({"size_bytes": 4096, "evictable": 1}, "evictable"),
        ({"size_bytes": 4096, "ttl_s": "60"}, "ttl_s"),
    ]:
        r = api.post("/v1/reserve", json=body, headers=auth(victim["key"]))
        assert r.status_code == 400, r.text
        assert r.json()["detail"].endswith(f"- at `$.{field}`"), r.text
    r = api.post("/v1/reserve", json={"size_bytes": "4096"}, headers=auth(victim["key"]))
    assert r.json()["detail"] == "Expected `int | null`, got `str` - at `$.size_bytes`"


@pytest.mark.parametrize(
    "raw", [DEEP, DEEP_OBJECT, b'{"keys": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"]
)
def test_deeply_nested_json_is_400(
    svc: Service, api: TestClient[Litestar], victim: dict[str, str], raw: bytes
) -> None:
    before = snapshot(svc)
    for path in ("/v1/reserve", "/v1/buffers/lookup"):
        r = api.post(
            path, content=raw, headers={**auth(victim["key"]), "content-type": "application/json"}
        )
        assert r.status_code == 400, r.text[:300]
        assert r.json()["type"].endswith("/invalid-request")
    assert snapshot(svc) == before


def test_decode_turns_running_out_of_stack_into_a_400() -> None:
    # An untyped decoder (none of the bodies is one) recurses as deep as the
    # document; the RecursionError inside decode() can only be the nesting.
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        strict.decode(DEEP, list)


def test_413_is_body_too_large(api: TestClient[Litestar], victim: dict[str, str]) -> None:
    r = api.post(
        "/v1/buffers/lookup",
        json={"keys": ["k" * 500] * 200},  # ~100 KiB
        headers=auth(victim["key"]),
    )
    assert r.status_code == 413
    problem = r.json()
    assert problem["type"] == "https://maasd.dev/problems/body-too-large"
    assert problem["detail"] == "the request body is over 64 KiB"


def test_every_body_is_decoded_by_the_strict_dto(svc: Service) -> None:
    app = create_app(svc)
    handlers = [h for route in app.routes for h in getattr(route, "route_handlers", [])]
    with_body = [h for h in handlers if h.parsed_fn_signature.parameters.get("data")]
    # create pool, create tenant, quota, 2 reserves, pin, renew, lookup; and the two that
    # take none (a key, a checkpoint): nothing, {} or null, a field in it refused
    assert len(with_body) == 10
    for handler in with_body:
        dto = handler.resolve_data_dto()
        assert dto is not None, handler
        assert issubclass(dto, strict.StrictBody), handler
        assert strict.is_strict_body(dto.model_type), handler


def test_openapi_declares_strict_bodies(svc: Service) -> None:
    doc = create_app(svc).openapi_schema.to_schema()
    schemas = doc["components"]["schemas"]
    for body in (
        PoolSpec,
        TenantBody,
        TenantPatchBody,
        ReserveBody,
        PoolReserveBody,
        NoBody,
        PinBody,
        RenewBody,
        LookupBody,
    ):
        assert schemas[body.__name__]["additionalProperties"] is False, body
    reserve = schemas["ReserveBody"]["properties"]
    assert reserve["size_bytes"]["exclusiveMinimum"] == 0
    assert reserve["size_gb"]["exclusiveMinimum"] == 0
    assert reserve["latency_us"]["minimum"] == 0
    assert reserve["numa_node"]["minimum"] == 0
    assert schemas["PinBody"]["properties"]["numa_node"]["minimum"] == 0
    request = doc["paths"]["/v1/reserve"]["post"]["requestBody"]
    assert request["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ReserveBody"
    }
    assert "numa_node" not in schemas["PoolReserveBody"]["properties"]


#: A body's headers that say something other than one UTF-8 JSON document, and what the
#: 400 names. Before, each was decoded as UTF-8 JSON and carried out.
NOT_ONE_UTF8_JSON = [
    ([("content-type", "application/json; charset=utf-16")], "charset=utf-16"),
    ([("content-type", "application/json; charset=latin-1")], "charset=latin-1"),
]  # two Content-Type headers: tests/integration/test_api_bad_input.py (the test client joins them)


@pytest.mark.parametrize(("headers", "said"), NOT_ONE_UTF8_JSON)
def test_a_body_is_one_utf8_json_document(
    svc: Service,
    api: TestClient[Litestar],
    victim: dict[str, str],
    headers: list[tuple[str, str]],
    said: str,
) -> None:
    asked = [*headers, *auth(victim["key"]).items()]
    before = snapshot(svc)
    for method, path, body in [
        ("POST", "/v1/reserve", b'{"size_bytes": 4096}'),
        ("DELETE", f"/v1/buffers/{victim['bid']}", b"{}"),  # a route that takes no body
    ]:
        r = api.request(method, path, content=body, headers=asked)
        problem = assert_problem_4xx(r)
        assert r.status_code == 400, problem
        assert said in problem["detail"], problem
    assert snapshot(svc) == before


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", '"utf-8"', "utf8"])
def test_a_utf8_charset_is_accepted(
    api: TestClient[Litestar], victim: dict[str, str], charset: str
) -> None:
    headers = {"content-type": f"application/json; charset={charset}", **auth(victim["key"])}
    r = api.post("/v1/reserve", content=b'{"size_bytes": 4096}', headers=headers)
    assert r.status_code == 201, r.text
    r = api.delete(f"/v1/buffers/{r.json()['id']}", headers=headers)
    assert r.status_code == 204, r.text


def test_a_lone_surrogate_escape_is_named_not_called_truncated(
    api: TestClient[Litestar], victim: dict[str, str]
) -> None:
    """msgspec says "Input data was truncated" of ``"\\ud800"`` (a high surrogate without
    its low half): the 400 names the escape instead. A whole pair is a key like any."""
    headers = {"content-type": "application/json", **auth(victim["key"])}
    for lone in (rb'"\ud800"', rb'"\ud800x"', rb'"\udbff"'):
        r = api.post(
            "/v1/reserve", content=b'{"size_bytes": 4096, "key": ' + lone + b"}", headers=headers
        )
        problem = assert_problem_4xx(r)
        assert r.status_code == 400, problem
        assert "surrogate" in problem["detail"], problem
    r = api.post(
        "/v1/reserve",
        content=b'{"size_bytes": 4096, "key": "' + rb"\ud83d\ude00" + b'"}',
        headers=headers,
    )
    assert r.status_code == 201, r.text
    assert r.json()["key"] == "\U0001f600"
    assert api.delete(f"/v1/buffers/{r.json()['id']}", headers=headers).status_code == 204
    r = api.post("/v1/reserve", content=b'{"size_bytes": 4096, "key": "ab', headers=headers)
    assert "truncated" in assert_problem_4xx(r)["detail"]  # a body truly cut short
