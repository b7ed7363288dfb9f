"""Measured latency classes on two real NUMA nodes: the daemon's background probe reports
every CPU node × memory node pair (remote ones too), and a reserve held to the measured
class lands on a pool whose measured class meets it, its pages on that pool's node.

In the guest the nodes' distances are declared (QEMU's ``-numa``) and both share the host's
memory: the figures are checked for being there and positive, not for a remote penalty.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import Daemon
from maasd.client import Worker
from placement import NODES, TOPOLOGY, MiB, all_on, array_pages

FAR = NODES[-1]
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A real ``maasd serve`` with its latency probe on (TCG: minutes for the child)."""
    d = Daemon(
        tmp_path_factory.mktemp("maasd-probed"),
        env={
            "MAASD_DEFAULT_POOL_BYTES": str(64 * MiB),
            "MAASD_LATENCY_PROBE": "true",
            "MAASD_LATENCY_PROBE_TIMEOUT_S": "900",
        },
    )
    d.start()
    yield d
    d.close()


def measured_pools(d: Daemon, timeout: float = 1000.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = {p["name"]: p for p in d.admin.get("/v1/pools").json()}
        if all(p["measured_latency_us"] is not None for p in pools.values()):
            return pools
        time.sleep(1.0)
    raise AssertionError(f"no measured class in {timeout}s:\n{d.log()}")


def test_every_pair_is_measured_remote_ones_included(probed: Daemon) -> None:
    pools = measured_pools(probed)
    cpu_nodes = {n.id for n in TOPOLOGY.nodes if n.cpus}
    assert len(cpu_nodes) >= 2
    for n in NODES:
        m = pools[f"node{n}"]["measured"]
        assert m["cpu_node"] == n  # the class: from the node's own cpus
        assert pools[f"node{n}"]["measured_latency_us"] == m["latency_us"] > 0
        by_cpu = {f["cpu_node"]: f for f in m["by_cpu_node"]}
        assert set(by_cpu) == cpu_nodes
        for f in by_cpu.values():  # remote: from the other node's cpus
            assert f["latency_us"] > 0
            assert f["gib_per_s"] > 0
    print(*(line for line in probed.log().splitlines() if "latency probe" in line), sep="\n")
    print(
        "measured (µs, GiB/s by cpu node):",
        {
            name: [
                (f["cpu_node"], f["latency_us"], f["gib_per_s"])
                for f in p["measured"]["by_cpu_node"]
            ]
            for name, p in pools.items()
        },
    )


def test_a_reserve_held_to_the_measured_class_lands_where_it_is_met(probed: Daemon) -> None:
    pools = measured_pools(probed)
    far_class = pools[f"node{FAR}"]["measured_latency_us"]
    slow = probed.pool("declared-slow", 32 * MiB, numa_node=FAR, latency_us=50)
    assert slow["measured_latency_us"] == far_class
    _, key = probed.tenant("measured")
    c = probed.client(key)
    body = {"size_bytes": 4 * MiB, "latency_us": 5, "ttl_s": 3600}
    declared = c.post(f"/v1/pools/{slow['id']}/reserve", json=body)
    assert declared.status_code == 422, declared.text
    trusted = c.post(f"/v1/pools/{slow['id']}/reserve", json={**body, "latency_source": "measured"})
    assert trusted.status_code == 201, trusted.text
    # Any pool whose measured class meets the ceiling, on the far node: its pages are there.
    anywhere = c.post(
        "/v1/reserve",
        json={**body, "latency_us": far_class, "latency_source": "measured", "numa_node": FAR},
    )
    assert anywhere.status_code == 201, anywhere.text
    landed = probed.admin.get(f"/v1/pools/{anywhere.json()['pool_id']}").json()
    assert landed["numa_node"] == FAR
    assert landed["measured_latency_us"] <= far_class
    with Worker(probed.socket_path, key, renew_interval_s=0) as w:
        for buf in (trusted.json(), anywhere.json()):
            assert array_pages(w.attach(buf["id"]).array) == all_on(FAR, 4 * MiB)
