"""The warm stock against a real daemon: reserves the stock covers fault
no page on the request path, the stock refills, it is never a tenant's, it gives way
to reserves, and it goes back on pool delete and on shutdown.

Faults are counted per thread of the daemon (``/proc/<pid>/task/<tid>/stat``, minor +
major) around a reserve, leaving out the stock's own refill thread (``maasd-warm``):
no wall-clock time is asserted.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Daemon
from maasd.allocator import SEALS, MemoryPool
from maasd.cli.maasctl.units import format_size
from maasd.client import Worker
from maasd.core import Service
from maasd.models import PoolSpec, ReserveSpec
from maasd.settings import Settings
from waiting import wait_until

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
REPO = Path(__file__).resolve().parents[2]


#: The stock refills only while MemAvailable stays above twice this: off on a shared host.
NO_MEMORY_FLOOR = {"MAASD_WARM_MIN_AVAILABLE_BYTES": "0"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("maasd"), env=NO_MEMORY_FLOOR)
    d.start()
    yield d
    d.close()


def thread_faults(pid: int) -> dict[int, int]:
    """Minor + major faults of each thread of ``pid`` but the warm stock's refill thread."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name == "maasd-warm":
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = int(fields[7]) + int(fields[9])  # minflt, majflt (stat fields 10, 12)
    return out


def faults_during(d: Daemon, action: Callable[[], dict]) -> tuple[int, dict]:
    """The daemon's page faults (but its refill thread's) while ``action()`` runs."""
    assert d.proc is not None
    before = thread_faults(d.proc.pid)
    result = action()
    after = thread_faults(d.proc.pid)
    return sum(n - before.get(tid, 0) for tid, n in after.items()), result


def memfds(d: Daemon, name: str = "maasd-") -> int:
    assert d.proc is not None
    fd_dir = f"/proc/{d.proc.pid}/fd"
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            count += os.readlink(f"{fd_dir}/{fd}").startswith(f"/memfd:{name}")
        except FileNotFoundError:
            continue
    return count


def pool_named(d: Daemon, name: str) -> dict:
    return next(p for p in d.admin.get("/v1/pools").json() if p["name"] == name)


def make_pool(d: Daemon, name: str, capacity: int, warm: int) -> dict:
    r = d.admin.post(
        "/v1/pools",
        json={"name": name, "numa_node": 0, "capacity_bytes": capacity, "warm_bytes": warm},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["warm_bytes"], body["warm_target_bytes"]) == (0, warm)
    return body


def reserve(user: httpx.Client, pool: str, size: int, **extra: object) -> dict:
    r = user.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": size, **extra})
    assert r.status_code == 201, r.text
    return dict(r.json())


def stocked(d: Daemon, pool: str, nbytes: int) -> None:
    wait_until(
        lambda: pool_named(d, pool)["warm_bytes"] == nbytes,
        timeout=60,
        message=f"pool {pool} holds {nbytes} warm bytes",
    )


def test_a_reserve_from_stock_faults_nothing_and_the_stock_refills(daemon: Daemon) -> None:
    size = 33 * MiB + 5 * PAGE
    make_pool(daemon, "warm-a", 256 * MiB, warm=64 * MiB)
    tenant_id, key = daemon.tenant("warm", 256 * MiB)
    user = daemon.client(key)

    cold_faults, cold = faults_during(daemon, lambda: reserve(user, "node0", size))
    assert cold_faults >= size // PAGE  # no stock in node0 (0 in tests): every page faulted
    first = reserve(user, "warm-a", size)  # tells the pool which size is asked for
    stocked(daemon, "warm-a", size)
    assert pool_named(daemon, "warm-a")["used_bytes"] == first["size_bytes"] == size
    assert daemon.metric("maasd_pool_warm_bytes", pool="warm-a") == size
    assert daemon.metric("maasd_pool_warm_target_bytes", pool="warm-a") == 64 * MiB

    warm_faults, buf = faults_during(daemon, lambda: reserve(user, "warm-a", size))
    pages = buf["size_bytes"] // PAGE
    assert warm_faults < pages // 8, f"{warm_faults} faults from stock, {cold_faults} cold"
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buf["id"])
        assert os.fstat(m.fd).st_size == buf["size_bytes"] == cold["size_bytes"]
        assert fcntl.fcntl(m.fd, fcntl.F_GET_SEALS) == SEALS
        assert not m.array.any()
    got = user.get(f"/v1/buffers/{buf['id']}").json()
    assert got["placement"] == {"0": pages}
    # The stock refills (one region: two would exceed the budget), and is nobody's use.
    stocked(daemon, "warm-a", size)
    usage = user.get("/v1/usage").json()
    assert usage["used_bytes"] == 3 * first["size_bytes"]
    assert daemon.admin.get(f"/v1/tenants/{tenant_id}").json()["used_bytes"] == usage["used_bytes"]
    pool = pool_named(daemon, "warm-a")
    assert pool["used_bytes"] == 2 * first["size_bytes"]
    assert pool["free_bytes"] == pool["capacity_bytes"] - pool["used_bytes"]
    for b in (cold, first, buf):
        assert user.delete(f"/v1/buffers/{b['id']}").status_code == 204
    user.close()


def test_a_short_pool_gives_its_stock_before_evicting_anyone(daemon: Daemon) -> None:
    make_pool(daemon, "warm-b", 64 * MiB, warm=32 * MiB)
    _, key_a = daemon.tenant("keeper", 256 * MiB)
    _, key_b = daemon.tenant("taker", 256 * MiB)
    a, b = daemon.client(key_a), daemon.client(key_b)
    entry = reserve(a, "warm-b", 16 * MiB, key="prefix", evictable=True)
    user_b = reserve(b, "warm-b", 32 * MiB)
    assert b.delete(f"/v1/buffers/{user_b['id']}").status_code == 204
    stocked(daemon, "warm-b", 32 * MiB)  # 16 live + 32 stock of 64
    evictions = daemon.metric("maasd_evictions_total")

    big = reserve(b, "warm-b", 48 * MiB)  # fits beside the entry once the stock gives way
    assert a.get(f"/v1/buffers/{entry['id']}").status_code == 200
    assert daemon.metric("maasd_evictions_total") == evictions
    pool = pool_named(daemon, "warm-b")
    assert (pool["used_bytes"], pool["warm_bytes"]) == (64 * MiB, 0)
    for c, buf in ((a, entry), (b, big)):
        assert c.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    a.close()
    b.close()


def test_the_stock_goes_with_its_pool(fresh_daemon: Daemon) -> None:
    fresh_daemon.env.update(NO_MEMORY_FLOOR)
    d = fresh_daemon.start()  # a daemon of its own: no other pool's stock comes and goes
    make_pool(d, "warm-c", 64 * MiB, warm=8 * MiB)
    _, key = d.tenant("doomed", 64 * MiB)
    user = d.client(key)
    for _ in range(2):
        buf = reserve(user, "warm-c", 2 * MiB)
        assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    stocked(d, "warm-c", 4 * MiB)  # two regions of 2 MiB
    # (a released buffer taken from the stock carries the name until the reclaimer closes it)
    wait_until(lambda: memfds(d, "maasd-warm") == 2, message="two stocked memfds")
    assert d.admin.delete("/v1/pools/warm-c").status_code == 204
    assert memfds(d, "maasd-") == 0
    assert d.metric("maasd_pool_warm_bytes", pool="warm-c") == 0
    user.close()


@pytest.mark.parametrize(
    ("env", "target"),
    [({"MAASD_DEFAULT_WARM_BYTES": str(8 * MiB)}, 8 * MiB), ({}, 256 * MiB // 16)],
    ids=["set", "default"],
)
def test_default_pools_budget(fresh_daemon: Daemon, env: dict[str, str], target: int) -> None:
    fresh_daemon.env.pop("MAASD_DEFAULT_WARM_BYTES")
    fresh_daemon.env.update(env | NO_MEMORY_FLOOR)
    d = fresh_daemon.start()
    node0 = pool_named(d, "node0")
    assert node0["warm_target_bytes"] == target
    status = subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", "status"],
        env={**os.environ, "MAASD_URL": d.url, "MAASD_ADMIN_KEY": d.admin_key, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    ).stdout
    assert "WARM" in status
    assert f"/{format_size(target)}" in status


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"warm_bytes": 65 * MiB}, "capacity"),
        ({"warm_bytes": MiB, "prefault": False}, "prefault"),
        ({"warm_bytes": -1}, "warm_bytes"),
        ({"warm_bytes": "1MiB"}, "warm_bytes"),
    ],
)
def test_a_bad_budget_is_refused_and_changes_nothing(daemon: Daemon, body: dict, word: str) -> None:
    before = daemon.admin.get("/v1/pools").json()
    r = daemon.admin.post(
        "/v1/pools", json={"name": "bad-warm", "numa_node": 0, "capacity_bytes": 64 * MiB, **body}
    )
    assert r.status_code == 400, r.text
    assert word in r.json()["detail"]
    assert daemon.admin.get("/v1/pools").json() == before


def test_shutdown_gives_the_stock_back(tmp_path: Path) -> None:
    """In-process: ``close()`` stops the refill thread and closes every stocked memfd."""

    def warm_memfds() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:
                continue
        return sum(link.startswith("/memfd:maasd-warm") for link in links)

    spec = PoolSpec(name="w", numa_node=0, capacity_bytes=32 * MiB, warm_bytes=8 * MiB)
    settings = Settings(
        data_dir=str(tmp_path), admin_key="k" * 32, pools=[spec], warm_min_available_bytes=0
    )
    before = warm_memfds()
    svc = Service(settings)
    svc.start(reaper=False)
    try:
        who = svc.auth.authenticate(svc.tenants.create("t", 64 * MiB).api_key)
        for _ in range(3):
            svc.buffers.release(who, svc.reserves.reserve(who, ReserveSpec(size_bytes=2 * MiB)).id)
        wait_until(lambda: svc.pools.info("w").warm_bytes == 6 * MiB, message="stock filled")
        svc.reclaimer.drain()  # a released buffer made from stock carries the name too
        assert warm_memfds() == before + 3
        live: MemoryPool = svc.live.find("w").pool
    finally:
        svc.close()
    assert warm_memfds() == before
    assert not svc.warmer.running
    assert (live.warm, live.used) == (0, 0)


def test_a_pools_budget_follows_its_configuration_at_start(fresh_daemon: Daemon) -> None:
    fresh_daemon.env.update({"MAASD_DEFAULT_WARM_BYTES": str(8 * MiB)} | NO_MEMORY_FLOOR)
    d = fresh_daemon.start()
    node0 = pool_named(d, "node0")
    assert node0["warm_target_bytes"] == 8 * MiB
    d.stop()
    d.env["MAASD_DEFAULT_WARM_BYTES"] = str(4 * MiB + 1)
    d.start()
    again = pool_named(d, "node0")
    assert again["id"] == node0["id"]  # the same pool: only its budget changed
    assert again["warm_target_bytes"] == 4 * MiB  # rounded down to pages
    assert d.metric("maasd_pool_warm_target_bytes", pool="node0") == 4 * MiB
