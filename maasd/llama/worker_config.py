"""``maasd worker``: an OpenAI-compatible llama.cpp server whose processes share prefixes.

::

    maasd worker --model PATH.gguf [--host 127.0.0.1] [--port 8000] [--processes N]
                 [--maasd-url URL] [--socket PATH] [--key KEY | MAASD_KEY] [--pool NAME]
                 [any llama-cpp-python server/model setting: --n_ctx, --n_threads, …]

The server is llama-cpp-python's own (``llama_cpp.server``: ``/v1/completions``,
``/v1/chat/completions`` with streaming, ``/v1/models``, its request types and errors);
its settings are taken as ``python -m llama_cpp.server`` takes them
(``add_args_from_model``/``parse_model_from_args``), with four defaults changed:

* ``--host 127.0.0.1`` (not ``localhost``), as maasd's REST API;
* ``--interrupt_requests false``: llama-cpp-python's default cuts a stream short as soon as
  another request waits, which also skips saving its state;
* ``--logits_all false``: nothing but ``echo`` with ``logprobs`` reads the prompt's logits,
  and computing them costs a copy of n_vocab floats per prompt token (1 MiB each for
  Gemma 3); ``MaasdCache`` refuses ``logits_all`` models (sharing is off with it);
* ``--verbose false``: llama.cpp's per-request timing lines, not the worker's log.

``--cache`` (llama-cpp-python's own per-process cache) is ignored: maasd is the cache.

This module only reads the command line into a :class:`WorkerConfig`; the command itself
is :mod:`maasd.cli.worker`, which hands the config to the supervisor
(:mod:`maasd.llama.worker_supervisor`), which runs ``--processes`` processes
(:mod:`maasd.llama.worker_process`) on one listening socket.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from typing import Any

from maasd.bounds import DEFAULT_HOST, DEFAULT_URL, worker_socket

__all__ = [
    "WorkerConfig",
    "build_parser",
    "default_socket",
    "max_processes",
    "model_file_problem",
    "parse_args",
    "url_problem",
]


#: llama-cpp-python settings whose default maasd worker changes (see the module docstring)
CHANGED_DEFAULTS: dict[str, Any] = {
    "host": DEFAULT_HOST,
    "interrupt_requests": False,
    "logits_all": False,
    "verbose": False,
}


#: ``--processes`` at most this many per CPU the worker may run on (its affinity mask).
#: Each process is a whole llama.cpp context (its own KV cache and compute buffers, the
#: model's weights shared through the page cache), a connection to maasd and at least one
#: thread that computes: past the CPUs they only take turns on the same cores while each
#: costs its memory, and N = 100000 tried to start that many. Four per CPU leaves room for
#: processes that mostly wait (on a GPU, on their clients).
PROCESSES_PER_CPU = 4


def max_processes() -> int:
    """The most ``--processes`` this worker takes: :data:`PROCESSES_PER_CPU` per CPU it may
    run on."""
    return PROCESSES_PER_CPU * len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class WorkerConfig:
    """A parsed ``maasd worker`` command line."""

    server: dict[str, Any]  # llama_cpp.server.settings.ServerSettings, as JSON
    model: dict[str, Any]  # llama_cpp.server.settings.ModelSettings, as JSON
    processes: int
    maasd_url: str | None
    socket: str
    key: str | None
    pool: str | None
    log_level: str
    graceful_s: int

    @property
    def host(self) -> str:
        return str(self.server["host"])

    @property
    def port(self) -> int:
        return int(self.server["port"])


def default_socket() -> str:
    """``MAASD_SOCKET``, else the daemon's default: ``DATA_DIR/maasd.sock`` (``MAASD_DATA_DIR``,
    else ``/var/lib/maasd`` as root, else ``$XDG_STATE_HOME/maasd`` or ``~/.local/state/maasd``)."""
    return os.environ.get("MAASD_SOCKET") or worker_socket()


def build_parser() -> argparse.ArgumentParser:
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    parser = argparse.ArgumentParser(
        prog="maasd worker",
        description="llama-cpp-python's OpenAI-compatible server, N processes on one port, "
        "sharing prompt prefixes through maasd.",
        epilog="Example: MAASD_KEY=… maasd worker --model gemma.gguf --processes 2 --n_threads 1",
    )
    m = parser.add_argument_group("maasd")
    m.add_argument(
        "--processes",
        type=int,
        default=1,
        help=f"Server processes (default: 1; at most {PROCESSES_PER_CPU} per CPU it may run on).",
    )
    m.add_argument(
        "--maasd-url",
        default=os.environ.get("MAASD_URL", DEFAULT_URL),
        help=f"maasd's REST API [env MAASD_URL, default {DEFAULT_URL}].",
    )
    m.add_argument(
        "--socket",
        default=None,
        help="maasd's worker socket [env MAASD_SOCKET, default DATA_DIR/maasd.sock].",
    )
    m.add_argument("--key", default=None, help="The tenant's API key [env MAASD_KEY].")
    m.add_argument("--pool", default=None, help="Pool (name or id) entries go to.")
    m.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    m.add_argument(
        "--graceful-timeout",
        type=int,
        default=30,
        help="Seconds in-flight requests get to finish after SIGTERM (default: 30).",
    )
    # add_argument is all it calls: a group of the parser will do
    group: Any = parser.add_argument_group("llama-cpp-python settings")
    add_args_from_model(group, Settings)
    for name, value in CHANGED_DEFAULTS.items():
        action = parser._option_string_actions.get(f"--{name}")
        if action is not None and action.help:
            action.help = action.help.split(" (default:")[0] + f" (default here: {value})"
    return parser


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """Parse a ``maasd worker`` command line (argparse exits 2 on a bad one)."""
    from llama_cpp.server.cli import parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from pydantic import ValidationError

    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in CHANGED_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.cache:
        print("maasd worker: --cache ignored: maasd is the prompt cache", file=sys.stderr)
    args.cache = False
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.processes > (most := max_processes()):
        parser.error(
            f"--processes must be at most {most} ({PROCESSES_PER_CPU} per CPU it may run on), "
            f"not {args.processes}"
        )
    if args.graceful_timeout < 0:
        parser.error("--graceful-timeout must be 0 or more")
    if args.maasd_url and (problem := url_problem(args.maasd_url)):
        parser.error(f"--maasd-url {args.maasd_url}: {problem}")
    try:  # (typed as returning the class; it returns an instance)
        server: Any = parse_model_from_args(ServerSettings, args)
        model: Any = parse_model_from_args(ModelSettings, args)
    except ValidationError as exc:
        parser.error(_first_error(exc))
    if not 0 <= server.port <= 65535:
        parser.error(f"--port must be 0-65535, not {server.port}")
    if model.hf_model_repo_id is None:  # else --model names a file of that repo
        problem = model_file_problem(model.model)
        if problem:
            parser.error(problem)
    return WorkerConfig(
        server=server.model_dump(mode="json"),
        model=model.model_dump(mode="json"),
        processes=args.processes,
        maasd_url=args.maasd_url or None,
        socket=args.socket or default_socket(),
        key=args.key or os.environ.get("MAASD_KEY") or None,
        pool=args.pool,
        log_level=args.log_level,
        graceful_s=args.graceful_timeout,
    )


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be maasd's REST API (None: an http(s) URL with a host)."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        return f"not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "not an http:// or https:// URL with a host"
    return None


def model_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be the worker's model (None: a readable GGUF file), so that
    a bad ``--model`` is one line before any process starts rather than a traceback of
    each process's llama.cpp load."""
    try:
        if os.path.isdir(path):
            return f"--model {path}: is a directory, not a GGUF file"
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
            return f"--model {path}: not a regular file"
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"--model {path}: cannot read it: {exc.strerror or exc}"
    if magic != b"GGUF":
        return f"--model {path}: not a GGUF file"
    return None


def _first_error(exc: Any) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "settings"
    if err.get("type") == "missing":
        return f"--{where} is required"
    return f"--{where}: {err.get('msg')}"
