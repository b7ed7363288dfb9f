"""REST connections, bounded: how many at once, and how long one may say nothing.

Every connection holds one of the daemon's open files, and uvicorn's h11
server neither caps connections nor closes one that never sends a complete
request. :func:`bounded_h11` makes its protocol class do both:

* past ``max_connections`` a new connection is answered 507 ``resource-limit``
  (the daemon is at a limit of its own, SPEC §2.7) and closed — its request is
  never run. Except one ``GET /healthz``: a liveness probe must not fail (and get
  the daemon restarted) because someone else holds every connection; such a
  connection is served that one request and closed;
* a connection that starts no request within ``idle_s``, or whose request body
  has not arrived a tick later, is closed, so slow or silent clients cannot keep
  files open: a request must arrive whole within ``2 × idle_s``.

The daemon passes it as uvicorn's ``http`` protocol class (``maasd serve``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from maasd.errors import ResourceLimit
from maasd.problems import problem_of

__all__ = ["IDLE_S", "BoundedH11Protocol", "bounded_h11", "refusal"]

#: Seconds a connection may go without starting a request.
IDLE_S = 10.0
#: Seconds a refused connection stays open for its peer to read the answer (closing at
#: once, with its request unread, would reset the connection before the answer is read).
LINGER_S = 0.5
#: The one request a connection past the cap may make (and its longest first line).
_PROBE, _FIRST_LINE = b"GET /healthz ", 256


def refusal(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection past the cap."""
    body = msgspec.json.encode(
        problem_of(
            ResourceLimit(
                f"the daemon serves {max_connections} REST connections at once, a limit "
                "derived from its open files; close idle connections or retry shortly"
            )
        )
    )
    head = (
        "HTTP/1.1 507 Insufficient Storage\r\n"
        "content-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n"
        "retry-after: 1\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on connections and an idle timeout; configure it
    with :func:`bounded_h11`."""

    max_connections = 0
    idle_s = IDLE_S
    answer = b""
    _over = False  # past the cap: one GET /healthz, or the refusal
    _deciding = False  # past the cap, its first line not read yet
    _head = b""
    _timer: asyncio.TimerHandle | None = None
    _seen: object = None

    def connection_made(self, transport: Any) -> None:  # an asyncio.Transport
        super().connection_made(transport)
        self._seen = None
        self._over = self._deciding = len(self.connections) > self.max_connections
        self._timer = self.loop.call_later(LINGER_S if self._over else self.idle_s, self._check)

    def data_received(self, data: bytes) -> None:
        if not self._deciding:
            super().data_received(data)
            return
        self._head += data
        if b"\r\n" not in self._head and len(self._head) < _FIRST_LINE:
            return
        self._deciding = False
        if self._head.startswith(_PROBE):
            super().data_received(self._head)
        else:
            self._refuse()

    def _refuse(self) -> None:
        self._deciding = False
        self.transport.write(self.answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._over:  # its one request is answered
            self.transport.close()

    def _check(self) -> None:
        if self.transport.is_closing():
            return
        if self._deciding:  # past the cap, and no first line in time
            self._refuse()
            return
        cycle = self.cycle
        if cycle is not self._seen:  # a request began since the last look
            self._seen = cycle
        elif cycle is None or cycle.response_complete or cycle.more_body:
            # idle since the last look, or the request's body did not arrive in time
            self.transport.close()
            return
        self._timer = self.loop.call_later(self.idle_s, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)


def bounded_h11(max_connections: int, idle_s: float = IDLE_S) -> type[BoundedH11Protocol]:
    """The protocol class for uvicorn's ``http=``: at most ``max_connections`` REST
    connections, each closed after ``idle_s`` without a request."""
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {"max_connections": max_connections, "idle_s": idle_s, "answer": refusal(max_connections)},
    )
