"""The signals that stop a maasd process, and the in-process uvicorn server, named once.

``maasd serve`` (:mod:`maasd.cli.daemon`), each process of ``maasd worker``
(:mod:`maasd.llama.worker_process`), the worker's supervisor
(:mod:`maasd.llama.worker_supervisor`) and ``maasd router`` (:mod:`maasd.cli.router`) stop
on the same signals, :data:`HANDLED_SIGNALS`, and put their handlers back when they return
(:func:`handling`). Their servers are
uvicorn's :class:`uvicorn.Server` with two changes (:func:`make_server`): a signal ends
:meth:`~uvicorn.Server.run` in a clean return — exit 0 — where uvicorn re-raises it once
the server stopped, and hooks for the moment it listens and the first signal. As in
uvicorn's ``server.py``, each process's life is explicit: startup, serve until a signal,
shutdown.

SIGHUP stops none of them (:func:`keep_on_hangup`): its default action would kill the
process — the daemon with every tenant's memory, the router or worker supervisor leaving
its backends or processes — on a terminal's hang-up or a ``systemctl reload``; each
reads its settings once, at start, so the signal is logged and ignored.

Their apps answer HEAD as GET without the body (:func:`head_as_get`): litestar routes a
HEAD to none of its GET handlers, and a load balancer's ``option httpchk HEAD`` got 405.

Only the standard library is imported here; uvicorn when a server is made.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import socket
    from types import FrameType

    import uvicorn
    from litestar.types import ASGIApp, Message, Receive, Send

__all__ = [
    "HANDLED_SIGNALS",
    "exit_on_signals",
    "handling",
    "head_as_get",
    "keep_on_hangup",
    "make_server",
]

#: What asks a maasd process to stop: finish what it serves, then exit 0.
HANDLED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, "FrameType | None"], object]


def keep_on_hangup(name: str) -> None:
    """From now until this process exits, a SIGHUP logs one line (a warning) and
    changes nothing: ``name`` (``maasd serve``, ``maasd router``, …) reads its settings
    only at start, so a restart is what applies a change. Main thread only, first
    thing in a command.

    The handler restarts the system calls it interrupts (``SA_RESTART``), so that no
    library sees an ``EINTR`` it does not expect; at exit the signal is ignored
    (``SIG_IGN``) rather than handed back to its default by the interpreter's
    finalization, which would make a SIGHUP during the last moments a kill.
    """

    def hung_up(_sig: int, _frame: FrameType | None) -> None:
        logging.getLogger("maasd").warning(
            "SIGHUP ignored: %s reads its settings only at start; restart it to apply a change",
            name,
        )

    signal.signal(signal.SIGHUP, hung_up)
    signal.siginterrupt(signal.SIGHUP, False)
    atexit.unregister(_ignore_hangup)
    atexit.register(_ignore_hangup)


def _ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@contextlib.contextmanager
def handling(handler: Handler) -> Iterator[None]:
    """``handler`` answers each of :data:`HANDLED_SIGNALS` while the block runs; the
    handlers before it answer them again after (main thread only, as ``signal.signal``)."""
    previous = {s: signal.signal(s, handler) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def exit_on_signals(code: int = 0) -> None:
    """Until a server takes them over (:func:`make_server`), each of :data:`HANDLED_SIGNALS`
    exits the process with ``code`` (``SystemExit``: ``finally`` blocks run) — e.g. while a
    worker process loads its model, so that a stop then is as clean as one later."""

    def _exit(_sig: int, _frame: FrameType | None) -> None:
        raise SystemExit(code)

    for s in HANDLED_SIGNALS:
        signal.signal(s, _exit)


def make_server(
    config: uvicorn.Config,
    *,
    ready: Callable[[asyncio.AbstractEventLoop], None] | None = None,
    stopping: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """uvicorn's Server, but a signal of :data:`HANDLED_SIGNALS` ends :meth:`run` in a clean
    return (exit 0), not a re-raise; ``ready(loop)`` runs once it listens, ``stopping()`` at
    the first signal. ``server.started`` says afterwards whether it ever listened."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and ready is not None:
                ready(asyncio.get_running_loop())

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if stopping is not None and not self.should_exit:
                stopping()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with handling(self.handle_exit):
                yield

    return Server(config)


def head_as_get(app: ASGIApp) -> ASGIApp:
    """``app`` answering a HEAD request as the GET of the same URL without its body (RFC
    9110 §9.3.2): the same status and headers (``content-length`` that of the GET's body),
    the same authentication — it *is* the GET to the app — and no body. Wrap the app's
    handler in front of its router (``app.asgi_handler = head_as_get(app.asgi_handler)``):
    its routes know GET only."""

    async def headed(scope: Any, receive: Receive, send: Send) -> None:  # HTTP or not
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        as_get: Any = {**scope, "method": "GET"}
        await app(as_get, receive, without_body)

    return headed
