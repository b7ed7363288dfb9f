"""A PostgreSQL ledger behind a lossy, slow network, then a black hole (``tc netem``).

The cluster runs in a network namespace this test makes (``ip netns``), reached by the
daemon over a veth pair whose two ends carry a ``netem`` qdisc. Skipped, saying exactly
why, where the machine cannot (:func:`netns.netem_unavailable`: not root, no iproute2, no
namespaces, a kernel without ``sch_netem``). Checked:

* ``delay 20ms 5ms loss 2%`` (every ledger round trip slower, some packets resent): socket
  ``lookup``, ``attach`` and ``detach`` of live entries never fail, and reserves still
  work (TCP resends what was lost);
* ``loss 100%`` (a partition that answers nothing, not even a reset): the data plane goes
  on; a reserve answers 507 ``ledger-unavailable`` — once the first ledger call gave up
  (``tcp_user_timeout``: unacknowledged data), at once — never 500; ``/healthz`` degraded;
* the qdisc removed: reserves work again without a restart.

And where only netem is missing, the same partition made by setting the veth's outer end
down (no route to the ledger's host): the black-hole checks above, then back up.

The development machines' kernel (6.18) has no ``sch_netem``; Debian's 6.1 has it, so CI
runs this in the QEMU guest of ``scripts/numa-guest`` (root there, its own network
namespaces and PostgreSQL cluster on the guest's tmpfs)::

    scripts/numa-guest --nodes 1 --cpus-per-node 2 --pytest -q -rs tests/integration/test_ledger_netem.py
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
from test_ledger_outage_dataplane import _daemon, commit, healthy, hit

from conftest import Daemon, free_port
from maasd.client import Worker
from maasd.client.errors import MaasdClientError
from netns import NetNs, netem_unavailable, netns_unavailable
from pgdb import PrivatePostgres, has_pg_server
from waiting import wait_until

MiB = 1 << 20

# The module makes its own cluster (no MAASD_TEST_PG_URL needed: the guest has none).
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not has_pg_server(), reason="no PostgreSQL server binaries (initdb)"),
]


@contextlib.contextmanager
def _behind_a_veth(tmp_path: Path) -> Iterator[tuple[Daemon, NetNs]]:
    ns = NetNs().create()
    pg = PrivatePostgres(free_port()).create()
    d: Daemon | None = None
    try:
        pg.stop()
        pg.start(host=ns.inner_ip, wrap=tuple(ns.exec()))
        url = sa.engine.make_url(pg.url).set(host=ns.inner_ip)
        d = _daemon(tmp_path / "maasd", url.render_as_string(hide_password=False), "netem")
        d.start()
        yield d, ns
    finally:
        ns.link(up=True)
        if d is not None:
            d.close()
        pg.remove()
        ns.remove()


@pytest.fixture(scope="module")
def veth_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, NetNs]]:
    """One cluster and one daemon for both tests: in the guest, where CI runs them, making
    a cluster and starting a daemon takes 2-3 minutes (TCG)."""
    why = netns_unavailable()
    if why:
        pytest.skip(f"a network namespace cannot be made here: {why}")
    with _behind_a_veth(tmp_path_factory.mktemp("netem")) as pair:
        yield pair


@pytest.fixture
def behind_netem(veth_ledger: tuple[Daemon, NetNs]) -> Iterator[tuple[Daemon, NetNs]]:
    why = netem_unavailable()
    if why:
        pytest.skip(f"tc netem cannot be used here: {why}")
    try:
        yield veth_ledger
    finally:
        veth_ledger[1].netem("")


@pytest.fixture
def behind_a_veth(veth_ledger: tuple[Daemon, NetNs]) -> Iterator[tuple[Daemon, NetNs]]:
    try:
        yield veth_ledger
    finally:
        veth_ledger[1].link(up=True)


def _data_plane(w: Worker, entry: str, buf: str, data: bytes, seconds: float) -> list[str]:
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with hit(w, ["net:0", "net:1"]) as m:
                assert m.buffer_id == entry
                assert bytes(m.array[: len(data)]) == data
            w.attach(buf).array[:4] = 3
            w.detach(buf)
        except MaasdClientError as exc:
            failures.append(repr(exc))
        time.sleep(0.02)
    return failures


def _black_hole(d: Daemon, c: httpx.Client, w: Worker, held: tuple[str, str, bytes]) -> None:
    """The ledger answers nothing: the data plane goes on, reserves 507, never 500."""
    first = c.post("/v1/reserve", json={"size_bytes": 4096}, timeout=60)
    assert first.status_code == 507, first.text  # once the ledger call gave up
    assert first.json()["type"].endswith("/ledger-unavailable")
    assert not (failures := _data_plane(w, *held, 3.0)), failures[:5]
    for _ in range(3):
        r = c.post("/v1/reserve", json={"size_bytes": 4096}, timeout=5)
        assert r.status_code == 507, r.text
    assert d.admin.get("/healthz").json()["status"] == "degraded"


def _back(d: Daemon, c: httpx.Client, w: Worker, entry: str) -> None:
    def reserves_again() -> bool:
        try:
            return c.post("/v1/reserve", json={"size_bytes": 4096}).status_code == 201
        except httpx.TransportError:
            return False

    wait_until(reserves_again, timeout=60, message="reserves work again, no restart")
    wait_until(lambda: healthy(d), timeout=30, message="healthz ok again")
    with hit(w, ["net:1"]) as m:
        assert m.buffer_id == entry


def _held(w: Worker, c: httpx.Client) -> tuple[str, str, bytes]:
    data = np.random.default_rng(5).bytes(MiB + 3)
    entry = commit(w, "net:1", data)
    buf = c.post("/v1/reserve", json={"size_bytes": MiB}).json()["id"]
    return entry, buf, data


def test_the_data_plane_holds_behind_netem(behind_netem: tuple[Daemon, NetNs]) -> None:
    d, ns = behind_netem
    _tid, key = d.tenant("netem", quota_bytes=64 * MiB)
    c = d.client(key)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        held = _held(w, c)
        ns.netem("delay 20ms 5ms loss 2%")
        assert not (failures := _data_plane(w, *held, 3.0)), failures[:5]
        for _ in range(5):
            r = c.post("/v1/reserve", json={"size_bytes": 4096})
            assert r.status_code == 201, r.text
        ns.netem("loss 100%")
        _black_hole(d, c, w, held)
        ns.netem("")
        _back(d, c, w, held[0])


def test_the_data_plane_holds_through_a_partition(behind_a_veth: tuple[Daemon, NetNs]) -> None:
    """No netem needed: the veth's outer end set down — no route to the ledger's host."""
    d, ns = behind_a_veth
    _tid, key = d.tenant("partition", quota_bytes=64 * MiB)
    c = d.client(key)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        held = _held(w, c)
        ns.link(up=False)
        _black_hole(d, c, w, held)
        ns.link(up=True)
        _back(d, c, w, held[0])
