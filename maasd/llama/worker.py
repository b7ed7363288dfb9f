"""``maasd worker``'s command line, under its first module name.

The command line is read by :mod:`maasd.llama.worker_config`; the command is
:mod:`maasd.cli.worker`. These names stay importable from here.
"""

from maasd.llama.worker_config import (
    CHANGED_DEFAULTS,
    DEFAULT_HOST,
    WorkerConfig,
    build_parser,
    default_socket,
    parse_args,
)

__all__ = [
    "CHANGED_DEFAULTS",
    "DEFAULT_HOST",
    "WorkerConfig",
    "build_parser",
    "default_socket",
    "parse_args",
]
