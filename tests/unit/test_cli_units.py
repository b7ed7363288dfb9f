"""Pure parts of maasctl: SIZE parsing and display, bars, metrics, error lines."""

from __future__ import annotations

import io

import httpx
import pytest
from click.testing import CliRunner
from rich.console import Console

from maasd.cli.maasctl import cli
from maasd.cli.maasctl.errors import ApiError, CliError, from_client_error
from maasd.cli.maasctl.formatting import format_cpus, format_time, usage_bar
from maasd.cli.maasctl.text import one_line, visible
from maasd.cli.maasctl.top import KeyReader, parse_metrics, rates, sparkline
from maasd.cli.maasctl.units import bar, usage_fraction
from maasd.client import (
    Buffer,
    Client,
    Event,
    KeyInfo,
    MaasdClientError,
    NewTenant,
    Pool,
    Tenant,
)
from maasd.units import MAX_BYTES, SizeError, format_size, parse_size

# -- parse_size ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1", 1),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 << 29),
        ("2KiB", 2048),
        ("2kB", 2000),
        ("2KB", 2000),
        ("3MB", 3_000_000),
        ("1TiB", 1 << 40),
        ("1TB", 10**12),
        ("1PiB", 1 << 50),
        ("1EiB", 1 << 60),
        ("9EB", 9 * 10**18),
        ("64Mi", 64 << 20),
        ("64 MiB", 64 << 20),
        ("  64mib ", 64 << 20),
        ("100B", 100),
        ("100b", 100),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("2.KiB", 2048),
        ("+7", 7),
        ("0.25MB", 250_000),
        (str(MAX_BYTES), MAX_BYTES),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-1", "negative"),
        ("-5GiB", "negative"),
        ("0", "zero"),
        ("0GiB", "zero"),
        ("12XB", "unknown unit"),
        ("12 bananas", "unknown unit"),
        ("abc", "not a size"),
        ("1.2.3", "not a size"),
        ("1e9", "not a size"),
        ("0x10", "not a size"),
        ("1,000", "not a size"),
        ("1_000", "not a size"),
        ("GiB", "not a size"),
        ("1.5", "whole number of bytes"),
        ("0.1KiB", "whole number of bytes"),
        ("1.0000001MB", "whole number of bytes"),
        ("8G", "ambiguous"),
        ("8g", "ambiguous"),
        ("512M", "ambiguous"),
        ("4k", "ambiguous"),
        ("1T", "ambiguous"),
        ("8EiB", "too large"),
        ("9.3EB", "too large"),
        ("8ZiB", "unknown unit"),
        (str(MAX_BYTES + 1), "too large"),
        ("9000PiB", "too large"),
        ("nan", "not a size"),
        ("inf", "not a size"),
        # digits a reader does not read as the number (\\d matches them without re.ASCII)
        ("\uff11\uff12\uff13", "not a size"),
        ("\u0663GiB", "not a size"),
        ("8\u00a0GiB", "not a size"),
        # int() refuses 4301 digits with a ValueError of its own (a traceback in maasctl)
        ("1" * 5000, "digits"),
        ("1." + "0" * 5000 + "GB", "digits"),
    ],
)
def test_parse_size_refuses(text: str, fragment: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_parse_size_zero_when_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0
    assert parse_size("0MiB", allow_zero=True) == 0
    with pytest.raises(SizeError):
        parse_size("-0.5", allow_zero=True)


def test_parse_size_is_a_value_error() -> None:
    assert issubclass(SizeError, ValueError)


# -- format_size -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (4096, "4 KiB"),
        (256 << 20, "256 MiB"),
        (3 << 29, "1.5 GiB"),
        (8 << 30, "8 GiB"),
        (1 << 40, "1 TiB"),
        (1_500_000_000, "1.4 GiB"),
        ((1 << 30) - 1, "1.0 GiB"),  # not "1024.0 MiB"
        (None, "-"),
        (-2048, "-2 KiB"),
    ],
)
def test_format_size(n: int | None, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [1, 4096, 512 << 20, 8 << 30, 3 << 40])
def test_format_then_parse_round_trips_exact_sizes(n: int) -> None:
    assert parse_size(format_size(n).replace(" ", "")) == n


# -- bars -----------------------------------------------------------------------------------


def test_bar_width_is_exact() -> None:
    for f in (0, 0.001, 0.1, 0.33, 0.5, 0.999, 1, 1.7, -1):
        for w in (1, 7, 10, 24):
            assert len(bar(f, w)) == w
            assert len(bar(f, w, ascii_only=True)) == w


def test_bar_levels() -> None:
    assert bar(0, 10) == "░" * 10
    assert bar(1, 10) == "█" * 10
    assert bar(0.5, 10) == "█████░░░░░"
    assert bar(2.0, 10) == "█" * 10  # over quota: clamped, the percentage says the rest
    assert bar(0.5, 10, ascii_only=True) == "#####....."
    assert bar(0.5, 0) == ""


def test_bar_tiny_use_is_visible() -> None:
    assert bar(1e-9, 10) != "░" * 10
    assert bar(1e-9, 10, ascii_only=True).startswith("#")


def test_usage_fraction() -> None:
    assert usage_fraction(0, 100) == 0
    assert usage_fraction(50, 100) == 0.5
    assert usage_fraction(150, 100) == 1.5
    assert usage_fraction(0, 0) == 0
    assert usage_fraction(10, 0) == 1.0  # quota 0 with use: full
    assert usage_fraction(None, None) == 0


# -- formatting helpers ---------------------------------------------------------------------


def test_format_cpus() -> None:
    assert format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpus([5]) == "5"
    assert format_cpus([]) == "-"
    assert format_cpus("0-3") == "0-3"


def test_format_time() -> None:
    assert format_time("2025-01-02T03:04:05.123456Z") == "2025-01-02 03:04:05Z"
    assert format_time(None) == "-"
    assert format_time("not a time") == "not a time"


# -- metrics (top) ---------------------------------------------------------------------------

METRICS = """\
# HELP maasd_pool_capacity_bytes Pool capacity.
# TYPE maasd_pool_capacity_bytes gauge
maasd_pool_capacity_bytes{pool="node0"} 2.68435456e+08
# HELP maasd_pool_used_bytes Pool use.
# TYPE maasd_pool_used_bytes gauge
maasd_pool_used_bytes{pool="node0"} 1.048576e+06
# HELP maasd_tenant_used_bytes Tenant use.
# TYPE maasd_tenant_used_bytes gauge
maasd_tenant_used_bytes{tenant="acme"} 1.048576e+06
maasd_tenant_used_bytes{name="beta",tenant="t-2"} 2048.0
# HELP maasd_tenant_quota_bytes Tenant quota.
# TYPE maasd_tenant_quota_bytes gauge
maasd_tenant_quota_bytes{name="beta",tenant="t-2"} 4096.0
# HELP maasd_pool_buffers Buffers.
# TYPE maasd_pool_buffers gauge
maasd_pool_buffers{node="0",pool="node0"} 1.0
# HELP maasd_reserve_total Reserves.
# TYPE maasd_reserve_total counter
maasd_reserve_total{outcome="ok"} 10.0
maasd_reserve_total{outcome="quota"} 2.0
maasd_reserve_created{outcome="ok"} 1.7e9
# HELP maasd_release_total Releases.
# TYPE maasd_release_total counter
maasd_release_total{reason="tenant"} 4.0
# HELP maasd_attached_handles Handles.
# TYPE maasd_attached_handles gauge
maasd_attached_handles{tenant="acme"} 3.0
"""


def test_parse_metrics() -> None:
    s = parse_metrics(METRICS, at=1.0)
    assert s.pool_capacity == {"node0": 256 << 20}
    assert s.pool_used == {"node0": 1 << 20}
    assert s.tenant_used == {"acme": 1 << 20, "t-2": 2048}
    assert s.tenant_quota == {"t-2": 4096}
    assert s.tenant_names == {"t-2": "beta"}
    assert s.pool_buffers == {"node0": 1}
    assert s.reserves == {"ok": 10, "quota": 2}
    assert s.releases == {"tenant": 4}
    assert s.attached == {"acme": 3}


def test_rates() -> None:
    a = parse_metrics(METRICS, at=1.0)
    b = parse_metrics(METRICS.replace('"ok"} 10.0', '"ok"} 30.0'), at=3.0)
    assert rates(None, b, "reserves") == {"ok": 0.0, "quota": 0.0}
    assert rates(a, b, "reserves") == {"ok": 10.0, "quota": 0.0}
    # a daemon restart resets counters: never a negative rate
    assert (
        rates(b, parse_metrics(METRICS.replace('"ok"} 10.0', '"ok"} 1.0'), at=4.0), "reserves")[
            "ok"
        ]
        == 0.0
    )


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0, 0]) == "▁▁"
    line = sparkline([0, 1, 2, 4, 8])
    assert line[0] == "▁"
    assert line[-1] == "█"
    assert len(line) == 5
    assert len(sparkline([1.0] * 100, width=30)) == 30


# -- problem details → one line --------------------------------------------------------------


def _response(status: int, body: bytes, ctype: str = "application/problem+json") -> httpx.Response:
    return httpx.Response(status, content=body, headers={"content-type": ctype})


def _problem(response: httpx.Response) -> CliError:
    """The line maasctl shows when the daemon answers ``response`` (through the client)."""
    transport = httpx.MockTransport(lambda _request: response)
    with Client("http://maasd.test", "k", transport=transport) as client:
        with pytest.raises(MaasdClientError) as info:
            client.pools()
        return from_client_error(info.value, client.base_url)


def test_problem_details_become_one_line() -> None:
    err = _problem(
        _response(
            409,
            b'{"type":"https://maasd.dev/problems/quota-exceeded","title":"Quota exceeded",'
            b'"status":409,"detail":"acme would use\\n 9 GiB of 8 GiB"}',
        )
    )
    assert isinstance(err, ApiError)
    assert err.status == 409
    assert err.type.endswith("quota-exceeded")
    assert err.line() == "Quota exceeded [409]: acme would use 9 GiB of 8 GiB"


def test_problem_without_json_body() -> None:
    err = _problem(_response(502, b"<html>bad gateway</html>", "text/html"))
    assert err.line().startswith("Bad Gateway [502]: <html>")
    assert _problem(_response(404, b"")).line() == "Not Found [404]"


def test_unauthorized_has_a_hint() -> None:
    err = _problem(_response(401, b'{"title":"Unauthorized","status":401,"detail":"unknown key"}'))
    assert "MAASD_ADMIN_KEY" in err.line()


def test_cli_error_show(capsys: pytest.CaptureFixture[str]) -> None:
    CliError("title", "detail", hint="hint").show()
    assert capsys.readouterr().err == "maasctl: error: title: detail (hint)\n"


# -- the command line without a daemon -----------------------------------------------------------


def test_bad_size_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli, ["--key", "k", "tenants", "create", "a", "--quota", "12XB"])
    assert r.exit_code == 2
    assert "unknown unit" in r.output
    assert "Traceback" not in r.output


def test_missing_key_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAASD_ADMIN_KEY", raising=False)
    monkeypatch.delenv("MAASD_KEY", raising=False)
    r = CliRunner().invoke(cli, ["tenants", "list"])
    assert r.exit_code == 2
    assert "no API key" in r.output


def test_connection_refused_reads_well() -> None:
    r = CliRunner().invoke(cli, ["--url", "http://127.0.0.1:9", "--key", "k", "pools", "list"])
    assert r.exit_code == 3
    assert "cannot reach maasd at http://127.0.0.1:9: connection refused" in r.output


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["status"],
        ["usage"],
        ["topology"],
        ["top"],
        ["pools"],
        ["pools", "list"],
        ["pools", "show"],
        ["pools", "create"],
        ["pools", "delete"],
        ["tenants"],
        ["tenants", "list"],
        ["tenants", "create"],
        ["tenants", "show"],
        ["tenants", "set-quota"],
        ["tenants", "delete"],
        ["keys"],
        ["keys", "issue"],
        ["keys", "revoke"],
        ["buffers"],
        ["buffers", "list"],
        ["buffers", "show"],
        ["buffers", "release"],
    ],
)
def test_every_command_has_help_with_an_example(args: list[str]) -> None:
    r = CliRunner().invoke(cli, [*args, "--help"])
    assert r.exit_code == 0, r.output
    assert "Example" in r.output
    assert "maasctl" in r.output.split("Example", 1)[1]


# -- the terminal is restored -----------------------------------------------------------------------


def test_key_reader_cbreak_and_restore() -> None:
    import os
    import termios

    master, slave = os.openpty()
    try:
        before = termios.tcgetattr(slave)
        assert before[3] & termios.ICANON
        with os.fdopen(os.dup(slave), "rb", buffering=0) as stream:
            with KeyReader(stream) as keys:
                assert keys.fd is not None
                assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak
                assert keys.wait(0.01) == ""  # nothing typed: returns, does not block
                os.write(master, b"q")
                assert keys.wait(1.0) == "q"  # one key, no Enter needed
            assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)


def test_key_reader_without_a_terminal_only_sleeps() -> None:
    import io

    with KeyReader(io.StringIO()) as keys:
        assert keys.fd is None
        assert keys.wait(0.01) == ""


def test_shell_completion_script() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, _MAASCTL_COMPLETE="bash_source")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    r = subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0
    assert "_maasctl_completion" in r.stdout


def test_pool_exhausted_reads_well() -> None:
    err = _problem(
        _response(
            507,
            b'{"type":"https://maasd.dev/problems/pool-exhausted","title":"Pool exhausted",'
            b'"status":507,"detail":"pool node0 has 1 MiB free, 4 MiB asked"}',
        )
    )
    assert err.line() == "Pool exhausted [507]: pool node0 has 1 MiB free, 4 MiB asked"
    assert err.exit_code == 1


def test_a_daemon_that_never_answers_times_out() -> None:
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)  # accepts connections in the backlog, never answers
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        r = CliRunner().invoke(cli, ["--url", url, "--key", "k", "--timeout", "0.3", "status"])
    assert r.exit_code == 3
    assert "timed out after 0.3s" in r.output


def test_usage_bar_text() -> None:
    assert usage_bar(1, 4, 4).plain == "█░░░  25.0%"
    assert usage_bar(8, 4, 4).plain == "████ 200.0%"
    assert usage_bar(8, 0, 4).plain == "████   over"
    assert usage_bar(0, 0, 4).plain == "░░░░   0.0%"


# -- tenant strings are text, never markup or control sequences ----------------------------------

HOSTILE = [
    "[/]",
    "[bold red]admin",
    "\x1b]0;pwned\x07",
    "\x1b[2J",
    "\u202eevil\u202c.exe",
    "\u2066iso\u2069",
    "a\nb\tc\rd",
    "\x00\x7f\x85\x9b",
    ":smile: [link=http://x]y[/link]",
    "\ud800lone",
    "\ufeffbom\u200bzw",
]

#: What must never reach the terminal raw: C0 (but the line feeds of the layout), DEL,
#: C1, bidi controls, lone surrogates, BOM / zero-width space.
FORBIDDEN = [chr(c) for c in [*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0)]] + [
    "\u202a",
    "\u202b",
    "\u202c",
    "\u202d",
    "\u202e",
    "\u2066",
    "\u2067",
    "\u2068",
    "\u2069",
    "\ud800",
    "\ufeff",
    "\u200b",
]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain label", "plain label"),
        ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
        ("\x1b[2J", "\\x1b[2J"),
        ("a\u202eb", "a\\u202eb"),
        ("\u2066x\u2069", "\\u2066x\\u2069"),
        ("tab\tnl\n", "tab\\x09nl\\x0a"),
        ("\x7f\x80\x9f", "\\x7f\\x80\\x9f"),
        ("\ud800", "\\ud800"),
        ("\U000e0041", "\\U000e0041"),  # a tag character: invisible
        ("crème 🍮 👩\u200d👩", "crème 🍮 👩\u200d👩"),  # joiners stay
        ("[bold]x[/]", "[bold]x[/]"),  # not the business of visible(): rich Text shows it as is
    ],
)
def test_visible(raw: str, shown: str) -> None:
    assert visible(raw) == shown
    assert visible(visible(raw)) == visible(raw)


def test_one_line() -> None:
    assert one_line("a\n  b\x1b[2J") == "a b\\x1b[2J"


def _render(renderable: object, *, terminal: bool) -> str:
    """Render on a console with rich's defaults (markup and emoji on): the views must be
    safe by themselves, not only on maasctl's own consoles (which turn both off)."""
    out = io.StringIO()
    con = Console(
        file=out, width=400, force_terminal=terminal, color_system="truecolor" if terminal else None
    )
    con.print(renderable)
    return out.getvalue()


def _hostile_records() -> dict[str, object]:
    """Every human view of maasctl, fed hostile strings wherever the daemon sends a string."""
    from maasd.cli.maasctl.buffers import buffer_detail, buffers_table
    from maasd.cli.maasctl.events import events_table
    from maasd.cli.maasctl.keys import key_issued
    from maasd.cli.maasctl.pools import pools_table
    from maasd.cli.maasctl.status import status_view
    from maasd.cli.maasctl.tenants import tenant_created, tenant_detail, tenants_table

    views: dict[str, object] = {}
    for i, h in enumerate(HOSTILE):
        pool = Pool(
            id=h, name=h, numa_node=0, backing=h, persistence=h, latency_us=1,
            capacity_bytes=1, used_bytes=0, free_bytes=1, page_bytes=4096, scrub=h,
        )  # fmt: skip
        tenant = Tenant(id=h, name=h, quota_bytes=1, used_bytes=0, buffers=0, created_at=h)
        buf = Buffer(
            id=h, tenant_id=h, pool_id=h, size_bytes=1, numa_node=0, persistence=h,
            label=h, key=h, state=h, created_at=h, expires_at=h, checksum=h,
        )  # fmt: skip
        event = Event(id=1, at=h, kind=h, tenant_id=h, buffer_id=h, pool_id=h, detail=h)
        views[f"pools-{i}"] = pools_table([pool])
        views[f"tenants-{i}"] = tenants_table([tenant])
        views[f"tenant-{i}"] = tenant_detail(tenant)
        views[f"created-{i}"] = tenant_created(
            NewTenant(id=h, name=h, quota_bytes=1, api_key=h, key_id=h)
        )
        views[f"key-{i}"] = key_issued(tenant, KeyInfo(id=h, api_key=h, created_at=h))
        views[f"buffers-{i}"] = buffers_table([buf], tenant_names={h: h}, pool_names={h: h})
        views[f"buffer-{i}"] = buffer_detail(buf, tenant_name=h, pool_name=h)
        views[f"events-{i}"] = events_table([event], tenant_names={h: h})
        views[f"status-{i}"] = status_view([pool], [tenant])
    return views


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_hostile_strings_render_as_text(terminal: bool) -> None:
    import re

    for name, view in _hostile_records().items():
        out = _render(view, terminal=terminal)
        if terminal:
            out = re.sub("\x1b\\[[0-9;]*m", "", out)  # rich's own styling (SGR), nothing else
        for ch in FORBIDDEN:
            assert ch not in out, (name, ch, out)
    # and the literal text is what shows
    pools = _render(_hostile_records()["buffer-1"], terminal=False)
    assert "[bold red]admin" in pools
    assert "\\x1b]0;pwned\\x07" in _render(_hostile_records()["buffer-2"], terminal=False)
    assert "[/]" in _render(_hostile_records()["buffers-0"], terminal=False)


def test_maasctl_consoles_never_parse_markup() -> None:
    from maasd.cli.maasctl.context import console

    for con in (console(), console(stderr=True)):
        assert not con._markup
        assert not con._emoji


def test_problem_details_reach_stderr_visible() -> None:
    err = _problem(
        _response(
            409,
            b'{"title":"Duplicate \\u001b[2Jkey","status":409,'
            b'"detail":"a buffer with key \\u001b]0;pwned\\u0007 \\u202eexists"}',
        )
    )
    assert "\x1b" not in err.line()
    assert "\x07" not in err.line()
    assert "\u202e" not in err.line()
    assert err.line() == (
        "Duplicate \\x1b[2Jkey [409]: a buffer with key \\x1b]0;pwned\\x07 \\u202eexists"
    )


def test_json_output_escapes_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints json.dumps of the daemon's answer, which escapes every control and
    non-ASCII character: nothing raw reaches the terminal there either."""
    import json

    from maasd.cli.maasctl.context import Ctx, console

    Ctx(url="u", key="k", as_json=True, timeout=1, out=console()).emit(
        {"label": HOSTILE}, lambda: None
    )
    out = capsys.readouterr().out
    for ch in FORBIDDEN:
        assert ch not in out
    assert "\\u001b]0;pwned\\u0007" in out
    assert json.loads(out) == {"label": HOSTILE}


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "Infinity", "1e999"])
def test_a_float_option_refuses_nan_and_infinity(text: str) -> None:
    """click.FloatRange lets nan through any bound; JSON sends it as null (no ceiling)."""
    import click

    from maasd.cli.maasctl.units import FiniteFloatRange

    with pytest.raises(click.BadParameter, match="not a finite number"):
        FiniteFloatRange(min=0).convert(text, None, None)
    assert FiniteFloatRange(min=0).convert("2.5", None, None) == 2.5
