"""What every maasctl command shares: the options before the subcommand, the key for a
role, a :class:`maasd.client.Client`, NAME|ID resolution and ``--json`` / human output.

Keys: ``--key`` wins; otherwise admin commands read ``MAASD_ADMIN_KEY``, tenant
commands (``usage``) read ``MAASD_KEY``, and read-only commands that any key may
run take whichever is set, admin first.

NAME|ID: the daemon resolves both on ``GET /v1/tenants/{ref}`` and
``GET /v1/pools/{ref}`` (an id wins over a name), so maasctl asks for the one object
and then acts on its id; it never lists every tenant to find one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import click
import httpx
from click.shell_completion import CompletionItem
from rich.console import Console, RenderableType

from maasd.bounds import DEFAULT_URL
from maasd.cli.maasctl.errors import ApiError, Unreachable, UsageProblem
from maasd.client import (
    Client,
    MaasdClientError,
    NotFound,
    Pool,
    Tenant,
    raw_json,
)

__all__ = [
    "DEFAULT_URL",
    "Ctx",
    "Role",
    "complete",
    "console",
    "names",
    "pass_ctx",
    "raw",
    "resolve_pool",
    "resolve_tenant",
]


#: Which key a command needs: the admin's, a tenant's, either, or none at all (``top``).
Role = Literal["admin", "tenant", "any", "none"]

_KEY_SOURCES: dict[Role, tuple[tuple[str, ...], str]] = {
    "admin": (("MAASD_ADMIN_KEY",), "--key or MAASD_ADMIN_KEY"),
    "tenant": (("MAASD_KEY",), "--key or MAASD_KEY (the tenant's API key)"),
    "any": (("MAASD_ADMIN_KEY", "MAASD_KEY"), "--key, MAASD_ADMIN_KEY or MAASD_KEY"),
    "none": (("MAASD_ADMIN_KEY", "MAASD_KEY"), ""),
}


def console(*, stderr: bool = False) -> Console:
    """A console that never interprets markup or emoji codes in what it prints."""
    out = Console(stderr=stderr, highlight=False, markup=False, emoji=False)
    if not stderr and not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = 200  # a pipe or a file: do not squeeze tables into 80 columns
    return out


@dataclass
class Ctx:
    url: str
    key: str | None
    as_json: bool
    timeout: float
    out: Console

    def key_for(self, role: Role) -> str | None:
        """The key for ``role``; :class:`UsageProblem` when one is needed and none is set."""
        if self.key:
            return self.key
        names, where = _KEY_SOURCES[role]
        key = next((v for n in names if (v := os.environ.get(n))), None)
        if not key and role != "none":
            raise UsageProblem("no API key", f"pass {where}")
        return key

    def client(self, role: Role = "admin") -> Client:
        """A client of the daemon with the right key for ``role``."""
        try:
            return Client(self.url, self.key_for(role), timeout=self.timeout)
        except ValueError as exc:
            raise Unreachable(f"invalid URL {self.url!r}", str(exc)) from None

    @property
    def ascii_only(self) -> bool:
        return not (self.out.encoding or "").lower().startswith("utf")

    def emit(self, raw: Any, human: Callable[[], RenderableType | None]) -> None:
        """Print ``raw`` (the daemon's JSON) with ``--json``, else what ``human()`` renders.

        ``json.dumps`` escapes every control and non-ASCII character (``\\u001b``), so
        the JSON output is as safe for a terminal as the tables.
        """
        if self.as_json:
            click.echo(json.dumps(raw, indent=2))
            return
        r = human()
        if r is not None:
            self.out.print(r)


pass_ctx = click.make_pass_decorator(Ctx)


def raw(seen: list[httpx.Response]) -> Any:
    """The daemon's JSON for ``--json``: the last response ``client.responses()`` saw
    (``None`` for a 204), so resolution calls before the command's own are not printed."""
    return raw_json(seen[-1]) if seen else None


def resolve_tenant(client: Client, ref: str) -> Tenant:
    """The tenant with id or name ``ref`` (one ``GET /v1/tenants/{ref}``); a miss is the
    problem's title and detail, as every error (SPEC §7), with a hint."""
    try:
        return client.tenant(ref)
    except NotFound as exc:
        raise _missing(exc, "maasctl tenants list shows them") from None


def resolve_pool(client: Client, ref: str) -> Pool:
    """The pool with id or name ``ref`` (one ``GET /v1/pools/{ref}``; a miss names the pools)."""
    try:
        return client.pool(ref)
    except NotFound as exc:
        raise _missing(exc) from None


def _missing(exc: NotFound, hint: str = "") -> ApiError:
    return ApiError(exc.status, exc.title, exc.detail, type_=exc.type, hint=hint)


def names(client: Client, *, tenant: Tenant | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """id → name maps for tenants and pools, to show names instead of ids.

    With ``tenant`` the listing is about that one tenant: its name is known, no
    listing of tenants is needed. Empty where the key may not list them.
    """
    tenants: dict[str, str] = {}
    pools: dict[str, str] = {}
    if tenant is not None:
        tenants = {tenant.id: tenant.name}
    else:
        with contextlib.suppress(MaasdClientError):
            tenants = {t.id: t.name for t in client.tenants()}
    with contextlib.suppress(MaasdClientError):
        pools = {p.id: p.name for p in client.pools()}
    return tenants, pools


def complete(kind: Literal["tenant", "pool"]) -> Callable[..., list[CompletionItem]]:
    """Shell completion of tenant/pool names, asked of the daemon (best effort, 2 s)."""

    def complete_names(
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
            with Client(url, key, timeout=2.0) as client:
                items: list[Tenant] | list[Pool] = (
                    client.tenants() if kind == "tenant" else client.pools()
                )
        except (MaasdClientError, ValueError):
            return []
        return [CompletionItem(x.name, help=x.id) for x in items if x.name.startswith(incomplete)]

    return complete_names
