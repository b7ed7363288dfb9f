"""``maasd router``: an OpenAI-compatible front for unmodified llama-server processes.

See docs/llama-server.md. Registered on ``maasd`` (``maasd router --help``).
"""

from __future__ import annotations

import logging
import os

import click

DEFAULT_URL = "http://127.0.0.1:7878"


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port to listen on.")
@click.option(
    "--maasd-url",
    envvar="MAASD_URL",
    default=DEFAULT_URL,
    show_default=True,
    help="maasd's REST API (drops entries that fail their checks) [env MAASD_URL].",
)
@click.option(
    "--socket",
    "socket_path",
    envvar="MAASD_SOCKET",
    default=None,
    help="maasd's worker socket [env MAASD_SOCKET, default DATA_DIR/maasd.sock].",
)
@click.option(
    "--key",
    envvar="MAASD_KEY",
    default=None,
    help="The tenant's API key [env MAASD_KEY]; without it: a plain balancer.",
)
@click.option("--pool", default=None, help="Pool (id or name) for published entries.")
@click.option(
    "--backends",
    "spawn",
    default=0,
    type=int,
    help="Start this many llama-server backends (needs --llama-server, --model).",
)
@click.option(
    "--llama-server",
    "llama_server",
    default=None,
    help="The llama-server binary (scripts/llama-server builds one).",
)
@click.option("--model", default=None, help="The GGUF model the backends run.")
@click.option(
    "--slots",
    default=1,
    show_default=True,
    type=int,
    help="Slots (-np) of each backend the router starts.",
)
@click.option(
    "--backend",
    "attach",
    multiple=True,
    help="URL of a running llama-server to attach to (repeatable; pair each with --slot-dir).",
)
@click.option(
    "--slot-dir",
    "slot_dirs",
    multiple=True,
    help="The --slot-save-path of the --backend in the same position.",
)
@click.option(
    "--chunk",
    default=64,
    show_default=True,
    type=int,
    help="Key granularity in tokens (equal on every router and worker that share).",
)
@click.option(
    "--min-save-tokens",
    default=128,
    show_default=True,
    type=int,
    help="Shortest prefix worth publishing.",
)
@click.option(
    "--ttl",
    "ttl_s",
    default=3600,
    show_default=True,
    type=int,
    help="Lease of published entries, seconds (a hit extends it).",
)
@click.option(
    "--cache-type-k", default="f16", show_default=True, help="K cache type of the backends."
)
@click.option(
    "--cache-type-v", default="f16", show_default=True, help="V cache type of the backends."
)
@click.option("--log-dir", default=None, help="Where the backends' logs go (default: dropped).")
@click.option("--log-level", default="info", show_default=True)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def router(
    host: str,
    port: int,
    maasd_url: str,
    socket_path: str | None,
    key: str | None,
    pool: str | None,
    spawn: int,
    llama_server: str | None,
    model: str | None,
    slots: int,
    attach: tuple[str, ...],
    slot_dirs: tuple[str, ...],
    chunk: int,
    min_save_tokens: int,
    ttl_s: int,
    cache_type_k: str,
    cache_type_v: str,
    log_dir: str | None,
    log_level: str,
    server_args: tuple[str, ...],
) -> None:
    """Serve the OpenAI API in front of llama-server backends, sharing prefixes through maasd.

    \b
    Extra arguments (after --) go to every backend the router starts, e.g. -c 4096 -t 2.
    Example:
      MAASD_KEY=… maasd router --backends 2 --llama-server $(scripts/llama-server) \\
          --model gemma.gguf -- -c 4096 -t 1
    """
    import uvicorn

    from maasd.llama.worker import default_socket
    from maasd.router.app import Router, RouterConfig, build_app
    from maasd.router.fleet import FleetConfig

    if len(attach) != len(slot_dirs):
        raise click.UsageError("each --backend needs its --slot-dir (in the same order)")
    if not spawn and not attach:
        raise click.UsageError("give --backends N (with --llama-server, --model) or --backend URL")
    if spawn and not (llama_server and model):
        raise click.UsageError("--backends needs --llama-server and --model")
    for d in slot_dirs:
        if not os.path.isdir(d):
            raise click.UsageError(f"--slot-dir {d}: not a directory")
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if "--cache-type-k" not in server_args and cache_type_k != "f16":
        server_args += ("--cache-type-k", cache_type_k)
    if "--cache-type-v" not in server_args and cache_type_v != "f16":
        server_args += ("--cache-type-v", cache_type_v)
    config = RouterConfig(
        fleet=FleetConfig(
            attach=list(zip(attach, slot_dirs, strict=True)),
            spawn=spawn,
            llama_server=llama_server,
            model=model,
            slots_per_backend=slots,
            server_args=list(server_args),
            log_dir=log_dir,
            type_k=cache_type_k,
            type_v=cache_type_v,
        ),
        socket_path=(socket_path or default_socket()) if key else None,
        maasd_url=maasd_url,
        key=key,
        pool=pool,
        chunk=chunk,
        min_save_tokens=min_save_tokens,
        ttl_s=ttl_s,
    )
    app = build_app(Router(config))
    uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="on")
