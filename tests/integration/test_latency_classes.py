"""Measured latency classes through a real ``maasd serve``: the background probe fills each
pool's ``measured_latency_us`` beside its declared ``latency_us`` (REST, maasctl), and a
reserve with ``latency_source = "measured"`` is held to it; with the probe off every class
is null and such a reserve is a clear 422. (Both nodes of a two-node host: tests/multinode.)"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conftest import Daemon

MiB = 1 << 20


def measured_pools(d: Daemon, timeout: float = 120.0) -> list[dict[str, Any]]:
    """``GET /v1/pools`` once every pool of the host has a measured class."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pools = d.admin.get("/v1/pools").json()
        if pools and all(p["measured_latency_us"] is not None for p in pools):
            return list(pools)
        time.sleep(0.2)
    raise AssertionError(f"no measured class in {timeout}s:\n{d.log()}")


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # Unset (conftest turns it off for every other daemon): the default of `maasd serve`, on.
    d = Daemon(tmp_path_factory.mktemp("probed"), env={"MAASD_LATENCY_PROBE": ""})
    d.start()
    yield d
    d.close()


def test_pools_report_declared_and_measured_side_by_side(probed: Daemon) -> None:
    pools = measured_pools(probed)
    cpu_nodes = {n["id"] for n in probed.admin.get("/v1/topology").json()["nodes"] if n["cpus"]}
    for p in pools:
        assert p["latency_us"] == 1  # declared: what the default pools were made with
        m = p["measured"]
        assert 0 < p["measured_latency_us"] == m["latency_us"] < 100
        assert {f["cpu_node"] for f in m["by_cpu_node"]} == cpu_nodes
        assert all(f["latency_us"] > 0 and f["gib_per_s"] > 0 for f in m["by_cpu_node"])
        one = probed.admin.get(f"/v1/pools/{p['id']}").json()
        assert one["measured_latency_us"] == p["measured_latency_us"]
    assert "latency probe: node 0 " in probed.log()
    node0 = next(p for p in pools if p["name"] == "node0")
    declared = probed.metric("maasd_pool_latency_seconds", pool="node0", source="declared")
    measured = probed.metric("maasd_pool_latency_seconds", pool="node0", source="measured")
    assert declared == pytest.approx(1e-6)
    assert measured == pytest.approx(node0["measured_latency_us"] / 1e6)


def test_a_reserve_held_to_the_measured_class(probed: Daemon) -> None:
    node0 = next(p for p in measured_pools(probed) if p["name"] == "node0")
    # Declared slow, measured as fast as its node: only a measured reserve may take it.
    slow = probed.pool("slow0", 16 * MiB, latency_us=50)
    assert slow["measured_latency_us"] == node0["measured_latency_us"]  # the node's class
    _, key = probed.tenant("lat")
    with probed.client(key) as c:
        declared = c.post(
            f"/v1/pools/{slow['id']}/reserve", json={"size_bytes": MiB, "latency_us": 5}
        )
        assert declared.status_code == 422
        assert declared.json()["type"].endswith("/qos-unmet")
        r = c.post(
            f"/v1/pools/{slow['id']}/reserve",
            json={"size_bytes": MiB, "latency_us": 5, "latency_source": "measured"},
        )
        assert r.status_code == 201, r.text
        assert r.json()["pool_id"] == slow["id"]
        # A fractional ceiling just above the measured class: a pool whose class meets it.
        ceiling = math.ceil(node0["measured_latency_us"] * 1000 + 1) / 1000
        body = {"size_bytes": MiB, "latency_us": ceiling, "latency_source": "measured"}
        got = c.post("/v1/reserve", json=body)
        assert got.status_code == 201, got.text
        pool = probed.admin.get(f"/v1/pools/{got.json()['pool_id']}").json()
        assert pool["measured_latency_us"] <= ceiling
        below = c.post("/v1/reserve", json={**body, "latency_us": ceiling / 1000})
        assert below.status_code == 422
        assert "measured latency_us" in below.json()["detail"]
        for b in (r.json(), got.json()):
            assert c.delete(f"/v1/buffers/{b['id']}").status_code == 204


def test_maasctl_shows_the_classes_and_reserves_by_the_measured_one(probed: Daemon) -> None:
    measured_pools(probed)
    _, key = probed.tenant("ctl")
    listing = maasctl(probed, "pools", "list").stdout
    assert "MEASURED µs" in listing
    shown = maasctl(probed, "pools", "show", "node0").stdout
    assert "FROM CPU NODE" in shown
    assert "(class)" in shown
    r = maasctl(probed, "buffers", "reserve", "1MiB", "--latency-us", "5", "--measured", key=key)
    assert "numa node" in r.stdout, r.stdout + r.stderr
    bad = maasctl(probed, "buffers", "reserve", "1MiB", "--measured", key=key, check=False)
    assert bad.returncode != 0
    assert "latency_source needs latency_us" in bad.stdout + bad.stderr


def test_the_openapi_document_has_the_fields(probed: Daemon) -> None:
    schema = httpx.get(f"{probed.url}/schema/openapi.json").text
    assert "latency_source" in schema
    assert "measured_latency_us" in schema


def test_with_the_probe_off_classes_are_null_and_a_measured_reserve_says_so(
    daemon: Daemon,
) -> None:
    pools = daemon.admin.get("/v1/pools").json()
    assert daemon.metric("maasd_pool_latency_seconds", pool="node0", source="measured") == 0.0
    assert pools
    assert all(p["measured_latency_us"] is None and p["measured"] is None for p in pools)
    _, key = daemon.tenant("off")
    with daemon.client(key) as c:
        before = c.get("/v1/usage").json()
        r = c.post(
            "/v1/reserve", json={"size_bytes": MiB, "latency_us": 100, "latency_source": "measured"}
        )
        assert r.status_code == 422
        assert "no node measured yet" in r.json()["detail"]
        no_ceiling = c.post("/v1/reserve", json={"size_bytes": MiB, "latency_source": "measured"})
        assert no_ceiling.status_code == 400
        assert "latency_source needs latency_us" in no_ceiling.json()["detail"]
        assert c.get("/v1/usage").json() == before
        assert c.post("/v1/reserve", json={"size_bytes": MiB, "latency_us": 1}).status_code == 201
    assert daemon.healthy()


def maasctl(d: Daemon, *args: str, key: str | None = None, check: bool = True) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env.update(MAASD_URL=d.url, MAASD_ADMIN_KEY=d.admin_key, COLUMNS="240", NO_COLOR="1")
    if key is not None:
        env["MAASD_KEY"] = key
        del env["MAASD_ADMIN_KEY"]
    p = subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p
