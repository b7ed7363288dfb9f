"""The pure parts of measured latency classes: placement held to a measured class, the
probe's arithmetic and its cycle, a node's class from the probe's pairs, doctor's findings,
and the reserve body's rules."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from maasd.api.schemas import ReserveBody
from maasd.cli.doctor_latency import latency_findings
from maasd.core import placement
from maasd.core.latency import Measurements, node_classes
from maasd.errors import InvalidRequest, QosUnmet
from maasd.models import Measured, PoolInfo, PoolSpec, ReserveSpec
from maasd.probe import Bandwidth, Latency, Probe, chase, chase_bytes, load_to_use_ns, write_cycle
from maasd.store import PoolRow
from maasd.topology import Node, Topology


def row(name: str, node: int, latency_us: int, capacity: int = 1 << 30) -> PoolRow:
    return PoolRow(
        id=f"id-{name}",
        host="h",
        name=name,
        numa_node=node,
        backing="memfd",
        persistence="volatile",
        latency_us=latency_us,
        capacity_bytes=capacity,
        page_bytes=4096,
        prefault=True,
        scrub="zero",
        spill_dir=None,
        created_at=0.0,
    )


def topo(distances: list[list[int]], cpus: list[list[int]]) -> Topology:
    nodes = [
        Node(id=i, cpus=c, mem_total_bytes=1 << 30, mem_free_bytes=1 << 30, distances=d)
        for i, (d, c) in enumerate(zip(distances, cpus, strict=True))
    ]
    return Topology(nodes=nodes, page_bytes=4096, hugepage_bytes=2 << 20, hugepages_free=0)


# -- placement ---------------------------------------------------------------------------

NEAR, FAR = row("near", 0, latency_us=5), row("far", 1, latency_us=1)
MEASURED = {0: 0.09, 1: 0.35}  # node 1 declares the better class and measures the worse


def test_declared_source_ignores_the_measurement() -> None:
    req = ReserveSpec(size_bytes=1, latency_us=2)
    assert placement.candidates([NEAR, FAR], req, {0, 1}, MEASURED) == [FAR]


def test_measured_source_holds_the_ceiling_to_the_measured_class() -> None:
    req = ReserveSpec(size_bytes=1, latency_us=0.2, latency_source="measured")
    assert placement.candidates([NEAR, FAR], req, {0, 1}, MEASURED) == [NEAR]
    wide = ReserveSpec(size_bytes=1, latency_us=1, latency_source="measured")
    assert placement.candidates([NEAR, FAR], wide, {0, 1}, MEASURED) == [NEAR, FAR]


def test_measured_ceiling_below_every_class_is_qos_unmet() -> None:
    req = ReserveSpec(size_bytes=1, latency_us=0.05, latency_source="measured")
    with pytest.raises(QosUnmet, match="measured latency_us ≤ 0.05"):
        placement.candidates([NEAR, FAR], req, {0, 1}, MEASURED)


def test_a_node_not_measured_does_not_qualify() -> None:
    req = ReserveSpec(size_bytes=1, latency_us=10, latency_source="measured")
    assert placement.candidates([NEAR, FAR], req, {0, 1}, {1: 0.35}) == [FAR]
    with pytest.raises(QosUnmet, match="no node measured yet"):
        placement.candidates([NEAR, FAR], req, {0, 1}, {})


def test_measured_source_keeps_the_other_rules() -> None:
    req = ReserveSpec(size_bytes=2 << 30, latency_us=1, latency_source="measured")
    with pytest.raises(Exception, match="exceed the .*capacity"):
        placement.candidates([NEAR, FAR], req, {0, 1}, MEASURED)
    on1 = ReserveSpec(size_bytes=1, latency_us=1, latency_source="measured", numa_node=1)
    assert placement.candidates([NEAR, FAR], on1, {0, 1}, MEASURED) == [FAR]


@given(
    ceiling=st.floats(min_value=0, max_value=10, allow_nan=False),
    classes=st.dictionaries(st.integers(0, 3), st.floats(0, 10, allow_nan=False)),
)
def test_meets_is_exactly_measured_at_most_the_ceiling(
    ceiling: float, classes: dict[int, float]
) -> None:
    req = ReserveSpec(size_bytes=1, latency_us=ceiling, latency_source="measured")
    for node in range(4):
        want = node in classes and classes[node] <= ceiling
        assert placement.meets(row("p", node, latency_us=0), req, classes) is want


# -- the probe's arithmetic and cycle ----------------------------------------------------


def test_load_to_use_is_the_far_minus_near_per_step() -> None:
    assert load_to_use_ns(far_s=0.002, near_s=0.0004, steps=16000) == pytest.approx(100.0)
    assert load_to_use_ns(far_s=0.0003, near_s=0.0004, steps=16000) == 0.0  # noise, not < 0
    with pytest.raises(ValueError, match="steps must be > 0"):
        load_to_use_ns(1.0, 0.5, 0)


def test_chase_bytes_is_four_llcs_within_bounds() -> None:
    assert chase_bytes(32 << 20) == 128 << 20
    assert chase_bytes(2 << 20) == 64 << 20
    assert chase_bytes(512 << 20) == 1 << 30


@given(lines=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_the_cycle_visits_every_line_once(lines: int, seed: int) -> None:
    words = np.zeros(lines * 8, dtype=np.int64)
    start = write_cycle(words, np.random.default_rng(seed))
    seen, i = set(), start
    for _ in range(lines):
        assert i % 8 == 0
        assert i not in seen
        seen.add(i)
        i = int(words[i])
    assert i == start
    assert len(seen) == lines


def test_chase_follows_the_cycle() -> None:
    words = np.zeros(64 * 8, dtype=np.int64)
    start = write_cycle(words, np.random.default_rng(7))
    m = words.data.cast("B").cast("q")
    i = start
    for _ in range(16):
        i = int(words[i])
    assert chase(m, start, 16) == i
    assert chase(m, start, 64 * 16) == start  # 16 whole turns of the cycle


# -- a node's class ----------------------------------------------------------------------

TWO = topo([[10, 21], [21, 10]], [[0], [1]])
PAIRS = Probe(
    latency=[
        Latency(cpu_node=c, mem_node=m, ns=ns, chase_bytes=1, rounds=3)
        for (c, m), ns in {(0, 0): 90.0, (0, 1): 140.0, (1, 0): 150.0, (1, 1): 95.0}.items()
    ],
    bandwidth=[Bandwidth(cpu_node=0, mem_node=1, gib_per_s=7.5)],
)


def test_a_node_class_is_its_own_cpus_figure_with_every_cpu_node_beside() -> None:
    classes = node_classes(TWO, PAIRS, at=0.0)
    assert classes[0].latency_us == pytest.approx(0.09)
    assert classes[0].cpu_node == 0
    assert classes[1].latency_us == pytest.approx(0.095)
    assert classes[1].cpu_node == 1
    by_cpu = {f.cpu_node: f for f in classes[1].by_cpu_node}
    assert by_cpu[0].latency_us == pytest.approx(0.14)
    assert by_cpu[0].gib_per_s == 7.5
    assert by_cpu[1].gib_per_s is None
    assert classes[0].measured_at == "1970-01-01T00:00:00.000000Z"


def test_a_memory_only_node_takes_the_nearest_cpu_node() -> None:
    three = topo([[10, 20, 30], [20, 10, 12], [30, 12, 10]], [[0], [1], []])
    probe = Probe(
        latency=[
            Latency(cpu_node=0, mem_node=2, ns=400.0, chase_bytes=1, rounds=3),
            Latency(cpu_node=1, mem_node=2, ns=250.0, chase_bytes=1, rounds=3),
        ],
        bandwidth=[],
    )
    classes = node_classes(three, probe, at=0.0)
    assert set(classes) == {2}
    assert classes[2].cpu_node == 1
    assert classes[2].latency_us == pytest.approx(0.25)


# -- the daemon's store of them ----------------------------------------------------------


def info(name: str, node: int, host: str = "h") -> PoolInfo:
    return PoolInfo(
        id=name, name=name, host=host, numa_node=node, backing="memfd",
        persistence="volatile", latency_us=1, capacity_bytes=1, used_bytes=0, free_bytes=1,
        page_bytes=4096, prefault=True, scrub="zero",
    )  # fmt: skip


def test_measurements_annotate_this_hosts_pools_once_measured() -> None:
    m = Measurements(True, 5.0, runner=lambda _timeout: PAIRS)
    assert m.annotate([info("a", 0)], "h")[0].measured_latency_us is None  # not yet
    m.start(TWO)
    assert m.wait(10)
    assert m.state == "done"
    a, b, other = m.annotate([info("a", 0), info("b", 1), info("c", 1, host="x")], "h")
    assert a.measured_latency_us == pytest.approx(0.09)
    assert a.measured is not None
    assert b.measured_latency_us == pytest.approx(0.095)
    assert other.measured_latency_us is None  # another host's pool: not ours to measure
    assert m.classes() == {0: pytest.approx(0.09), 1: pytest.approx(0.095)}


def test_a_failed_or_disabled_probe_leaves_every_class_null() -> None:
    def broken(_timeout: float) -> Probe:
        raise TimeoutError("killed past 5 s")

    m = Measurements(True, 5.0, runner=broken)
    m.start(TWO)
    assert m.wait(10)
    assert m.state.startswith("failed: killed past")
    assert m.classes() == {}
    off = Measurements(False, 5.0, runner=lambda _t: PAIRS)
    off.start(TWO)
    assert off.wait(1)
    assert off.state == "off"
    assert off.classes() == {}


# -- doctor's findings -------------------------------------------------------------------


def test_findings_flag_a_pool_slower_than_declared_and_a_reversed_order() -> None:
    fast = PoolSpec(name="fast", numa_node=1, capacity_bytes=1, latency_us=1)
    slow = PoolSpec(name="slow", numa_node=0, capacity_bytes=1, latency_us=3)
    classes = {0: Measured(latency_us=0.1, cpu_node=0), 1: Measured(latency_us=1.5, cpu_node=1)}
    lines, problems = latency_findings([fast, slow], classes)
    assert lines[0] == "fast: declared 1 µs, measured 1.500 µs (cpu node 1)"
    assert problems == [
        "fast measures 1.500 µs > its declared 1",
        "fast declares a lower class than slow (1 < 3 µs) but measures 15.0 × slower",
    ]
    agree = {0: Measured(latency_us=0.3, cpu_node=0), 1: Measured(latency_us=0.28, cpu_node=1)}
    assert latency_findings([fast, slow], agree)[1] == []  # within the margin


# -- the reserve body --------------------------------------------------------------------


def test_reserve_body_takes_a_fractional_ceiling_and_a_source() -> None:
    body = msgspec.json.decode(
        b'{"size_bytes":4096,"latency_us":0.25,"latency_source":"measured"}', type=ReserveBody
    )
    spec = body.to_spec()
    assert spec.latency_us == 0.25
    assert spec.latency_source == "measured"
    plain = msgspec.json.decode(b'{"size_bytes":4096,"latency_us":5}', type=ReserveBody)
    assert plain.to_spec().latency_source == "declared"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"size_bytes":1,"latency_us":1,"latency_source":"guessed"}',
        b'{"size_bytes":1,"latency_us":1,"latency_source":null}',
        b'{"size_bytes":1,"latency_us":-0.5}',
        b'{"size_bytes":1,"latency_us":1e400}',
        b'{"size_bytes":1,"latency_us":"0.2"}',
    ],
)
def test_reserve_body_refuses_bad_values(raw: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=ReserveBody)


def test_a_source_without_a_ceiling_is_refused() -> None:
    body = msgspec.json.decode(b'{"size_bytes":1,"latency_source":"measured"}', type=ReserveBody)
    with pytest.raises(InvalidRequest, match="latency_source needs latency_us"):
        body.to_spec()


@pytest.mark.parametrize(
    "module", ["maasd.probe", "maasd.core.placement", "maasd.cli.doctor_latency"]
)
def test_the_docstring_examples_hold(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0
    assert result.failed == 0


def test_the_probe_settings() -> None:
    from maasd.errors import ConfigError
    from maasd.settings import load

    base = {"MAASD_DATA_DIR": "/nonexistent"}
    assert load(env=base).latency_probe is None  # on under `maasd serve`, off embedded
    assert load(env={**base, "MAASD_LATENCY_PROBE": "false"}).latency_probe is False
    assert load(env={**base, "MAASD_LATENCY_PROBE_TIMEOUT_S": "30"}).latency_probe_timeout_s == 30
    with pytest.raises(ConfigError, match="latency_probe"):
        load(env={**base, "MAASD_LATENCY_PROBE": "sometimes"})
    with pytest.raises(ConfigError, match="latency_probe_timeout_s must be > 0"):
        load(env={**base, "MAASD_LATENCY_PROBE_TIMEOUT_S": "0"})
