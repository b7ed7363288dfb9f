"""Who is calling, and whether they may: the REST API's authentication, and what handlers get.

litestar runs a route's ``before_request`` hook before it reads a byte of the
body and before it resolves a dependency. The /v1 router's hook,
:func:`authenticated`, resolves the caller's key to a
:class:`~maasd.models.Principal` (on the event loop when the key is known
without I/O: the admin key, a remembered tenant key), then checks the role the
route asks for in its ``opt`` (:data:`ADMIN_ONLY`, :data:`TENANT_ONLY`; a
controller's ``opt`` applies to all its routes, none means any valid key). A
request refused there is answered 401 or 403 without its body being read and
without any service call. A hook, not guards: litestar copies the route handler
for every guard it calls, on every request.

A /v1 handler's one per-request dependency is :class:`RestCall` (the thread runner and
the caller): one dependency is resolved inline, while several are resolved
concurrently in a task group of their own, on every request. The use-case objects
it calls are provided once per app (:mod:`maasd.api.dependencies`).

``GET /metrics`` has a guard of its own, :func:`may_read_metrics`: the admin
key, the metrics key (good for nothing else), or anyone when the operator made
the metrics public.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, TypeVarTuple, cast

from litestar.connection import ASGIConnection, Request
from litestar.handlers import BaseRouteHandler

from maasd.api.health import Healthz
from maasd.api.schemas import NoBody
from maasd.api.server import begin, distrust, trust
from maasd.api.strict import JSON, decode, media_type
from maasd.core.auth import Auth, require_admin, require_tenant
from maasd.errors import Forbidden, InvalidRequest, Unauthorized
from maasd.metrics import Metrics
from maasd.models import Principal

__all__ = [
    "ADMIN_ONLY",
    "KEY_CHECKS",
    "STATE_KEY",
    "TENANT_ONLY",
    "ApiContext",
    "RestCall",
    "CallerRun",
    "Run",
    "authenticated",
    "bearer",
    "caller",
    "may_read_metrics",
    "metrics_digest",
]

R = TypeVar("R")
Ts = TypeVarTuple("Ts")

#: Where the app keeps its :class:`ApiContext` (``app.state``).
STATE_KEY = "maasd"

#: The ``opt`` of a route or controller that only the admin key may call (litestar
#: copies it into each route handler's own ``opt``).
ADMIN_ONLY: dict[str, Any] = {"role": "admin"}
#: The ``opt`` of a route or controller that only a tenant key may call.
TENANT_ONLY: dict[str, Any] = {"role": "tenant"}


#: The caller whose share of the threads the key checks that need the ledger take: the
#: requests are not authenticated yet, so one client sending many keys never seen (each
#: one a ledger read, a slow one while the ledger is) must not hold every thread.
KEY_CHECKS = "key-check"


class Run:
    """``await run(fn, *args)``: ``fn(*args)`` in one of ``threads`` worker threads.

    Every service call goes through it: the service may prefault or scrub
    gigabytes, or wait for the ledger, and the event loop must not. A caller's
    calls go through :meth:`of`, which gives each caller (a tenant, the admin) a
    share of the threads: beyond ``per_caller`` calls of one caller in flight, its
    next call waits for one of them to end *before* it asks for a thread. So a
    caller flooding the API holds at most ``per_caller`` threads and waits in its
    own queue, and another caller's call waits only for work already running.

    The hop is asyncio's own, not anyio's ``to_thread``: a thread pool of
    ``threads`` (calls beyond it queue in the pool, first come first served) and an
    :class:`asyncio.Semaphore` per caller, whose free path does not yield. anyio's
    capacity limiters yield to the event loop on every acquire (a whole turn of the
    loop, twice per call with the caller's share) and its cancel scope costs as
    much again: that was ~13 % of the event loop's time under load. What anyio
    gave is kept: a call whose request is cancelled while it runs is waited for
    (its thread and its share stay taken until it ends); one cancelled before it
    started never runs, and neither does one refused at the thread limit (the pool
    queues a call before it starts a thread for it: the thread that takes it later
    skips it).
    """

    def __init__(self, threads: int, per_caller: int | None = None) -> None:
        self.threads = threads
        self.per_caller = per_caller or threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="maasd-rest")
        #: Calls handed to the pool and not ended yet (running, or queued for a thread).
        self.in_pool = 0
        #: caller → its share and how many of its calls hold or wait for it (dropped at 0)
        self._shares: dict[str, tuple[asyncio.Semaphore, int]] = {}

    async def __call__(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        return await self._in_thread(fn, args)

    def of(self, who: Principal) -> CallerRun:
        """The runner of ``who``'s calls (its share of the threads)."""
        return CallerRun(self, caller_name(who))

    async def shared(self, caller: str, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """``fn(*args)`` in a worker thread, once ``caller`` has fewer than
        ``per_caller`` calls in flight and a thread is free (in that order)."""
        share, users = self._shares.get(caller) or (asyncio.Semaphore(self.per_caller), 0)
        self._shares[caller] = (share, users + 1)
        try:
            async with share:
                return await self._in_thread(fn, args)
        finally:
            share, users = self._shares[caller]
            if users == 1:
                del self._shares[caller]
            else:
                self._shares[caller] = (share, users - 1)

    def callers(self) -> int:
        """Callers with calls in flight or waiting (their shares are held only meanwhile)."""
        return len(self._shares)

    async def _in_thread(self, fn: Callable[..., R], args: tuple[Any, ...]) -> R:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()
        call = _Call()

        def work() -> None:  # in the pool's thread
            if not call.take():
                return  # dropped before it started: refused, or its request cancelled
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting task
                loop.call_soon_threadsafe(_settle, call, answer, None, e)
            else:
                loop.call_soon_threadsafe(_settle, call, answer, result, None)

        try:
            self._pool.submit(work)
        except RuntimeError:  # no thread could start (the thread limit: problems' 507)
            if call.take():  # queued, but no thread of the pool took it: it never runs
                raise
            # a thread of the pool took it meanwhile: it runs, its answer is awaited
        self.in_pool += 1
        try:
            return await answer
        except asyncio.CancelledError:
            if not call.ended and not call.take():  # running: it cannot be stopped
                await call.waited_out(loop)
            raise
        finally:
            self.in_pool -= 1


class _Call:
    """One call handed to the pool: who runs it (a thread, or no one) and whether it ended.

    ``claim`` holds one token: the pool's thread takes it to run the call, the event
    loop takes it to drop a call no thread started (refused, or cancelled). ``list.pop``
    is atomic, so exactly one of them gets it.
    """

    __slots__ = ("claim", "ended", "waiter")

    def __init__(self) -> None:
        self.claim: list[None] = [None]
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None

    def take(self) -> bool:
        try:
            self.claim.pop()
        except IndexError:
            return False
        return True

    async def waited_out(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the running call ends, whatever cancels the waiting task meanwhile."""
        self.waiter = ended = loop.create_future()
        while not ended.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(ended)


def _settle(call: _Call, answer: asyncio.Future[Any], result: Any, e: BaseException | None) -> None:
    """On the event loop: the call ended; its answer goes to the task still awaiting it."""
    call.ended = True
    if call.waiter is not None:
        call.waiter.set_result(None)
    if answer.done():  # cancelled meanwhile: no one is waiting for it
        return
    if e is None:
        answer.set_result(result)
    elif isinstance(e, StopIteration):  # a future refuses it (as anyio does: wrapped)
        wrapped = RuntimeError("a service call raised StopIteration")
        wrapped.__cause__ = e
        answer.set_exception(wrapped)
    else:
        answer.set_exception(e)


@dataclass(frozen=True, slots=True)
class CallerRun:
    """``await run(fn, *args)`` for one caller: :meth:`Run.shared` under its share."""

    run: Run
    caller: str

    async def __call__(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        return await self.run.shared(self.caller, fn, *args)


@dataclass(frozen=True)
class ApiContext:
    """What the guards and handlers of one app share."""

    auth: Auth  # the keys (maasd.core.auth)
    metrics: Metrics  # what GET /metrics renders
    run: Run
    metrics_digest: bytes | None  # SHA-256 of the metrics key
    metrics_public: bool
    health: Healthz
    #: The query parameters each /v1 route handler takes (by ``id``), filled once the app
    #: is built (:func:`maasd.api.app.create_app`); any other is refused, 400.
    query_names: dict[int, frozenset[str]] = field(default_factory=dict)
    #: The /v1 route handlers (by ``id``) that take no body: one sent is read and held to
    #: what a route that takes none accepts (:func:`_no_body`).
    bodiless: set[int] = field(default_factory=set)

    def is_metrics_key(self, token: str | None) -> bool:
        """Whether ``token`` is the metrics key, compared in constant time."""
        if token is None or self.metrics_digest is None:
            return False
        return hmac.compare_digest(_digest(token), self.metrics_digest)

    async def principal(self, token: str | None) -> Principal:
        """The principal of ``token``; Unauthorized (401) for none, an unknown or revoked key.
        A check that needs the ledger runs in the :data:`KEY_CHECKS` share of the threads."""
        who = self.auth.known_principal(token)  # the admin, or a remembered key: no I/O
        if who is None:
            who = await self.run.shared(KEY_CHECKS, self.auth.authenticate, token)
        return who


def caller_name(who: Principal) -> str:
    """Whose share a call takes (of the threads, of the kept REST connections)."""
    return "admin" if who.is_admin else f"tenant:{who.tenant_id}"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def metrics_digest(metrics_key: str | None) -> bytes | None:
    return _digest(metrics_key) if metrics_key else None


def context(connection: ASGIConnection[Any, Any, Any, Any]) -> ApiContext:
    return cast(ApiContext, connection.app.state[STATE_KEY])


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if there is one.

    Two ``Authorization`` headers are refused (400): which key the request is made with
    would depend on which of them a reader takes (a proxy the first, another the last).
    """
    headers = connection.headers.getall("authorization", [])
    if len(headers) > 1:
        raise InvalidRequest("more than one Authorization header: send one key")
    header = headers[0] if headers else None
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class RestCall:
    """What a /v1 handler works with: ``await call.run(reserves.reserve, call.who, …)``."""

    run: CallerRun  # the caller's share of the threads
    who: Principal


def caller(request: ASGIConnection[Any, Any, Any, Any]) -> RestCall:
    """The ``call`` dependency of /v1 handlers, with the caller :func:`authenticated` found."""
    ctx = context(request)
    who: Principal = request.state.principal
    return RestCall(ctx.run.of(who), who)


async def authenticated(request: Request[Any, Any, Any]) -> None:
    """The ``before_request`` hook of every /v1 route: a valid key (else 401), then the
    route's role (else 403). It runs on the event loop, before the body is read and
    before any dependency is resolved; raising here answers the problem.

    A hook rather than a guard: litestar copies the route handler for every guard it
    calls, on every request (~20–70 µs here), and passes a hook the request alone; the
    role is read from the route's handler in the request's scope.
    """
    ctx = context(request)
    token = bearer(request)
    state = request.scope.get("state")
    if ctx.is_metrics_key(token):
        distrust(state)
        raise Forbidden("the metrics key is good for GET /metrics only")
    generation = ctx.auth.generation
    try:
        who = await ctx.principal(token)
    except Unauthorized:
        # Whatever this connection was kept for (server.trust), it carries no valid key
        # now: a key revoked since, or its tenant deleted, keeps nothing from shedding.
        distrust(state)
        raise
    role = request.route_handler.opt.get("role")
    if role == "admin":
        require_admin(who)  # a tenant key gets 403 before any service call
    elif role == "tenant":
        require_tenant(who)  # the admin key (which owns no buffers) gets 403
    _known_query(ctx, request)
    request.state.principal = who
    name = caller_name(who)
    # At its share of requests in progress (bodies arriving, answers unread), the caller
    # gets a 507 for this one, unread, and its connection is closed (server.begin).
    begin(state, name)
    if id(request.route_handler) in ctx.bodiless and _carries_body(request):
        await _no_body(request)  # read once counted: a body trickled to it is busy too
    if ctx.auth.generation == generation:
        # (else a key was revoked while this one was checked in a thread: the revocation's
        # Gate.revoked may have come by already; the connection is kept from its next request)
        trust(state, name)


def _known_query(ctx: ApiContext, request: Request[Any, Any, Any]) -> None:
    """:class:`InvalidRequest` for a query parameter the route does not take: unknown body
    fields are refused, and a mistyped filter (``GET /v1/buffers?tenantid=t``) answered
    every tenant's buffers to the admin as if there were none."""
    if not request.scope.get("query_string"):
        return
    allowed = ctx.query_names.get(id(request.route_handler))
    if allowed is None:
        return
    unknown = sorted(set(request.query_params.keys()) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) if allowed else "none"
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r} (this route takes: {takes})")


def _carries_body(request: Request[Any, Any, Any]) -> bool:
    """Whether the request says a body follows (most carry neither header: no cost)."""
    headers = request.headers
    length = headers.get("content-length")
    return (length is not None and length.strip() != "0") or "transfer-encoding" in headers


async def _no_body(request: Request[Any, Any, Any]) -> None:
    """:class:`InvalidRequest` unless the body of a route that takes none is what such a
    route accepts (docs/api.md): nothing, ``{}`` or ``null``, as ``application/json``.
    Before, a ``DELETE`` with ``{"x": 1}``, with text that is not JSON or with a
    ``text/plain`` body was carried out (204) where a ``POST`` that takes no body refused
    the same (400): a client's mistaken request must change nothing (invariant 7)."""
    raw = await request.body()  # at most the app's request_max_body_size
    if not raw.strip():
        return
    media = media_type(request)
    if media != JSON:
        raise InvalidRequest(
            f"this route takes no body; expected none or an {JSON} {{}}, got {media or 'no content type'}"
        )
    decode(raw, NoBody | None)  # type: ignore[arg-type]


async def may_read_metrics(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """Guard of ``GET /metrics``: public, the metrics key, or the admin key (docs/api.md)."""
    ctx = context(connection)
    if ctx.metrics_public:
        return
    token = bearer(connection)
    if ctx.is_metrics_key(token):
        return
    if not (await ctx.principal(token)).is_admin:
        raise Forbidden("GET /metrics needs the admin key or the metrics key")
