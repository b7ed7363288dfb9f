"""``maasd worker``: the command line of :mod:`maasd.llama.worker`, registered on ``maasd``.

Its flags are llama-cpp-python's (``--n_ctx``, ``--n_threads`` …) besides maasd's, so the
arguments go as they are to the worker's own parser (``maasd worker --help`` lists both).
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
    from maasd.llama.worker import main

    sys.exit(main(list(args)))
