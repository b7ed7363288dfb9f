"""What ``maasd serve`` does not import: the start cost a test suite (and a restart) pays
hundreds of times. ``maasd doctor``, ``router`` and ``worker`` are imported only when
asked for (numpy, httpx, the client); litestar's pydantic plugins are not registered;
the latency probe's answer is decoded without the probe's numpy."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import click
import pytest
from click.testing import CliRunner

from maasd.api.app import _pydantic_unseen
from maasd.cli.daemon import LazyGroup, cli

HEAVY = ("numpy", "httpx", "pydantic", "maasd.client", "maasd.cli.router", "maasd.cli.doctor")


def _imported_after(code: str) -> set[str]:
    """The names of ``HEAVY`` in ``sys.modules`` of a fresh interpreter after ``code``."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import sys
        print(" ".join(m for m in {HEAVY!r} if m in sys.modules))
        """)
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def test_the_serve_path_imports_no_numpy_httpx_or_pydantic() -> None:
    # What ``maasd serve`` imports before it listens: the CLI, the core, the API (with the
    # app built, litestar's plugins chosen), the broker, the latency probe's reader.
    heavy = _imported_after("""
        import maasd.cli.daemon, maasd.core, maasd.core.latency, maasd.broker
        import maasd.api.app
        from maasd.api.app import _pydantic_unseen
        from litestar import Litestar
        with _pydantic_unseen():
            Litestar(route_handlers=[])
        """)
    assert heavy == set()


def test_the_lazy_subcommands_are_listed_and_load_when_asked() -> None:
    runner = CliRunner()
    listing = runner.invoke(cli, ["--help"])
    assert listing.exit_code == 0, listing.output
    for name in ("serve", "migrate", "info", "doctor", "router", "worker"):
        assert f"  {name} " in listing.output
    for name in ("doctor", "router", "worker"):
        shown = runner.invoke(cli, [name, "--help"])
        assert shown.exit_code == 0, shown.output
        assert f"maasd {name}" in shown.output  # worker's help is argparse's (llama's)


def test_an_unknown_subcommand_is_still_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["serveX"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_a_lazy_name_that_is_no_command_is_refused() -> None:
    group = LazyGroup(name="g", lazy={"bad": "maasd.units:parse_size"})
    with pytest.raises(TypeError, match="not a click command"):
        group.get_command(click.Context(group), "bad")


@pytest.mark.parametrize("preloaded", [False, True])
def test_pydantic_unseen_puts_back_what_was_there(
    monkeypatch: pytest.MonkeyPatch, preloaded: bool
) -> None:
    sentinel = object()
    if preloaded:
        monkeypatch.setitem(sys.modules, "pydantic", sentinel)
    else:
        monkeypatch.delitem(sys.modules, "pydantic", raising=False)
    with _pydantic_unseen(), pytest.raises(ImportError):
        import pydantic  # noqa: F401
    if preloaded:
        assert sys.modules["pydantic"] is sentinel
    else:
        assert "pydantic" not in sys.modules


def test_litestar_builds_no_pydantic_plugin_and_its_plugin_imports_whole_after() -> None:
    lines = _lines_after("""
        from litestar import Litestar
        from maasd.api.app import _pydantic_unseen
        with _pydantic_unseen():
            app = Litestar(route_handlers=[])
        print(sorted(type(p).__name__ for p in app.plugins))
        import litestar.plugins.pydantic as p
        print(p.PydanticPlugin.__name__)
        """)
    assert "Pydantic" not in lines[0]
    assert lines[1] == "PydanticPlugin"


def _lines_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.splitlines()
