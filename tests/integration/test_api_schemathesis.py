"""Schemathesis against the OpenAPI document the daemon serves (``/schema/openapi.json``).

Every operation, a bounded number of generated cases (valid and invalid), once
with the admin key and once with a tenant key: no answer may be a 5xx other
than 507 (``not_a_server_error``), and every documented answer must match its
declared schema (``response_schema_conformance``), error answers included.

The tenant's quota is small, so generated reserves can never fault in much
memory, even in pools that the admin run created with enormous capacities.

Schemathesis' own pytest loader (``schemathesis.pytest.from_fixture``) does not
run under pytest 9 (it sets ``Item._nodeid``), so each operation's Hypothesis
strategy (``APIOperation.as_strategy``) is driven here directly, one pytest
test per operation, role and generation mode.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING
from unittest.mock import MagicMock

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from maasd.api.app import create_app

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20
MAX_EXAMPLES = 30


def _operations() -> list[tuple[str, str]]:
    """(METHOD, path) of every operation, read from the app's own document at collection time.

    The test itself loads the document the daemon *serves*; an operation missing
    there fails the test.
    """
    with warnings.catch_warnings():  # litestar's deprecation notes on handler signatures
        warnings.simplefilter("ignore")
        doc = create_app(MagicMock()).openapi_schema.to_schema()
    return [(method.upper(), path) for path, item in doc["paths"].items() for method in item]


OPERATIONS = _operations()


@pytest.fixture(scope="module", params=["admin", "tenant"])
def auth(request: pytest.FixtureRequest, daemon: Daemon) -> dict[str, str]:
    """The Authorization header of the role under test."""
    if request.param == "admin":
        return {"Authorization": f"Bearer {daemon.admin_key}"}
    _, key = daemon.tenant("fuzz", 8 * MiB)
    # a live, keyed buffer, so that list and lookup routes answer with real records
    with daemon.client(key) as c:
        assert c.post("/v1/reserve", json={"size_bytes": MiB, "key": "k"}).status_code == 201
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def api_schema(daemon: Daemon):
    return schemathesis.openapi.from_url(f"{daemon.url}/schema/openapi.json")


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value
)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_5xx_and_responses_conform(
    daemon: Daemon, api_schema, auth: dict[str, str], method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=daemon.url, headers=auth, timeout=30)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    run()
