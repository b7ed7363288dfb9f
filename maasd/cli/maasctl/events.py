"""``maasctl events``: the audit trail, newest first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import click
from rich.table import Table

from maasd.cli.maasctl.context import Ctx, complete, names, pass_ctx, raw, resolve_tenant
from maasd.cli.maasctl.formatting import add_row, format_time, ident, note, short, size, table
from maasd.client import Event

__all__ = ["events", "events_table"]


def events_table(
    items: Iterable[Event],
    *,
    tenant_names: Mapping[str, str] | None = None,
    pool_names: Mapping[str, str] | None = None,
) -> Table:
    tenant_names = tenant_names or {}
    pool_names = pool_names or {}
    t = table()
    t.add_column("#", justify="right")
    t.add_column("AT", no_wrap=True)
    t.add_column("EVENT", no_wrap=True)
    t.add_column("TENANT", no_wrap=True)
    t.add_column("POOL", no_wrap=True)
    t.add_column("BUFFER", overflow="fold")
    t.add_column("BYTES", justify="right")
    t.add_column("DETAIL")
    for e in items:
        tid, pid = e.tenant_id, e.pool_id
        add_row(
            t,
            e.id,
            format_time(e.at),
            e.kind,
            tenant_names.get(tid, tid) if tid else None,
            pool_names.get(pid, pid) if pid else None,
            ident(e.buffer_id),
            size(e.bytes),
            short(e.detail, 40),
        )
    return t


@click.command()
@click.option(
    "--tenant",
    metavar="NAME|ID",
    shell_complete=complete("tenant"),
    help="Only this tenant's events.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 1000),
    default=50,
    show_default=True,
    help="How many of the newest events.",
)
@click.option(
    "--before", type=click.IntRange(min=1), help="Only events older than this # (to page back)."
)
@pass_ctx
def events(c: Ctx, tenant: str | None, limit: int, before: int | None) -> None:
    """The audit trail, newest first: reserves, releases and why, keys, quotas, pools.

    \b
    Examples:
      maasctl events
      maasctl events --tenant acme --limit 200
      maasctl --json events --before 1200
    """
    with c.client("admin") as client:
        owner = resolve_tenant(client, tenant) if tenant else None
        with client.responses() as seen:
            items = client.events(limit, owner.id if owner else None, before)
        tn, pn = ({}, {}) if c.as_json or not items else names(client, tenant=owner)
    c.emit(
        raw(seen),
        lambda: (
            events_table(items, tenant_names=tn, pool_names=pn) if items else note("No events.")
        ),
    )
