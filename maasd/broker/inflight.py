"""Fds in flight: what a peer that never reads may make the daemon's user hold.

Each fd the daemon sends stays *in flight* in the peer's receive queue until the
peer reads it, and the kernel counts those, per sending user, against its
``RLIMIT_NOFILE``: past it every ``sendmsg`` with an fd fails (``ETOOMANYREFS``),
for every tenant. Closing the connection does not help — the fds stay in the
peer's queue until it reads or closes. So:

* a reply with fds waits until the peer has read everything sent before it
  (:mod:`.connection`), retried every :data:`PEER_READ_POLL_S` until the send
  deadline closes the connection; no further frame is read meanwhile;
* a connection closed while its peer has not read fds sent to it is *drained*:
  it gives back everything else at once, shuts its write side and stays counted
  (its tenant's, its uid's and the total caps) until the peer reads what it was
  sent or hangs up, checked every :data:`DRAIN_POLL_S`.

The fds in flight from the daemon are then at most one per connection, bounded
by ``socket_max_connections``. If the kernel refuses a reply's fds anyway (other
processes of the daemon's user hold the rest), the reply becomes a 507
``resource-limit`` error frame, and :meth:`InFlight.refusal` makes ``/healthz``
say so until fds pass again (or :data:`FDS_REFUSED_UNHEALTHY_S` after the last).
"""

from __future__ import annotations

from .connection import Connection
from .deadlines import Deadlines
from .sink import recv_discarding

__all__ = ["InFlight"]

#: A reply with fds waiting for its peer to read the previous one is retried this often.
PEER_READ_POLL_S = 0.02
#: A drained connection (closed, its peer not having read its fds) is checked this often.
DRAIN_POLL_S = 0.5
#: Bytes read (and dropped) from a drained connection at once.
DRAIN_RECV_BYTES = 16 * 1024
#: The broker reports itself unhealthy this long after the kernel last refused fds.
FDS_REFUSED_UNHEALTHY_S = 30.0

REFUSED_DETAIL = (
    "the kernel refuses to pass more fds from the daemon (ETOOMANYREFS: its user has "
    "RLIMIT_NOFILE fds in flight, sent and not yet received)"
)


class InFlight:
    """The timers of held replies and drained connections, and the kernel's refusals."""

    def __init__(self) -> None:
        #: replies with fds held until their peer reads the one before
        self.held: Deadlines[Connection] = Deadlines(PEER_READ_POLL_S)
        #: closed connections whose peer has yet to read the fds it was sent
        self.draining: Deadlines[Connection] = Deadlines(DRAIN_POLL_S)
        #: when the kernel last refused a reply's fds (ETOOMANYREFS), and how often
        self.refused_at: float | None = None
        self.refused = 0

    def next_due(self) -> float | None:
        held, draining = self.held.next(), self.draining.next()
        if held is None or draining is None:
            return draining if held is None else held
        return min(held, draining)

    def drained(self, now: float) -> list[Connection]:
        """Drained connections whose peer has now read everything (the rest wait on)."""
        done = []
        for conn in self.draining.expired(now):
            if conn.unread():
                self.draining.start(conn, now)
            else:
                done.append(conn)
        return done

    def refuse(self, now: float) -> None:
        self.refused_at = now
        self.refused += 1

    def refusal(self, now: float) -> str | None:
        """Why the broker is unhealthy while the kernel refuses its fds, or None."""
        at = self.refused_at
        if at is None or now - at > FDS_REFUSED_UNHEALTHY_S:
            return None
        return (
            f"the kernel refused the fds of {self.refused} replies (ETOOMANYREFS), the last "
            f"{now - at:.0f} s ago: the daemon's user has RLIMIT_NOFILE fds in flight"
        )


def peer_ended(conn: Connection) -> bool:
    """A drained connection is readable: drop what its peer sent; True at its EOF."""
    try:
        return not recv_discarding(conn.sock, DRAIN_RECV_BYTES)
    except BlockingIOError:
        return False
    except OSError:
        return True
