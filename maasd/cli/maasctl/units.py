"""SIZE arguments and usage bars for maasctl.

Parsing and display of sizes are :mod:`maasd.units` (the one parser, shared with
anything else a person types a size into); this module adds the click parameter
type and the bars drawn from a fraction of use.
"""

from __future__ import annotations

import math
from typing import Any

import click

from maasd.units import SizeError, format_size, parse_size

__all__ = [
    "FiniteFloatRange",
    "SizeType",
    "bar",
    "format_percent",
    "format_size",
    "parse_size",
    "usage_fraction",
]


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


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` without ``nan`` and ``inf``, which it lets through (``nan``
    compares false to any bound): ``--latency-us nan`` went out as JSON ``null``, a
    reserve with no latency ceiling, and ``--timeout nan`` was an internal error."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def usage_fraction(used: int | float | None, total: int | float | None) -> float:
    """``used / total``, 0 for an empty or unknown total, may exceed 1 (quota lowered below use)."""
    used = used or 0
    if not total or total <= 0:
        return 1.0 if used > 0 else 0.0
    return max(0.0, used / total)


def format_percent(fraction: float) -> str:
    """``0.425`` → ``' 42.5%'``-style text without padding: ``'42.5%'``."""
    return f"{fraction * 100:.1f}%"


_EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, width: int = 20, *, ascii_only: bool = False) -> str:
    """A usage bar of exactly ``width`` cells for ``fraction`` in [0, 1] (clamped).

    Unicode uses eighth blocks for resolution and ``░`` for the empty part;
    ``ascii_only`` draws ``#`` and ``.`` for terminals that cannot show them.
    A non-zero fraction always shows at least a sliver, so that "a little"
    never looks like "nothing".

    >>> bar(0.5, 10)
    '█████░░░░░'
    >>> bar(0.5, 10, ascii_only=True)
    '#####.....'
    """
    if width <= 0:
        return ""
    f = min(1.0, max(0.0, fraction))
    if ascii_only:
        full = round(f * width)
        if f > 0 and full == 0:
            full = 1
        return "#" * full + "." * (width - full)
    eighths = round(f * width * 8)
    if f > 0 and eighths == 0:
        eighths = 1
    full, part = divmod(eighths, 8)
    out = "█" * full
    if part and full < width:
        out += _EIGHTHS[part]
    return out + "░" * (width - len(out))
