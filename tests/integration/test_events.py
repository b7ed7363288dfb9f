"""The audit trail: GET /v1/events and `maasctl events`, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


def kinds_for(events: list[dict[str, Any]], **match: str) -> list[str]:
    return [e["kind"] for e in events if all(e.get(k) == v for k, v in match.items())]


def test_a_buffers_life_and_a_tenants_keys_are_on_the_record(daemon: Daemon) -> None:
    tenant_id, key = daemon.tenant("audited", 8 * MiB)
    with daemon.client(key) as c:
        buf = c.post("/v1/reserve", json={"size_bytes": MiB, "label": "kv"}).json()
        assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    new_key = daemon.admin.post(f"/v1/tenants/{tenant_id}/keys").json()
    assert daemon.admin.delete(f"/v1/tenants/{tenant_id}/keys/{new_key['id']}").status_code == 204
    assert (
        daemon.admin.patch(f"/v1/tenants/{tenant_id}", json={"quota_bytes": 4 * MiB}).status_code
        == 200
    )

    r = daemon.admin.get("/v1/events", params={"tenant_id": tenant_id})
    assert r.status_code == 200, r.text
    events = r.json()
    assert [e["id"] for e in events] == sorted(
        (e["id"] for e in events), reverse=True
    )  # newest first
    assert all(e["tenant_id"] == tenant_id for e in events)
    assert kinds_for(events, buffer_id=buf["id"]) == ["release", "reserve"]
    assert [e["bytes"] for e in events if e["buffer_id"] == buf["id"]] == [MiB, MiB]
    assert {"tenant_create", "key_issue", "key_revoke", "quota_set"} <= {e["kind"] for e in events}
    assert not any(key in json.dumps(e) for e in events)  # a key is never in the trail
    assert events[0]["at"].endswith("Z")
    assert len(events[0]["at"]) == 27

    # paging back: `before` the oldest seen gives strictly older ones
    first = daemon.admin.get("/v1/events", params={"tenant_id": tenant_id, "limit": 2}).json()
    rest = daemon.admin.get(
        "/v1/events", params={"tenant_id": tenant_id, "before": first[-1]["id"]}
    ).json()
    assert len(first) == 2
    assert [e["id"] for e in first + rest] == [e["id"] for e in events]


@pytest.mark.parametrize(
    "params", [{"limit": 0}, {"limit": 1001}, {"limit": "many"}, {"before": "x"}]
)
def test_bad_paging_is_a_400(daemon: Daemon, params: dict[str, Any]) -> None:
    r = daemon.admin.get("/v1/events", params=params)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/problem+json")


def test_events_are_for_the_admin_only_and_unknown_tenants_are_404(daemon: Daemon) -> None:
    _, key = daemon.tenant("curious", MiB)
    with daemon.client(key) as c:
        assert c.get("/v1/events").status_code == 403
    assert daemon.admin.get("/v1/events", params={"tenant_id": "nope"}).status_code == 404


def test_maasctl_events(daemon: Daemon) -> None:
    tenant_id, key = daemon.tenant("cli-audit", 8 * MiB)
    with daemon.client(key) as c:
        c.post("/v1/reserve", json={"size_bytes": MiB})
    env = {**os.environ, "MAASD_URL": daemon.url, "MAASD_ADMIN_KEY": daemon.admin_key}
    name = daemon.admin.get(f"/v1/tenants/{tenant_id}").json()["name"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "maasd.cli.maasctl", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    table = run("events", "--tenant", name)
    assert table.returncode == 0, table.stderr
    assert "reserve" in table.stdout
    assert "tenant_create" in table.stdout
    assert name in table.stdout
    as_json = run("--json", "events", "--tenant", tenant_id, "--limit", "1")
    assert as_json.returncode == 0, as_json.stderr
    assert (
        json.loads(as_json.stdout)
        == daemon.admin.get("/v1/events", params={"tenant_id": tenant_id, "limit": 1}).json()
    )
    bad = run("events", "--limit", "0")
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("before", [0, -1, 2**63, 72660684794466286960640])
def test_out_of_range_before_is_a_400_not_a_500(daemon: Daemon, before: int) -> None:
    r = daemon.admin.get("/v1/events", params={"before": before})
    assert r.status_code == 400, r.text
