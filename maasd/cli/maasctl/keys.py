"""``maasctl keys``: issue and revoke tenants' API keys."""

from __future__ import annotations

import click
from rich.console import Group

from maasd.cli.maasctl.context import Ctx, complete, pass_ctx, raw, resolve_tenant
from maasd.cli.maasctl.formatting import add_row, done, format_time, ident, kv_table, note, text
from maasd.cli.maasctl.tenants import KEY_ONCE
from maasd.client import KeyInfo, Tenant

__all__ = ["key_issued", "keys"]


def key_issued(tenant: Tenant, key: KeyInfo) -> Group:
    """The new key, labelled apart from its tenant: in the JSON ``id`` is the key's."""
    t = kv_table()
    add_row(t, "tenant", f"{tenant.name} (tenant id {tenant.id})")
    add_row(t, "key id", ident(key.id))
    add_row(t, "api key", text(key.api_key, "bold yellow", overflow="fold"))
    add_row(t, "created", format_time(key.created_at))
    return Group(text("Key issued.", "bold green"), t, note(KEY_ONCE))


@click.group()
def keys() -> None:
    """Issue and revoke tenants' API keys.

    \b
    Example:
      maasctl keys issue acme
    """


@keys.command("issue")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@pass_ctx
def keys_issue(c: Ctx, tenant: str) -> None:
    """Issue a new API key for a tenant (shown only this once).

    The "key id" it prints ("id" in --json) is what `maasctl keys revoke` takes.

    \b
    Example:
      maasctl keys issue acme
    """
    with c.client("admin") as client:
        t = resolve_tenant(client, tenant)
        with client.responses() as seen:
            k = client.issue_key(t.id)
    c.emit(raw(seen), lambda: key_issued(t, k))


@keys.command("revoke")
@click.argument("tenant", metavar="NAME|ID", shell_complete=complete("tenant"))
@click.argument("key_id", metavar="KEY_ID")
@pass_ctx
def keys_revoke(c: Ctx, tenant: str, key_id: str) -> None:
    """Revoke a tenant's API key; it answers 401 at once.

    KEY_ID is the "key id" printed by `keys issue` or `tenants create`.

    \b
    Example:
      maasctl keys revoke acme 3f1c9e0a…
    """
    with c.client("admin") as client:
        t = resolve_tenant(client, tenant)
        with client.responses() as seen:
            client.revoke_key(t.id, key_id)
    c.emit(raw(seen), lambda: done(f"Key {key_id} of {t.name} revoked."))
