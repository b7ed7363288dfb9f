"""``maasctl tenants``: list, show, create, re-quota, cap and delete tenants."""

from __future__ import annotations

from collections.abc import Iterable

import click
from rich.console import Group, RenderableType
from rich.table import Table

from maasd.cli.maasctl.context import Ctx, complete, pass_ctx, raw, resolve_tenant
from maasd.cli.maasctl.formatting import (
    add_row,
    done,
    format_time,
    ident,
    kv_table,
    note,
    size,
    table,
    text,
    usage_bar,
)
from maasd.cli.maasctl.units import SizeType, format_size
from maasd.client import NewTenant, Tenant

__all__ = ["KEY_ONCE", "tenant_detail", "tenants", "tenants_table"]

KEY_ONCE = "The API key is shown only this once: store it now (MAASD_KEY)."


def tenants_table(items: Iterable[Tenant], *, ascii_only: bool = False) -> Table:
    t = table()
    t.add_column("NAME", style="bold", no_wrap=True)
    t.add_column("ID", overflow="fold")
    t.add_column("QUOTA", justify="right")
    t.add_column("USED", justify="right")
    t.add_column("USE", no_wrap=True)
    t.add_column("BUFFERS", justify="right")
    t.add_column("CREATED", no_wrap=True)
    for x in items:
        add_row(
            t,
            x.name,
            ident(x.id),
            size(x.quota_bytes),
            size(x.used_bytes),
            usage_bar(x.used_bytes, x.quota_bytes, 12, ascii_only=ascii_only),
            _buffers(x),
            format_time(x.created_at),
        )
    return t


def _buffers(x: Tenant) -> str:
    """``12/4096``: the tenant's buffers of its cap (just ``12`` from a daemon without caps)."""
    return f"{x.buffers}/{x.max_buffers}" if x.max_buffers is not None else str(x.buffers)


def tenant_detail(x: Tenant, *, ascii_only: bool = False) -> Table:
    t = kv_table()
    add_row(t, "name", x.name)
    add_row(t, "tenant id", ident(x.id))
    add_row(t, "quota", format_size(x.quota_bytes))
    add_row(t, "used", format_size(x.used_bytes))
    add_row(t, "use", usage_bar(x.used_bytes, x.quota_bytes, ascii_only=ascii_only))
    add_row(t, "buffers", x.buffers)
    if x.max_buffers is not None:
        add_row(t, "max buffers", x.max_buffers)
    add_row(t, "disk quota", format_size(x.disk_quota_bytes))
    add_row(t, "disk used", format_size(x.disk_used_bytes))
    if x.created_at is not None:
        add_row(t, "created", format_time(x.created_at))
    return t


def tenant_created(x: NewTenant) -> Group:
    """The new tenant and its first key, labelled apart: in the JSON ``id`` is the
    tenant's and ``key_id`` the key's."""
    t = kv_table()
    add_row(t, "name", x.name)
    add_row(t, "tenant id", ident(x.id))
    add_row(t, "quota", format_size(x.quota_bytes))
    add_row(t, "disk quota", format_size(x.disk_quota_bytes))
    if x.key_id is not None:
        add_row(t, "key id", ident(x.key_id))
    add_row(t, "api key", text(x.api_key, "bold yellow", overflow="fold"))
    return Group(text("Tenant created.", "bold green"), t, note(KEY_ONCE))


@click.group()
def tenants() -> None:
    """List, show, create, re-quota, cap and delete tenants.

    \b
    Example:
      maasctl tenants create acme --quota 8GiB
    """


@tenants.command("list")
@pass_ctx
def tenants_list(c: Ctx) -> None:
    """All tenants with quota and use.

    \b
    Example:
      maasctl tenants list
    """
    with c.client("admin") as client, client.responses() as seen:
        items = client.tenants()
    c.emit(
        raw(seen),
        lambda: tenants_table(items, ascii_only=c.ascii_only) if items else note("No tenants."),
    )


@tenants.command("create")
@click.argument("name")
@click.option("--quota", type=SizeType(allow_zero=True), required=True, help="Hard quota (SIZE).")
@click.option(
    "--disk-quota",
    type=SizeType(allow_zero=True),
    default=None,
    help="Bytes it may hold on the disk tiers (SIZE; default disk_quota_factor × quota).",
)
@pass_ctx
def tenants_create(c: Ctx, name: str, quota: int, disk_quota: int | None) -> None:
    """Create a tenant; prints its first API key, shown only this once.

    The answer names two ids: the tenant's ("tenant id"; "id" in --json) and its
    first key's ("key id"; "key_id" in --json), which `maasctl keys revoke` takes.

    \b
    Examples:
      maasctl tenants create acme --quota 8GiB
      maasctl tenants create acme --quota 8GiB --disk-quota 100GiB
      maasctl --json tenants create acme --quota 8GiB | jq -r .api_key
    """
    with c.client("admin") as client, client.responses() as seen:
        t = client.create_tenant(name, quota, disk_quota)
    c.emit(raw(seen), lambda: tenant_created(t))


@tenants.command("show")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@pass_ctx
def tenants_show(c: Ctx, tenant: str) -> None:
    """One tenant: quota, use, buffers.

    \b
    Example:
      maasctl tenants show acme
    """
    with c.client("admin") as client, client.responses() as seen:
        t = resolve_tenant(client, tenant)
    c.emit(raw(seen), lambda: tenant_detail(t, ascii_only=c.ascii_only))


@tenants.command("set-quota")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@click.argument("size", metavar="SIZE", type=SizeType(allow_zero=True))
@pass_ctx
def tenants_set_quota(c: Ctx, tenant: str, size: int) -> None:
    """Change a tenant's quota. Lowering it below current use is allowed: it blocks new reserves.

    \b
    Example:
      maasctl tenants set-quota acme 16GiB
    """
    _update(c, tenant, f"Quota of {{}} set to {format_size(size)}.", quota_bytes=size)


@tenants.command("set-disk-quota")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@click.argument("size", metavar="SIZE", type=SizeType(allow_zero=True))
@pass_ctx
def tenants_set_disk_quota(c: Ctx, tenant: str, size: int) -> None:
    """Bound a tenant's bytes on the pools' disk tiers (by default disk_quota_factor × quota).

    Lowering it below current use is allowed: the tenant's coldest entries on disk
    are evicted at its next demotion. 0: none of its entries is kept on disk.

    \b
    Example:
      maasctl tenants set-disk-quota acme 100GiB
    """
    _update(c, tenant, f"Disk quota of {{}} set to {format_size(size)}.", disk_quota_bytes=size)


@tenants.command("set-max-buffers")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@click.argument("count", metavar="N", type=int)
@pass_ctx
def tenants_set_max_buffers(c: Ctx, tenant: str, count: int) -> None:
    """Cap how many buffers (entries included) a tenant may hold at once.

    Each buffer holds one of the daemon's open files; without a cap of its own a
    tenant gets the daemon's default (max_buffers_per_tenant, 4096). At the cap a
    reserve first evicts the tenant's evictable buffers, then answers 409
    buffer-count-exceeded. Lowering it below current use is allowed: it blocks new
    reserves.

    \b
    Example:
      maasctl tenants set-max-buffers acme 1000
    """
    _update(c, tenant, f"Buffer cap of {{}} set to {count}.", max_buffers=count)


def _update(c: Ctx, tenant: str, message: str, **change: int) -> None:
    """``PATCH`` the tenant with ``change``; say ``message`` (``{}``: its name) and show it."""
    with c.client("admin") as client:
        ref = resolve_tenant(client, tenant)
        with client.responses() as seen:
            t = client.update_tenant(ref.id, **change)

    def human() -> RenderableType:
        return Group(done(message.format(t.name)), tenant_detail(t, ascii_only=c.ascii_only))

    c.emit(raw(seen), human)


@tenants.command("delete")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@pass_ctx
def tenants_delete(c: Ctx, tenant: str) -> None:
    """Delete a tenant: releases (scrubs) all its buffers and revokes its keys.

    \b
    Example:
      maasctl tenants delete acme
    """
    with c.client("admin") as client:
        t = resolve_tenant(client, tenant)
        with client.responses() as seen:
            client.delete_tenant(t.id)
    extra = f"; {t.buffers} buffer(s) released and scrubbed" if t.buffers else ""
    c.emit(raw(seen), lambda: done(f"Tenant {t.name} ({t.id}) deleted{extra}."))
