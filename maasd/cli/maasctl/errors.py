"""How maasctl fails: one line on stderr, an exit code, never a traceback.

Every failure becomes a :class:`CliError` — a ``click.ClickException`` whose
``show()`` prints ``maasctl: error: <title>: <detail> (<hint>)`` — either raised
by a command itself or translated by :func:`from_client_error` from what
:mod:`maasd.client` raised. The text is made one line and visible
(:func:`~maasd.cli.maasctl.text.one_line`): a problem's ``detail`` may echo a
tenant's label or key, and must not reach the terminal as control sequences.

Exit codes: 0 success, 1 the daemon refused the request (or NAME|ID matched
nothing), 2 bad usage (unknown option, bad SIZE, missing key, an impossible
NAME|ID), 3 the daemon could not be reached.
"""

from __future__ import annotations

import sys
from typing import IO, Any

import click

from maasd.cli.maasctl.text import one_line
from maasd.client import ConnectionFailed, InvalidReference, MaasdClientError, ProtocolError

__all__ = [
    "EXIT_API",
    "EXIT_CONNECTION",
    "EXIT_USAGE",
    "ApiError",
    "CliError",
    "Unreachable",
    "UsageProblem",
    "from_client_error",
]

EXIT_API = 1
EXIT_USAGE = 2
EXIT_CONNECTION = 3

#: A hint added to an API error of this status, whatever the command.
_HINTS = {
    401: "check --key or MAASD_ADMIN_KEY; tenant commands use MAASD_KEY",
}


class CliError(click.ClickException):
    """A failure to show as one line on stderr, then exit non-zero (1 unless a subclass says)."""

    exit_code = EXIT_API

    def __init__(self, title: str, detail: str = "", *, hint: str = "") -> None:
        self.title = one_line(title)
        self.detail = one_line(detail)
        self.hint = one_line(hint)
        super().__init__(self.line())

    def line(self) -> str:
        out = self.title
        if self.detail and self.detail != self.title:
            out += f": {self.detail}"
        if self.hint:
            out += f" ({self.hint})"
        return out

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"maasctl: error: {self.line()}", file=file if file is not None else sys.stderr)


class ApiError(CliError):
    """The daemon answered with an error status; ``status`` and ``type`` are its problem's."""

    def __init__(
        self, status: int, title: str, detail: str = "", *, type_: str = "", hint: str = ""
    ) -> None:
        self.status = status
        self.type = type_
        super().__init__(f"{title} [{status}]", detail, hint=hint)


class UsageProblem(CliError):
    """Bad usage that click could not see: no key, an id that cannot be one (exit 2)."""

    exit_code = EXIT_USAGE


class Unreachable(CliError):
    """The daemon could not be reached: refused, unknown host, timeout, bad URL (exit 3)."""

    exit_code = EXIT_CONNECTION


def _connect_reason(text: str) -> str:
    low = text.lower()
    if "connection refused" in low or "errno 111" in low:
        return "connection refused"
    if "name or service not known" in low or "nodename nor servname" in low:
        return "unknown host"
    return text


def from_client_error(exc: MaasdClientError | InvalidReference, url: str) -> CliError:
    """The one-line error for what the client raised while talking to ``url``."""
    if isinstance(exc, InvalidReference):
        return UsageProblem("invalid NAME|ID", str(exc))
    if isinstance(exc, ConnectionFailed):
        if exc.timed_out:
            return Unreachable(
                f"no answer from {url}", exc.detail, hint="is maasd overloaded? raise --timeout"
            )
        return Unreachable(
            f"cannot reach maasd at {url}",
            _connect_reason(exc.detail),
            hint="is the daemon running? set --url or MAASD_URL",
        )
    if isinstance(exc, ProtocolError):
        return CliError("unexpected answer from maasd", exc.detail)
    return ApiError(
        exc.status, exc.title, exc.detail, type_=exc.type, hint=_HINTS.get(exc.status, "")
    )
