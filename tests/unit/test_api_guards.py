"""Who may call what, in-process: the guards refuse before any service call.

A tenant key on an admin route, the admin key on a tenant route, a missing or
unknown key: each is answered 401/403 by a guard on the event loop, before the
body is read and before the handler's thread hop — the counting wrapper around
the real service sees no call. Then ``/metrics``: admin key, metrics key,
public, none.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from litestar import Litestar
from litestar.testing import TestClient

from inprocess_api import ADMIN_KEY, ServiceCalls, auth, client, service, snapshot
from maasd.api.app import create_app
from maasd.api.auth import authenticated
from maasd.core import Service
from maasd.settings import load

MiB = 1 << 20
METRICS_KEY = "metrics-key-0123456789abcdef"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = service(tmp_path_factory.mktemp("api-guards"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def tenant(svc: Service) -> tuple[str, str, str]:
    """``(tenant_id, api_key, buffer_id)``: a tenant holding one buffer."""
    new = svc.tenants.create("guarded", 8 * MiB)
    with client(svc) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB}, headers=auth(new.api_key))
        assert r.status_code == 201, r.text
        return new.id, new.api_key, r.json()["id"]


@pytest.fixture(scope="module")
def api(svc: Service) -> Iterator[TestClient[Litestar]]:
    with client(svc, metrics_key=METRICS_KEY) as c:
        yield c


def admin_routes(tid: str) -> list[tuple[str, str, Any]]:
    return [
        ("POST", "/v1/pools", {"name": "x", "numa_node": 0, "capacity_bytes": 4096}),
        ("DELETE", "/v1/pools/node0?drain=true", None),
        ("POST", "/v1/tenants", {"name": "x", "quota_bytes": 1}),
        ("GET", "/v1/tenants", None),
        ("GET", f"/v1/tenants/{tid}", None),
        ("PATCH", f"/v1/tenants/{tid}", {"quota_bytes": 1}),
        ("DELETE", f"/v1/tenants/{tid}", None),
        ("POST", f"/v1/tenants/{tid}/keys", None),
        ("DELETE", f"/v1/tenants/{tid}/keys/{'0' * 32}", None),
        ("GET", "/v1/events", None),
        ("GET", "/v1/hosts", None),
        ("DELETE", "/v1/hosts/elsewhere", None),
    ]


def tenant_routes(bid: str) -> list[tuple[str, str, Any]]:
    return [
        ("GET", "/v1/usage", None),
        ("POST", "/v1/reserve", {"size_bytes": 4096}),
        ("POST", "/v1/pools/node0/reserve", {"size_bytes": 4096}),
        ("PATCH", f"/v1/buffers/{bid}/pin", {"numa_node": 0}),
        ("POST", f"/v1/buffers/{bid}/renew", {"ttl_s": 60}),
        ("POST", f"/v1/buffers/{bid}/checkpoint", None),
        ("POST", "/v1/buffers/lookup", {"keys": ["k"]}),
    ]


def test_tenant_key_on_admin_routes_is_403_without_a_service_call(
    svc: Service, api: TestClient[Litestar], tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid, key, _ = tenant
    before = snapshot(svc)
    calls = ServiceCalls(svc, monkeypatch)
    for method, path, body in admin_routes(tid):
        r = api.request(method, path, json=body, headers=auth(key))
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["type"].endswith("/forbidden")
        assert r.headers["content-type"].startswith("application/problem+json")
        # a body the decoder would refuse: the guard answers first, the body is never read
        r = api.request(method, path, content=b"{", headers=auth(key))
        assert r.status_code == 403, (method, path, r.text)
    assert calls.counts == {}, calls.counts
    monkeypatch.undo()
    assert snapshot(svc) == before


def test_admin_key_on_tenant_routes_is_403_without_a_service_call(
    api: TestClient[Litestar], tenant, svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, bid = tenant
    calls = ServiceCalls(svc, monkeypatch)
    for method, path, body in tenant_routes(bid):
        r = api.request(method, path, json=body, headers=auth(ADMIN_KEY))
        assert r.status_code == 403, (method, path, r.text)
        assert "tenant key" in r.json()["detail"]
    assert calls.counts == {}, calls.counts


@pytest.mark.parametrize(
    "headers",
    [
        {},
        auth("maasd_unknown"),
        {"Authorization": "Basic dXNlcjpwdw=="},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "unknown", "basic", "empty-bearer"],
)
def test_no_valid_key_is_401_without_a_service_call(
    api: TestClient[Litestar], tenant, svc: Service, monkeypatch: pytest.MonkeyPatch, headers
) -> None:
    tid, _, bid = tenant
    calls = ServiceCalls(svc, monkeypatch)
    for method, path, _ in admin_routes(tid) + tenant_routes(bid):
        r = api.request(method, path, content=b"[[[", headers=headers)  # never read
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["type"].endswith("/unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
    assert calls.counts == {}, calls.counts


def test_allowed_calls_reach_the_service(
    api: TestClient[Litestar], tenant, svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counting wrapper does see handler calls (so an empty count above means something)."""
    _, key, bid = tenant
    calls = ServiceCalls(svc, monkeypatch)
    assert api.get("/v1/tenants", headers=auth(ADMIN_KEY)).status_code == 200
    assert api.get("/v1/usage", headers=auth(key)).status_code == 200
    assert api.get(f"/v1/buffers/{bid}", headers=auth(key)).status_code == 200
    assert {"tenants.infos", "last_known.usage", "buffers.buffer"} <= calls.counts.keys()


def test_every_v1_route_is_authenticated_on_the_event_loop(svc: Service) -> None:
    """Every /v1 route runs the ``authenticated`` hook (before the body and any dependency);
    litestar runs a plain-function hook or guard in a worker thread: each is a coroutine."""
    app = create_app(svc)
    routed = [
        (route.path, h)
        for route in app.routes
        for h in getattr(route, "route_handlers", [])
        if "OPTIONS" not in h.http_methods
    ]
    v1 = [h for path, h in routed if path.startswith("/v1/")]
    assert len(v1) == 25
    for handler in v1:
        hook = handler.resolve_before_request()
        assert getattr(hook, "__wrapped__", hook) is authenticated, handler
        assert inspect.iscoroutinefunction(authenticated)
    guarded = [(path, h) for path, h in routed if h.resolve_guards()]
    assert [path for path, _ in guarded] == ["/metrics"]
    for _, handler in guarded:
        for guard in handler.resolve_guards():
            assert inspect.iscoroutinefunction(guard), (handler, guard)
    outside = [h for path, h in routed if not path.startswith("/v1/")]
    assert all(h.resolve_before_request() is None for h in outside)


def test_one_guard_and_no_dependency_task_group_per_route(svc: Service) -> None:
    """litestar copies a route's handler for each guard it runs, and resolves a batch of
    several independent dependencies in a task group of its own, on every request: a
    route has at most one guard (/v1 routes none: their role is in their ``opt``, checked
    by the hook), and its dependencies resolve one at a time (the use-case objects after
    ``call``: maasd.api.dependencies)."""
    app = create_app(svc)
    handlers = [h for route in app.routes for h in getattr(route, "route_handlers", [])]
    roles = {h.opt.get("role") for h in handlers}
    assert roles == {None, "admin", "tenant"}, roles  # a misspelt role would mean "any key"
    for h in handlers:
        assert len(h.resolve_guards()) <= 1, h
    batched = 0
    for route in app.routes:
        for handler, kwargs_model in getattr(route, "route_handler_map", {}).values():
            assert all(len(batch) <= 1 for batch in kwargs_model.dependency_batches), handler
            batched += len(kwargs_model.dependency_batches) > 1
    assert batched > 0  # the use-case objects are dependencies of their own


# -- /metrics -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "key", "status"),
    [
        ({}, "admin", 200),
        ({}, "tenant", 403),
        ({}, None, 401),
        ({}, "unknown", 401),
        ({}, "metrics", 401),  # no metrics key configured: it is just an unknown key
        ({"metrics_key": METRICS_KEY}, "metrics", 200),
        ({"metrics_key": METRICS_KEY}, "admin", 200),
        ({"metrics_key": METRICS_KEY}, None, 401),
        ({"metrics_key": METRICS_KEY}, "tenant", 403),
        ({"metrics_key": METRICS_KEY}, "metrics-prefix", 401),
        ({"metrics_public": True}, None, 200),
        ({"metrics_public": True}, "unknown", 200),
    ],
)
def test_metrics_access(
    svc: Service, tenant, options: dict[str, Any], key: str | None, status: int
) -> None:
    keys = {
        "admin": ADMIN_KEY,
        "tenant": tenant[1],
        "unknown": "maasd_unknown",
        "metrics": METRICS_KEY,
        "metrics-prefix": METRICS_KEY[:-1],
        None: None,
    }
    token = keys[key]
    with client(svc, **options) as c:
        r = c.get("/metrics", headers=auth(token) if token else {})
    assert r.status_code == status, r.text
    if status == 200:
        assert r.headers["content-type"].startswith("text/plain")
        assert "maasd_pool_capacity_bytes" in r.text
    else:
        assert r.headers["content-type"].startswith("application/problem+json")


def test_metrics_key_is_good_for_metrics_only(
    api: TestClient[Litestar], tenant, svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid, _, bid = tenant
    calls = ServiceCalls(svc, monkeypatch)
    for method, path, body in (
        admin_routes(tid)
        + tenant_routes(bid)
        + [("GET", "/v1/pools", None), ("GET", "/v1/topology", None), ("GET", "/v1/buffers", None)]
    ):
        r = api.request(method, path, json=body, headers=auth(METRICS_KEY))
        assert r.status_code == 403, (method, path, r.text)
        assert "metrics key" in r.json()["detail"]
    assert calls.counts == {}, calls.counts


def test_metrics_settings(tmp_path: Path) -> None:
    assert load(env={}).metrics_public is False
    assert load(env={"MAASD_METRICS_PUBLIC": "1"}).metrics_public is True
    assert load(env={"MAASD_METRICS_PUBLIC": "0"}).metrics_public is False
    assert load(env={"MAASD_METRICS_KEY": METRICS_KEY}).metrics_key == METRICS_KEY
    assert load({"metrics_public": True}, env={"MAASD_METRICS_PUBLIC": "0"}).metrics_public
    with pytest.raises(Exception, match="metrics_key must be at least 16 characters"):
        load(env={"MAASD_METRICS_KEY": "short"})
    config = tmp_path / "maasd.toml"
    config.write_text(f'metrics_key = "{METRICS_KEY}"\nmetrics_public = true\n')
    settings = load(env={"MAASD_CONFIG": str(config)})
    assert (settings.metrics_key, settings.metrics_public) == (METRICS_KEY, True)


@pytest.mark.parametrize(
    ("argv", "env", "public"),
    [([], {}, False), (["--metrics-public"], {}, True), ([], {"MAASD_METRICS_PUBLIC": "1"}, True)],
)
def test_serve_metrics_public_flag(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    public: bool,
) -> None:
    from maasd.cli import daemon

    seen: list[Any] = []
    monkeypatch.setattr(daemon, "_serve", lambda settings, _stop, **_: seen.append(settings))
    monkeypatch.setattr(daemon, "harden", lambda: (0, 0))  # not on the test process
    monkeypatch.setattr(daemon, "setup_logging", lambda _level: None)
    monkeypatch.delenv("MAASD_METRICS_PUBLIC", raising=False)
    result = CliRunner().invoke(
        daemon.cli, ["serve", "--data-dir", str(tmp_path), *argv], env=env, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert [s.metrics_public for s in seen] == [public]


def test_serve_drops_the_secret_keys_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read once into the settings, then gone from os.environ: nothing the daemon starts
    inherits them (the kernel's copy in /proc/PID/environ is root's only: not dumpable)."""
    from maasd.cli import daemon

    env_then: list[dict[str, str]] = []
    seen: list[Any] = []

    def serve(settings: Any, _stop: Any, **_: Any) -> None:
        seen.append(settings)
        env_then.append(dict(os.environ))

    monkeypatch.setattr(daemon, "_serve", serve)
    monkeypatch.setattr(daemon, "harden", lambda: (0, 0))
    monkeypatch.setattr(daemon, "setup_logging", lambda _level: None)
    admin, metrics = "a" * 40, "m" * 40
    result = CliRunner().invoke(
        daemon.cli,
        ["serve", "--data-dir", str(tmp_path)],
        env={
            "MAASD_ADMIN_KEY": admin,
            "MAASD_METRICS_KEY": metrics,
            "MAASD_DB_URL": "postgresql+psycopg://maasd:secret@db/maasd",
        },
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert (seen[0].admin_key, seen[0].metrics_key) == (admin, metrics)
    assert "MAASD_ADMIN_KEY" not in env_then[0]
    assert "MAASD_METRICS_KEY" not in env_then[0]
    assert "MAASD_DB_URL" not in env_then[0]
    assert seen[0].db_url == "postgresql+psycopg://maasd:secret@db/maasd"
