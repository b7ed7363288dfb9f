"""What every check of ``maasd doctor`` answers: a :class:`Check` (its name, a status, what
it saw, and the fix). The check families (``doctor_kernel``, ``doctor_memory``,
``doctor_limits``, ``doctor_host``, ``doctor_ledger``, ``doctor_llama``) return these;
:mod:`maasd.cli.doctor` runs them in order and prints them."""

from __future__ import annotations

import errno
from typing import Literal

import msgspec

from maasd.errors import BackingError

__all__ = ["Check", "Status", "why"]

#: ``ok``; ``warn`` (works, but look); ``fail`` (the daemon will not work as configured:
#: exit 1); ``skip`` (does not apply here, or ``--skip``).
Status = Literal["ok", "warn", "fail", "skip"]


class Check(msgspec.Struct, frozen=True):
    """One line of the report."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def why(e: OSError | BackingError) -> str:
    """A kernel refusal in a line: ``[EPERM] Operation not permitted`` (its errno's name,
    then the message), for an ``OSError`` or the allocator's :class:`BackingError`."""
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    if isinstance(e, BackingError):
        return f"[{code}] {e.detail}"
    return f"[{code}] {e.strerror or e}"
