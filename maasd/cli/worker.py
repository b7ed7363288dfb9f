"""``maasd worker``: llama-cpp-python's OpenAI server in N processes sharing prefixes.

Registered on ``maasd``. Its flags are llama-cpp-python's (``--n_ctx``, ``--n_threads`` …)
besides maasd's, so the arguments go as they are to the worker's own parser
(:func:`maasd.llama.worker_config.parse_args`; ``maasd worker --help`` lists both), and the
config it reads goes to the supervisor (:mod:`maasd.llama.worker_supervisor`).
"""

from __future__ import annotations

import importlib.util
import sys

import click


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def worker(args: tuple[str, ...]) -> None:
    """Serve a llama.cpp model (OpenAI API), sharing prompt prefixes through maasd.

    \b
    Example:
      MAASD_KEY=… maasd worker --model model.gguf --processes 2
    See `maasd worker --help` for every flag.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        raise click.ClickException(
            "maasd worker needs llama-cpp-python: install maasd with the `llama` extra"
        )
    sys.exit(main(list(args)))


def main(argv: list[str] | None = None) -> int:
    """Run ``maasd worker`` → its exit code (0 after SIGTERM/SIGINT). Needs the llama extra."""
    from maasd.llama.worker_config import parse_args
    from maasd.llama.worker_supervisor import Supervisor
    from maasd.serving import keep_on_hangup

    keep_on_hangup("maasd worker")  # its processes would stop with it (PR_SET_PDEATHSIG)
    return Supervisor(parse_args(argv)).run()
