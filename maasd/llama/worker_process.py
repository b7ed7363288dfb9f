"""One process of ``maasd worker``: llama-cpp-python's OpenAI server on a ``MaasdCache``.

The supervisor (:mod:`maasd.llama.worker_supervisor`) starts ``python -m maasd.llama.worker_process``
with a readiness pipe inherited, and writes a :class:`ProcessSpec` (JSON, with the tenant
key: never on a command line) to its stdin. This process then:

1. builds llama-cpp-python's app (``llama_cpp.server.app.create_app``), which loads the
   model — the routes, request types, errors and streaming are llama-cpp-python's own;
2. sets a :class:`~maasd.llama.cache.MaasdCache` on the model (with the process's
   :class:`~maasd.llama.worker_metrics.WorkerMetrics` as its observer), connects to
   maasd once to say whether prefixes are shared, and times the first sampled token;
3. adds ``GET /metrics`` and a middleware (request arrival for the TTFT, an
   ``x-maasd-worker-pid`` header on every answer);
4. listens on the worker's port with a socket of its own (``SO_REUSEPORT``: the kernel
   spreads new connections over the processes), and serves until SIGTERM/SIGINT
   (:data:`maasd.serving.HANDLED_SIGNALS`, uvicorn's server from
   :func:`maasd.serving.make_server`), then finishes the requests in flight and exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from maasd.serving import exit_on_signals, keep_on_hangup, make_server

if TYPE_CHECKING:
    import uvicorn

    from maasd.llama.worker_metrics import WorkerMetrics

__all__ = ["ProcessSpec", "main"]

logger = logging.getLogger("maasd.worker")

PR_SET_PDEATHSIG = 1


class ProcessSpec(msgspec.Struct, forbid_unknown_fields=True):
    """What the supervisor tells each process."""

    server: dict[str, Any]  # llama_cpp.server.settings.ServerSettings
    model: dict[str, Any]  # llama_cpp.server.settings.ModelSettings
    socket: str
    key: str | None
    pool: str | None
    maasd_url: str | None
    host: str
    port: int
    ready_fd: int
    parent_pid: int
    log_level: str = "info"
    graceful_s: int = 30


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=ProcessSpec)
    _die_with_parent(spec.parent_pid)
    # Until uvicorn takes the signals over: a stop while the model loads exits 0 too.
    exit_on_signals(0)
    keep_on_hangup("maasd worker")  # a terminal's hang-up reaches every process of its group
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s maasd-worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    from maasd.llama.worker_metrics import WorkerMetrics

    metrics = WorkerMetrics()
    app, cache = build_app(spec, metrics)
    listener = listen(spec.host, spec.port)  # after the model loaded: no request waits on it
    config = _config(app, spec)
    server = make_server(config, ready=lambda _loop: _ready(spec.ready_fd))
    try:
        server.run(sockets=[listener])
    finally:
        if cache is not None:
            cache.close()
        listener.close()
    return 0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def listen(host: str, port: int) -> socket.socket:
    """This process's own listening socket on the worker's port: the kernel spreads new
    connections over the processes' sockets (``SO_REUSEPORT``)."""
    sock = reuse_port_socket(host, port)
    sock.listen(2048)
    return sock


def build_app(spec: ProcessSpec, metrics: WorkerMetrics) -> tuple[Any, Any]:
    """llama-cpp-python's app with this process's model wired to maasd → (app, cache or
    None when the model cannot share)."""
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from starlette.requests import Request
    from starlette.responses import Response

    app = server_app.create_app(
        server_settings=ServerSettings.model_validate(spec.server),
        model_settings=[ModelSettings.model_validate(spec.model)],
    )
    answer_bad_requests_with_400(app)
    model = server_model(server_app)
    cache = wire_cache(model, spec, metrics)
    metrics.hook_sampling(model)

    def scrape(_request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.add_route("/metrics", scrape, methods=["GET"], include_in_schema=False)
    app.add_middleware(_AsgiMiddleware, wrap=metrics.middleware)
    return app, cache


def answer_bad_requests_with_400(app: Any) -> None:
    """A malformed request gets 400 ``invalid_request_error`` (the OpenAI API's answer),
    not the 500 llama-cpp-python 0.3.36 gives it.

    Its ``RouteErrorHandler`` turns every exception but two message patterns (context
    length, model path) into a 500 with a traceback in the log, request validation
    errors included; and a body that is not JSON makes its error path raise again.
    """
    import json

    from fastapi.exceptions import RequestValidationError
    from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    original = RouteErrorHandler.error_message_wrapper

    def wrapper(self: Any, error: Exception, body: Any = None) -> tuple[int, ErrorResponse]:
        if isinstance(error, RequestValidationError):
            errors = error.errors()
            first = errors[0] if errors else {}
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            return 400, ErrorResponse(
                message=f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                type="invalid_request_error",
                param=where or None,
                code=None,
            )
        return original(self, error, body)

    # (unused-ignore: without the llama extra the class is Any)
    RouteErrorHandler.error_message_wrapper = wrapper  # type: ignore[method-assign, unused-ignore]

    async def not_json(_request: Request, exc: Exception) -> JSONResponse:
        error = ErrorResponse(
            message=f"the body is not JSON: {exc}",
            type="invalid_request_error",
            param=None,
            code=None,
        )
        return JSONResponse({"error": error}, status_code=400)

    app.add_exception_handler(json.JSONDecodeError, not_json)
    app.add_exception_handler(UnicodeDecodeError, not_json)


def server_model(server_app: Any) -> Any:
    """The ``Llama`` llama-cpp-python's app loaded (its proxy's current model)."""
    proxy = getattr(server_app, "_llama_proxy", None)
    if proxy is None:
        raise RuntimeError("llama_cpp.server.app loaded no model")
    return proxy()


def wire_cache(model: Any, spec: ProcessSpec, metrics: WorkerMetrics) -> Any:
    """Set a ``MaasdCache`` on ``model`` and connect once → the cache, or None."""
    from maasd.llama.cache import MaasdCache

    metrics.sharing(False)
    if not spec.key:
        logger.warning("PREFIX SHARING OFF: no tenant key (--key or MAASD_KEY)")
        return None
    try:
        cache = MaasdCache(
            model, spec.maasd_url, spec.socket, spec.key, pool=spec.pool, observer=metrics
        )
    except ValueError as exc:
        logger.warning("PREFIX SHARING OFF: %s", exc)
        return None
    model.set_cache(cache)
    cache.link.get()  # connect now: the log and /metrics say at once whether it shares
    return cache


class _AsgiMiddleware:
    """Adapts ``WorkerMetrics.middleware`` (a function of the app) to ``add_middleware``."""

    def __init__(self, app: Any, wrap: Callable[[Any], Any]) -> None:
        self._call = wrap(app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._call(scope, receive, send)


def _config(app: Any, spec: ProcessSpec) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=spec.log_level.lower(),
        timeout_graceful_shutdown=spec.graceful_s,
        lifespan="off",
    )


def _ready(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, b"ready\n")
        os.close(fd)


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the supervisor dies (even by SIGKILL): no orphan keeps
    serving the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before the call above
        sys.exit(0)


if __name__ == "__main__":
    sys.exit(main())
