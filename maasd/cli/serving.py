"""REST connections, bounded: how many at once, and how long one may say nothing.

Every connection holds one of the daemon's open files, and uvicorn's h11
server neither caps connections nor closes one that never sends a complete
request. :func:`bounded_h11` makes its protocol class do both:

* past ``max_connections`` a new connection is answered 507 ``resource-limit``
  (the daemon is at a limit of its own, SPEC §2.7) and closed — its request is
  never read or run;
* a connection that starts no request within ``idle_s`` (and is not waiting
  for an answer) is closed, so slow or silent clients cannot keep files open:
  a request must arrive whole within ``idle_s``–``2 × idle_s``.

The daemon passes it as uvicorn's ``http`` protocol class (``maasd serve``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from maasd.errors import ResourceLimit
from maasd.problems import problem_of

__all__ = ["IDLE_S", "bounded_h11", "refusal"]

#: Seconds a connection may go without starting a request.
IDLE_S = 10.0
#: Seconds a refused connection stays open for its peer to read the answer (closing at
#: once, with its request unread, would reset the connection before the answer is read).
LINGER_S = 0.5


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


def bounded_h11(max_connections: int, idle_s: float = IDLE_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a cap on connections and an idle timeout."""
    answer = refusal(max_connections)

    class BoundedH11Protocol(H11Protocol):
        _refused = False
        _idle: asyncio.TimerHandle | None = None
        _seen: object = None

        def connection_made(self, transport: Any) -> None:  # an asyncio.Transport
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refused = True
                transport.write(answer)
                if transport.can_write_eof():
                    transport.write_eof()
                self.loop.call_later(LINGER_S, transport.close)
                return
            self._seen = None
            self._idle = self.loop.call_later(idle_s, self._check_idle)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def _check_idle(self) -> None:
            if self.transport.is_closing():
                return
            cycle = self.cycle
            started = cycle is not self._seen
            waiting = cycle is not None and not cycle.response_complete
            if not started and not waiting:
                self.transport.close()
                return
            self._seen = cycle
            self._idle = self.loop.call_later(idle_s, self._check_idle)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            super().connection_lost(exc)

    return BoundedH11Protocol
