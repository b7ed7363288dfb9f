"""``maasd doctor``'s region budget: the budget the daemon derives, against what the
configured tenants and pools could hold (the pure part; tests/integration/test_doctor.py
runs it against real limits and a real ledger)."""

from __future__ import annotations

from maasd.cli.doctor import check_region_budget, region_need
from maasd.core.limits import Limits

#: The documented example (docs/operations.md, "Limits"): M = 20000, the default socket
#: and REST caps, SQLite with the default ledger pool → 15,000 regions.
DEFAULTS = Limits(
    open_files=20000,
    max_map_count=65530,
    socket_connections=1024,
    rest_connections=576,
    ledger_files=160,
)


def test_the_documented_budget_is_reported_with_its_basis() -> None:
    c = check_region_budget(DEFAULTS, 4096, None, 1 << 30)
    assert c.status == "ok", c
    assert c.detail.startswith("15000 regions from RLIMIT_NOFILE 20000")
    assert "vm.max_map_count 65530" in c.detail
    assert "could need 4096: one tenant at max_buffers_per_tenant" in c.detail


def test_no_budget_fails() -> None:
    low = Limits(open_files=1024, max_map_count=65530, socket_connections=1024)
    c = check_region_budget(low, 4096, None, 1 << 30, soft_now=256)
    assert c.status == "fail"
    assert "budget 0 regions" in c.detail
    assert "RLIMIT_NOFILE 1024 (raised from 256 by maasd serve)" in c.detail
    assert "LimitNOFILE" in c.fix


def test_tenants_that_could_hold_more_than_the_budget_warn() -> None:
    c = check_region_budget(DEFAULTS, 4096, [None, None, None, 3000], 1 << 30)
    assert c.status == "warn"
    assert "below what could be asked for" in c.detail
    assert "could need 15288: 4 tenant(s) at their caps" in c.detail
    assert check_region_budget(DEFAULTS, 4096, [None, None, None, 2000], 1 << 30).status == "ok"


def test_one_tenant_cap_at_the_budget_warns() -> None:
    c = check_region_budget(DEFAULTS, 15000, None, 1 << 30)
    assert c.status == "warn"
    assert "one tenant could hold every region" in c.detail


def test_the_pools_pages_bound_the_need() -> None:
    # 100 tenants could ask for 409,600 regions, but 8 MiB of 4 KiB pages holds 2048.
    need, why = region_need(4096, [None] * 100, 2048)
    assert need == 2048
    assert why.startswith("the pools' pages: 2048")
    assert check_region_budget(DEFAULTS, 4096, [None] * 100, 2048).status == "ok"
    assert region_need(4096, [], 1 << 30) == (4096, "one tenant at max_buffers_per_tenant: 4096")
