"""Leases (a buffer not renewed is released at expiry) and tenant deletion, against a real daemon (reaper every 0.2 s).

* an expired lease is reaped: the buffer is gone within a few seconds, its
  bytes are no longer counted by the pool or the tenant, the reaped counter
  went up, and a worker's stale mapping reads zeros (scrubbed);
* renewing extends a lease (REST and socket);
* deleting a tenant releases (scrubs) all its buffers and revokes its keys.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest

from maasd.client import ConnectionFailed, Scratch, Unauthorized, Worker
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


def pool_used(d: Daemon, name: str = "node0") -> int:
    return next(p["used_bytes"] for p in d.admin.get("/v1/pools").json() if p["name"] == name)


def test_expired_lease_is_reaped_and_scrubbed(daemon) -> None:
    _, key = daemon.tenant("lease", 64 * MiB)
    user = daemon.client(key)
    reaped_before = daemon.metric("maasd_leases_reaped_total")
    used_before = pool_used(daemon)
    r = user.post("/v1/reserve", json={"size_bytes": 2 * MiB, "ttl_s": 1})
    assert r.status_code == 201, r.text
    buf = r.json()
    assert pool_used(daemon) == used_before + 2 * MiB
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buf["id"])
        m.array[:] = 0xA5
        assert user.get("/v1/usage").json()["used_bytes"] == 2 * MiB
        wait_until(
            lambda: user.get(f"/v1/buffers/{buf['id']}").status_code == 404,
            timeout=5.0,
            message="the lease ended but the buffer is still there",
        )
        # The stale mapping still works, and reads nothing but zeros.
        assert not np.any(m.array)
    usage = user.get("/v1/usage").json()
    assert usage["used_bytes"] == 0
    assert usage["buffers"] == 0
    assert pool_used(daemon) == used_before
    assert daemon.metric("maasd_leases_reaped_total") >= reaped_before + 1
    assert daemon.metric("maasd_release_total", reason="expire") >= 1
    assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 404
    user.close()


def test_renew_extends_the_lease(daemon) -> None:
    _, key = daemon.tenant("renew", 64 * MiB)
    user = daemon.client(key)
    buf = user.post("/v1/reserve", json={"size_bytes": MiB, "ttl_s": 2}).json()
    r = user.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 30})
    assert r.status_code == 200, r.text
    assert r.json()["expires_at"] > buf["expires_at"]
    time.sleep(3)
    again = user.get(f"/v1/buffers/{buf['id']}")
    assert again.status_code == 200
    assert again.json()["state"] == "live"
    assert again.json()["expires_at"] == r.json()["expires_at"]
    assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    user.close()


def test_renew_over_the_socket_extends_the_lease(daemon) -> None:
    _, key = daemon.tenant("sockrenew", 64 * MiB)
    user = daemon.client(key)
    buf = user.post("/v1/reserve", json={"size_bytes": MiB, "ttl_s": 1}).json()
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        w.renew(buf["id"], ttl_s=30)
        time.sleep(1.6)
        assert user.get(f"/v1/buffers/{buf['id']}").status_code == 200
    assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    user.close()


@pytest.mark.parametrize("via", ["rest", "socket"])
def test_a_shorter_renew_after_a_lookup_hit_holds(daemon, via: str) -> None:
    """A lookup hit extends an entry's lease in memory (batched); a renew to a shorter
    lease after it is what holds. Before, the hit's extension was written later, over the
    renew: the entry lived on for its old lease."""
    _, key = daemon.tenant(f"shorter-{via}", 64 * MiB)
    user = daemon.client(key)
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w, Scratch(MiB) as s:
        s.array[:] = 7
        entry = w.publish("prefix", s, MiB, ttl_s=600)
        hit = w.lookup(["prefix"])
        assert hit is not None
        hit.close()
        w.forget(entry.id)
        if via == "rest":
            r = user.post(f"/v1/buffers/{entry.id}/renew", json={"ttl_s": 1})
            assert r.status_code == 200, r.text
        else:
            w.renew(entry.id, ttl_s=1)
        wait_until(
            lambda: user.get(f"/v1/buffers/{entry.id}").status_code == 404,
            timeout=10.0,
            message="the entry outlived the lease its renew set",
        )
    user.close()


def test_renew_bad_ttl_and_foreign_buffer(daemon) -> None:
    _, key = daemon.tenant("renewbad", 64 * MiB)
    _, other = daemon.tenant("renewother", 64 * MiB)
    user, stranger = daemon.client(key), daemon.client(other)
    buf = user.post("/v1/reserve", json={"size_bytes": MiB}).json()
    for body in ({"ttl_s": 0}, {"ttl_s": -5}, {"ttl_s": "10"}, {}, {"ttl_s": 5, "x": 1}):
        assert user.post(f"/v1/buffers/{buf['id']}/renew", json=body).status_code == 400, body
    assert stranger.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 5}).status_code == 404
    assert user.get(f"/v1/buffers/{buf['id']}").json()["expires_at"] == buf["expires_at"]
    assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    user.close()
    stranger.close()


def test_tenant_delete_releases_everything_and_revokes_keys(daemon) -> None:
    tenant_id, key = daemon.tenant("doomed", 64 * MiB)
    extra = daemon.admin.post(f"/v1/tenants/{tenant_id}/keys")
    assert extra.status_code == 201, extra.text
    user = daemon.client(key)
    used_before = pool_used(daemon)
    ids = [
        user.post("/v1/reserve", json={"size_bytes": s}).json()["id"] for s in (MiB, 3 * MiB, 4096)
    ]
    assert pool_used(daemon) == used_before + 4 * MiB + 4096
    w = Worker(daemon.socket_path, key, renew_interval_s=0)
    m = w.attach(ids[1])
    m.array[:] = 7
    assert daemon.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
    assert not np.any(m.array), "a released buffer must read zeros through a stale mapping"
    assert pool_used(daemon) == used_before
    assert all(b["tenant_id"] != tenant_id for b in daemon.admin.get("/v1/buffers").json())
    assert daemon.admin.get(f"/v1/tenants/{tenant_id}").status_code == 404
    for k in (key, extra.json()["api_key"]):
        with daemon.client(k) as c:
            assert c.get("/v1/usage").status_code == 401
            assert c.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 401
        with pytest.raises(Unauthorized):
            Worker(daemon.socket_path, k, renew_interval_s=0)
    # The connected worker is refused too: its key is revoked.
    with pytest.raises((Unauthorized, ConnectionFailed)):
        w.attach(ids[0])
    w.close()
    assert daemon.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 404
    user.close()


def test_reaper_leaves_live_leases_alone(daemon) -> None:
    _, key = daemon.tenant("alive", 64 * MiB)
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {key}"}) as user:
        short = user.post("/v1/reserve", json={"size_bytes": MiB, "ttl_s": 1}).json()
        long = user.post("/v1/reserve", json={"size_bytes": MiB, "ttl_s": 60}).json()
        wait_until(
            lambda: user.get(f"/v1/buffers/{short['id']}").status_code == 404,
            timeout=5.0,
            message="the 1 s lease is reaped",
        )
        assert user.get(f"/v1/buffers/{long['id']}").status_code == 200
        assert user.get("/v1/usage").json()["used_bytes"] == MiB
        assert user.delete(f"/v1/buffers/{long['id']}").status_code == 204
