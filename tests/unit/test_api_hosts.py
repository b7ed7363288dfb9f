"""One daemon on its own SQLite ledger, seen through the multi-host routes.

The fleet itself (three daemons on PostgreSQL) is tested in
``tests/integration/test_multihost.py``; here the same routes on the embedded
ledger: the daemon is the one host there is, it beats, it cannot be forgotten,
and a clean close says it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from inprocess_api import ADMIN_KEY, MiB, auth, client, service
from maasd.core import Service
from maasd.store import Store


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = service(tmp_path)
    yield s
    s.close()


@pytest.fixture
def api(svc: Service) -> Iterator[TestClient[Litestar]]:
    with client(svc) as c:
        yield c


def test_the_daemon_is_the_one_live_host(api: TestClient[Litestar], svc: Service) -> None:
    (host,) = api.get("/v1/hosts", headers=auth(ADMIN_KEY)).json()
    assert (host["name"], host["live"], host["local"]) == ("api-unit", True, True)
    assert host["pools"] == 1
    assert host["stopped_at"] is None
    r = api.delete("/v1/hosts/api-unit", headers=auth(ADMIN_KEY))
    assert r.status_code == 409, r.text
    assert api.delete("/v1/hosts/elsewhere", headers=auth(ADMIN_KEY)).status_code == 404
    key = svc.tenants.create("hosts", MiB).api_key
    assert api.get("/v1/hosts", headers=auth(key)).status_code == 403


def test_pools_name_their_host(api: TestClient[Litestar], svc: Service) -> None:
    key = svc.tenants.create("pools", MiB).api_key
    for who in (ADMIN_KEY, key):
        pools = api.get("/v1/pools", headers=auth(who)).json()
        assert [(p["host"], p["name"]) for p in pools] == [("api-unit", "node0")]
    assert api.get("/v1/pools/node0", headers=auth(key)).json()["host"] == "api-unit"


def test_a_clean_close_marks_the_host_stopped(tmp_path: Path) -> None:
    svc = service(tmp_path)
    svc.close()
    store = Store(svc.settings.database_url)
    try:
        (host,) = store.hosts.hosts()
        assert host.stopped_at is not None
    finally:
        store.dispose()
