"""Tenant-supplied strings made safe to show on an admin's terminal. Pure: no rich, no click.

Labels, keys, tenant and pool names, event details and the ``detail`` of a problem
the daemon echoes back all come, in the end, from whoever holds a key. Shown raw,
``\\x1b]0;…\\x07`` retitles the admin's terminal, ``\\x1b[2J`` clears it, a bidi
override (U+202E) makes ``exe.txt`` read ``txt.exe``, and a newline forges a table
row. :func:`visible` replaces every such character with an escape that shows what
was there::

    >>> visible("\\x1b]0;pwned\\x07")
    '\\\\x1b]0;pwned\\\\x07'
    >>> visible("abc\\u202edef")
    'abc\\\\u202edef'
    >>> visible("crème brûlée 🍮")
    'crème brûlée 🍮'

Made visible: every C0 control (tab and newline too), DEL, every C1 control, the
other invisible format characters (Unicode category Cf: bidi embeddings,
overrides and isolates U+202A–U+202E and U+2066–U+2069, marks, zero-width
space, BOM, tag characters), lone surrogates (which a JSON string may carry and
a terminal encoder would choke on) and the line/paragraph separators. Zero-width
(non-)joiners U+200C/U+200D stay: scripts and emoji need them, and they move nothing.

Rich markup is the other half: :mod:`maasd.cli.maasctl.formatting` only hands
rich ``Text`` objects (never parsed for ``[bold]``-style markup), and the consoles
are built with ``markup=False``.
"""

from __future__ import annotations

import unicodedata

__all__ = ["one_line", "visible"]

#: Categories shown as escapes: controls, invisible format characters, surrogates,
#: line and paragraph separators.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_KEPT = frozenset({"\u200c", "\u200d"})  # zero-width non-joiner / joiner


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(text: str) -> str:
    """``text`` with every control, invisible format character and surrogate escaped."""
    if text.isascii() and text.isprintable():
        return text  # the common case: nothing to do
    return "".join(
        _escape(ch) if ch not in _KEPT and unicodedata.category(ch) in _ESCAPED_CATEGORIES else ch
        for ch in text
    )


def one_line(text: str) -> str:
    """Whitespace runs (newlines too) become one space, then :func:`visible`.

    >>> one_line("acme would use\\n  9 GiB\\x1b[2J")
    'acme would use 9 GiB\\\\x1b[2J'
    """
    return visible(" ".join(str(text).split()))
