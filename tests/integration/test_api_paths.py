"""Through a real daemon: an id that is not one path segment never reaches another route.

The HTTP server decodes ``%2F`` before routing, so ``DELETE
/v1/tenants/<tid>%2Fkeys%2F<kid>`` used to revoke a key; empty, ``.`` and
``..`` segments moved a request to another route as well. Every route that
takes an id (read from the daemon's own OpenAPI document, so a new one is
covered too) is sent each hostile id as written on the wire (``http.client``
does not normalise paths) and must answer a 400 problem and change nothing.
"""

from __future__ import annotations

import http.client
import json
import re
from typing import Any

import pytest

from bad_paths import DOTS, ENCODED, id_routes
from conftest import Daemon

MiB = 1 << 20


def send(d: Daemon, method: str, path: str, key: str) -> tuple[int, str, dict[str, Any]]:
    """``method path`` exactly as written; ``(status, content type, body)``."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key}"})
        r = conn.getresponse()
        raw = r.read()
        return r.status, r.getheader("content-type", ""), json.loads(raw) if raw else {}
    finally:
        conn.close()


def state(d: Daemon) -> tuple[Any, ...]:
    """What a refused request must leave as it was: tenants, buffers, pools."""
    return tuple(d.admin.get(p).json() for p in ("/v1/tenants", "/v1/buffers", "/v1/pools"))


@pytest.fixture(scope="module")
def world(daemon: Daemon) -> dict[str, str]:
    """A tenant with a second key and a buffer: what the hostile ids point at."""
    tid, key = daemon.tenant("paths", 64 * MiB)
    r = daemon.admin.post(f"/v1/tenants/{tid}/keys")
    assert r.status_code == 201, r.text
    kid, key2 = r.json()["id"], r.json()["api_key"]
    r = daemon.client(key).post("/v1/reserve", json={"size_bytes": MiB})
    assert r.status_code == 201, r.text
    return {"tid": tid, "key": key, "kid": kid, "key2": key2, "bid": r.json()["id"]}


def test_revoking_a_key_through_an_encoded_slash_is_refused(
    daemon: Daemon, world: dict[str, str]
) -> None:
    before = state(daemon)
    status, media, body = send(
        daemon,
        "DELETE",
        f"/v1/tenants/{world['tid']}%2Fkeys%2F{world['kid']}",
        daemon.admin_key,
    )
    assert (status, media) == (400, "application/problem+json"), body
    assert "encoded '/'" in body["detail"]
    assert daemon.client(world["key2"]).get("/v1/usage").status_code == 200  # key not revoked
    assert state(daemon) == before


def test_an_empty_id_does_not_reach_the_collection(daemon: Daemon, world: dict[str, str]) -> None:
    for key in (daemon.admin_key, world["key"]):
        status, _, body = send(daemon, "GET", "/v1/buffers/", key)
        assert status == 400, body
    status, _, body = send(daemon, "DELETE", "/v1/tenants//keys/" + world["kid"], daemon.admin_key)
    assert status == 400, body


@pytest.mark.parametrize("hostile", ENCODED + DOTS)
def test_every_route_with_an_id_refuses_an_id_that_is_not_one_segment(
    daemon: Daemon, world: dict[str, str], hostile: str
) -> None:
    before = state(daemon)
    routes = id_routes(daemon.admin.get("/schema/openapi.json").json())
    assert ("DELETE", "/v1/tenants/{tenant_id}/keys/{key_id}") in routes
    value = hostile.format(**world)
    for method, template in routes:
        for key in (daemon.admin_key, world["key"]):
            # the hostile value in each parameter in turn, real ids in the others
            names = re.findall(r"\{([^}]+)\}", template)
            for i in range(len(names)):
                path = template
                for j, name in enumerate(names):
                    real = world["bid"] if name == "buffer_id" else world["tid"]
                    path = path.replace("{" + name + "}", value if i == j else real)
                status, media, body = send(daemon, method, path, key)
                assert status == 400, (method, path, body)
                assert media == "application/problem+json"
                assert body["type"].endswith("/invalid-request")
    assert state(daemon) == before
    assert daemon.client(world["key2"]).get("/v1/usage").status_code == 200
    assert daemon.healthy()
