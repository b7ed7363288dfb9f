"""The ``maasctl`` command group: options before the subcommand, the nouns, the entry point.

Every failure the client raises is turned into one line on stderr here, in
:class:`MaasctlGroup`, so commands just call :class:`maasd.client.Client` and let
errors rise; :func:`main` is the last line of defence against a traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click

from maasd.cli.maasctl.buffers import buffers
from maasd.cli.maasctl.context import DEFAULT_URL, Ctx, console
from maasd.cli.maasctl.entries import entries
from maasd.cli.maasctl.errors import from_client_error
from maasd.cli.maasctl.events import events
from maasd.cli.maasctl.hosts import hosts
from maasd.cli.maasctl.keys import keys
from maasd.cli.maasctl.pools import pools
from maasd.cli.maasctl.status import status, top
from maasd.cli.maasctl.tenants import tenants
from maasd.cli.maasctl.units import FiniteFloatRange
from maasd.cli.maasctl.usage import topology, usage
from maasd.client import InvalidReference, MaasdClientError

__all__ = ["cli", "main"]

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class MaasctlGroup(click.Group):
    """The root group: whatever the client raises in any subcommand becomes a ``CliError``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (MaasdClientError, InvalidReference) as exc:
            url = ctx.obj.url if isinstance(ctx.obj, Ctx) else DEFAULT_URL
            raise from_client_error(exc, url) from None


def _print_version(ctx: click.Context) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("maasd")
    except PackageNotFoundError:
        v = "unknown (not installed)"
    click.echo(f"maasctl {v}")
    ctx.exit(0)


@click.group(
    cls=MaasctlGroup,
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
    type=FiniteFloatRange(min=0.1),
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
    ctx.obj = Ctx(url=url, key=key, as_json=as_json, timeout=timeout, out=console())


for command in (
    *(status, usage, topology, top, pools, tenants, keys, buffers, entries, events, hosts),
):
    cli.add_command(command)


def _internal(exc: BaseException) -> NoReturn:
    click.echo(
        f"maasctl: error: internal error: {type(exc).__name__}: {exc!r} "
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
