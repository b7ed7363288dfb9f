"""The ledger's circuit: fail fast while the database is known to be down, probe it apart.

When a statement finds the database gone (a refused or lost connection, a server shut
down, a file that cannot be opened: :func:`maasd.store.base.unavailable` with
``outage=True``), the circuit opens. While it is open every ledger call raises
:class:`~maasd.errors.LedgerUnavailable` at once, without waiting for a connect or a
statement timeout: a request that needs a new row is answered 507 in microseconds, and
the threads that serve requests are never all stuck on a dead server. One thread of the
circuit's own probes the database (``SELECT 1``) with a backoff of 0.1 s doubling to
``max_backoff_s``; its first success closes the circuit and calls the ``on_up``
callbacks (the core writes what it batched meanwhile). Contention is no outage: an
exhausted connection pool or a statement timeout answer 507 but leave it closed.

A SQLite file that can be read but not written — its write lock held past the busy
timeout by another process, its disk full, its file system read-only — opens the circuit
for *writes only* (``trip(..., writes_only=True)``): reads go on (``check(write=False)``
passes), every write is 507 at once instead of each waiting out the busy timeout in
turn, and the probe is ``write_probe`` (a harmless committed write with a short wait).

::

    closed ──an outage error──► open (every call: 507 at once) ──probe succeeds──► closed
    closed ──locked/full/read-only──► open for writes (reads go on) ──write probe──► closed

An outage of reads seen while the circuit is open for writes widens it; when the read
probe then succeeds, the circuit narrows back to writes only (the writes were never
shown to work again) and closes on the write probe's first success.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from maasd.errors import LedgerUnavailable

__all__ = ["LedgerCircuit"]

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.1


class LedgerCircuit:
    """Thread-safe. ``probe()`` raises while the database cannot serve; ``clock`` is
    wall time (``down_since`` is reported to operators)."""

    def __init__(
        self,
        probe: Callable[[], None],
        *,
        write_probe: Callable[[], None] | None = None,
        max_backoff_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._probe = probe
        self._write_probe = write_probe or probe
        self._writes_only = False
        # writes were seen failing during this outage: only the write probe closes it
        self._writes_out = False
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_up: list[Callable[[], None]] = []
        #: times the circuit opened (metrics, tests)
        self.opened = 0

    @property
    def down_since(self) -> float | None:
        """When the current outage was noticed (wall time); ``None`` while the ledger serves."""
        return self._down_since

    @property
    def why(self) -> str:
        return self._why

    @property
    def writes_only(self) -> bool:
        """Open for writes only: the database can be read (see the module docstring)."""
        return self._down_since is not None and self._writes_only

    def check(self, *, write: bool = True) -> None:
        """Raise :class:`LedgerUnavailable` at once while the circuit is open (for a
        read, ``write=False``: only while it is open for reads too)."""
        if self._down_since is not None and (write or not self._writes_only):
            raise LedgerUnavailable(f"the ledger database cannot serve now ({self._why}); retry")

    def on_up(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the probe's thread) each time an outage ends."""
        with self._lock:
            self._on_up.append(callback)

    def trip(self, why: str, *, writes_only: bool = False) -> None:
        """An outage was seen: open the circuit (if closed) and start probing.
        ``writes_only``: the database can be read, not written. An outage of reads
        widens a circuit open for writes only."""
        with self._lock:
            if self._stop.is_set():
                return
            if self._down_since is not None:
                if self._writes_only and not writes_only:
                    self._writes_only, self._why = False, why
                self._writes_out |= writes_only
                return
            self._down_since, self._why = self._clock(), why
            self._writes_only = self._writes_out = writes_only
            self.opened += 1
            self._thread = threading.Thread(
                target=self._run, name="maasd-ledger-probe", daemon=True
            )
            self._thread.start()
        logger.warning("ledger unavailable (%s): failing fast until it answers again", why)

    def close(self) -> None:
        """Stop probing (the store is being disposed)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        delay = _FIRST_BACKOFF_S
        while not self._stop.wait(delay):
            writes = self._writes_only
            try:
                (self._write_probe if writes else self._probe)()
            except Exception as exc:
                logger.debug("ledger probe failed: %s", exc)
                delay = min(delay * 2, self._max_backoff_s)
                continue
            if not writes and self._narrowed():
                delay = _FIRST_BACKOFF_S
                continue
            self._closed()
            return

    def _narrowed(self) -> bool:
        """After a read probe's success: back to writes only if writes failed during this
        outage (and a write probe of their own exists); whether it did."""
        with self._lock:
            if not self._writes_out or self._write_probe is self._probe:
                return False
            self._writes_only = True
        logger.warning("ledger readable again; writes still probed (%s)", self._why)
        return True

    def _closed(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
            self._writes_only = self._writes_out = False
            callbacks = list(self._on_up)
        if since is not None:
            logger.warning("ledger reachable again after %.1f s", self._clock() - since)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one callback's failure must not keep the others from running
                logger.exception("a ledger-up callback failed")
