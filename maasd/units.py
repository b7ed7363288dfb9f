"""Sizes as people type and read them: one parser, one display. Pure: no I/O, no rich, no click.

Used by ``maasctl`` (every SIZE argument) and by anything else that takes a size
from a person (settings, config files), so a size means the same everywhere.

A SIZE is a whole number of bytes, optionally with a unit::

    >>> parse_size("512MiB")
    536870912
    >>> parse_size("1.5GB")
    1500000000
    >>> parse_size("4096")
    4096

IEC units (``KiB MiB GiB TiB PiB EiB``, also ``Ki`` … ``Ei``) are powers of
1024; SI units (``kB MB GB TB PB EB``) are powers of 1000; ``B`` or nothing means
bytes. Units are case-insensitive. Bare ``K``/``M``/``G``/``T`` are refused as
ambiguous: for a memory daemon, guessing 10^9 where 2^30 was meant would be an
error of 7 %, silently.

Display is always binary (``format_size(3 << 29) == '1.5 GiB'``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from maasd.bounds import MAX_BYTES

__all__ = ["MAX_BYTES", "SizeError", "format_size", "parse_size"]

_IEC = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40, "pi": 1 << 50, "ei": 1 << 60}
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "e": 10**18}

_UNITS: dict[str, int] = {"": 1, "b": 1}
for _p, _m in _IEC.items():
    _UNITS[_p] = _m
    _UNITS[_p + "b"] = _m
for _p, _m in _SI.items():
    _UNITS[_p + "b"] = _m

# ASCII digits only: ``\d`` alone also matches '１２３' or '٣', which a person reading the
# command line does not read as the number the parser would take.
_SIZE_RE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)", re.ASCII)

#: More digits than any size below 2^63 bytes needs, with a fraction (``int()`` refuses
#: a number of thousands of digits with a ValueError of its own, not a SizeError).
_MAX_DIGITS = 64

_DISPLAY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


class SizeError(ValueError):
    """A SIZE that is not a whole, positive, representable number of bytes."""


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """Parse a SIZE (``4096``, ``512MiB``, ``8GiB``, ``1.5GB``) to bytes.

    Raises :class:`SizeError` with a message meant for the user for anything
    else: junk, negative numbers, unknown or ambiguous units, fractions that
    do not land on a whole byte, zero (unless ``allow_zero``) and sizes of
    2^63 bytes or more.
    """
    raw = text
    text = text.strip()
    if not text:
        raise SizeError("empty size; expected bytes or a number with a unit, e.g. 512MiB")
    if text.startswith("-"):
        raise SizeError(f"{raw!r} is negative; a size must be positive")
    if text.startswith("+"):
        text = text[1:]
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise SizeError(
            f"{raw!r} is not a size; expected bytes or a number with a unit "
            "(e.g. 4096, 512MiB, 8GiB, 1.5GB)"
        )
    if len(m["num"]) > _MAX_DIGITS:
        raise SizeError(
            f"{raw[:24]!r}… is not a size: {len(m['num'])} digits, a size has at most {_MAX_DIGITS}"
        )
    unit = m["unit"].lower()
    if unit in _SI:
        u = m["unit"].upper()
        raise SizeError(
            f"{raw!r}: unit {m['unit']!r} is ambiguous; write {u}iB (binary, 1024-based) "
            f"or {u}B (decimal, 1000-based)"
        )
    if unit not in _UNITS:
        raise SizeError(
            f"{raw!r}: unknown unit {m['unit']!r}; use B, KiB, MiB, GiB, TiB, PiB, EiB or kB, MB, GB, TB, PB, EB"
        )
    value = Fraction(m["num"]) * _UNITS[unit]
    if value.denominator != 1:
        raise SizeError(f"{raw!r} is not a whole number of bytes ({float(value):g} B)")
    n = int(value)
    if n == 0 and not allow_zero:
        raise SizeError(f"{raw!r} is zero; a size must be positive")
    if n > MAX_BYTES:
        raise SizeError(f"{raw!r} is too large; sizes must be below 2^63 bytes (8 EiB)")
    return n


def format_size(n: int | float | None) -> str:
    """Bytes in binary units, one decimal unless exact.

    >>> [format_size(x) for x in (0, 512, 4096, 1536, 256 << 20, (3 << 30) // 2)]
    ['0 B', '512 B', '4 KiB', '1.5 KiB', '256 MiB', '1.5 GiB']
    """
    if n is None:
        return "-"
    n = int(n)
    if n < 0:
        return "-" + format_size(-n)
    if n < 1024:
        return f"{n} B"
    i = 0
    while i + 1 < len(_DISPLAY_UNITS) and n >= 1024 ** (i + 1):
        i += 1
    scale = 1024**i
    if n % scale == 0:
        return f"{n // scale} {_DISPLAY_UNITS[i]}"
    value = n / scale
    text = f"{value:.1f}"
    if float(text) >= 1024 and i + 1 < len(_DISPLAY_UNITS):
        # 1023.97 MiB rounds to "1024.0 MiB": say "1.0 GiB" instead.
        return f"{n / (scale * 1024):.1f} {_DISPLAY_UNITS[i + 1]}"
    return f"{text} {_DISPLAY_UNITS[i]}"
