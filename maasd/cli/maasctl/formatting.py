"""Shared pieces of maasctl's human output: safe cells, tables, sizes, times, bars.

Nothing here does I/O, so the same renderables serve one-shot commands and the
refreshing ``top`` view; each noun's module builds its own tables from these.

Every cell is a rich ``Text`` built by :func:`text` (or :func:`add_row`, which
converts whatever it gets): ``Text`` is never parsed for markup, so a label like
``[/]`` or ``[bold red]admin`` shows as typed instead of failing or restyling the
table, and :func:`~maasd.cli.maasctl.text.visible` escapes control characters, so
no tenant string can send escape sequences to the admin's terminal. Sizes are
shown in binary units and right-aligned; colours come from styles, which rich
drops when the output is not a terminal.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from maasd.cli.maasctl.text import visible
from maasd.cli.maasctl.units import bar, format_percent, format_size, usage_fraction

__all__ = [
    "Cell",
    "add_row",
    "ago",
    "done",
    "format_cpus",
    "format_time",
    "ident",
    "kv_table",
    "note",
    "opt",
    "short",
    "size",
    "table",
    "text",
    "usage_bar",
]

#: What a table cell may be given as; everything but ``Text`` goes through :func:`text`.
Cell = Text | str | int | float | bool | None


def opt(value: Any) -> str:
    """A value as a plain string: ``-`` for nothing, ``yes``/``no`` for booleans."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def text(value: Any, style: str = "", **kw: Any) -> Text:
    """A safe cell: :func:`opt` of ``value``, control characters made visible, no markup."""
    return Text(visible(opt(value)), style=style, **kw)


def add_row(t: Table, *cells: Cell) -> None:
    """``t.add_row`` where every cell that is not already ``Text`` becomes a safe one."""
    t.add_row(*(c if isinstance(c, Text) else text(c) for c in cells))


def done(message: str) -> Text:
    """A green "it worked" line (``message`` may quote names: it is made visible)."""
    return text(message, "green")


def note(message: str) -> Text:
    return text(message, "dim")


def size(n: int | float | None) -> Text:
    """Bytes in binary units, right-aligned."""
    return Text(format_size(n) if isinstance(n, int | float) else "-", justify="right")


def ident(value: Any) -> Text:
    """An id: cyan, folded rather than truncated (ids are copied from here)."""
    return text(value, "cyan", overflow="fold")


def short(value: Any, n: int = 24) -> Text:
    """A free-text cell cut to ``n`` characters (after escaping, so the cut shows)."""
    s = visible(opt(value))
    return Text(s if len(s) <= n else s[: n - 1] + "…")


def table(title: str | None = None) -> Table:
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        header_style="bold",
        pad_edge=False,
    )


def kv_table() -> Table:
    """Two columns, no borders: ``name  value`` rows of one object."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    return t


def _style_for(fraction: float) -> str:
    if fraction >= 0.9:
        return "red"
    if fraction >= 0.7:
        return "yellow"
    return "green"


def usage_bar(
    used: int | None, total: int | None, width: int = 24, *, ascii_only: bool = False
) -> Text:
    """``████░░░░  42.5%`` coloured by fill level (green, yellow ≥ 70 %, red ≥ 90 %)."""
    f = usage_fraction(used, total)
    out = Text(bar(f, width, ascii_only=ascii_only), style=_style_for(f))
    if used and (not total or total <= 0):
        out.append("   over", style="bold red")  # a zero quota with use: no percentage
    else:
        out.append(f" {format_percent(f):>6}", style="bold red" if f > 1 else "")
    return out


# -- times and cpus -----------------------------------------------------------------


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def ago(delta_s: float) -> str:
    """``in 9m58s`` for a future delta, ``3h05m ago`` for a past one."""
    s = int(abs(delta_s))
    if s < 60:
        out = f"{s}s"
    elif s < 3600:
        out = f"{s // 60}m{s % 60:02d}s"
    elif s < 86400:
        out = f"{s // 3600}h{(s % 3600) // 60:02d}m"
    else:
        out = f"{s // 86400}d{(s % 86400) // 3600:02d}h"
    return f"in {out}" if delta_s > 0 else f"{out} ago"


def format_time(
    value: Any,
    *,
    relative: bool = False,
    only_relative: bool = False,
    now: dt.datetime | None = None,
) -> str:
    """``2025-01-02T03:04:05.123456Z`` → ``2025-01-02 03:04:05Z`` (``(in 9m58s)`` if relative).

    Anything that is not a timestamp comes back as it was (made visible).
    """
    t = _parse_time(value)
    if t is None:
        return visible(opt(value))
    rel = ago((t - (now or dt.datetime.now(dt.UTC))).total_seconds())
    if only_relative:
        return rel
    out = t.strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{out} ({rel})" if relative else out


def format_cpus(cpus: Any) -> str:
    """``[0, 1, 2, 3, 8, 10]`` → ``0-3,8,10``."""
    if not isinstance(cpus, list) or not all(isinstance(c, int) for c in cpus):
        return visible(opt(cpus))
    if not cpus:
        return "-"
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = ordered[0]
    for c in ordered[1:]:
        if c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
