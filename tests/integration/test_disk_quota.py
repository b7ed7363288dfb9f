"""A tenant's own disk quota (``disk_quota_bytes``) through a real daemon and directory.

Set at creation or by PATCH (strictly: hostile bodies change nothing), shown with the
bytes used in the tenant's record and its usage, and enforced by the disk tier at each
demotion under concurrent demotions (docs/operations.md, "The disk tier").
"""

from __future__ import annotations

import functools
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_disk_tier import maasctl

from conftest import Daemon
from rawentries import (
    FILE_OVERHEAD,
    churn_concurrently,
    connect,
    entry_file_bytes,
    entry_files,
    pattern,
    put_committed,
    tier_pool,
    use_once,
)
from waiting import wait_until

MiB = 1 << 20


def new_tenant(d: Daemon, quota: int, **fields: Any) -> tuple[str, str]:
    body = {"name": f"dq-{secrets.token_hex(3)}", "quota_bytes": quota, **fields}
    r = d.admin.post("/v1/tenants", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["api_key"]


def record(d: Daemon, tenant_id: str) -> dict[str, Any]:
    r = d.admin.get(f"/v1/tenants/{tenant_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def demoted(d: Daemon, pool: str, n: int) -> bool:
    return d.metric("maasd_disk_demotions_total", pool=pool) >= n


def test_a_small_disk_quota_holds_under_concurrent_demotions(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB, disk_bytes=256 * MiB)
    # The default would be 4 × 64 MiB; its own quota is 5 MiB.
    tenant_id, key = new_tenant(d, 64 * MiB, disk_quota_bytes=5 * MiB)
    assert record(d, tenant_id)["disk_quota_bytes"] == 5 * MiB
    seen: list[int] = []

    def watch() -> None:
        seen.append(entry_file_bytes(disk))
        seen.append(record(d, tenant_id)["disk_used_bytes"])

    churn_concurrently(d, key, pool, entries=12, demotions=15, sample=watch)
    assert max(seen) <= 5 * (MiB + FILE_OVERHEAD)
    rec = record(d, tenant_id)
    assert 0 < rec["disk_used_bytes"] <= 5 * MiB
    assert int(d.metric("maasd_disk_bytes", pool=pool)) == rec["disk_used_bytes"]
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="evicted") >= 1
    usage = httpx.get(f"{d.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert usage["disk_quota_bytes"] == 5 * MiB
    assert usage["disk_used_bytes"] == rec["disk_used_bytes"]
    assert d.healthy()


def test_patch_lowers_the_disk_quota_from_the_next_demotion_on(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=4 * MiB, disk_bytes=64 * MiB)
    tenant_id, key = new_tenant(d, 16 * MiB)
    assert record(d, tenant_id)["disk_quota_bytes"] == 4 * 16 * MiB  # the factor's default
    r = connect(d, key)
    for i in range(8):  # DRAM holds 4: the first ones are demoted as the others come
        put_committed(r, f"a{i}", pattern(MiB, i), pool)
        use_once(r, f"a{i}")
    wait_until(lambda: record(d, tenant_id)["disk_used_bytes"] >= 3 * MiB)
    used = record(d, tenant_id)["disk_used_bytes"]
    p = d.admin.patch(f"/v1/tenants/{tenant_id}", json={"disk_quota_bytes": MiB})
    assert p.status_code == 200, p.text
    assert (p.json()["disk_quota_bytes"], p.json()["disk_used_bytes"]) == (MiB, used)
    assert p.json()["quota_bytes"] == 16 * MiB  # left alone
    before = d.metric("maasd_disk_demotions_total", pool=pool)
    for i in range(8, 10):  # the next demotions make room under the new quota
        put_committed(r, f"a{i}", pattern(MiB, i), pool)
        use_once(r, f"a{i}")
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) > before)
    wait_until(lambda: record(d, tenant_id)["disk_used_bytes"] <= MiB)
    r.close()
    events = d.admin.get("/v1/events", params={"tenant_id": tenant_id}).json()
    assert any(e["kind"] == "disk_quota_set" and e["bytes"] == MiB for e in events)


HOSTILE = [
    {"disk_quota_bytes": -1},
    {"disk_quota_bytes": 1.5},
    {"disk_quota_bytes": "1GiB"},
    {"disk_quota_bytes": None},
    {"disk_quota_bytes": True},
    {"disk_quota_bytes": 2**64},
    {"disk_quota_bytes": MiB, "disk_quota": MiB},  # an unknown field
]


@pytest.mark.parametrize("fields", HOSTILE, ids=json.dumps)
def test_hostile_disk_quotas_are_refused_and_nothing_changes(
    daemon: Daemon, fields: dict[str, Any]
) -> None:
    tenant_id, _ = daemon.tenant()
    before = record(daemon, tenant_id)
    r = daemon.admin.patch(f"/v1/tenants/{tenant_id}", json=fields)
    assert r.status_code == 400, r.text
    assert record(daemon, tenant_id) == before
    listed = daemon.admin.get("/v1/tenants").json()
    name = f"hostile-{secrets.token_hex(3)}"
    r = daemon.admin.post("/v1/tenants", json={"name": name, "quota_bytes": MiB, **fields})
    assert r.status_code == 400, r.text
    assert daemon.admin.get("/v1/tenants").json() == listed
    assert daemon.healthy()


def test_maasctl_creates_shows_and_sets_a_disk_quota(daemon: Daemon) -> None:
    name = f"cli-{secrets.token_hex(3)}"
    out = maasctl(daemon, "tenants", "create", name, "--quota", "8MiB", "--disk-quota", "32MiB")
    assert "disk quota" in out
    assert "32 MiB" in out
    shown = maasctl(daemon, "tenants", "show", name)
    assert "disk quota" in shown
    assert "32 MiB" in shown
    assert "disk used" in shown
    out = maasctl(daemon, "tenants", "set-disk-quota", name, "2MiB")
    assert "Disk quota of" in out
    as_json = json.loads(maasctl(daemon, "--json", "tenants", "show", name))
    assert (as_json["disk_quota_bytes"], as_json["disk_used_bytes"]) == (2 * MiB, 0)
    other = f"cli-{secrets.token_hex(3)}"
    created = json.loads(maasctl(daemon, "--json", "tenants", "create", other, "--quota", "8MiB"))
    assert created["disk_quota_bytes"] == 4 * 8 * MiB  # the default: the factor × the quota


def test_the_disk_quota_spans_the_hosts_tiers(disk_daemon: Daemon, tmp_path: Path) -> None:
    d = disk_daemon
    one, two = tmp_path / "one", tmp_path / "two"
    pools = [tier_pool(d, one, capacity=2 * MiB), tier_pool(d, two, capacity=2 * MiB)]
    tenant_id, key = new_tenant(d, 16 * MiB, disk_quota_bytes=2 * MiB)
    r = connect(d, key)
    for n, pool in enumerate(pools):  # two demoted to each tier, in turn
        for i in range(4):
            put_committed(r, f"p{n}-{i}", pattern(MiB, 10 * n + i), pool)
            use_once(r, f"p{n}-{i}")
        wait_until(functools.partial(demoted, d, pool, 2))
    r.close()
    # The first tier held 2 MiB, all the quota: the second tier's first demotion made
    # room by evicting one of them there; its second, by the policy on its own tier first.
    wait_until(lambda: len(entry_files(one)) == 1)
    assert len(entry_files(two)) == 1
    assert record(d, tenant_id)["disk_used_bytes"] == 2 * MiB
    assert d.metric("maasd_disk_drops_total", pool=pools[0], reason="evicted") == 1
    assert sum(int(d.metric("maasd_disk_bytes", pool=p)) for p in pools) == 2 * MiB
