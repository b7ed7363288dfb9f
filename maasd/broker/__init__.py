"""The Unix-socket handle server: hands workers their buffers' memfds (docs/client.md).

One event-loop thread serves every connection (:mod:`.loop`); operations that
may block for long run on a small fair pool (:mod:`.slowpool`); every bound is
a :class:`Limits` field. A connection's failure — garbage, an oversized frame,
a peer that vanishes mid-reply or never reads, an unexpected exception — ends
at most that connection; accepting and every other connection carry on.

Life of a connection::

    accept ─ SO_PEERCRED recorded (pid, uid, gid); caps: total, unauthenticated, per uid
      │     over a cap ───────────────────────── error 429 limit-exceeded + close
      │
      ├─ first frame must be hello{api_key}, within hello_timeout_s of accept
      │     anything else / garbage / too late ──── error 400 + close
      │     wrong / revoked key ──────────────────── error 401 + close
      │     tenant at its cap ────────────────────── error 429 + close
      │     ok → welcome{tenant_id, pid}
      │
      ├─ attach{buffer_id}  → attached{…} + memfd in the same sendmsg (SCM_RIGHTS)
      │                       foreign / unknown → error 404 and no fd
      ├─ detach{buffer_id}  → ok        (drops one attachment of this connection)
      ├─ renew{buffer_id, ttl_s} → ok   (on the slow pool: it writes the ledger)
      ├─ lookup / put / commit / abort   the entry fast path (docs/client.md, "Entries")
      ├─ publish{key, size_bytes, …} + the writer's memfd → published{…} (no fd); the
      │     only op that takes fds (:mod:`.inbound`: others' are closed unread)
      │     every op re-authenticates the hello key: revoked → error 401 + close
      │     a bad frame → error 400, the connection survives
      │     a length prefix over 64 KiB → error 400 + close
      │     a reply not read within send_timeout_s → close
      │
      └─ close (EOF, crash, stop()) → a handle dropped for every attachment still held

Example::

    broker = Broker(svc.socket_use_cases(), "/var/lib/maasd/maasd.sock")
    broker.start()
    ...
    broker.stop()
"""

from .dispatch import OPS, Op, Outcome, UseCases
from .limits import Limits
from .server import Broker

__all__ = ["OPS", "Broker", "UseCases", "Limits", "Op", "Outcome"]
