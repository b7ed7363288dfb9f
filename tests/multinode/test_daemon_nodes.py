"""A real ``maasd serve`` on two real NUMA nodes: REST for the control, the socket for the fds.

The test process maps each buffer as a worker does (``maasd.client.Worker``) and counts its
pages with ``move_pages`` itself (:func:`placement.array_pages`): 100 % on the node expected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from conftest import Daemon
from maasd.client import Worker
from maasd.core.strays import PAGES_PER_REGION
from maasd.topology import discover, node_room
from placement import (
    HUGE,
    NODES,
    PAGE,
    TOPOLOGY,
    MiB,
    all_on,
    array_pages,
    huge_pages,
    move_behind_its_back,
)
from waiting import wait_until

FAR = NODES[-1]
# Under TCG on a busy host a daemon takes minutes to start (imports over 9p).
pytestmark = pytest.mark.timeout(1200)


def reserve(d: Daemon, key: str, path: str = "/v1/reserve", **body: Any) -> dict[str, Any]:
    r = d.client(key).post(path, json={"ttl_s": 3600, **body})
    assert r.status_code == 201, r.text
    return dict(r.json())


def placement_of(d: Daemon, key: str, buffer_id: str) -> dict[int, int]:
    """The daemon's own count (``GET /v1/buffers/{id}``), keys as ints."""
    r = d.client(key).get(f"/v1/buffers/{buffer_id}")
    assert r.status_code == 200, r.text
    return {int(k): v for k, v in r.json()["placement"].items()}


def test_default_pools_one_per_node_each_buffer_on_its_node(numa_daemon: Daemon) -> None:
    d = numa_daemon
    pools = {p["name"]: p for p in d.admin.get("/v1/pools").json()}
    assert {f"node{n}": n for n in NODES} == {
        name: p["numa_node"] for name, p in pools.items() if name.startswith("node")
    }
    _, key = d.tenant("defaults")
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for n in NODES:
            buf = reserve(d, key, f"/v1/pools/node{n}/reserve", size_bytes=8 * MiB)
            assert buf["numa_node"] == n
            m = w.attach(buf["id"])
            assert m.numa_node == n
            assert array_pages(m.array) == all_on(n, 8 * MiB)
            assert placement_of(d, key, buf["id"]) == all_on(n, 8 * MiB)


def test_reserve_by_numa_node_and_by_a_latency_class_only_the_far_node_meets(
    numa_daemon: Daemon,
) -> None:
    d = numa_daemon
    d.pool("fast-far", 32 * MiB, numa_node=FAR, latency_us=0)
    _, key = d.tenant("qos")
    by_node = reserve(d, key, size_bytes=4 * MiB, numa_node=FAR)
    by_latency = reserve(d, key, size_bytes=4 * MiB, latency_us=0)
    assert by_node["numa_node"] == FAR
    assert by_latency["numa_node"] == FAR
    assert by_latency["pool_id"] == d.admin.get("/v1/pools/fast-far").json()["id"]
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for buf in (by_node, by_latency):
            assert array_pages(w.attach(buf["id"]).array) == all_on(FAR, 4 * MiB)


def test_a_pool_on_the_far_node_buffers_warm_stock_and_entries(numa_daemon: Daemon) -> None:
    """The pool is made as an operator makes it (``maasctl pools create --node``), with a
    capacity of two buffers and a warm stock of one: once the first buffer is held, the
    stock can hold one more region and nothing else, so a reserve that empties the stock
    (0 bytes left, none refilled: no room) was served from it."""
    d = numa_daemon
    maasctl(d, "pools", "create", "far", "--node", str(FAR), "--capacity", "8MiB", "--warm", "4MiB")
    pool = d.admin.get("/v1/pools/far").json()
    assert (pool["numa_node"], pool["warm_target_bytes"]) == (FAR, 4 * MiB)
    _, key = d.tenant("far")
    first = reserve(d, key, "/v1/pools/far/reserve", size_bytes=4 * MiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        assert array_pages(w.attach(first["id"]).array) == all_on(FAR, 4 * MiB)
        # the stock follows the sizes asked for: wait until it holds one of this size
        wait_until(lambda: warm_bytes(d, "far") == 4 * MiB, 120, message="the stock filled")
        warm = reserve(d, key, "/v1/pools/far/reserve", size_bytes=4 * MiB)
        assert warm_bytes(d, "far") == 0, "the reserve did not take the stocked region"
        assert d.admin.get("/v1/pools/far").json()["free_bytes"] == 0
        assert array_pages(w.attach(warm["id"]).array) == all_on(FAR, 4 * MiB)
        for buf in (first, warm):
            assert d.client(key).delete(f"/v1/buffers/{buf['id']}").status_code == 204
        # an entry: written in a staging region, copied at commit into a fresh one
        data = np.random.default_rng(1).integers(0, 256, 2 * MiB, dtype=np.uint8)
        with w.entry("far-entry", 2 * MiB, pool="far") as staged:
            assert array_pages(staged.array) == all_on(FAR, 2 * MiB)
            staged.array[:] = data
        hit = w.lookup(["far-entry"])
        assert hit is not None
        with hit as entry:
            assert np.array_equal(entry.array, data)
            assert array_pages(entry.array) == all_on(FAR, 2 * MiB)


def test_pin_there_and_back_reports_what_the_kernel_counts(numa_daemon: Daemon) -> None:
    d = numa_daemon
    _, key = d.tenant("pin")
    c = d.client(key)
    buf = reserve(d, key, "/v1/pools/node0/reserve", size_bytes=8 * MiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buf["id"])
        m.array[:] = 7
        for node in (FAR, 0):
            r = c.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": node})
            assert r.status_code == 200, r.text
            reported = {int(k): v for k, v in r.json()["placement"].items()}
            assert reported == all_on(node, 8 * MiB)
            assert array_pages(m.array) == reported
        assert np.all(m.array == 7)


def test_pin_while_a_worker_writes_to_its_mapping(numa_daemon: Daemon) -> None:
    d = numa_daemon
    _, key = d.tenant("pin-busy")
    c = d.client(key)
    buf = reserve(d, key, "/v1/pools/node0/reserve", size_bytes=16 * MiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        words = w.attach(buf["id"]).array.view(np.uint64)
        stop = threading.Event()
        rounds = [0]

        def write() -> None:
            while not stop.is_set():
                rounds[0] += 1
                words[:: PAGE // 8] = rounds[0]

        t = threading.Thread(target=write)
        t.start()
        try:
            for node in (FAR, 0, FAR):
                r = c.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": node})
                assert r.status_code == 200, r.text
                assert {int(k): v for k, v in r.json()["placement"].items()} == all_on(
                    node, 16 * MiB
                )
        finally:
            stop.set()
            t.join()
        assert rounds[0] > 0
        assert array_pages(words) == all_on(FAR, 16 * MiB)
        assert set(words[:: PAGE // 8].tolist()) == {rounds[0]}
        assert placement_of(d, key, buf["id"]) == all_on(FAR, 16 * MiB)


def test_a_full_node_is_a_clear_507_and_nothing_changes(numa_daemon: Daemon) -> None:
    d = numa_daemon
    room = node_room(FAR)
    assert room is not None
    # as large as the node (a larger capacity is refused: 422), so more than it has free
    node = TOPOLOGY.node(FAR)
    assert node is not None
    d.pool("huge-far", node.mem_total_bytes // PAGE * PAGE, numa_node=FAR)
    _, key = d.tenant("full", 4 << 30)
    c = d.client(key)
    before = c.get("/v1/usage").json()
    r = c.post("/v1/pools/huge-far/reserve", json={"size_bytes": room + 64 * MiB})
    assert r.status_code == 507, r.text
    assert r.json()["type"].endswith("/pool-exhausted")
    assert f"NUMA node {FAR} has" in r.json()["detail"]
    assert c.get("/v1/usage").json() == before
    assert d.healthy()
    small = reserve(d, key, "/v1/pools/huge-far/reserve", size_bytes=8 * MiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        assert array_pages(w.attach(small["id"]).array) == all_on(FAR, 8 * MiB)


def test_placement_metric_samples_and_sees_pages_moved_off_their_node(
    numa_daemon: Daemon,
) -> None:
    """``maasd_pool_pages_off_node`` is 0 because pages were asked about and found home
    (``maasd_pool_pages_sampled`` > 0), and not 0 once a buffer's pages are moved to the
    other node behind the daemon's back (``move_pages`` from a worker's mapping, as a NUMA
    balancer or a hot-remove would); a pin puts them back and the count falls to 0."""
    d = numa_daemon
    _, key = d.tenant("watched")
    c = d.client(key)
    bufs = {n: reserve(d, key, f"/v1/pools/node{n}/reserve", size_bytes=4 * MiB) for n in NODES}
    for n in NODES:
        assert d.metric("maasd_pool_pages_sampled", pool=f"node{n}") >= PAGES_PER_REGION
        assert d.metric("maasd_pool_pages_off_node", pool=f"node{n}") == 0
    away = NODES[0]
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(bufs[FAR]["id"])
        m.array[:] = 3
        assert move_behind_its_back(m.array, away) == all_on(away, 4 * MiB)
        assert array_pages(m.array) == all_on(away, 4 * MiB)
        # every page the daemon samples of that buffer is found off its node, no other
        assert d.metric("maasd_pool_pages_off_node", pool=f"node{FAR}") == PAGES_PER_REGION
        assert d.metric("maasd_pool_pages_off_node", pool=f"node{away}") == 0
        assert placement_of(d, key, bufs[FAR]["id"]) == all_on(away, 4 * MiB)
        r = c.patch(f"/v1/buffers/{bufs[FAR]['id']}/pin", json={"numa_node": FAR})
        assert r.status_code == 200, r.text
        assert array_pages(m.array) == all_on(FAR, 4 * MiB)
        assert d.metric("maasd_pool_pages_off_node", pool=f"node{FAR}") == 0
        assert np.all(m.array == 3)
    for n in NODES:
        assert d.metric("maasd_pool_pages_off_node", pool=f"node{n}") == 0


@pytest.mark.hugetlb
def test_a_hugetlb_pool_on_each_node_takes_that_nodes_huge_pages(numa_daemon: Daemon) -> None:
    """Huge pages reserved per node (4 on the far node, none on node 0): a hugetlb pool
    made with ``maasctl --backing hugetlb`` on the far node gives a worker buffers of that
    node's huge pages, all of them; one on node 0 answers 507 and takes none of the far
    node's."""
    d = numa_daemon
    near = NODES[0]
    with huge_pages({near: 0, FAR: 4}):
        maasctl(
            d, "pools", "create", "hp-far", "--node", str(FAR), "--capacity", "8MiB",
            "--backing", "hugetlb",
        )  # fmt: skip
        maasctl(
            d, "pools", "create", "hp-near", "--node", str(near), "--capacity", "8MiB",
            "--backing", "hugetlb",
        )  # fmt: skip
        _, key = d.tenant("hugetlb")
        c = d.client(key)
        try:
            buf = reserve(d, key, "/v1/pools/hp-far/reserve", size_bytes=4 * MiB)
            assert buf["numa_node"] == FAR
            assert huge_free() == {near: 0, FAR: 2}
            data = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
            with Worker(d.socket_path, key, renew_interval_s=0) as w:
                m = w.attach(buf["id"])
                m.array[:] = data
                assert array_pages(m.array, HUGE) == all_on(FAR, 4 * MiB, HUGE)
                assert np.array_equal(m.array, data)
            assert placement_of(d, key, buf["id"]) == all_on(FAR, 4 * MiB, HUGE)
            r = c.post("/v1/pools/hp-near/reserve", json={"size_bytes": 2 * MiB})
            assert r.status_code == 507, r.text  # was a 500: EFAULT at populate
            assert r.json()["type"].endswith("/pool-exhausted")
            assert f"on node {near}" in r.json()["detail"]
            assert huge_free() == {near: 0, FAR: 2}, "a huge page was taken from the far node"
            assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
            wait_until(lambda: huge_free()[FAR] == 4, 60, message="the huge pages given back")
        finally:
            for name in ("hp-far", "hp-near"):
                d.admin.delete(f"/v1/pools/{name}", params={"drain": "true"})


def huge_free() -> dict[int, int]:
    """Free huge pages per node, as the kernel counts them now."""
    return {n.id: n.hugepages_free for n in discover().nodes}


def warm_bytes(d: Daemon, pool: str) -> int:
    return int(d.admin.get(f"/v1/pools/{pool}").json()["warm_bytes"])


def maasctl(d: Daemon, *args: str) -> str:
    """``maasctl ARGS`` against this daemon, as its admin; its output."""
    return _cli("maasd.cli.maasctl", *args, MAASD_URL=d.url, MAASD_ADMIN_KEY=d.admin_key)


def _cli(*args: str, **env: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", *args],
        env={**os.environ, **env, "COLUMNS": "200", "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_topology_everywhere_shows_both_nodes_and_their_distances(
    numa_daemon: Daemon, tmp_path: Any
) -> None:
    d = numa_daemon
    distances = [[10 if i == j else 20 for j in NODES] for i in NODES]
    topo = d.admin.get("/v1/topology").json()
    assert [n["distances"] for n in topo["nodes"]] == distances
    table = maasctl(d, "topology")
    assert "10 20" in table
    assert "20 10" in table
    info = json.loads(_cli("maasd.cli.daemon", "info", "--json", MAASD_DATA_DIR=str(tmp_path)))
    assert [n["distances"] for n in info["topology"]["nodes"]] == distances
    assert [p["numa_node"] for p in info["pools"]] == NODES
    doctor = subprocess.run(
        [
            sys.executable,
            "-m",
            "maasd.cli.daemon",
            "doctor",
            "--json",
            *("--skip", "ledger", "--skip", "llama-cpp-python"),
        ],
        env={**os.environ, "MAASD_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    numa = checks["NUMA placement"]
    assert numa["status"] == "ok", numa
    assert f"{len(NODES)} node(s)" in numa["detail"]
    assert "distances 10 20 / 20 10" in numa["detail"]


def test_a_checkpointed_buffer_comes_back_on_its_node(numa_daemon: Daemon) -> None:
    """Last in the module: it restarts the module's daemon (one start fewer, minutes in TCG)."""
    d = numa_daemon
    d.pool("durable-far", 16 * MiB, numa_node=FAR, persistence="persistent")
    _, key = d.tenant("durable")
    buf = reserve(d, key, "/v1/pools/durable-far/reserve", size_bytes=4 * MiB)
    data = np.random.default_rng(2).integers(0, 256, 4 * MiB, dtype=np.uint8)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        w.attach(buf["id"]).array[:] = data
    assert d.client(key).post(f"/v1/buffers/{buf['id']}/checkpoint").status_code == 200
    d.stop()
    d.start()
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buf["id"])
        assert m.numa_node == FAR
        assert np.array_equal(m.array, data)
        assert array_pages(m.array) == all_on(FAR, 4 * MiB)
    assert placement_of(d, key, buf["id"]) == all_on(FAR, 4 * MiB)
