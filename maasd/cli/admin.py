"""``maasctl``: the admin CLI of maasd (SPEC §7).

It talks to the REST API only (:mod:`maasd.cli.admin_http`) — no database,
no memory of its own — so it works the same against a local or a remote
daemon. Human output is rich tables (:mod:`maasd.cli.admin_format`);
``--json`` before the subcommand prints exactly what the API returned.

Keys: ``--key`` wins; otherwise admin commands read ``MAASD_ADMIN_KEY``,
tenant commands (``usage``) read ``MAASD_KEY``, and read-only commands that
any key may run take whichever is set, admin first.

Exit codes: 0 success, 1 the daemon refused the request (or NAME|ID matched
nothing), 2 bad usage (unknown option, bad SIZE, missing key), 3 the daemon
could not be reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import click
from click.shell_completion import CompletionItem
from rich.console import Console, Group, RenderableType
from rich.text import Text

from maasd.cli import admin_format as fmt
from maasd.cli.admin_http import (
    DEFAULT_URL,
    EXIT_USAGE,
    AdminApi,
    ApiError,
    CliError,
    NotFoundLocally,
)
from maasd.cli.admin_units import SizeError, format_size, parse_size

__all__ = ["cli", "main"]

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# -- parameter types ------------------------------------------------------------


class SizeType(click.ParamType):
    """SIZE: bytes or a number with a unit (``4096``, ``512MiB``, ``8GiB``, ``1.5GB``)."""

    name = "SIZE"

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        try:
            return parse_size(str(value), allow_zero=self.allow_zero)
        except SizeError as exc:
            self.fail(str(exc), param, ctx)


class MissingKey(CliError):
    exit_code = EXIT_USAGE


def _complete(kind: str) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    """Shell completion of tenant/pool names, asked of the daemon (best effort, 2 s)."""

    def complete(
        ctx: click.Context, _param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        root = ctx.find_root()
        url = root.params.get("url") or os.environ.get("MAASD_URL") or DEFAULT_URL
        key = (
            root.params.get("key")
            or os.environ.get("MAASD_ADMIN_KEY")
            or os.environ.get("MAASD_KEY")
        )
        try:
            with AdminApi(url, key, timeout=2.0) as api:
                items = api.tenants() if kind == "tenant" else api.pools()
        except CliError:
            return []
        out = []
        for item in items or []:
            name = str(item.get("name", ""))
            if name.startswith(incomplete):
                out.append(CompletionItem(name, help=str(item.get("id", ""))))
        return out

    return complete


# -- shared state ---------------------------------------------------------------------


@dataclass
class Ctx:
    url: str
    key: str | None
    as_json: bool
    timeout: float
    out: Console
    err: Console

    def api(self, role: str = "admin") -> AdminApi:
        """An API client with the right key for ``role``: admin, tenant or any."""
        key = self.key
        if not key:
            if role == "admin":
                key = os.environ.get("MAASD_ADMIN_KEY")
                where = "--key or MAASD_ADMIN_KEY"
            elif role == "tenant":
                key = os.environ.get("MAASD_KEY")
                where = "--key or MAASD_KEY (the tenant's API key)"
            else:
                key = os.environ.get("MAASD_ADMIN_KEY") or os.environ.get("MAASD_KEY")
                where = "--key, MAASD_ADMIN_KEY or MAASD_KEY"
            if not key and role != "none":
                raise MissingKey("no API key", f"pass {where}")
        return AdminApi(self.url, key, timeout=self.timeout)

    @property
    def ascii_only(self) -> bool:
        return not (self.out.encoding or "").lower().startswith("utf")

    def emit(self, data: Any, human: Callable[[], RenderableType | str | None]) -> None:
        """Print ``data`` as JSON with ``--json``, else what ``human()`` renders."""
        if self.as_json:
            click.echo(json.dumps(data, indent=2))
            return
        r = human()
        if r is not None:
            self.out.print(r)


pass_ctx = click.make_pass_decorator(Ctx)


def _find(items: Any, ref: str, what: str) -> dict[str, Any]:
    """The item whose id is ``ref``, else the one whose name is ``ref``."""
    items = [x for x in items or [] if isinstance(x, dict)]
    for x in items:
        if str(x.get("id")) == ref:
            return x
    for x in items:
        if str(x.get("name")) == ref:
            return x
    names = ", ".join(sorted(str(x.get("name")) for x in items)[:10])
    known = f"; known: {names}" if names else f"; there are no {what}s"
    raise NotFoundLocally(
        f"no such {what}", f"{ref!r} is neither the name nor the id of a {what}{known}"
    )


def resolve_tenant(api: AdminApi, ref: str) -> dict[str, Any]:
    return _find(api.tenants(), ref, "tenant")


def resolve_pool(api: AdminApi, ref: str) -> dict[str, Any]:
    return _find(api.pools(), ref, "pool")


def _names(api: AdminApi) -> tuple[dict[str, str], dict[str, str]]:
    """id → name maps for tenants and pools, empty where the key may not list them."""
    tenants: dict[str, str] = {}
    pools: dict[str, str] = {}
    with contextlib.suppress(ApiError, KeyError, TypeError):
        tenants = {str(t["id"]): str(t["name"]) for t in api.tenants() or []}
    with contextlib.suppress(ApiError, KeyError, TypeError):
        pools = {str(p["id"]): str(p["name"]) for p in api.pools() or []}
    return tenants, pools


def _done(message: str) -> Text:
    return Text(message, style="green")


def _print_version(ctx: click.Context) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("maasd")
    except PackageNotFoundError:
        v = "unknown (not installed)"
    click.echo(f"maasctl {v}")
    ctx.exit(0)


# -- the group -------------------------------------------------------------------------


@click.group(
    context_settings=CONTEXT_SETTINGS,
    epilog="""\b
Examples:
  export MAASD_URL=http://127.0.0.1:7878 MAASD_ADMIN_KEY=...
  maasctl status
  maasctl tenants create acme --quota 8GiB
  maasctl --json pools list | jq '.[].name'

Shell completion: eval "$(_MAASCTL_COMPLETE=bash_source maasctl)" (see docs/maasctl.md).""",
)
@click.option(
    "--url",
    envvar="MAASD_URL",
    default=DEFAULT_URL,
    show_default=True,
    metavar="URL",
    help="Base URL of the daemon's REST API [env: MAASD_URL].",
)
@click.option(
    "--key",
    metavar="KEY",
    default=None,
    help="API key. Default: MAASD_ADMIN_KEY, or MAASD_KEY for tenant commands (usage).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the API's JSON answer instead of tables."
)
@click.option(
    "--timeout",
    envvar="MAASD_TIMEOUT",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Per-request timeout [env: MAASD_TIMEOUT].",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _p, v: _print_version(ctx) if v else None,
    help="Show the version and exit.",
)
@click.pass_context
def cli(ctx: click.Context, url: str, key: str | None, as_json: bool, timeout: float) -> None:
    """Administer a maasd memory daemon over its REST API.

    Pools, tenants, API keys and buffers; status, topology and a live `top`.
    Wherever a command takes NAME|ID, either the name or the id works.
    SIZE is bytes or a number with a unit: 4096, 512MiB, 8GiB, 1.5GB.
    """
    out = Console(highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = 200  # a pipe or a file: do not squeeze tables into 80 columns
    err = Console(stderr=True, highlight=False)
    ctx.obj = Ctx(url=url, key=key, as_json=as_json, timeout=timeout, out=out, err=err)


# -- status, usage, topology, top ----------------------------------------------------------


@cli.command()
@pass_ctx
def status(c: Ctx) -> None:
    """Pools with usage bars, tenants with quota bars, and totals.

    With --json: {"pools": GET /v1/pools, "tenants": GET /v1/tenants}
    ("tenants" is null when the key may not list them).

    \b
    Example:
      maasctl status
    """
    with c.api("any") as api:
        pools = api.pools() or []
        tenants: list[Any] | None
        try:
            tenants = api.tenants()
        except ApiError as exc:
            if exc.status != 403:
                raise
            tenants = None
    c.emit(
        {"pools": pools, "tenants": tenants},
        lambda: fmt.status_view(pools, tenants, ascii_only=c.ascii_only),
    )


@cli.command()
@pass_ctx
def usage(c: Ctx) -> None:
    """A tenant's own quota and use (uses MAASD_KEY, the tenant's key).

    \b
    Example:
      MAASD_KEY=... maasctl usage
    """
    with c.api("tenant") as api:
        u = api.usage()
    c.emit(u, lambda: fmt.usage_view(u, ascii_only=c.ascii_only))


@cli.command()
@pass_ctx
def topology(c: Ctx) -> None:
    """NUMA nodes of the host: cpus, memory, distances, huge pages.

    \b
    Example:
      maasctl topology
    """
    with c.api("any") as api:
        topo = api.topology()
    c.emit(topo, lambda: fmt.topology_view(topo))


@cli.command()
@click.option(
    "--interval",
    "-n",
    type=click.FloatRange(min=0.05),
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

    Built from GET /metrics (no key needed); with a key that may list pools
    and tenants it also shows names and quotas. Press q or Ctrl-C to quit.

    \b
    Example:
      maasctl top --interval 0.5
    """
    from maasd.cli.admin_top import run_top

    if c.as_json:
        raise click.UsageError("top is interactive and has no --json; use `maasctl --json status`")
    if not c.out.is_terminal:
        once = True
    with (
        c.api("none" if not (c.key or _env_key()) else "any") as api,
        contextlib.suppress(KeyboardInterrupt),  # Ctrl-C is how one leaves top: exit 0
    ):
        run_top(api, c.out, interval, once=once)


def _env_key() -> str | None:
    return os.environ.get("MAASD_ADMIN_KEY") or os.environ.get("MAASD_KEY")


# -- pools ---------------------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT_SETTINGS)
def pools() -> None:
    """List, show, create and delete pools.

    \b
    Example:
      maasctl pools create fast0 --node 0 --capacity 8GiB --latency-us 1
    """


@pools.command("list")
@pass_ctx
def pools_list(c: Ctx) -> None:
    """All pools with capacity, use and properties.

    \b
    Example:
      maasctl pools list
    """
    with c.api("any") as api:
        items = api.pools() or []
    c.emit(items, lambda: fmt.pools_table(items) if items else Text("No pools.", style="dim"))


@pools.command("show")
@click.argument("pool", metavar="NAME|ID", shell_complete=_complete("pool"))
@pass_ctx
def pools_show(c: Ctx, pool: str) -> None:
    """One pool.

    \b
    Example:
      maasctl pools show node0
    """
    with c.api("any") as api:
        p = resolve_pool(api, pool)
        data = api.pool(str(p["id"]))
    c.emit(data, lambda: fmt.pools_table([data]))


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
@pass_ctx
def pools_create(
    c: Ctx,
    name: str,
    numa_node: int,
    capacity: int,
    backing: str | None,
    persistence: str | None,
    latency_us: int | None,
    scrub: str | None,
    prefault: bool | None,
    spill_dir: str | None,
) -> None:
    """Create a pool NAME on a NUMA node. Unset options take the daemon's defaults.

    \b
    Examples:
      maasctl pools create fast0 --node 0 --capacity 8GiB
      maasctl pools create kv1 --node 1 --capacity 64GiB --backing hugetlb \\
          --persistence persistent --spill-dir /var/lib/maasd/spill --scrub punch
    """
    body: dict[str, Any] = {"name": name, "numa_node": numa_node, "capacity_bytes": capacity}
    optional = {
        "backing": backing,
        "persistence": persistence,
        "latency_us": latency_us,
        "scrub": scrub,
        "prefault": prefault,
        "spill_dir": spill_dir,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    with c.api("admin") as api:
        p = api.create_pool(body)

    def human() -> RenderableType:
        t = fmt.pools_table([p] if isinstance(p, dict) else [])
        return Group(_done(f"Pool {name} created."), t)

    c.emit(p, human)


@pools.command("delete")
@click.argument("pool", metavar="NAME|ID", shell_complete=_complete("pool"))
@click.option("--drain", is_flag=True, help="Release (and scrub) the pool's buffers first.")
@pass_ctx
def pools_delete(c: Ctx, pool: str, drain: bool) -> None:
    """Delete a pool. Refused while it holds buffers, unless --drain.

    \b
    Examples:
      maasctl pools delete fast0
      maasctl pools delete fast0 --drain
    """
    with c.api("admin") as api:
        p = resolve_pool(api, pool)
        try:
            data = api.delete_pool(str(p["id"]), drain=drain)
        except ApiError as exc:
            if exc.status == 409 and not drain:
                exc.hint = "maasctl pools delete --drain releases and scrubs them"
            raise
    n = p.get("buffers")
    extra = f" ({n} buffer(s) released and scrubbed)" if drain and n else ""
    c.emit(data, lambda: _done(f"Pool {p.get('name')} ({p.get('id')}) deleted{extra}."))


# -- tenants ------------------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT_SETTINGS)
def tenants() -> None:
    """List, show, create, re-quota and delete tenants.

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
    with c.api("admin") as api:
        items = api.tenants() or []
    c.emit(
        items,
        lambda: (
            fmt.tenants_table(items, ascii_only=c.ascii_only)
            if items
            else Text("No tenants.", style="dim")
        ),
    )


@tenants.command("create")
@click.argument("name")
@click.option("--quota", type=SizeType(allow_zero=True), required=True, help="Hard quota (SIZE).")
@pass_ctx
def tenants_create(c: Ctx, name: str, quota: int) -> None:
    """Create a tenant; prints its first API key, shown only this once.

    \b
    Example:
      maasctl tenants create acme --quota 8GiB
      maasctl --json tenants create acme --quota 8GiB | jq -r .api_key
    """
    with c.api("admin") as api:
        t = api.create_tenant(name, quota)
    c.emit(t, lambda: fmt.tenant_created(t))


@tenants.command("show")
@click.argument("tenant", metavar="NAME|ID", shell_complete=_complete("tenant"))
@pass_ctx
def tenants_show(c: Ctx, tenant: str) -> None:
    """One tenant: quota, use, buffers.

    \b
    Example:
      maasctl tenants show acme
    """
    with c.api("admin") as api:
        t = api.tenant(str(resolve_tenant(api, tenant)["id"]))
    c.emit(t, lambda: fmt.tenant_detail(t, ascii_only=c.ascii_only))


@tenants.command("set-quota")
@click.argument("tenant", metavar="NAME|ID", shell_complete=_complete("tenant"))
@click.argument("size", metavar="SIZE", type=SizeType(allow_zero=True))
@pass_ctx
def tenants_set_quota(c: Ctx, tenant: str, size: int) -> None:
    """Change a tenant's quota. Lowering it below current use is allowed: it blocks new reserves.

    \b
    Example:
      maasctl tenants set-quota acme 16GiB
    """
    with c.api("admin") as api:
        ref = resolve_tenant(api, tenant)
        t = api.set_quota(str(ref["id"]), size)

    def human() -> RenderableType:
        msg = _done(f"Quota of {ref.get('name')} set to {format_size(size)}.")
        if isinstance(t, dict):
            return Group(msg, fmt.tenant_detail(t, ascii_only=c.ascii_only))
        return msg

    c.emit(t, human)


@tenants.command("delete")
@click.argument("tenant", metavar="NAME|ID", shell_complete=_complete("tenant"))
@pass_ctx
def tenants_delete(c: Ctx, tenant: str) -> None:
    """Delete a tenant: releases (scrubs) all its buffers and revokes its keys.

    \b
    Example:
      maasctl tenants delete acme
    """
    with c.api("admin") as api:
        t = resolve_tenant(api, tenant)
        data = api.delete_tenant(str(t["id"]))
    n = t.get("buffers")
    extra = f"; {n} buffer(s) released and scrubbed" if n else ""
    c.emit(data, lambda: _done(f"Tenant {t.get('name')} ({t.get('id')}) deleted{extra}."))


# -- keys -----------------------------------------------------------------------------------------


@cli.group(context_settings=CONTEXT_SETTINGS)
def keys() -> None:
    """Issue and revoke tenants' API keys.

    \b
    Example:
      maasctl keys issue acme
    """


@keys.command("issue")
@click.argument("tenant", metavar="NAME|ID", shell_complete=_complete("tenant"))
@pass_ctx
def keys_issue(c: Ctx, tenant: str) -> None:
    """Issue a new API key for a tenant (shown only this once).

    \b
    Example:
      maasctl keys issue acme
    """
    with c.api("admin") as api:
        t = resolve_tenant(api, tenant)
        k = api.issue_key(str(t["id"]))
    c.emit(k, lambda: fmt.key_issued(t, k))


@keys.command("revoke")
@click.argument("tenant", metavar="NAME|ID", shell_complete=_complete("tenant"))
@click.argument("key_id", metavar="KEY_ID")
@pass_ctx
def keys_revoke(c: Ctx, tenant: str, key_id: str) -> None:
    """Revoke a tenant's API key; it answers 401 at once.

    \b
    Example:
      maasctl keys revoke acme 3f1c9e0a-…
    """
    with c.api("admin") as api:
        t = resolve_tenant(api, tenant)
        data = api.revoke_key(str(t["id"]), key_id)
    c.emit(data, lambda: _done(f"Key {key_id} of {t.get('name')} revoked."))


# -- buffers ----------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--tenant",
    metavar="NAME|ID",
    shell_complete=_complete("tenant"),
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
    with c.api("admin") as api:
        tenant_id = str(resolve_tenant(api, tenant)["id"]) if tenant else None
        items = api.events(limit, tenant_id, before) or []
        names = ({}, {}) if c.as_json else _names(api)
    c.emit(
        items,
        lambda: (
            fmt.events_table(items, tenant_names=names[0], pool_names=names[1])
            if items
            else Text("No events.", style="dim")
        ),
    )


@cli.group(context_settings=CONTEXT_SETTINGS)
def buffers() -> None:
    """List, show and release buffers.

    \b
    Example:
      maasctl buffers list --tenant acme
    """


@buffers.command("list")
@click.option(
    "--tenant",
    metavar="NAME|ID",
    shell_complete=_complete("tenant"),
    help="Only this tenant's buffers.",
)
@pass_ctx
def buffers_list(c: Ctx, tenant: str | None) -> None:
    """Live buffers (all tenants with the admin key).

    \b
    Examples:
      maasctl buffers list
      maasctl buffers list --tenant acme
    """
    with c.api("any") as api:
        tenant_id = str(resolve_tenant(api, tenant)["id"]) if tenant else None
        items = api.buffers(tenant_id) or []
        names = ({}, {}) if c.as_json else _names(api)
    c.emit(
        items,
        lambda: (
            fmt.buffers_table(items, tenant_names=names[0], pool_names=names[1])
            if items
            else Text("No buffers.", style="dim")
        ),
    )


@buffers.command("show")
@click.argument("buffer_id", metavar="ID")
@pass_ctx
def buffers_show(c: Ctx, buffer_id: str) -> None:
    """One buffer: size, placement, lease, key.

    \b
    Example:
      maasctl buffers show 9b2f0c4e-…
    """
    with c.api("any") as api:
        b = api.buffer(buffer_id)
        tn, pn = ({}, {}) if c.as_json else _names(api)
    c.emit(
        b,
        lambda: fmt.buffer_detail(
            b, tenant_name=tn.get(str(b.get("tenant_id"))), pool_name=pn.get(str(b.get("pool_id")))
        ),
    )


@buffers.command("release")
@click.argument("buffer_id", metavar="ID")
@pass_ctx
def buffers_release(c: Ctx, buffer_id: str) -> None:
    """Release a buffer: its memory is scrubbed to zero, then freed.

    \b
    Example:
      maasctl buffers release 9b2f0c4e-…
    """
    with c.api("any") as api:
        data = api.release_buffer(buffer_id)
    c.emit(data, lambda: _done(f"Buffer {buffer_id} released (scrubbed)."))


# -- entry point ---------------------------------------------------------------------------------------


def _internal(exc: BaseException) -> NoReturn:
    click.echo(
        f"maasctl: error: internal error: {type(exc).__name__}: {exc} "
        "(set MAASCTL_DEBUG=1 for a traceback)",
        file=sys.stderr,
    )
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: never lets a traceback reach the user."""
    try:
        cli.main(args=argv, prog_name="maasctl")
    except SystemExit:
        raise
    except Exception as exc:  # the last line of defence; commands raise CliError
        if os.environ.get("MAASCTL_DEBUG"):
            raise
        _internal(exc)


if __name__ == "__main__":
    main()
