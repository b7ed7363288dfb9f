"""``maasctl pools``: list, show, create and delete pools."""

from __future__ import annotations

from collections.abc import Iterable

import click
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from maasd.cli.maasctl.context import (
    Ctx,
    complete,
    pass_ctx,
    raw,
    resolve_pool,
)
from maasd.cli.maasctl.errors import ApiError
from maasd.cli.maasctl.formatting import add_row, done, ident, note, size, table
from maasd.cli.maasctl.units import SizeType, format_size
from maasd.client import Conflict, Pool

__all__ = ["pools", "pools_table", "warm"]


def pools_table(items: Iterable[Pool], *, title: str | None = None) -> Table:
    items = list(items)
    hosts = len({p.host for p in items}) > 1  # the admin's view of several hosts
    t = table(title)
    if hosts:
        t.add_column("HOST", no_wrap=True)
    t.add_column("NAME", style="bold", no_wrap=True)
    t.add_column("ID", overflow="fold")
    t.add_column("NODE", justify="right")
    t.add_column("BACKING")
    t.add_column("PERSISTENCE")
    t.add_column("LAT µs", justify="right")
    t.add_column("MEASURED µs", justify="right")
    t.add_column("CAPACITY", justify="right")
    t.add_column("USED", justify="right")
    t.add_column("FREE", justify="right")
    t.add_column("PAGE", justify="right")
    t.add_column("BUFFERS", justify="right")
    t.add_column("SCRUB")
    t.add_column("WARM", justify="right")
    t.add_column("DISK", justify="right")
    for p in items:
        add_row(
            t,
            *((p.host,) if hosts else ()),
            p.name,
            ident(p.id),
            p.numa_node,
            p.backing,
            p.persistence,
            p.latency_us,
            measured(p),
            size(p.capacity_bytes),
            size(p.used_bytes),
            size(p.free_bytes),
            size(p.page_bytes),
            p.buffers,
            p.scrub,
            warm(p),
            disk(p),
        )
    return t


def measured(p: Pool) -> Text:
    """The measured latency class (µs, from the nearest CPU node); ``-`` until measured."""
    if p.measured_latency_us is None:
        return Text("-", justify="right")
    return Text(f"{p.measured_latency_us:.3f}", justify="right")


def measured_table(p: Pool) -> Table | None:
    """A pool's node as measured from each CPU node (``pools show``); None until measured."""
    if p.measured is None:
        return None
    t = table(f"{p.name}: node {p.numa_node} measured {p.measured.measured_at}")
    t.add_column("FROM CPU NODE", justify="right")
    t.add_column("LATENCY µs", justify="right")
    t.add_column("COPY GiB/s", justify="right")
    for m in p.measured.by_cpu_node:
        add_row(
            t,
            f"{m.cpu_node}{' (class)' if m.cpu_node == p.measured.cpu_node else ''}",
            "-" if m.latency_us is None else f"{m.latency_us:.3f}",
            "-" if m.gib_per_s is None else f"{m.gib_per_s:.1f}",
        )
    return t


def disk(p: Pool) -> Text:
    """The disk tier as ``used/budget (entries)`` (``-`` without one)."""
    if not p.disk_bytes:
        return Text("-", justify="right")
    used, entries = (p.disk.used_bytes, p.disk.entries) if p.disk else (0, 0)
    return Text(f"{format_size(used)}/{format_size(p.disk_bytes)} ({entries})", justify="right")


def warm(p: Pool) -> Text:
    """The warm stock as ``now/budget`` (``-`` without a budget)."""
    if not p.warm_target_bytes:
        return Text("-", justify="right")
    return Text(f"{format_size(p.warm_bytes)}/{format_size(p.warm_target_bytes)}", justify="right")


@click.group()
def pools() -> None:
    """List, show, create and delete pools.

    \b
    Example:
      maasctl pools create fast0 --node 0 --capacity 8GiB --latency-us 1
    """


@pools.command("list")
@pass_ctx
def pools_list(c: Ctx) -> None:
    """All pools with capacity, use and properties (the admin: of every host).

    \b
    Example:
      maasctl pools list
    """
    with c.client("any") as client, client.responses() as seen:
        items = client.pools()
    c.emit(raw(seen), lambda: pools_table(items) if items else note("No pools."))


@pools.command("show")
@click.argument("pool", metavar="NAME|ID", shell_complete=complete("pool"))
@pass_ctx
def pools_show(c: Ctx, pool: str) -> None:
    """One pool, and its node's measured latency and bandwidth from each CPU node.

    \b
    Example:
      maasctl pools show node0
    """
    with c.client("any") as client, client.responses() as seen:
        p = resolve_pool(client, pool)
    c.emit(raw(seen), lambda: Group(pools_table([p]), *filter(None, [measured_table(p)])))


@pools.command("create")
@click.argument("name")
@click.option("--node", "numa_node", type=click.IntRange(min=0), required=True, help="NUMA node.")
@click.option("--capacity", type=SizeType(), required=True, help="Capacity (SIZE).")
@click.option("--backing", type=click.Choice(["memfd", "hugetlb"]), help="Memory backing [memfd].")
@click.option(
    "--persistence",
    type=click.Choice(["volatile", "persistent"]),
    help="Whether buffers survive restarts via checkpoints [volatile].",
)
@click.option(
    "--latency-us", type=click.IntRange(min=0), help="Advertised access-latency class [1]."
)
@click.option(
    "--scrub", type=click.Choice(["zero", "punch"]), help="How released memory is zeroed [zero]."
)
@click.option(
    "--prefault/--no-prefault", default=None, help="Fault pages in ahead of demand [prefault]."
)
@click.option("--spill-dir", type=click.Path(), help="Checkpoint directory (persistent pools).")
@click.option(
    "--warm",
    "warm_bytes",
    type=SizeType(),
    help="Keep this much prefaulted memory ready for reserves (SIZE, within the capacity) [0].",
)
@click.option(
    "--disk-dir",
    type=click.Path(),
    help="The disk tier's directory (its own; emptied at start) [DATA_DIR/disk/NAME].",
)
@click.option(
    "--disk",
    "disk_bytes",
    type=SizeType(),
    help="Demote evicted entries worth keeping to a disk tier of this size (SIZE) [0].",
)
@pass_ctx
def pools_create(c: Ctx, name: str, numa_node: int, capacity: int, **optional: object) -> None:
    """Create a pool NAME on a NUMA node. Unset options take the daemon's defaults.

    \b
    Examples:
      maasctl pools create fast0 --node 0 --capacity 8GiB
      maasctl pools create kv1 --node 1 --capacity 64GiB --backing hugetlb \\
          --persistence persistent --spill-dir /var/lib/maasd/spill --scrub punch
      maasctl pools create fast1 --node 0 --capacity 16GiB --warm 1GiB
      maasctl pools create kv0 --node 0 --capacity 16GiB --disk 200GiB \\
          --disk-dir /nvme/maasd/kv0
    """
    fields = {k: v for k, v in optional.items() if v is not None}
    with c.client("admin") as client, client.responses() as seen:
        p = client.create_pool(name=name, numa_node=numa_node, capacity_bytes=capacity, **fields)

    def human() -> RenderableType:
        return Group(done(f"Pool {p.name} created."), pools_table([p]))

    c.emit(raw(seen), human)


@pools.command("delete")
@click.argument("pool", metavar="NAME|ID", shell_complete=complete("pool"))
@click.option("--drain", is_flag=True, help="Release (and scrub) the pool's buffers first.")
@pass_ctx
def pools_delete(c: Ctx, pool: str, drain: bool) -> None:
    """Delete a pool. Refused while it holds buffers, unless --drain.

    \b
    Examples:
      maasctl pools delete fast0
      maasctl pools delete fast0 --drain
    """
    with c.client("admin") as client:
        p = resolve_pool(client, pool)
        with client.responses() as seen:
            try:
                client.delete_pool(p.id, drain=drain)
            except Conflict as exc:
                if drain:
                    raise
                hint = "maasctl pools delete --drain releases and scrubs them"
                raise ApiError(
                    exc.status, exc.title, exc.detail, type_=exc.type, hint=hint
                ) from None
    extra = f" ({p.buffers} buffer(s) released and scrubbed)" if drain and p.buffers else ""
    c.emit(raw(seen), lambda: done(f"Pool {p.name} ({p.id}) deleted{extra}."))
