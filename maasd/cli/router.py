"""``maasd router``: an OpenAI-compatible front for unmodified llama-server processes.

See docs/llama-server.md. Registered on ``maasd`` (``maasd router --help``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import click

from maasd.router import DEFAULT_CHUNK, DEFAULT_MIN_SAVE_TOKENS, PUBLISH_TTL_S

DEFAULT_URL = "http://127.0.0.1:7878"
#: The K cache types llama-server's ``-ctk`` knows (``--cache-type-k``).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: The V cache types a backend without flash attention (``-fa off``, what every backend
#: of the router runs) can load: llama.cpp refuses a quantized V cache without it.
V_CACHE_TYPES = ("f32", "f16", "bf16")


def _http_url(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    """An ``http(s)://host[:port]`` URL (each of a repeated option), or a usage error:
    anything else would only fail once the router starts, as a traceback."""
    import httpx

    for url in value if isinstance(value, tuple) else (value,):
        if url is None:
            continue
        try:
            u = httpx.URL(url)
            ok = u.scheme in ("http", "https") and bool(u.host)
            ok = ok and (u.port is None or 0 < u.port < 65536)
        except (httpx.InvalidURL, ValueError, TypeError):
            ok = False
        if not ok:
            raise click.BadParameter(
                f"{url!r} is not an http:// or https:// URL with a host (and a port in 1-65535)"
            )
    return value


_OPTIONS = [
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on."),
    click.option(
        "--port",
        default=8080,
        show_default=True,
        type=click.IntRange(1, 65535),
        help="Port to listen on.",
    ),
    click.option(
        "--maasd-url",
        envvar="MAASD_URL",
        default=DEFAULT_URL,
        show_default=True,
        callback=_http_url,
        help="maasd's REST API (drops entries that fail their checks) [env MAASD_URL].",
    ),
    click.option(
        "--socket",
        "socket_path",
        envvar="MAASD_SOCKET",
        default=None,
        help="maasd's worker socket [env MAASD_SOCKET, default DATA_DIR/maasd.sock].",
    ),
    click.option(
        "--key",
        envvar="MAASD_KEY",
        default=None,
        help="The tenant's API key [env MAASD_KEY]; without it: a plain balancer.",
    ),
    click.option("--pool", default=None, help="Pool (id or name) for published entries."),
    click.option(
        "--backends",
        "spawn",
        default=None,
        type=click.IntRange(1),
        help="Start this many llama-server backends (needs --llama-server, --model); "
        "or attach running ones with --backend.",
    ),
    click.option(
        "--llama-server",
        "llama_server",
        default=None,
        type=click.Path(exists=True, dir_okay=False, executable=True),
        help="The llama-server binary (scripts/llama-server builds one).",
    ),
    click.option(
        "--model",
        default=None,
        type=click.Path(exists=True, dir_okay=False, readable=True),
        help="The GGUF model the backends run.",
    ),
    click.option(
        "--slots",
        default=4,
        show_default=True,
        type=click.IntRange(1),
        help="Slots (-np) of each backend the router starts: one per conversation it "
        "serves at once (one unified KV cache: -c is shared by all of them).",
    ),
    click.option(
        "--backend",
        "attach",
        multiple=True,
        callback=_http_url,
        help="URL of a running llama-server to attach to (repeatable; pair each with --slot-dir).",
    ),
    click.option(
        "--slot-dir",
        "slot_dirs",
        multiple=True,
        help="The --slot-save-path of the --backend in the same position.",
    ),
    click.option(
        "--chunk",
        default=DEFAULT_CHUNK,
        show_default=True,
        type=click.IntRange(1),
        help="Key granularity in tokens (equal on every router and worker that share).",
    ),
    click.option(
        "--min-save-tokens",
        default=DEFAULT_MIN_SAVE_TOKENS,
        show_default=True,
        type=click.IntRange(0),
        help="Shortest prefix worth publishing.",
    ),
    click.option(
        "--ttl",
        "ttl_s",
        default=PUBLISH_TTL_S,
        show_default=True,
        type=click.IntRange(1),
        help="Lease of published entries, seconds (a hit extends it).",
    ),
    click.option(
        "--cache-type-k",
        default=None,
        type=click.Choice(CACHE_TYPES),
        help="K cache type of the backends: those it starts run it (default f16); attached "
        "ones must (default: whatever they run, read from them).",
    ),
    click.option(
        "--cache-type-v",
        default=None,
        type=click.Choice(V_CACHE_TYPES),
        help="V cache type, as --cache-type-k (not quantized: the backends run -fa off).",
    ),
    click.option(
        "--max-waiting",
        default=64,
        show_default=True,
        type=click.IntRange(0),
        help="Requests that may wait for a slot at once; past it a 503 (Retry-After).",
    ),
    click.option(
        "--slot-timeout",
        default=600.0,
        show_default=True,
        type=click.FloatRange(min=0, min_open=True),
        help="Seconds a request waits for a slot before a 503.",
    ),
    click.option(
        "--log-dir",
        default=None,
        type=click.Path(exists=True, file_okay=False, writable=True),
        help="Where the backends' logs go (default: dropped).",
    ),
    click.option(
        "--slot-files",
        type=click.Choice(["link", "copy"]),
        default="link",
        show_default=True,
        help="link: /proc links to router memfds (same uid and PID namespace as the "
        "backends); copy: real files in the slot dirs (a tmpfs both reach).",
    ),
    click.option("--log-level", default="info", show_default=True),
]


def _options(f: Callable[..., None]) -> Callable[..., None]:
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


@click.command(context_settings={"ignore_unknown_options": True})
@_options
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def router(server_args: tuple[str, ...], **o: Any) -> None:
    """Serve the OpenAI API in front of llama-server backends, sharing prefixes through maasd.

    \b
    Extra arguments (after --) go to every backend the router starts, e.g. -c 4096 -t 2;
    those it sets itself (model, slots, cache types, -fa, --kv-unified, …) are refused.
    Example:
      MAASD_KEY=… maasd router --backends 2 --llama-server $(scripts/llama-server) \\
          --model gemma.gguf -- -c 4096 -t 1
    """
    import importlib.util

    import uvicorn

    from maasd.router.app import Router, build_app
    from maasd.serving import keep_on_hangup, make_server

    keep_on_hangup("maasd router")  # dying would leave its llama-server backends running
    if importlib.util.find_spec("xxhash") is None:
        raise click.ClickException(
            "maasd router needs xxhash: install maasd with the `router` extra"
        )

    config = _config(server_args, o)
    logging.basicConfig(
        level=o["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per backend call
    fleet = Router(config)
    app = _one_line_start_failure(build_app(fleet), fleet)
    # The daemon's and the worker's one server and signals (maasd.serving): SIGINT/SIGTERM
    # stop it (the lifespan's shutdown stops the backends) and it exits 0.
    server = make_server(
        uvicorn.Config(app, host=o["host"], port=o["port"], log_level=o["log_level"], lifespan="on")
    )
    try:
        server.run()
    except SystemExit:  # uvicorn's exit(3) when the lifespan's startup failed
        if fleet.start_error:
            raise click.ClickException(f"could not start: {fleet.start_error}") from None
        raise
    if not server.started:
        raise click.ClickException(f"could not listen on {o['host']}:{o['port']}")


def _one_line_start_failure(app: Any, router: Any) -> Any:
    """``app`` as uvicorn runs it, but a failed start is not logged as litestar's whole
    traceback: the reason (``router.start_error``) is the one ``Error:`` line the command
    ends with."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def send_short(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and router.start_error:
                message = {**message, "message": ""}  # uvicorn logs a message it is given
            await send(message)

        await app(scope, receive, send_short)

    return asgi


def _config(server_args: tuple[str, ...], o: dict[str, Any]) -> Any:
    """The router's configuration from its options; UsageError for what can't work."""
    from maasd.llama.worker_config import default_socket
    from maasd.router.app import RouterConfig
    from maasd.router.fleet import FleetConfig

    attach, slot_dirs = o["attach"], o["slot_dirs"]
    if len(attach) != len(slot_dirs):
        raise click.UsageError("each --backend needs its --slot-dir (in the same order)")
    if not o["spawn"] and not attach:
        raise click.UsageError("give --backends N (with --llama-server, --model) or --backend URL")
    if o["spawn"] and attach:
        raise click.UsageError("give --backends N or --backend URL, not both")
    if o["spawn"] and not (o["llama_server"] and o["model"]):
        raise click.UsageError("--backends needs --llama-server and --model")
    for d in slot_dirs:
        if not os.path.isdir(d):
            raise click.UsageError(f"--slot-dir {d}: not a directory")
    from maasd.router.backend import check_server_args

    if server_args and not o["spawn"]:
        raise click.UsageError("arguments after -- are for the backends --backends N starts")
    try:
        check_server_args(server_args)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return RouterConfig(
        fleet=FleetConfig(
            attach=list(zip(attach, slot_dirs, strict=True)),
            spawn=o["spawn"] or 0,
            llama_server=o["llama_server"],
            model=o["model"],
            slots_per_backend=o["slots"],
            server_args=list(server_args),
            log_dir=o["log_dir"],
            type_k=o["cache_type_k"],
            type_v=o["cache_type_v"],
            copy_files=o["slot_files"] == "copy",
            slot_timeout_s=o["slot_timeout"],
            max_waiting=o["max_waiting"],
        ),
        socket_path=(o["socket_path"] or default_socket()) if o["key"] else None,
        maasd_url=o["maasd_url"],
        key=o["key"],
        pool=o["pool"],
        chunk=o["chunk"],
        min_save_tokens=o["min_save_tokens"],
        ttl_s=o["ttl_s"],
        copy_slot_files=o["slot_files"] == "copy",
    )
