"""Frame dispatch: one frame body → one use-case call → one :class:`Outcome` (ops: :mod:`maasd.protocol`).

No sockets here: the event loop (:mod:`maasd.broker.frames`) hands in frame
bodies and sends what comes back. The table :data:`OPS` is the one place that
says how each request is served::

    OPS[Attach] = Op(_attach)             # runs on the event loop: no thread hop
    OPS[Renew]  = Op(_renew, slow=True)   # runs on the slow pool: may wait on the ledger

Adding an op is: its request and reply structs in :mod:`maasd.protocol`, a
handler here (``(Call, request) -> Outcome``), and one row in :data:`OPS`.
A handler only calls the core and describes the result; what the connection
now holds (``attached`` / ``detached``) is applied by the loop, on its thread,
after the handler returns — so a slow handler never races the connection's
own close.

Every error frame is built by :meth:`Dispatcher.error`, from
:func:`maasd.problems.problem_of`: the same status, ``type``, title and detail
that the REST API answers for the same failure.

The key is checked once, at ``hello``. Every later op compares the connection's
auth generation with the service's (an int compare; it moves on every key
revocation) and checks the key again only when it moved — on the slow pool, as
that may read the ledger: a revoked key gets 401 and the connection closes.

The entry ops: ``lookup`` is inline (the core answers it from memory) — but a local
miss that the disk tier or the shared tier (L2) is to be asked about answers ``LATER``
(:mod:`maasd.core.tiers`), is deferred (``Outcome.defer``) and runs again on the slow
pool, since that waits for the disk or the network; ``put``
(a reserve: eviction, prefault), ``commit`` (a copy) and ``abort`` (a scrub) are
slow, and so is ``publish`` (a put and a commit in one, reading the memfd the writer
sent with the frame: the one op that takes fds). A ``put`` leaves the connection holding a *staged* entry (``Outcome.staged``)
until its ``commit`` or ``abort`` settles it; the connection's close abandons the
entries it still holds staged (released, scrubbed).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Container, Mapping, Set
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from maasd import errors
from maasd.core.tiers import LATER, Later
from maasd.models import BufferInfo, Principal
from maasd.problems import problem_of
from maasd.protocol import (
    Abort,
    Attach,
    Attached,
    Commit,
    Detach,
    Error,
    Found,
    Hello,
    Lookup,
    Ok,
    Publish,
    Published,
    Put,
    Renew,
    Reply,
    Request,
    Reserved,
    Welcome,
    decode_request,
)

from .pacing import Fields, LogLimiter

__all__ = ["OPS", "Call", "Dispatcher", "UseCases", "Op", "Outcome", "Session"]

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


class AttachHandle(Handle, Protocol):
    """A buffer's handle for ``attach``: with the lease it was reserved with."""

    @property
    def ttl_s(self) -> int: ...


class EntryHit(Handle, Protocol):
    @property
    def key(self) -> str: ...
    @property
    def buffer_id(self) -> str: ...


class StagedHandle(Handle, Protocol):
    @property
    def buffer_id(self) -> str: ...


class KeyChecks(Protocol):
    """:class:`maasd.core.auth.Auth`, as the broker uses it."""

    @property
    def generation(self) -> int: ...
    def authenticate(self, token: str, /) -> Principal: ...
    def known_principal(self, token: str | None, /) -> Principal | None: ...
    def watch_revocations(self, callback: Callable[[], None], /) -> None: ...


class HandleDesk(Protocol):
    """:class:`maasd.core.handles.Handles`: a buffer's handle, given and given back."""

    def open(self, principal: Principal, buffer_id: str, /) -> AttachHandle: ...
    def drop(self, principal: Principal, buffer_id: str, /) -> None: ...


class Leases(Protocol):
    """:class:`maasd.core.buffers.Buffers`, for a socket ``renew``."""

    def renew(self, principal: Principal, buffer_id: str, ttl_s: int, /) -> BufferInfo | None: ...


class EntryDesk(Protocol):
    """:class:`maasd.core.entries.Entries`: a writer's put, commit and abort."""

    def put(
        self,
        principal: Principal,
        key: str,
        size_bytes: int,
        pool: str | None = None,
        ttl_s: int | None = None,
        /,
    ) -> StagedHandle: ...
    def commit(self, principal: Principal, buffer_id: str, /, *, owned: bool) -> None: ...
    def abort(self, principal: Principal, buffer_id: str, /, *, owned: bool) -> None: ...
    def abandon(self, principal: Principal, buffer_id: str, /) -> None: ...
    def staged(self, buffer_id: str, /) -> bool: ...
    def watch_releases(self, callback: Callable[[str], None], /) -> None: ...


class MadeEntry(Protocol):
    """A committed entry as a publish answers it (:class:`maasd.models.BufferInfo`)."""

    @property
    def id(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def numa_node(self) -> int: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def pool_id(self) -> str: ...
    @property
    def persistence(self) -> str: ...
    @property
    def created_at(self) -> str: ...
    @property
    def expires_at(self) -> str: ...


class EntryPublishing(Protocol):
    """:class:`maasd.core.publish.Publishes`: a committed entry from a writer's memfd."""

    def publish(
        self,
        principal: Principal,
        key: str,
        fd: int,
        size_bytes: int,
        pool: str | None = None,
        ttl_s: int | None = None,
        /,
    ) -> MadeEntry: ...


class EntryLookups(Protocol):
    """:class:`maasd.core.tiers.Tiers`: the lookup order through the tiers, the one place.
    Without ``may_wait``, a miss a slower tier is to be asked about answers ``LATER``."""

    def find(
        self,
        principal: Principal,
        keys: list[str],
        attached: Container[str] = (),
        /,
        *,
        may_wait: bool = True,
    ) -> EntryHit | Later | None: ...


class UseCases(Protocol):
    """The core's use-case objects the broker is built with
    (:meth:`maasd.core.Service.socket_use_cases`)."""

    @property
    def auth(self) -> KeyChecks: ...
    @property
    def handles(self) -> HandleDesk: ...
    @property
    def buffers(self) -> Leases: ...
    @property
    def entries(self) -> EntryDesk: ...
    @property
    def lookups(self) -> EntryLookups: ...
    @property
    def publishes(self) -> EntryPublishing: ...


@dataclass(slots=True)
class Outcome:
    """What to send for one frame, and what the connection holds afterwards."""

    #: ``None``: nothing to send (a key re-checked between requests, still valid)
    reply: Reply | None
    #: fds sent with the reply (SCM_RIGHTS); owned by the outcome, closed once sent or dropped
    fds: tuple[int, ...] = ()
    #: the connection now holds one more attachment of this buffer
    attached: str | None = None
    #: the connection gives back one attachment of this buffer (the loop calls drop_handle)
    detached: str | None = None
    #: close the connection once the reply is handed to the kernel
    close: bool = False
    #: the connection now holds this entry staged (its writer: it may commit or abort it)
    staged: str | None = None
    #: the connection no longer holds this entry staged (committed, aborted or gone)
    unstaged: str | None = None
    #: the key was checked again at this auth generation
    authed: int | None = None
    #: nothing to send yet: run the op again on the slow pool (an inline op that must wait)
    defer: bool = False
    #: a hello checked on the slow pool: ``(principal or None if refused, api_key)``, for
    #: the loop to apply (:meth:`maasd.broker.hellos.Hellos.checked`)
    hello: tuple[Principal | None, str | None] | None = None
    #: the reply was sent from the slow pool's thread, but for a rest queued on the
    #: connection (``reply`` and ``fds`` are cleared once sent): the loop watches for writing
    queued: bool = False
    #: fds went with a reply sent from the slow pool's thread (the kernel took them again)
    passed_fds: bool = False


@dataclass(frozen=True, slots=True)
class Call:
    """What a handler gets: the service, who asks, and what the connection holds."""

    service: UseCases
    principal: Principal
    #: buffer_id -> attachments of this connection; read only (the loop applies changes)
    held: Mapping[str, int]
    #: the entries this connection put and has not committed or aborted; read only
    staged: Set[str] = frozenset()
    #: running on the event loop (a handler that would wait answers ``Outcome.defer``)
    inline: bool = False
    #: the fds that came with the frame (only for an op that ``takes_fds``); the loop
    #: closes them once the handler returns: a handler never keeps one
    fds: tuple[int, ...] = ()


Handler = Callable[[Call, Any], Outcome]


@dataclass(frozen=True, slots=True)
class Op:
    """How one request type is served: its handler, and whether it may block for long."""

    handler: Handler
    #: True: run on the slow pool (the ledger, prefault, copies); False: inline on the loop,
    #: which every other connection waits for — only operations that answer from memory.
    slow: bool = False
    #: True: once its handler ran, the request's ``buffer_id`` is no longer staged on the
    #: connection unless the entry is still staged (a commit or abort settles it, but for
    #: a refusal that changed nothing: a 507 leaves it to retry)
    settles_staged: bool = False
    #: True: the fds sent with the frame's first byte are the handler's to read
    #: (``Call.fds``); for any other op they are closed unread, as the kernel would
    takes_fds: bool = False


def _attach(call: Call, req: Attach) -> Outcome:
    handle = call.service.handles.open(call.principal, req.buffer_id)
    reply = Attached(
        buffer_id=req.buffer_id,
        size_bytes=handle.size_bytes,
        numa_node=handle.numa_node,
        ttl_s=handle.ttl_s,
    )
    return Outcome(reply, fds=(handle.fd,), attached=req.buffer_id)


def _detach(call: Call, req: Detach) -> Outcome:
    if call.held.get(req.buffer_id, 0) <= 0:
        raise errors.NotFound(f"buffer {req.buffer_id} is not attached on this connection")
    return Outcome(Ok(), detached=req.buffer_id)


def _renew(call: Call, req: Renew) -> Outcome:
    call.service.buffers.renew(call.principal, req.buffer_id, req.ttl_s)
    return Outcome(Ok())


def _lookup(call: Call, req: Lookup) -> Outcome:
    # One attachment per connection and entry, so that the worker detaches once, when it
    # unmaps it: a hit on an entry the connection holds already (a worker's mapping
    # cache) is not counted again. Telling the service which ones it holds saves a count
    # and its drop on every cache hit (two lock rounds and a gauge update, ~5 µs).
    # A DRAM miss that the disk tier or L2 is to be asked about waits for the disk or the
    # network: on the event loop it answers LATER, and runs again on the slow pool
    # (maasd.core.tiers, the one place that says the order).
    held = call.held
    hit = call.service.lookups.find(call.principal, req.keys, held, may_wait=not call.inline)
    if hit is LATER:
        return Outcome(None, defer=True)
    if hit is None:
        raise errors.NotFound("no committed entry carries any of these keys")
    reply = Found(
        key=hit.key, buffer_id=hit.buffer_id, size_bytes=hit.size_bytes, numa_node=hit.numa_node
    )
    if hit.buffer_id in held:  # (the loop deletes a count that drops to 0)
        return Outcome(reply, fds=(hit.fd,))
    return Outcome(reply, fds=(hit.fd,), attached=hit.buffer_id)


def _put(call: Call, req: Put) -> Outcome:
    h = call.service.entries.put(call.principal, req.key, req.size_bytes, req.pool, req.ttl_s)
    reply = Reserved(buffer_id=h.buffer_id, size_bytes=h.size_bytes, numa_node=h.numa_node)
    return Outcome(reply, fds=(h.fd,), staged=h.buffer_id)


def _commit(call: Call, req: Commit) -> Outcome:
    owned = req.buffer_id in call.staged
    try:
        call.service.entries.commit(call.principal, req.buffer_id, owned=owned)
    except Exception:
        if owned:  # whatever went wrong, nothing of it may stay behind
            call.service.entries.abandon(call.principal, req.buffer_id)
        raise
    return Outcome(Ok())


def _publish(call: Call, req: Publish) -> Outcome:
    if len(call.fds) != 1:
        # More than one fd is discarded as it arrives (maasd.broker.inbound): the frame
        # sees none, and the answer cannot tell how many there were.
        raise errors.InvalidRequest(
            "publish needs exactly one fd, the writer's memfd, sent with its frame "
            "(SCM_RIGHTS); this frame came with none the daemon kept (none was sent, more "
            "than one was — all closed unread —, or it came apart from the frame's bytes)"
        )
    made = call.service.publishes.publish(
        call.principal, req.key, call.fds[0], req.size_bytes, req.pool, req.ttl_s
    )
    return Outcome(
        Published(
            buffer_id=made.id,
            size_bytes=made.size_bytes,
            numa_node=made.numa_node,
            tenant_id=made.tenant_id,
            pool_id=made.pool_id,
            persistence=made.persistence,
            created_at=made.created_at,
            expires_at=made.expires_at,
        )
    )


def _abort(call: Call, req: Abort) -> Outcome:
    owned = req.buffer_id in call.staged
    call.service.entries.abort(call.principal, req.buffer_id, owned=owned)
    return Outcome(Ok())


#: request type → how it is served (the one place to add an op).
OPS: dict[type[Request], Op] = {
    Attach: Op(_attach),
    Detach: Op(_detach),
    Renew: Op(_renew, slow=True),
    Lookup: Op(_lookup),
    Put: Op(_put, slow=True),
    Commit: Op(_commit, slow=True, settles_staged=True),
    Abort: Op(_abort, slow=True, settles_staged=True),
    Publish: Op(_publish, slow=True, takes_fds=True),
}


def tenant_of(principal: Principal) -> str:
    """The name a principal's connections are counted under."""
    return "admin" if principal.is_admin else str(principal.tenant_id)


class Dispatcher:
    """Turns frame bodies into outcomes by calling ``service``; never raises."""

    def __init__(self, service: UseCases, log: LogLimiter) -> None:
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
        """The first frame: ``(outcome, principal, api_key)``; any failure closes.

        A welcome's ``outcome.authed`` is the auth generation the key was checked at.
        """
        try:
            req = decode_request(body)
        except msgspec.DecodeError as exc:
            return self.error(errors.InvalidRequest(str(exc)), fields, close=True), None, None
        if not isinstance(req, Hello):
            op = type(req).__name__.lower()
            err = errors.InvalidRequest(f"the first frame must be hello, got {op}")
            return self.error(err, fields, close=True), None, None
        try:
            generation = self.service.auth.generation  # before the check: a revocation
            principal = self.service.auth.authenticate(req.api_key)  # racing it moves it on
        except errors.Unauthorized as exc:
            self.log.log(logging.INFO, "hello-refused", "hello refused", fields)
            return self.error(exc, fields, close=True), None, None
        except Exception as exc:
            return self.error(exc, fields, close=True), None, None
        welcome = Outcome(Welcome(tenant_id=principal.tenant_id, pid=pid), authed=generation)
        return welcome, principal, req.api_key

    def hello_inline(self, body: bytes) -> bool:
        """Whether the hello ``body`` can be answered on the loop: its key is told from
        memory (the admin, a remembered key), or it is refused without a check. Otherwise
        checking it reads the ledger, which the loop must never wait on (a slow or frozen
        database would stall every worker of the host): it goes to the slow pool."""
        try:
            req = decode_request(body)
            return (
                not isinstance(req, Hello)
                or self.service.auth.known_principal(req.api_key) is not None
            )
        except Exception:  # undecodable, or no key: refused at once
            return True

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

    def current(self, generation: int) -> bool:
        """Whether a key checked at ``generation`` needs no new check (no revocation since)."""
        return generation == self.service.auth.generation

    def recheck(self, session: Session, fields: Fields) -> Outcome:
        """Check an idle connection's key again after a revocation (off the loop: it may read
        the ledger). Revoked: a 401 frame and a close, without waiting for the worker's next
        request. Still valid: nothing to send. The ledger unreachable: nothing now — the
        next request checks again."""
        authed = self.service.auth.generation
        try:
            self.service.auth.authenticate(session.api_key)
        except errors.Unauthorized as exc:
            self.log.log(logging.INFO, "key-revoked", "key revoked, closing", fields)
            return self.error(exc, fields)
        except Exception as exc:
            self.log.log(logging.WARNING, "recheck", "key re-check failed", fields, exc_info=exc)
            return Outcome(None)
        return Outcome(None, authed=authed)

    def run(
        self, op: Op, req: Request, session: Session, fields: Fields, *, inline: bool = False
    ) -> Outcome:
        """Serve one request; the key is checked again first if any key was revoked since
        the connection's last check (a revoked key answers 401 and closes). ``inline``: on
        the event loop; the outcome may then be a ``defer`` (run it on the slow pool)."""
        principal, authed = session.principal, None
        try:
            if not self.current(session.generation):
                authed = self.service.auth.generation
                principal = self.service.auth.authenticate(session.api_key)
        except errors.Unauthorized as exc:
            self.log.log(logging.INFO, "key-revoked", "key no longer valid, closing", fields)
            return self.error(exc, fields)
        except Exception as exc:
            return self.error(exc, fields)
        try:
            call = Call(self.service, principal, session.held, session.staged, inline, session.fds)
            outcome = op.handler(call, req)
        except Exception as exc:
            outcome = self.error(exc, fields)
        if op.settles_staged:
            buffer_id = getattr(req, "buffer_id", None)
            # Settled unless it is still staged: a commit refused with nothing changed
            # (507, the ledger cannot be written) leaves the entry this connection's, to
            # retry or abort — and its close to abandon.
            if buffer_id is not None and not self.service.entries.staged(buffer_id):
                outcome.unstaged = buffer_id
        outcome.authed = authed
        return outcome


@dataclass(frozen=True, slots=True)
class Session:
    """What a request runs with: the connection's principal, its key and the generation
    the key was last checked at, and what it holds (snapshots for a slow op)."""

    principal: Principal
    api_key: str
    generation: int
    held: Mapping[str, int]
    staged: Set[str]
    #: the fds the frame came with, for an op that takes them (closed once it ran)
    fds: tuple[int, ...] = ()
