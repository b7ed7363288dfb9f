"""``maasd info --probe`` and doctor's bandwidth check: measured on this host's real memory
(one node here; every pair of two nodes in tests/multinode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from maasd.cli.doctor_kernel import check_bandwidth
from maasd.probe import probe_bandwidth
from maasd.topology import discover


def test_one_figure_per_cpu_node_and_memory_node() -> None:
    topo = discover()
    measured = probe_bandwidth(topo, size=8 << 20, rounds=2)
    pairs = {(n.id, m.id) for n in topo.nodes if n.cpus for m in topo.nodes}
    assert {(b.cpu_node, b.mem_node) for b in measured} == pairs
    assert all(b.gib_per_s > 0 for b in measured)


def test_affinity_is_given_back() -> None:
    before = os.sched_getaffinity(0)
    probe_bandwidth(discover(), size=4 << 20, rounds=1)
    assert os.sched_getaffinity(0) == before


def test_doctor_check() -> None:
    c = check_bandwidth(discover())
    assert c.status == "ok", c
    assert "cpu 0→mem 0" in c.detail


def test_info_probe_side_by_side(tmp_path) -> None:
    env = {**os.environ, "MAASD_DATA_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "maasd.cli.daemon", "info", "--probe"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "copy bandwidth, GiB/s (CPU node → memory node):" in out.stdout
    assert "node0: declared latency_us=1; measured " in out.stdout
    js = subprocess.run(
        [*run, "--json"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    bandwidth = json.loads(js.stdout)["bandwidth"]
    assert [(b["cpu_node"], b["mem_node"]) for b in bandwidth][0] == (0, 0)
    plain = subprocess.run(
        run[:-1] + ["--json"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert "bandwidth" not in json.loads(plain.stdout)  # measured only when asked


def test_latency_one_figure_per_pair_and_affinity_given_back() -> None:
    from maasd.probe import probe_latency

    topo = discover()
    before = os.sched_getaffinity(0)
    measured = probe_latency(topo, size=64 << 20, rounds=4)
    assert os.sched_getaffinity(0) == before
    pairs = {(n.id, m.id) for n in topo.nodes if n.cpus for m in topo.nodes}
    assert {(x.cpu_node, x.mem_node) for x in measured} == pairs
    assert all(x.ns > 0 and x.rounds == 4 and x.chase_bytes == 64 << 20 for x in measured)


def test_latency_past_the_deadline_measures_nothing_more() -> None:
    import time

    from maasd.probe import probe_latency

    assert probe_latency(discover(), deadline=time.monotonic() - 1) == []


def test_doctor_latency_check_holds_each_pool_to_its_node(tmp_path) -> None:
    from maasd.cli.doctor_latency import check_latency
    from maasd.models import PoolSpec
    from maasd.settings import Settings

    pools = [
        PoolSpec(name="roomy", numa_node=0, capacity_bytes=1 << 20, latency_us=5),
        PoolSpec(name="zero", numa_node=0, capacity_bytes=1 << 20, latency_us=0),
    ]
    c = check_latency(discover(), Settings(data_dir=str(tmp_path), pools=pools))
    assert c.name == "latency classes"
    assert "roomy: declared 5 µs, measured " in c.detail
    # No memory answers in 0 µs: the pool declaring it is flagged, with the fix.
    assert c.status == "warn", c
    assert "zero measures " in c.detail
    assert "> its declared 0" in c.detail
    assert "latency_source" in c.fix


def test_info_probe_prints_the_latency_matrix(tmp_path) -> None:
    env = {**os.environ, "MAASD_DATA_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "maasd.cli.daemon", "info", "--probe"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert "load-to-use latency, ns (CPU node → memory node):" in out.stdout
    assert " µs, " in out.stdout  # the pool's measured class beside its declared one
    js = json.loads(
        subprocess.run(
            [*run, "--json"], env=env, capture_output=True, text=True, timeout=120, check=True
        ).stdout
    )
    assert js["latency"][0]["ns"] > 0
    assert js["measured"]["node0"]["latency_us"] > 0
