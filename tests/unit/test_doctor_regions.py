"""``maasd doctor``'s region budget: the budget the daemon derives, against what the
configured tenants and pools could hold (the pure part; tests/integration/test_doctor.py
runs it against real limits and a real ledger)."""

from __future__ import annotations

import anyio
import anyio.to_thread

from maasd.cli.doctor import check_region_budget, needs, region_need, regions_wanted
from maasd.core.limits import BASE_TASKS, REST_THREADS, ProcessLimits, settings_limits
from maasd.settings import Settings

#: The documented example (docs/operations.md, "ProcessLimits"): M = 20000, the default socket
#: and REST caps, SQLite with the default ledger pool → 15,000 regions.
DEFAULTS = ProcessLimits(
    open_files=20000,
    max_map_count=65530,
    socket_connections=1024,
    rest_connections=576,
    ledger_files=160,
    tenant_share=0.25,
)


def test_the_documented_budget_is_reported_with_its_basis() -> None:
    c = check_region_budget(DEFAULTS, 3000, None, 1 << 30)
    assert c.status == "ok", c
    assert c.detail.startswith("15000 entries or buffers in all, 3750 per tenant")
    assert "from RLIMIT_NOFILE 20000, vm.max_map_count 65530" in c.detail
    assert "could need 3000: one tenant at max_buffers_per_tenant" in c.detail


def test_a_tenant_cap_above_its_share_warns_with_the_limits_to_set() -> None:
    # the default cap 4096 over the share 0.25: a budget of 16,384 lets a tenant reach it
    c = check_region_budget(DEFAULTS, 4096, None, 1 << 30)
    assert c.status == "warn"
    assert "a tenant at its cap needs 16384 in all" in c.detail
    files = needs(Settings()).files
    assert f"for 16384 regions: LimitNOFILE ≥ {files}" in c.fix
    assert "vm.max_map_count" not in c.fix  # 65,530 holds 16,384 already
    big = ProcessLimits(**{**DEFAULTS.__dict__, "max_map_count": 8192})
    assert "sysctl -w vm.max_map_count=" in check_region_budget(big, 4096, None, 1 << 30).fix


def test_the_needs_are_the_daemons_own_budget() -> None:
    n = needs(Settings())
    assert n.regions == regions_wanted(Settings()) == 16384
    # at the files it names, the daemon's own formula gives that many regions, not one less
    assert settings_limits(Settings(), n.files, None, postgres=False).region_budget >= n.regions
    assert settings_limits(Settings(), n.files - 1, None, postgres=False).region_budget < n.regions
    assert ProcessLimits(open_files=0, max_map_count=n.maps).map_budget == n.regions
    assert regions_wanted(Settings(), [None, 100, 20000]) == 80000  # 20000 / 0.25


def test_the_tasks_are_the_daemons_own_pools() -> None:
    """The task sum counts the pools the daemon runs: its REST limiter (``REST_THREADS``,
    what ``create_app`` bounds service calls with), anyio's default pool as anyio sizes
    it in an event loop, and the socket's slow-op threads as configured."""

    async def default_pool() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    pool = anyio.run(default_pool)
    n = needs(Settings(socket_slow_workers=7))
    assert n.tasks == REST_THREADS + pool + 7 + BASE_TASKS
    assert n.tasks_sum == f"{REST_THREADS} service + {pool} pool + 7 socket slow-op threads + 12"
    assert needs(Settings()).tasks == n.tasks - 7 + Settings().socket_slow_workers


def test_no_budget_fails() -> None:
    low = ProcessLimits(open_files=1024, max_map_count=65530, socket_connections=1024)
    c = check_region_budget(low, 4096, None, 1 << 30, soft_now=256)
    assert c.status == "fail"
    assert "maasd serve would refuse to start: budget 0 regions" in c.detail
    assert "RLIMIT_NOFILE 1024 (raised from 256 by maasd serve)" in c.detail
    assert "LimitNOFILE" in c.fix


def test_tenants_that_could_hold_more_than_the_budget_warn() -> None:
    c = check_region_budget(DEFAULTS, 3500, [None, None, None, None, 3500], 1 << 30)
    assert c.status == "warn"
    assert "below what could be asked for" in c.detail
    assert "could need 17500: 5 tenant(s) at their caps" in c.detail
    assert check_region_budget(DEFAULTS, 3500, [None, None, 3000], 1 << 30).status == "ok"


def test_one_tenant_cap_at_the_budget_warns() -> None:
    c = check_region_budget(DEFAULTS, 15000, None, 1 << 30)
    assert c.status == "warn"
    assert "a tenant at its cap needs 60000 in all" in c.detail


def test_the_pools_pages_bound_the_need() -> None:
    # 100 tenants could ask for 409,600 regions, but 8 MiB of 4 KiB pages holds 2048.
    need, why = region_need(4096, [None] * 100, 2048)
    assert need == 2048
    assert why.startswith("the pools' pages: 2048")
    assert check_region_budget(DEFAULTS, 4096, [None] * 100, 2048).status == "ok"
    assert region_need(4096, [], 1 << 30) == (4096, "one tenant at max_buffers_per_tenant: 4096")


def test_the_tenants_caps_are_read_through_the_daemons_store(tmp_path):
    """``maasd doctor`` reads the caps with :meth:`Store.tenants`, the query ``GET
    /v1/tenants`` answers from: a tenant's own cap, ``None`` for the default, and nothing
    for one being deleted; no ledger file, nothing read (and none created)."""
    from maasd.cli.doctor_ledger import ledger_tenant_caps
    from maasd.store import Store
    from maasd.store.engine import normalize_url

    missing = tmp_path / "none.db"
    assert ledger_tenant_caps(normalize_url(f"sqlite:///{missing}")) is None
    assert not missing.exists()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store = Store(url)
    try:
        store.upgrade()
        store.tenants.add_tenant("a" * 32, "own", 1 << 20, 1.0)
        store.tenants.update_tenant("a" * 32, max_buffers=7)
        store.tenants.add_tenant("b" * 32, "default", 1 << 20, 1.0)
        store.tenants.add_tenant("c" * 32, "leaving", 1 << 20, 1.0)
        store.tenants.mark_tenant_deleting("c" * 32)
    finally:
        store.dispose()
    assert sorted(ledger_tenant_caps(normalize_url(url)) or [], key=str) == [7, None]
