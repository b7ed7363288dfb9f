"""``maasd doctor``: can this host run the daemon as configured? Each check says why not, and the fix.

Every check is real — it makes a memfd and seals it, binds a small region to each
NUMA node and asks the kernel where its pages are, reads the limits and the
ledger — and none changes anything the daemon owns (no ledger file is created,
no migration is run, no huge page is reserved). Each asks the daemon's own code
(the allocator, the budget of :mod:`maasd.core.limits`, the store), so that what
passes here is what ``maasd serve`` does. Run it the way the daemon runs (same user,
same settings, inside the unit or the container) so the limits and permissions it
sees are the daemon's.

    maasd doctor                    a table; exit 1 when a check fails
    maasd doctor --json             {"ok": …, "checks": [{name, status, detail, fix}, …]}

Statuses: ``ok``; ``warn`` (works, but look); ``fail`` (the daemon will not work as
configured; exit 1); ``skip`` (does not apply here, e.g. llama-cpp-python absent).

This module runs the checks and prints them; each family is a module of its own:

==========================  ==========================================================
``doctor_kernel``           the kernel's features; memory bandwidth per node pair
``doctor_memory``           memfd seals, hugetlb memfds, huge pages, NUMA placement
``doctor_limits``           open files, tasks, the region budget
``doctor_host``             the worker socket's directory
``doctor_ledger``           the ledger's schema, the tenants' caps
``doctor_llama``            llama-cpp-python's build
``doctor_llama_server``     ``--llama-server PATH``: a llama-server binary's quantized eval
==========================  ==========================================================

A new check: a function returning a :class:`Check` (or a list) in the module of its
family, a row of :func:`run_checks`' steps and of :data:`CHECKS`, and a flag below if
it takes one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import msgspec

from maasd.cli.doctor_check import Check, Status
from maasd.cli.doctor_host import check_socket_dir
from maasd.cli.doctor_kernel import check_bandwidth, check_kernel, check_pipe_pages
from maasd.cli.doctor_latency import check_latency
from maasd.cli.doctor_ledger import check_ledger
from maasd.cli.doctor_limits import (
    Needs,
    check_limits,
    check_region_budget,
    check_regions,
    needs,
    region_need,
    regions_wanted,
)
from maasd.cli.doctor_llama import check_llama
from maasd.cli.doctor_memory import (
    check_hugepages,
    check_hugetlb_memfd,
    check_memfd_seals,
    check_numa,
)
from maasd.errors import ConfigError
from maasd.settings import Settings
from maasd.topology import SYSFS_NODES, discover

__all__ = [
    "CHECKS",
    "Check",
    "Needs",
    "Settings",
    "Status",
    "check_region_budget",
    "doctor",
    "needs",
    "region_need",
    "regions_wanted",
    "run_checks",
]


def run_checks(
    settings: Settings,
    *,
    sysfs_root: str = SYSFS_NODES,
    llama_model: str | None = None,
    skip: frozenset[str] = frozenset(),
    open_files: int | None = None,
    max_map_count: int | None = None,
) -> list[Check]:
    """Every check, in the order an operator would fix them; those named in ``skip`` are
    reported as skipped. ``open_files``/``max_map_count``: size the region budget for
    these limits instead of this host's."""
    topology = discover(sysfs_root)
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("kernel", check_kernel),
        ("pipe pages", check_pipe_pages),
        ("memfd seals", lambda: check_memfd_seals(topology)),
        ("hugetlb memfd", lambda: check_hugetlb_memfd(topology)),
        ("huge pages", lambda: check_hugepages(topology, settings)),
        ("NUMA placement", lambda: check_numa(topology)),
        ("memory bandwidth", lambda: check_bandwidth(topology)),
        ("latency classes", lambda: check_latency(topology, settings)),
        (
            "limits",
            lambda: [
                *check_limits(settings),
                *check_regions(
                    settings, topology, open_files=open_files, max_map_count=max_map_count
                ),
            ],
        ),
        ("socket directory", lambda: check_socket_dir(settings)),
        ("ledger", lambda: check_ledger(settings)),
        ("llama-cpp-python", lambda: check_llama(llama_model)),
    ]
    out: list[Check] = []
    for name, step in steps:
        if name in skip:
            out.append(Check(name, "skip", "skipped (--skip)"))
            continue
        try:
            got = step()
        except Exception as e:  # a check that breaks is a finding, not a traceback
            got = Check(name, "fail", f"the check itself failed: {type(e).__name__}: {e}")
        out.extend(got if isinstance(got, list) else [got])
    return out


#: The checks by name, in order (``--skip`` takes these).
CHECKS = (
    "kernel",
    "pipe pages",
    "memfd seals",
    "hugetlb memfd",
    "huge pages",
    "NUMA placement",
    "memory bandwidth",
    "latency classes",
    "limits",
    "socket directory",
    "ledger",
    "llama-cpp-python",
)

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def _print_table(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="maasd doctor", title_justify="left", show_lines=False)
    for col in ("CHECK", "STATUS", "DETAIL", "FIX"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, c.fix)
    Console(soft_wrap=False).print(table)


@click.command()
@click.option("--data-dir", help="State directory [env MAASD_DATA_DIR].")
@click.option("--db", "db_url", help="Ledger URL [env MAASD_DB_URL].")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML config [env MAASD_CONFIG].")
@click.option("--socket", "socket", help="Worker socket path [env MAASD_SOCKET].")
@click.option("--socket-group", help="Workers' group [env MAASD_SOCKET_GROUP].")
@click.option("--llama-model", type=click.Path(dir_okay=False), help="A GGUF to eval with.")
@click.option(
    "--llama-server",
    type=click.Path(dir_okay=False),
    help="Also check that this llama-server binary runs a quantized eval here (maasd router).",
)
@click.option(
    "--skip",
    multiple=True,
    type=click.Choice(CHECKS),
    help="Do not run this check (repeatable), e.g. llama-cpp-python on a host with no worker.",
)
@click.option(
    "--nofile",
    type=click.IntRange(1),
    help="Size the region budget for this LimitNOFILE instead of this host's hard limit.",
)
@click.option(
    "--max-map-count",
    type=click.IntRange(1),
    help="Size the region budget for this vm.max_map_count instead of this host's.",
)
@click.option("--sysfs-root", default=SYSFS_NODES, hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def doctor(
    as_json: bool,
    llama_model: str | None,
    llama_server: str | None,
    sysfs_root: str,
    skip: tuple[str, ...],
    nofile: int | None,
    max_map_count: int | None,
    **flags: Any,
) -> None:
    """Check that this host can run the daemon as configured, and say how to fix what fails.

    The region budget says how many entries and buffers the daemon holds (in all, and
    per tenant); --nofile and --max-map-count ask it for other limits.

    \b
    Example:
      maasd doctor --data-dir /var/lib/maasd --socket /run/maasd/maasd.sock
      maasd doctor --nofile 262144 --max-map-count 262144 --skip llama-cpp-python
    """
    from maasd.settings import load

    try:
        settings = load(flags)
    except ConfigError as e:
        raise click.ClickException(e.detail) from e
    checks = run_checks(
        settings,
        sysfs_root=sysfs_root,
        llama_model=llama_model,
        skip=frozenset(skip),
        open_files=nofile,
        max_map_count=max_map_count,
    )
    if llama_server:
        from maasd.cli.doctor_llama import gemma_model
        from maasd.cli.doctor_llama_server import check_llama_server

        checks.append(check_llama_server(llama_server, gemma_model(llama_model)))
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(msgspec.json.encode({"ok": ok, "checks": checks}).decode())
    else:
        _print_table(checks)
    if not ok:
        raise SystemExit(1)
