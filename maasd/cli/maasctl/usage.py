"""``maasctl usage`` (a tenant's own use) and ``maasctl topology`` (the host's NUMA nodes)."""

from __future__ import annotations

import click
from rich.console import Group
from rich.table import Table

from maasd.cli.maasctl.context import Ctx, pass_ctx, raw
from maasd.cli.maasctl.formatting import (
    add_row,
    format_cpus,
    ident,
    kv_table,
    size,
    table,
    usage_bar,
)
from maasd.cli.maasctl.units import format_size
from maasd.client import Topology, Usage

__all__ = ["topology", "topology_view", "usage", "usage_view"]


def usage_view(u: Usage, *, ascii_only: bool = False) -> Table:
    t = kv_table()
    add_row(t, "tenant id", ident(u.tenant_id))
    add_row(t, "quota", format_size(u.quota_bytes))
    add_row(t, "used", format_size(u.used_bytes))
    # released entries a process still holds open: in "used" until every fd and mapping goes
    add_row(t, "held after release", format_size(u.held_bytes))
    add_row(t, "free", format_size(max(0, u.quota_bytes - u.used_bytes)))
    add_row(t, "use", usage_bar(u.used_bytes, u.quota_bytes, ascii_only=ascii_only))
    add_row(t, "buffers", u.buffers)
    add_row(t, "disk quota", format_size(u.disk_quota_bytes))  # on this host's disk tiers
    add_row(t, "disk used", format_size(u.disk_used_bytes))
    return t


def topology_view(topo: Topology) -> Group:
    t = table("NUMA nodes")
    t.add_column("NODE", justify="right")
    t.add_column("CPUS")
    t.add_column("MEM TOTAL", justify="right")
    t.add_column("MEM FREE", justify="right")
    t.add_column("DISTANCES")
    for n in topo.nodes:
        add_row(
            t,
            n.id,
            format_cpus(n.cpus),
            size(n.mem_total_bytes),
            size(n.mem_free_bytes),
            " ".join(str(x) for x in n.distances),
        )
    hp = kv_table()
    add_row(hp, "huge page size", format_size(topo.hugepage_bytes))
    add_row(hp, "huge pages free", topo.hugepages_free)
    return Group(t, hp)


@click.command()
@pass_ctx
def usage(c: Ctx) -> None:
    """A tenant's own quota and use (uses MAASD_KEY, the tenant's key).

    \b
    Example:
      MAASD_KEY=... maasctl usage
    """
    with c.client("tenant") as client, client.responses() as seen:
        u = client.usage()
    c.emit(raw(seen), lambda: usage_view(u, ascii_only=c.ascii_only))


@click.command()
@pass_ctx
def topology(c: Ctx) -> None:
    """NUMA nodes of the host: cpus, memory, distances, huge pages.

    \b
    Example:
      maasctl topology
    """
    with c.client("any") as client, client.responses() as seen:
        topo = client.topology()
    c.emit(raw(seen), lambda: topology_view(topo))
