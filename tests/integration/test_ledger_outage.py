"""The ledger database goes away under a running daemon: answers are 507, never 500.

No input yields a 5xx but 507, when the daemon is at a resource limit it states in
``detail``. A ledger that cannot be reached is that: nothing the request
did was wrong, nothing changed, and it may be retried. The daemon reaches its
PostgreSQL through a TCP proxy this test owns; cutting the proxy is the outage.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from conftest import Daemon
from pgdb import PG_URL, fresh_pg_database
from tcpproxy import Proxy
from waiting import wait_until

MiB = 1 << 20

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"),
]


@pytest.fixture
def outage(tmp_path: Path) -> Iterator[tuple[Daemon, Proxy]]:
    with fresh_pg_database() as url:
        u = sa.engine.make_url(url)
        proxy = Proxy((u.host or "127.0.0.1", u.port or 5432))
        via = u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        d = Daemon(tmp_path / "maasd", env={"MAASD_DB_URL": via, "MAASD_NODE_NAME": "outage"})
        try:
            d.start()
            yield d, proxy
        finally:
            proxy.resume()
            d.close()
            proxy.close()


def test_requests_during_a_ledger_outage_get_507_and_recover(outage) -> None:
    d, proxy = outage
    tenant_id, key = d.tenant(quota_bytes=64 * MiB)
    c = d.client(key)
    assert c.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201
    before = d.admin.get(f"/v1/tenants/{tenant_id}").json()["used_bytes"]

    proxy.cut()
    for method, path, body in (
        ("POST", "/v1/reserve", {"size_bytes": MiB}),
        ("GET", "/v1/buffers", None),
        ("POST", "/v1/tenants", {"name": f"t-{secrets.token_hex(3)}", "quota_bytes": MiB}),
    ):
        client = d.admin if path == "/v1/tenants" else c
        r = client.request(method, path, json=body)
        assert r.status_code == 507, (path, r.status_code, r.text)
        problem = r.json()
        assert problem["type"].endswith("/ledger-unavailable"), problem
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "127.0.0.1" not in problem["detail"]  # the database's address stays in the log
        assert str(proxy.port) not in problem["detail"]
    assert d.healthy()  # an outage of the ledger is not a reason to restart (and lose memory)

    proxy.resume()

    def reserves_again() -> bool:
        return c.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201

    wait_until(reserves_again, timeout=30, message="reserves work again once the ledger is back")
    used = d.admin.get(f"/v1/tenants/{tenant_id}").json()["used_bytes"]
    assert used == before + MiB  # nothing was admitted during the outage
