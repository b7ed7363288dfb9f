"""The REST API's HTTP server: uvicorn's h11 protocol with deadlines and a connection cap.

uvicorn keeps a connection for as long as its client likes: it has no deadline
for a request's head or body (only an idle keep-alive timeout, which every byte
received resets), and its ``limit_concurrency`` answers a plain-text 503. A
local user sending half a request per connection could therefore hold the
daemon's file descriptors until the open-files limit stopped it from
answering anyone. :class:`GuardedH11` closes that hole, connection by
connection, and :class:`Gate` bounds the connections of the whole server::

    accept ─> connection_made ─ Gate.admit ─┬─ held      (≤ max_connections)
                                            ├─ shed      the oldest *idle* held connection
                                            │            is closed to make room for this one
                                            │            (an anonymous one; a caller's only
                                            │            when callers keep over half the cap,
                                            │            or after KEPT_GRACE_S of refusals)
                                            ├─ refused   nothing idle to shed: the first request
                                            │            is answered 507 resource-limit, then closed
                                            └─ dropped   over the refusal allowance too: closed at once

    head   from accept (or a keep-alive request's first byte): complete within head_timeout_s
    body   from the end of the head: complete within body_timeout_s
    send   a response the client does not read for send_timeout_s: closed

A deadline that passes closes the connection (there is no one to answer a
request that never finished arriving). *Idle* means no request is being
answered: a connection waiting for (the rest of) a request head, or whose
answer is complete. A client that trickles a head one byte at a time stays
idle; so a flood of half-open connections is shed oldest first, and a real
client, whose head arrives in one piece, gets through. Connections that are
all busy (requests in flight, bodies arriving) are bounded by the deadlines
above; while they last, new connections get the 507.

A connection that carried a request with a valid key is its caller's
(:func:`trust`, from the ``/v1`` authentication hook), up to a share of the cap per
caller (``max_connections // CALLER_SHARE``, at least 2). An idle connection of a
caller is shed only when no anonymous idle one is left and callers keep more than
half the cap, or newcomers have been refused for :data:`KEPT_GRACE_S` with nothing
anonymous idle meanwhile; otherwise the newcomer is refused (507) rather than a tenant's
pooled keep-alive connection closed under it (its next request would meet a reset). So
clients looping on ``/healthz`` or sending nothing, however many, shed one another
and meet 507s, and the tenants' connections that carried a key go on. The grace ends
a lock-out: callers sending a request on each of their kept connections every second
(the keep-alive timeout never closes them) and holding the rest of the cap busy,
renewed as its deadlines pass, refused everyone else for as long as they went on. A caller's
connections beyond its share are shed as anonymous ones, so one tenant's many
connections do not crowd out the others'. A *new* connection is anonymous until its
first request's key is checked: under such a flood it may be shed before that, as
any anonymous one. A kept connection whose ``/v1`` request carries a key refused as
unknown or revoked (:func:`distrust`) is anonymous again: a key revoked, or its
tenant deleted, keeps nothing for a client that goes on sending it. And any
revocation (this daemon's, or another's heard from a shared ledger) makes every
kept connection anonymous at once (:meth:`Gate.revoked`, on the event loop): a
client of the revoked key that sends only ``/healthz`` afterwards keeps nothing
either; the other callers' connections are kept again from their next ``/v1``
request.

Busy connections are bounded per caller too: from the ``/v1`` authentication hook
(:func:`begin`, before the body is read) until its answer is complete, a request of a
caller counts in its share of requests in progress (``caller_share`` again). A
request beyond it is answered 507 ``resource-limit`` unread and its connection
closed after the answer. So a tenant whose bodies never finish, or who never reads
its answers, holds at most a quarter of the cap busy, however it renews them at each
deadline, and the others (the admin, ``/healthz``) find the rest. (A head still
arriving is idle and anonymous: shed as above.) Requests outside ``/v1`` (the API
page, ``/docs``), which no key check counts, count as one caller's, :data:`ANONYMOUS`,
from when the app first sees them (:func:`anonymous_share`); ``/metrics`` as
:data:`METRICS`, a share of its own; ``/healthz`` is not counted. A request refused at a share while answers before it
lie unsent (pipelined, unread) closes its connection at once, without the 507.

Everything here runs on the event loop; the cost per request is two timer
handles and a few dict operations at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, cast

import h11
import msgspec
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol

from maasd.errors import InvalidRequest, ResourceLimit
from maasd.problems import problem_of

if TYPE_CHECKING:
    import uvicorn
    from litestar.types import ASGIApp, Receive, Scope, Send
    from uvicorn._types import ASGIReceiveCallable, ASGISendCallable
    from uvicorn._types import Scope as UvicornScope

    from maasd.core.auth import Auth
    from maasd.metrics import Metrics
    from maasd.settings import Settings

__all__ = [
    "ANONYMOUS",
    "Gate",
    "GuardedH11",
    "HttpLimits",
    "OnceAMinute",
    "Verdict",
    "anonymous_share",
    "begin",
    "distrust",
    "http_config",
    "protocol_for",
    "trust",
]

logger = logging.getLogger(__name__)

#: The share of the open-files limit REST connections may hold at most (the rest is
#: for buffers, the worker socket, the ledger and checkpoint files).
FD_SHARE = 4
#: Connections answered 507 beyond the cap, at most, as a share of the cap.
REFUSAL_SHARE = 8
#: The connections one caller may have kept from shedding, and its requests in progress
#: at most, as a share of the cap.
CALLER_SHARE = 4
#: Newcomers are refused in favour of callers' idle connections for this long at most:
#: past it, with still nothing anonymous idle, the oldest of those is shed for each.
KEPT_GRACE_S = 2.0
#: Refusals further apart than this are not one stretch of refusals (:meth:`Gate._starved`).
STREAK_S = 60.0
#: Where :class:`GuardedH11` puts itself in each request's ``scope["state"]`` (:func:`trust`).
CONNECTION_STATE = "maasd.connection"
#: The caller of every request outside ``/v1`` (:func:`anonymous_share`): no key is checked there.
ANONYMOUS = "anonymous"
#: The caller of ``GET /metrics`` (:func:`anonymous_share`): a share of its own, so that a
#: flood of requests without a key leaves the scrapes (with the metrics or admin key) room.
#: Its guard answers a request without such a key at once, in a few bytes: only a client
#: with one (or any, with ``--metrics-public``) can hold a connection busy with it.
METRICS = "metrics"
#: At most one "cap reached" warning in this many seconds.
WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class HttpLimits:
    """Deadlines and the connection cap of the REST server (settings ``http_*``)."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    max_connections: int = 512

    @property
    def caller_share(self) -> int:
        """Connections of one caller that are shed only after every anonymous idle one;
        also its requests in progress at most (:meth:`Gate.begin`)."""
        return max(2, self.max_connections // CALLER_SHARE)

    @property
    def max_refusals(self) -> int:
        """Connections beyond the cap that are still answered (507) rather than just closed."""
        return max(4, self.max_connections // REFUSAL_SHARE)

    @classmethod
    def of(cls, settings: Settings, fd_limit: int | None = None) -> HttpLimits:
        """The limits the settings ask for, the cap lowered to a share of the open-files limit."""
        if fd_limit is None:
            fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        cap = settings.http_max_connections
        if fd_limit != resource.RLIM_INFINITY:
            cap = min(cap, max(8, fd_limit // FD_SHARE))
        return cls(
            head_timeout_s=settings.http_head_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            send_timeout_s=settings.http_send_timeout_s,
            max_connections=cap,
        )


class Verdict(Enum):
    HELD = "held"
    REFUSED = "refused"
    DROPPED = "dropped"


class Gate:
    """The connections of one server: how many are held, which are idle, what happens at the cap."""

    def __init__(self, limits: HttpLimits, metrics: Metrics | None = None) -> None:
        self.limits = limits
        self.held = 0
        self.refusing = 0
        self._idle: OrderedDict[GuardedH11, None] = OrderedDict()  # oldest idle first
        self._idle_kept: OrderedDict[GuardedH11, None] = OrderedDict()  # callers' ones
        self._caller_of: dict[GuardedH11, str] = {}
        self._kept: dict[str, int] = {}  # connections kept per caller
        self._busy_for: dict[GuardedH11, str] = {}  # connection → caller of its request
        self._busy: dict[str, int] = {}  # requests in progress per caller
        #: The server's event loop, once a connection came (:meth:`revoked` hops to it).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._metrics = metrics
        self._warned = 0.0
        self._starved_since: float | None = None  # newcomers refused since, nothing idle
        self._refused_at = 0.0
        problem = problem_of(
            ResourceLimit(
                f"the daemon holds its maximum of {limits.max_connections} REST connections "
                "(http_max_connections), all with requests in progress; retry shortly"
            )
        )
        self.refusal = msgspec.json.encode(problem)
        self.busy_detail = (
            f"this caller has {limits.caller_share} REST requests in progress, its share of "
            f"the {limits.max_connections} connections (http_max_connections); the request "
            "was not read and its connection is closed: retry once one of them has ended"
        )
        self.anonymous_refusal = msgspec.json.encode(
            problem_of(
                ResourceLimit(
                    f"requests outside /v1 (no key checked) have {limits.caller_share} REST "
                    f"requests in progress, their share of the {limits.max_connections} "
                    "connections (http_max_connections); the request was not read and its "
                    "connection is closed: retry once one of them has ended"
                )
            )
        )
        if metrics is not None:
            metrics.http_connections.set_function(lambda: self.held)

    def admit(self) -> Verdict:
        """Count a new connection in, shedding the oldest idle connection if the cap is reached."""
        if self.held >= self.limits.max_connections:
            if self._idle:
                idle = self._idle
                self._starved_since = None  # anonymous ones come and go: no lock-out
            elif self._idle_kept and (self._kept_over_half() or self._starved()):
                idle = self._idle_kept
            else:
                idle = None
            if not idle:
                self._warn()
                if self.refusing >= self.limits.max_refusals:
                    self.count_close("dropped")
                    return Verdict.DROPPED
                self.refusing += 1
                self.count_close("refused")
                return Verdict.REFUSED
            victim, _ = idle.popitem(last=False)
            self._warn()
            victim.close_for("shed")  # leaves the count at once
        self.held += 1
        return Verdict.HELD

    def _starved(self) -> bool:
        """Whether newcomers have been refused for :data:`KEPT_GRACE_S` with nothing
        anonymous idle to shed meanwhile (a refusal :data:`STREAK_S` after the last one
        starts over): then the rest of the cap is held busy, by whoever renews it as its
        deadlines pass, and callers' idle connections are shed rather than everyone else
        refused for as long as that goes on (invariant 9)."""
        now = time.monotonic()
        if self._starved_since is None or now - self._refused_at > STREAK_S:
            self._starved_since = now
        self._refused_at = now
        return now - self._starved_since >= KEPT_GRACE_S

    def _kept_over_half(self) -> bool:
        """Whether callers keep more than half the cap: then their idle connections are
        shed too (oldest first), so that callers, however many, never lock the rest out."""
        return len(self._caller_of) > self.limits.max_connections // 2

    def idle(self, conn: GuardedH11) -> None:
        """``conn`` answers nothing now (it keeps its place if it was idle already)."""
        idle = self._idle_kept if conn in self._caller_of else self._idle
        if conn not in idle:
            idle[conn] = None

    def busy(self, conn: GuardedH11) -> None:
        self._idle.pop(conn, None)
        self._idle_kept.pop(conn, None)

    def trust(self, conn: GuardedH11, caller: str) -> None:
        """``conn`` carried a request of ``caller`` (a valid key): shed it last, if the
        caller has fewer than its share of such connections. Once per (held) connection."""
        if conn in self._caller_of:
            return
        kept = self._kept.get(caller, 0)
        if kept >= self.limits.caller_share:
            return
        self._kept[caller] = kept + 1
        self._caller_of[conn] = caller
        if self._idle.pop(conn, 0) is None:  # idle already: among the callers' ones now
            self._idle_kept[conn] = None

    def distrust(self, conn: GuardedH11) -> None:
        """``conn`` carried a request whose key is not valid (any more: revoked, its tenant
        deleted): it is anonymous again, its place in its caller's share given back."""
        if self._uncount(conn) and self._idle_kept.pop(conn, 0) is None:
            self._idle[conn] = None  # idle already: among the anonymous ones now

    def begin(self, conn: GuardedH11, caller: str) -> bool:
        """A request of ``caller`` (a valid key) on ``conn`` is in progress until :meth:`end`
        (or :meth:`leave`): whether the caller had fewer than its share of such requests.
        If not, nothing is counted (the request is to be refused and the connection closed)."""
        if conn in self._busy_for:
            return True
        busy = self._busy.get(caller, 0)
        if busy >= self.limits.caller_share:
            return False
        self._busy[caller] = busy + 1
        self._busy_for[conn] = caller
        return True

    def end(self, conn: GuardedH11) -> None:
        """The request on ``conn`` is answered (or never will be): its caller's count drops."""
        caller = self._busy_for.pop(conn, None)
        if caller is None:
            return
        left = self._busy[caller] - 1
        if left:
            self._busy[caller] = left
        else:
            del self._busy[caller]

    def forget_callers(self) -> None:
        """Every kept connection is anonymous again (a key was revoked: whose is not known
        here); the next request with a valid key keeps its connection again."""
        self._caller_of.clear()
        self._kept.clear()
        idle_kept, self._idle_kept = self._idle_kept, OrderedDict()
        self._idle.update(idle_kept)

    def revoked(self) -> None:
        """:meth:`forget_callers`, from any thread (``Auth.watch_revocations``): one hop to
        the event loop, nothing waited for. Before any connection there is nothing kept."""
        loop = self.loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
            loop.call_soon_threadsafe(self.forget_callers)

    def _uncount(self, conn: GuardedH11) -> bool:
        """Take ``conn`` out of its caller's share; whether it was in one."""
        caller = self._caller_of.pop(conn, None)
        if caller is None:
            return False
        left = self._kept[caller] - 1
        if left:
            self._kept[caller] = left
        else:
            del self._kept[caller]
        return True

    def leave(self, verdict: Verdict, conn: GuardedH11) -> None:
        self.busy(conn)
        self._uncount(conn)
        self.end(conn)
        if verdict is Verdict.HELD:
            self.held -= 1
        elif verdict is Verdict.REFUSED:
            self.refusing -= 1

    def count_close(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.http_closed.labels(reason=reason).inc()

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            logger.warning(
                "REST connection cap reached: shedding idle connections, answering 507 when "
                "none is idle",
                extra={"http_max_connections": self.limits.max_connections},
            )


class _Phase(Enum):
    HEAD = "head_timeout"
    BODY = "body_timeout"


class OnceAMinute(logging.Filter):
    """Lets ``message`` through at most once every ``interval_s`` (the line then says how
    many it stands for); other records pass. uvicorn logs a warning for every request
    that is not HTTP — what any local client can send as fast as it likes."""

    def __init__(self, message: str, interval_s: float = 60.0) -> None:
        super().__init__()
        self.message = message
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._said_at = -interval_s
        self._count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.message:
            return True
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._said_at < self.interval_s:
                return False
            count, self._count, self._said_at = self._count, 0, now
        record.msg = f"{self.message} ({count} since the last such line; at most one a minute)"
        record.args = ()
        return True


#: What uvicorn says of each request that is not HTTP (h11_impl's handle_events).
NOT_HTTP_WARNING = "Invalid HTTP request received."
#: What uvicorn says of each request with an ``Upgrade`` header (h11_impl's
#: ``_unsupported_upgrade_warning``): the server takes no WebSocket (``ws="none"``), so
#: every ``Upgrade: websocket`` request, answered as plain HTTP, also logged two lines.
UPGRADE_WARNINGS = (
    "Unsupported upgrade request.",
    "No supported WebSocket library detected. Please use \"pip install 'uvicorn[standard]'\", "
    "or install 'websockets' or 'wsproto' manually.",
)


class CancelledAtStop(logging.Filter):
    """A graceful stop finishes the requests in flight (SPEC §3), a body still coming
    included, for at most its grace; then uvicorn cancels the rest, logging an ERROR for
    the stop and, for each request, an ERROR "Exception in ASGI application" with the
    CancelledError's traceback: what a client that never finishes its body can put in the
    log. They become warnings, the cancellation one line without its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        msg = str(record.msg)
        if isinstance(exc, asyncio.CancelledError) and msg.startswith(
            "Exception in ASGI application"
        ):
            record.msg = "a request still in progress at the end of the stop's grace was cancelled"
            record.args = ()
            record.exc_info = record.exc_text = None
        elif not msg.startswith("Cancel %s running task(s), timeout graceful shutdown"):
            return True
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _quiet_not_http(logger: logging.Logger) -> None:
    """One filter per message and logger (a daemon, and tests, may build several servers)."""
    quiet = {f.message for f in logger.filters if isinstance(f, OnceAMinute)}
    for message in (NOT_HTTP_WARNING, *UPGRADE_WARNINGS):
        if message not in quiet:
            logger.addFilter(OnceAMinute(message))
    if not any(isinstance(f, CancelledAtStop) for f in logger.filters):
        logger.addFilter(CancelledAtStop())


#: The answer to bytes that are not an HTTP request (:meth:`GuardedH11.send_400_response`).
_NOT_HTTP = msgspec.json.encode(
    problem_of(InvalidRequest("the request is not valid HTTP/1.1 (its head could not be parsed)"))
)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap of the module docstring.

    A subclass per server carries its :class:`Gate` (:func:`protocol_for`).
    """

    gate: ClassVar[Gate]

    _verdict: Verdict = Verdict.DROPPED
    _phase: _Phase | None = None
    _timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Each request's scope["state"] is a copy of this: the way back from the /v1
        # authentication hook to the connection (:func:`trust`).
        self.app_state = {**self.app_state, CONNECTION_STATE: self}
        self.gate.loop = self.loop
        self._verdict = self.gate.admit()
        if self._verdict is Verdict.DROPPED:
            transport.abort()
            return
        if self._verdict is Verdict.REFUSED:
            self.app = self._refuse  # uvicorn runs ``self.app`` for the request it reads next
        self._arm(_Phase.HEAD)
        if self._verdict is Verdict.HELD:
            self.gate.idle(self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        self.gate.end(self)  # before uvicorn starts a pipelined request's cycle
        super().on_response_complete()
        # Between keep-alive requests uvicorn's own keep-alive timeout watches the idle
        # connection; the next head's deadline starts with its first byte (data_received).
        self._track(after_response=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        self._send_deadline(False)
        self.gate.leave(self._verdict, self)
        self._verdict = Verdict.DROPPED  # counted out once
        self.app_state = {}  # its reference to itself (the collector frees the rest)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._send_deadline(True)

    def send_400_response(self, msg: str) -> None:
        """A request that is not HTTP (h11 refused it: a header without a colon, a bad
        ``Content-Length``, a garbage request line) is answered as every error is, an
        ``application/problem+json`` 400 (uvicorn's own is plain text), then closed."""
        del msg  # uvicorn's "Invalid HTTP request received."
        body = _NOT_HTTP
        head = h11.Response(
            status_code=400,
            reason=b"Bad Request",
            headers=[
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        )
        for event in (head, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._send_deadline(False)

    def trusted_by(self, caller: str) -> None:
        if self._verdict is Verdict.HELD:
            self.gate.trust(self, caller)

    def began_by(self, caller: str) -> bool:
        """The request read now is ``caller``'s (:meth:`Gate.begin`); ``False`` if the caller
        has its share in progress already: the connection is then closed after the answer,
        as if the client had asked for it (``Connection: close``) — or at once, without
        one, if the client has not read the answers before it."""
        if self._verdict is not Verdict.HELD or self.gate.begin(self, caller):
            return True  # (a connection shed or refused meanwhile counts nothing)
        if self.flow.write_paused or self.transport.get_write_buffer_size():
            # Earlier answers lie unsent (pipelined, unread): the 507 would wait behind
            # them, the connection busy (or closing) and counted nowhere. Closed now.
            self.close_for("unread")
            return False
        cycle = self.cycle
        if cycle is not None:
            cycle.keep_alive = False
            headers = cast("list[tuple[bytes, bytes]]", cycle.scope["headers"])
            if CLOSE_HEADER not in headers:
                headers.append(CLOSE_HEADER)  # uvicorn answers it with the same header
        return False

    def close_for(self, reason: str) -> None:
        """Close now, counting ``reason``; the connection leaves the gate's count at once."""
        self.gate.count_close(reason)
        self.gate.leave(self._verdict, self)
        self._verdict = Verdict.DROPPED
        self._arm(None)
        self._send_deadline(False)
        logger.debug("closing a REST connection", extra={"reason": reason, "peer": self.client})
        self.transport.abort()

    # -- state ---------------------------------------------------------------------------

    def _track(self, *, after_response: bool = False) -> None:
        """Follow the client's side of h11 after each event: which deadline runs, idle or busy."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if not after_response and self._phase is None:
                self._arm(_Phase.HEAD)  # the first bytes of a keep-alive request's head
        elif state is h11.SEND_BODY:
            if self._phase is not _Phase.BODY:
                self._arm(_Phase.BODY)
        elif self._phase is not None:  # DONE, MUST_CLOSE, ...: the whole request is in
            self._arm(None)
        if self._verdict is not Verdict.HELD:
            return
        if self.cycle is None or self.cycle.response_complete:
            self.gate.idle(self)
        else:
            self.gate.busy(self)

    def _arm(self, phase: _Phase | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            limits = self.gate.limits
            delay = limits.head_timeout_s if phase is _Phase.HEAD else limits.body_timeout_s
            self._timer = self.loop.call_later(delay, self.close_for, phase.value)

    def _send_deadline(self, on: bool) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if on:
            self._send_timer = self.loop.call_later(
                self.gate.limits.send_timeout_s, self.close_for, "send_timeout"
            )

    async def _refuse(
        self, _scope: UvicornScope, _receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """The answer to every connection over the cap: 507 ``resource-limit``, then close."""
        await _insufficient_storage(cast("Send", send), self.gate.refusal)


async def _insufficient_storage(send: Send, body: bytes) -> None:
    """A 507 ``resource-limit`` problem (``body``), saying the connection closes after it."""
    await send(
        {
            "type": "http.response.start",
            "status": 507,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def trust(state: dict[str, Any] | None, caller: str) -> None:
    """The connection that carried a request (its ``scope["state"]``) is ``caller``'s: a
    valid key was sent on it (:meth:`Gate.trust`). Nothing for a request served otherwise."""
    conn = _connection(state)
    if conn is not None:
        conn.trusted_by(caller)


def begin(state: dict[str, Any] | None, caller: str) -> None:
    """A request of ``caller`` is in progress on the connection that carries it, until it is
    answered (:meth:`Gate.begin`); :class:`ResourceLimit` (507) if the caller has its share
    of requests in progress already: the request is refused unread, its connection closed."""
    conn = _connection(state)
    if conn is not None and not conn.began_by(caller):
        raise ResourceLimit(conn.gate.busy_detail)


def anonymous_share(app: ASGIApp) -> ASGIApp:
    """``app`` with its requests outside ``/v1`` counted as :data:`ANONYMOUS`'s in the busy
    share (:meth:`Gate.begin`), from here until the answer is complete
    (:meth:`GuardedH11.on_response_complete`): beyond the share, 507 ``resource-limit``
    unread and the connection closed. ``/v1`` requests are counted by the authentication
    hook, by caller (:func:`begin`); ``/healthz`` not at all: load balancers must reach it;
    ``/metrics`` as :data:`METRICS`, a share of its own.
    Wrap the app's handler in front of routing, outermost. Nothing is counted for a
    request served without :class:`GuardedH11` (an ASGI test client)."""

    async def shared(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if not path.startswith("/v1/") and path != "/healthz":
                conn = _connection(scope.get("state"))
                caller = METRICS if path == "/metrics" else ANONYMOUS
                if conn is not None and not conn.began_by(caller):
                    await _insufficient_storage(send, conn.gate.anonymous_refusal)
                    return
        await app(scope, receive, send)

    return shared


def distrust(state: dict[str, Any] | None) -> None:
    """The connection that carried a request sent a key that is not valid (:meth:`Gate.distrust`):
    a connection kept with a key revoked since is kept no more, although its client goes on."""
    conn = _connection(state)
    if conn is not None:
        conn.gate.distrust(conn)


def _connection(state: dict[str, Any] | None) -> GuardedH11 | None:
    conn = state.get(CONNECTION_STATE) if state else None
    return conn if isinstance(conn, GuardedH11) else None


def protocol_for(gate: Gate) -> type[GuardedH11]:
    """A :class:`GuardedH11` class bound to ``gate`` (uvicorn's ``http=`` takes a class)."""
    return type("GuardedH11", (GuardedH11,), {"gate": gate})


def http_config(
    app: Any, settings: Settings, metrics: Metrics | None = None, auth: Auth | None = None
) -> uvicorn.Config:
    """The uvicorn configuration of ``maasd serve``: the guarded protocol, no access log.
    ``auth``'s revocations (this daemon's, or another's on a shared ledger) make the
    connections kept so far anonymous again (:meth:`Gate.revoked`)."""
    import uvicorn

    limits = HttpLimits.of(settings)
    _quiet_not_http(logging.getLogger("uvicorn.error"))
    if limits.max_connections < settings.http_max_connections:
        logger.info(
            "REST connections capped below http_max_connections by the open-files limit",
            extra={
                "http_max_connections": limits.max_connections,
                "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            },
        )
    gate = Gate(limits, metrics)
    if auth is not None:
        auth.watch_revocations(gate.revoked)
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol_for(gate),
        loop="maasd.api.loop:GuardedLoop",  # an accept loop that backs off at EMFILE
        ws="none",  # no WebSocket routes; an upgrade would also take a connection out of the gate
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=10,
        # Longer than a client's pool keeps an idle connection (httpx: 5 s): at uvicorn's
        # default, also 5 s, a request sent on a pooled connection as the server closed
        # it met a reset. (uvicorn types it int; it only reaches loop.call_later.)
        timeout_keep_alive=cast("int", settings.http_keepalive_s),
        server_header=False,
    )
