"""``maasctl status`` (pools, tenants and totals at a glance) and ``maasctl top`` (live)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import click
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from maasd.cli.maasctl.context import Ctx, pass_ctx, raw
from maasd.cli.maasctl.formatting import add_row, kv_table, size, table, text, usage_bar
from maasd.cli.maasctl.pools import warm
from maasd.cli.maasctl.units import FiniteFloatRange, format_size
from maasd.client import Forbidden, Pool, Tenant

__all__ = ["by_host", "status", "status_view", "top"]


def _pools(pools: list[Pool], ascii_only: bool, title: str = "Pools") -> Table:
    pt = table(title)
    pt.add_column("NAME", style="bold", no_wrap=True)
    pt.add_column("NODE", justify="right")
    pt.add_column("KIND", no_wrap=True)
    pt.add_column("USE", no_wrap=True)
    pt.add_column("USED", justify="right")
    pt.add_column("CAPACITY", justify="right")
    pt.add_column("BUFFERS", justify="right")
    pt.add_column("HELD", justify="right")
    pt.add_column("WARM", justify="right")
    for p in pools:
        add_row(
            pt,
            p.name,
            p.numa_node,
            f"{p.backing}/{p.persistence}",
            usage_bar(p.used_bytes, p.capacity_bytes, ascii_only=ascii_only),
            size(p.used_bytes),
            size(p.capacity_bytes),
            p.buffers,
            size(p.held_bytes),
            warm(p),
        )
    if not pools:
        add_row(pt, "(no pools)", *[Text()] * 8)
    return pt


def _disk_tiers(pools: list[Pool], ascii_only: bool) -> Table | None:
    """Each pool's disk tier (docs/operations.md, "The disk tier"); None if there is none."""
    tiered = [p for p in pools if p.disk_bytes and p.disk is not None]
    if not tiered:
        return None
    dt = table("Disk tiers")
    for name, justify in [("POOL", "left"), ("USE", "left"), ("USED", "right"),
                          ("ENTRIES", "right"), ("DEMOTED", "right"), ("PROMOTED", "right"),
                          ("READ", "right"), ("WRITTEN", "right"), ("DROPS", "left")]:  # fmt: skip
        dt.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for p in tiered:
        assert p.disk is not None
        drops = ", ".join(f"{k} {v}" for k, v in sorted(p.disk.drops.items())) or "-"
        add_row(
            dt,
            p.name,
            usage_bar(p.disk.used_bytes, p.disk_bytes, ascii_only=ascii_only),
            size(p.disk.used_bytes),
            p.disk.entries,
            p.disk.demotions,
            p.disk.promotions,
            size(p.disk.read_bytes),
            size(p.disk.write_bytes),
            drops,
        )
    return dt


def _tenants(tenants: list[Tenant], ascii_only: bool) -> Table:
    tt = table("Tenants")
    tt.add_column("NAME", style="bold", no_wrap=True)
    tt.add_column("USE", no_wrap=True)
    tt.add_column("USED", justify="right")
    tt.add_column("QUOTA", justify="right")
    tt.add_column("BUFFERS", justify="right")
    tt.add_column("HELD", justify="right")
    for x in tenants:
        add_row(
            tt,
            x.name,
            usage_bar(x.used_bytes, x.quota_bytes, ascii_only=ascii_only),
            size(x.used_bytes),
            size(x.quota_bytes),
            x.buffers,
            size(x.held_bytes),
        )
    if not tenants:
        add_row(tt, "(no tenants)", *[Text()] * 5)
    return tt


def by_host(pools: list[Pool]) -> dict[str, list[Pool]]:
    """Pools grouped by their host (``""`` when the daemon does not say), hosts in name order."""
    groups: dict[str, list[Pool]] = {}
    for p in sorted(pools, key=lambda p: (p.host, p.name)):
        groups.setdefault(p.host, []).append(p)
    return groups


def _pool_tables(pools: list[Pool], ascii_only: bool) -> list[RenderableType]:
    """One table of pools; with several hosts (the admin's view of a fleet), one per host,
    each with the host's totals."""
    groups = by_host(pools)
    if len(groups) <= 1:
        return [_pools(pools, ascii_only)]
    parts: list[RenderableType] = []
    for host, group in groups.items():
        cap = sum(p.capacity_bytes for p in group)
        used = sum(p.used_bytes for p in group)
        title = f"Pools on {host} — {format_size(used)} of {format_size(cap)} used"
        parts += [_pools(group, ascii_only, title), Text("")]
    return parts[:-1]


def status_view(
    pools: list[Pool], tenants: list[Tenant] | None, *, ascii_only: bool = False
) -> Group:
    """Pools (by host, when they are several) with usage bars, tenants with quota bars, totals."""
    parts: list[RenderableType] = _pool_tables(pools, ascii_only)
    disk = _disk_tiers(pools, ascii_only)
    if disk is not None:
        parts += [Text(""), disk]
    if tenants is not None:
        parts += [Text(""), _tenants(tenants, ascii_only)]
    cap = sum(p.capacity_bytes for p in pools)
    used = sum(p.used_bytes for p in pools)
    tot = kv_table()
    hosts = len(by_host(pools))
    where = f" on {hosts} hosts" if hosts > 1 else ""
    add_row(tot, "capacity", f"{format_size(cap)} in {len(pools)} pool(s){where}")
    add_row(
        tot, "used", usage_bar(used, cap, ascii_only=ascii_only).append(f"  {format_size(used)}")
    )
    add_row(tot, "free", format_size(max(0, cap - used)))
    add_row(tot, "buffers", sum(p.buffers for p in pools))
    add_row(tot, "warm", format_size(sum(p.warm_bytes for p in pools)))
    if tenants is not None:
        quota = sum(t.quota_bytes for t in tenants)
        ratio = f" ({quota / cap:.2f}x capacity)" if cap else ""
        add_row(tot, "tenants", len(tenants))
        add_row(tot, "quotas", f"{format_size(quota)}{ratio}")
    parts += [Text(""), text("Totals", "bold"), tot]
    return Group(*parts)


@click.command()
@pass_ctx
def status(c: Ctx) -> None:
    """Pools with usage bars, tenants with quota bars, and totals.

    With the admin key of a daemon that shares its ledger with others, the pools
    of every host, one table per host. With --json: {"pools": GET /v1/pools,
    "tenants": GET /v1/tenants} ("tenants" is null when the key may not list them).

    \b
    Example:
      maasctl status
    """
    raw_tenants: Any = None
    with c.client("any") as client:
        with client.responses() as seen:
            pools = client.pools()
        raw_pools = raw(seen)
        tenants: list[Tenant] | None
        try:
            with client.responses() as seen:
                tenants = client.tenants()
            raw_tenants = raw(seen)
        except Forbidden:
            tenants = None
    c.emit(
        {"pools": raw_pools, "tenants": raw_tenants},
        lambda: status_view(pools, tenants, ascii_only=c.ascii_only),
    )


@click.command()
@click.option(
    "--interval",
    "-n",
    type=FiniteFloatRange(min=0.05),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Refresh period.",
)
@click.option(
    "--once", is_flag=True, help="Print one frame and exit (the default when not on a terminal)."
)
@pass_ctx
def top(c: Ctx, interval: float, once: bool) -> None:
    """A refreshing full-screen view of pools, tenants and reserve/release rates.

    Built from GET /metrics (the admin key, MAASD_METRICS_KEY, or none with a daemon run
    with --metrics-public); with a key that may list pools
    and tenants it also shows names and quotas. Press q or Ctrl-C to quit.

    \b
    Example:
      maasctl top --interval 0.5
    """
    from maasd.cli.maasctl.top import run_top

    if c.as_json:
        raise click.UsageError("top is interactive and has no --json; use `maasctl --json status`")
    if not c.out.is_terminal:
        once = True
    has_key = bool(c.key or os.environ.get("MAASD_ADMIN_KEY") or os.environ.get("MAASD_KEY"))
    with (
        c.client("any" if has_key else "none") as client,
        contextlib.suppress(KeyboardInterrupt),  # Ctrl-C is how one leaves top: exit 0
    ):
        run_top(client, c.out, interval, use_api=has_key, once=once)
