"""``/metrics`` samples where each pool's pages are: on this one-node host none is off its
node, and the sample counts the pages of the pool's buffers (the two-node case:
tests/multinode)."""

from __future__ import annotations

from conftest import Daemon, MiB
from maasd.client import Worker


def test_pages_sampled_per_pool_none_off_node(daemon: Daemon) -> None:
    daemon.pool("sampled", 32 * MiB)
    _, key = daemon.tenant("sampled")
    r = daemon.client(key).post(
        "/v1/pools/sampled/reserve", json={"size_bytes": 4 * MiB, "ttl_s": 600}
    )
    assert r.status_code == 201, r.text
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        w.attach(r.json()["id"]).array[:] = 1
        assert daemon.metric("maasd_pool_pages_sampled", pool="sampled", node="0") == 8
        assert daemon.metric("maasd_pool_pages_off_node", pool="sampled", node="0") == 0
    text = daemon.admin.get("/metrics").text
    assert 'maasd_pool_pages_off_node{node="0",pool="node0"} 0.0' in text
