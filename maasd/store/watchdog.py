"""PostgreSQL: a ledger connection held past every bound the server should keep is cut.

Every wait on PostgreSQL is bounded by the server or the kernel (docs/scale-out.md,
"Failure modes"): the server cancels a statement past ``statement_timeout``, TCP
keepalives and ``tcp_user_timeout`` end a connection to a host that is gone. One fault
escapes them all: a server that is *frozen* (``SIGSTOP``, a hung VM, a stuck storage
layer under it) keeps its connections open, its kernel acknowledges every packet, and
its ``statement_timeout`` is frozen with it — a statement sent to it waits until it
thaws, and with it the request, its thread and its pooled connection.

So the engine's pool tells the watchdog of every checkout and checkin; a connection
checked out for longer than ``limit_s`` (twice the statement timeout — a transaction
of two statements that each waited for a row lock — plus the connect timeout and a
second: longer than any ledger transaction of the store that the server still serves) has
its socket shut down (``shutdown(2)`` on a duplicate of libpq's fd, from the watchdog's
thread). The blocked call then fails as a lost connection — 507, and the ledger's
circuit opens — instead of waiting. A connection the store marks unwatched
(:func:`unwatched`: a migration, which may run as long as it needs) is left alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = ["CheckoutWatchdog", "unwatched"]

logger = logging.getLogger(__name__)

#: The connection record's ``info`` key that exempts it until its checkin.
_UNWATCHED = "maasd_unwatched"


def unwatched(info: dict[str, Any]) -> None:
    """Exempt the connection of ``info`` (``Connection.info``) until it is checked in."""
    info[_UNWATCHED] = True


class CheckoutWatchdog:
    """Cuts the pooled PostgreSQL connections of ``engine`` held past ``limit_s``."""

    def __init__(self, engine: Engine, limit_s: float) -> None:
        self.limit_s = limit_s
        self._cond = threading.Condition()
        self._out: dict[int, tuple[float, Any, Any]] = {}  # id(record) -> (due, dbapi, record)
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: connections cut (tests, logs)
        self.cut = 0
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "checkin", self._checkin)

    def _checkout(self, dbapi: Any, record: Any, _proxy: Any) -> None:
        with self._cond:
            self._out[id(record)] = (time.monotonic() + self.limit_s, dbapi, record)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="maasd-ledger-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _checkin(self, _dbapi: Any, record: Any) -> None:
        with self._cond:
            self._out.pop(id(record), None)
            record.info.pop(_UNWATCHED, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for key, (due, dbapi, record) in list(self._out.items()):
                    if due <= now and not record.info.get(_UNWATCHED):
                        del self._out[key]  # once: a checkin of it is a no-op then
                        self._cut(dbapi)
                dues = [due for due, _, r in self._out.values() if not r.info.get(_UNWATCHED)]
                self._cond.wait(max(0.05, min(dues) - now) if dues else None)

    def _cut(self, dbapi: Any) -> None:
        """Shut the connection's socket down (under the lock: it cannot be checked in and
        handed to another caller meanwhile); the call blocked on it fails at once."""
        try:
            fd = dbapi.pgconn.socket
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except Exception as exc:  # closed meanwhile: nothing left to cut
            logger.debug("ledger watchdog: nothing to cut (%s)", exc)
            return
        self.cut += 1
        logger.warning(
            "a ledger connection was held %.0f s, past every bound of a serving database "
            "(frozen?): cut",
            self.limit_s,
        )
