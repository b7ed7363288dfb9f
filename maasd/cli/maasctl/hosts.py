"""``maasctl hosts``: the daemon hosts sharing one ledger — list them, forget a dead one."""

from __future__ import annotations

from collections.abc import Iterable

import click
from rich.table import Table

from maasd.cli.maasctl.context import Ctx, pass_ctx, raw
from maasd.cli.maasctl.errors import ApiError
from maasd.cli.maasctl.formatting import add_row, done, format_time, note, size, table, text
from maasd.cli.maasctl.formatting import ago as ago_text
from maasd.client import Conflict, Host

__all__ = ["hosts", "hosts_table"]


def hosts_table(items: Iterable[Host]) -> Table:
    t = table()
    t.add_column("HOST", style="bold", no_wrap=True)
    t.add_column("STATE", no_wrap=True)
    t.add_column("LAST SEEN", justify="right")
    t.add_column("STARTED")
    t.add_column("POOLS", justify="right")
    t.add_column("CAPACITY", justify="right")
    t.add_column("USED", justify="right")
    t.add_column("BUFFERS", justify="right")
    for h in items:
        state = (
            text("serving", "green")
            if h.live
            else text("stopped" if h.stopped_at else "silent", "yellow" if h.stopped_at else "red")
        )
        if h.local:
            state.append(" (this daemon)")
        add_row(
            t,
            h.name,
            state,
            ago_text(-h.last_seen_age_s),
            format_time(h.started_at),
            h.pools,
            size(h.capacity_bytes),
            size(h.used_bytes),
            h.buffers,
        )
    return t


@click.group()
def hosts() -> None:
    """The daemon hosts sharing this daemon's ledger (PostgreSQL): list, forget.

    \b
    Example:
      maasctl hosts list
    """


@hosts.command("list")
@pass_ctx
def hosts_list(c: Ctx) -> None:
    """Every host with its heartbeat, pools and use.

    "silent": no heartbeat for the daemons' host_timeout_s, nor a clean stop — a
    host that died (its buffers count until it restarts or is forgotten).

    \b
    Example:
      maasctl hosts list
    """
    with c.client("admin") as client, client.responses() as seen:
        items = client.hosts()
    c.emit(raw(seen), lambda: hosts_table(items) if items else note("No hosts."))


@hosts.command("forget")
@click.argument("host")
@pass_ctx
def hosts_forget(c: Ctx, host: str) -> None:
    """Forget a host that is not serving: its buffers stop counting against quotas, its
    pools go. Refused while the host still beats. If it comes back, it joins as a new host.

    \b
    Example:
      maasctl hosts forget gpu-node-17
    """
    with c.client("admin") as client:
        before = next((h for h in client.hosts() if h.name == host), None)
        with client.responses() as seen:
            try:
                client.forget_host(host)
            except Conflict as exc:
                hint = "only a host that stopped, or is silent for host_timeout_s, can be forgotten"
                raise ApiError(
                    exc.status, exc.title, exc.detail, type_=exc.type, hint=hint
                ) from None
    freed = f": {before.buffers} buffer(s), {before.used_bytes} bytes released" if before else ""
    c.emit(raw(seen), lambda: done(f"Host {host} forgotten{freed}."))
