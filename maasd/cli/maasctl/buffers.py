"""``maasctl buffers``: reserve, list, show and release buffers.

Labels and keys are the tenant's own free text: they are shown as text (never
markup) with control characters escaped, and cut to 24 characters in the list
(``buffers show`` prints them whole).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Literal

import click
from rich.table import Table

from maasd.bounds import DEFAULT_TTL_S
from maasd.cli.maasctl.context import (
    Ctx,
    complete,
    names,
    pass_ctx,
    raw,
    resolve_tenant,
)
from maasd.cli.maasctl.formatting import (
    add_row,
    done,
    format_time,
    ident,
    kv_table,
    note,
    short,
    size,
    table,
    text,
)
from maasd.cli.maasctl.units import FiniteFloatRange, SizeType, format_size
from maasd.client import Buffer, Client, MaasdClientError

__all__ = ["buffer_detail", "buffers", "buffers_table"]


def buffers_table(
    items: Iterable[Buffer],
    *,
    tenant_names: Mapping[str, str] | None = None,
    pool_names: Mapping[str, str] | None = None,
) -> Table:
    tenant_names = tenant_names or {}
    pool_names = pool_names or {}
    t = table()
    t.add_column("ID", overflow="fold")
    t.add_column("TENANT", no_wrap=True)
    t.add_column("POOL", no_wrap=True)
    t.add_column("SIZE", justify="right")
    t.add_column("NODE", justify="right")
    t.add_column("PERSISTENCE")
    t.add_column("STATE")
    t.add_column("EVICT")
    t.add_column("LABEL")
    t.add_column("KEY")
    t.add_column("EXPIRES", no_wrap=True)
    held = any(b.holder_pids is not None for b in items)
    if held:
        t.add_column("HELD BY (PIDS)")
    now = dt.datetime.now(dt.UTC)
    for b in items:
        pids = [" ".join(map(str, b.holder_pids or ())) or "?"] if held else []
        add_row(
            t,
            ident(b.id),
            tenant_names.get(b.tenant_id, b.tenant_id),
            pool_names.get(b.pool_id, b.pool_id),
            size(b.size_bytes),
            b.numa_node,
            b.persistence,
            b.state,
            b.evictable,
            short(b.label),
            short(b.key),
            format_time(b.expires_at, only_relative=True, now=now),
            *pids,
        )
    return t


def _named(name: str | None, id_: str) -> str:
    return f"{name} ({id_})" if name else id_


def buffer_detail(
    b: Buffer, *, tenant_name: str | None = None, pool_name: str | None = None
) -> Table:
    t = kv_table()
    add_row(t, "id", ident(b.id))
    add_row(t, "tenant", _named(tenant_name, b.tenant_id))
    add_row(t, "pool", _named(pool_name, b.pool_id))
    add_row(t, "size", f"{format_size(b.size_bytes)} ({b.size_bytes} bytes)")
    add_row(t, "numa node", b.numa_node)
    if b.placement:
        add_row(t, "placement", ", ".join(f"node {k}: {v} pages" for k, v in b.placement.items()))
    add_row(t, "persistence", b.persistence)
    add_row(t, "state", b.state)
    add_row(t, "evictable", b.evictable)
    add_row(t, "label", text(b.label, overflow="fold"))
    add_row(t, "key", text(b.key, overflow="fold"))
    if b.checksum:
        add_row(t, "checksum", b.checksum)
    add_row(t, "created", format_time(b.created_at))
    add_row(t, "expires", format_time(b.expires_at, relative=True))
    return t


def _owner_names(client: Client, b: Buffer) -> tuple[str | None, str | None]:
    """The names of the buffer's tenant and pool, when this key may see them."""
    tenant_name = pool_name = None
    with contextlib.suppress(MaasdClientError):  # a tenant key may not look tenants up
        tenant_name = client.tenant(b.tenant_id).name
    with contextlib.suppress(MaasdClientError):
        pool_name = client.pool(b.pool_id).name
    return tenant_name, pool_name


@click.group()
def buffers() -> None:
    """Reserve, list, show and release buffers.

    \b
    Example:
      maasctl buffers list --tenant acme
    """


@buffers.command("list")
@click.option(
    "--tenant",
    metavar="NAME|ID",
    shell_complete=complete("tenant"),
    help="Only this tenant's buffers.",
)
@click.option(
    "--held",
    is_flag=True,
    help="Released entries some process still holds open (admin), and the pids holding them.",
)
@pass_ctx
def buffers_list(c: Ctx, tenant: str | None, held: bool) -> None:
    """Live buffers (all tenants with the admin key); with --held, released entries still
    held open: they count in their tenant's quota until every fd and mapping is gone.

    \b
    Examples:
      maasctl buffers list
      maasctl buffers list --tenant acme
      maasctl buffers list --held
    """
    with c.client("admin" if held else "any") as client:
        owner = resolve_tenant(client, tenant) if tenant else None
        with client.responses() as seen:
            items = client.buffers(owner.id if owner else None, held=held)
        tn, pn = ({}, {}) if c.as_json or not items else names(client, tenant=owner)
    c.emit(
        raw(seen),
        lambda: (
            buffers_table(items, tenant_names=tn, pool_names=pn) if items else note("No buffers.")
        ),
    )


@buffers.command("show")
@click.argument("buffer_id", metavar="ID")
@pass_ctx
def buffers_show(c: Ctx, buffer_id: str) -> None:
    """One buffer: size, placement, lease, label and key (whole).

    \b
    Example:
      maasctl buffers show 9b2f0c4e…
    """
    with c.client("any") as client:
        with client.responses() as seen:
            b = client.buffer(buffer_id)
        tn, pn = (None, None) if c.as_json else _owner_names(client, b)
    c.emit(raw(seen), lambda: buffer_detail(b, tenant_name=tn, pool_name=pn))


@buffers.command("reserve")
@click.argument("size", type=SizeType())
@click.option("--pool", metavar="NAME|ID", shell_complete=complete("pool"), help="In this pool.")
@click.option(
    "--latency-us",
    type=FiniteFloatRange(min=0),
    help="A pool whose latency class is at most this (µs; fractions with --measured).",
)
@click.option(
    "--measured",
    "latency_source",
    flag_value="measured",
    default=None,
    help="Hold --latency-us to the measured class of the pools' nodes, not the declared one.",
)
@click.option("--persistence", type=click.Choice(["volatile", "persistent"]))
@click.option("--node", "numa_node", type=click.IntRange(min=0), help="On this NUMA node.")
@click.option(
    "--ttl", "ttl_s", type=click.IntRange(min=1), default=DEFAULT_TTL_S, show_default=True
)
@click.option("--label", help="Free text shown in listings.")
@pass_ctx
def buffers_reserve(
    c: Ctx,
    size: int,
    pool: str | None,
    latency_us: float | None,
    latency_source: Literal["measured"] | None,
    persistence: Literal["volatile", "persistent"] | None,
    numa_node: int | None,
    ttl_s: int,
    label: str | None,
) -> None:
    """Reserve a buffer (a tenant key): where the QoS fits, or in --pool. It lives until
    released or its lease (--ttl) ends; no process maps it.

    \b
    Examples:
      maasctl buffers reserve 64MiB --latency-us 1
      maasctl buffers reserve 64MiB --latency-us 0.2 --measured
    """
    with c.client("tenant") as client, client.responses() as seen:
        b = client.reserve(
            size,
            pool=pool,
            latency_us=latency_us,
            latency_source=latency_source,
            persistence=persistence,
            numa_node=numa_node,
            ttl_s=ttl_s,
            label=label,
        )
    c.emit(raw(seen), lambda: buffer_detail(b))


@buffers.command("release")
@click.argument("buffer_id", metavar="ID")
@pass_ctx
def buffers_release(c: Ctx, buffer_id: str) -> None:
    """Release a buffer: its memory is scrubbed to zero, then freed.

    \b
    Example:
      maasctl buffers release 9b2f0c4e…
    """
    with c.client("any") as client, client.responses() as seen:
        client.release(buffer_id)
    c.emit(raw(seen), lambda: done(f"Buffer {buffer_id} released (scrubbed)."))
