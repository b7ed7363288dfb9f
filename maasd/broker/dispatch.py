"""Frame dispatch: one frame body → one service call → one :class:`Outcome` (SPEC §5).

No sockets here: the event loop (:mod:`maasd.broker.loop`) hands in frame
bodies and sends what comes back. The table :data:`OPS` is the one place that
says how each request is served::

    OPS[Attach] = Op(_attach)             # runs on the event loop: no thread hop
    OPS[Renew]  = Op(_renew, slow=True)   # runs on the slow pool: may wait on the ledger

Adding an op is: its request and reply structs in :mod:`maasd.protocol`, a
handler here (``(Call, request) -> Outcome``), and one row in :data:`OPS`.
A handler only calls the service and describes the result; what the connection
now holds (``attached`` / ``detached``) is applied by the loop, on its thread,
after the handler returns — so a slow handler never races the connection's
own close.

Every error frame is built by :meth:`Dispatcher.error`, from
:func:`maasd.problems.problem_of`: the same status, ``type``, title and detail
that the REST API answers for the same failure.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from maasd import errors
from maasd.models import BufferInfo, Principal
from maasd.problems import problem_of
from maasd.protocol import (
    Attach,
    Attached,
    Detach,
    Error,
    Hello,
    Ok,
    Renew,
    Reply,
    Request,
    Welcome,
    decode_request,
)

from .pacing import Fields, LogLimiter

__all__ = ["OPS", "Call", "Dispatcher", "HandleService", "Op", "Outcome"]

logger = logging.getLogger("maasd.broker")

#: errnos that mean "the daemon is at a limit of its own", answered 507 (not a bug: 500).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class Handle(Protocol):
    @property
    def fd(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def numa_node(self) -> int: ...


class HandleService(Protocol):
    """The part of :class:`maasd.core.Service` the broker calls."""

    def authenticate(self, token: str, /) -> Principal: ...
    def open_handle(self, principal: Principal, buffer_id: str, /) -> Handle: ...
    def drop_handle(self, principal: Principal, buffer_id: str, /) -> None: ...
    def renew(self, principal: Principal, buffer_id: str, ttl_s: int, /) -> BufferInfo | None: ...


@dataclass(slots=True)
class Outcome:
    """What to send for one frame, and what the connection holds afterwards."""

    reply: Reply
    #: fds sent with the reply (SCM_RIGHTS); owned by the outcome, closed once sent or dropped
    fds: tuple[int, ...] = ()
    #: the connection now holds one more attachment of this buffer
    attached: str | None = None
    #: the connection gives back one attachment of this buffer (the loop calls drop_handle)
    detached: str | None = None
    #: close the connection once the reply is handed to the kernel
    close: bool = False


@dataclass(frozen=True, slots=True)
class Call:
    """What a handler gets: the service, who asks, and what the connection holds."""

    service: HandleService
    principal: Principal
    #: buffer_id -> attachments of this connection; read only (the loop applies changes)
    held: Mapping[str, int]


Handler = Callable[[Call, Any], Outcome]


@dataclass(frozen=True, slots=True)
class Op:
    """How one request type is served: its handler, and whether it may block for long."""

    handler: Handler
    #: True: run on the slow pool (the ledger, prefault, copies); False: inline on the loop,
    #: which every other connection waits for — only operations that answer from memory.
    slow: bool = False


def _attach(call: Call, req: Attach) -> Outcome:
    handle = call.service.open_handle(call.principal, req.buffer_id)
    reply = Attached(
        buffer_id=req.buffer_id, size_bytes=handle.size_bytes, numa_node=handle.numa_node
    )
    return Outcome(reply, fds=(handle.fd,), attached=req.buffer_id)


def _detach(call: Call, req: Detach) -> Outcome:
    if call.held.get(req.buffer_id, 0) <= 0:
        raise errors.NotFound(f"buffer {req.buffer_id} is not attached on this connection")
    return Outcome(Ok(), detached=req.buffer_id)


def _renew(call: Call, req: Renew) -> Outcome:
    call.service.renew(call.principal, req.buffer_id, req.ttl_s)
    return Outcome(Ok())


#: request type → how it is served (the one place to add an op).
OPS: dict[type[Request], Op] = {
    Attach: Op(_attach),
    Detach: Op(_detach),
    Renew: Op(_renew, slow=True),
}


def tenant_of(principal: Principal) -> str:
    """The name a principal's connections are counted under."""
    return "admin" if principal.is_admin else str(principal.tenant_id)


class Dispatcher:
    """Turns frame bodies into outcomes by calling ``service``; never raises."""

    def __init__(self, service: HandleService, log: LogLimiter) -> None:
        self.service = service
        self.log = log

    def error(self, exc: BaseException, fields: Fields, *, close: bool = False) -> Outcome:
        """The error frame for ``exc`` (the one place they are built). 401 always closes."""
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            exc = errors.ResourceLimit(f"the daemon is at a resource limit: {exc.strerror}")
        p = problem_of(exc)
        if isinstance(exc, errors.ResourceLimit):
            self.log.log(logging.WARNING, "resource-limit", exc.detail, fields)
        elif p.status >= 500 and not isinstance(exc, errors.InsufficientStorage):
            self.log.log(logging.ERROR, "internal", "unexpected error", fields, exc_info=exc)
        reply = Error(status=p.status, title=p.title, detail=p.detail, type=p.type)
        return Outcome(reply, close=close or p.status == 401)

    def hello(
        self, body: bytes, pid: int, fields: Fields
    ) -> tuple[Outcome, Principal | None, str | None]:
        """The first frame: ``(outcome, principal, api_key)``; any failure closes."""
        try:
            req = decode_request(body)
        except msgspec.DecodeError as exc:
            return self.error(errors.InvalidRequest(str(exc)), fields, close=True), None, None
        if not isinstance(req, Hello):
            op = type(req).__name__.lower()
            err = errors.InvalidRequest(f"the first frame must be hello, got {op}")
            return self.error(err, fields, close=True), None, None
        try:
            principal = self.service.authenticate(req.api_key)
        except errors.Unauthorized as exc:
            self.log.log(logging.INFO, "hello-refused", "hello refused", fields)
            return self.error(exc, fields, close=True), None, None
        except Exception as exc:
            return self.error(exc, fields, close=True), None, None
        return Outcome(Welcome(tenant_id=principal.tenant_id, pid=pid)), principal, req.api_key

    def decode(self, body: bytes, fields: Fields) -> tuple[Request, Op] | Outcome:
        """A frame after hello: the request and its op, or the 400 to answer (no close)."""
        try:
            req = decode_request(body)
        except msgspec.DecodeError as exc:
            return self.error(errors.InvalidRequest(str(exc)), fields)
        op = OPS.get(type(req))
        if op is None:
            detail = "already authenticated: hello is only valid first"
            if not isinstance(req, Hello):
                detail = f"op {type(req).__name__.lower()} is not served on this socket"
            return self.error(errors.InvalidRequest(detail), fields)
        return req, op

    def run(
        self, op: Op, req: Request, api_key: str, held: Mapping[str, int], fields: Fields
    ) -> Outcome:
        """Serve one request. The key is checked again on every op: a revoked key stops at once."""
        try:
            principal = self.service.authenticate(api_key)
            return op.handler(Call(self.service, principal, held), req)
        except errors.Unauthorized as exc:
            self.log.log(logging.INFO, "key-revoked", "key no longer valid, closing", fields)
            return self.error(exc, fields)
        except Exception as exc:
            return self.error(exc, fields)
