"""What other threads hand the event loop, and the wake pipe that makes it turn for them.

A slow operation's outcome (its reply perhaps sent already, :func:`.outbox.answer_now`),
a checked hello and a re-checked key are :meth:`Inbox.post`-ed from slow-pool threads; a
revocation or a released entry only :meth:`Inbox.wake`-s the loop. Either writes a byte
to the wake pipe, which the loop's selector watches, so ``select()`` returns at once
instead of at its next deadline.

Once the loop has finished (:meth:`Inbox.finish`), nothing is posted or woken any more:
an outcome posted then is given back on the poster's thread (``undeliverable``), and
the pipe is not written after :meth:`Inbox.close` closed it. One lock orders the two.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import threading
from collections.abc import Callable, Iterator

from .connection import Connection
from .dispatch import Outcome

__all__ = ["Inbox"]


class Inbox:
    """Outcomes for the loop from any thread; :meth:`take` and :meth:`drain` on the loop's."""

    def __init__(
        self,
        sel: selectors.BaseSelector,
        undeliverable: Callable[[Connection, Outcome], None],
    ) -> None:
        """``undeliverable(conn, outcome)`` gives back an outcome the loop will never see."""
        self._undeliverable = undeliverable
        self._results: collections.deque[tuple[Connection, Outcome]] = collections.deque()
        self._lock = threading.Lock()
        self._finished = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        sel.register(self._wake_r, selectors.EVENT_READ, self)

    def __bool__(self) -> bool:
        """Whether outcomes wait for the loop."""
        return bool(self._results)

    def post(self, conn: Connection, outcome: Outcome) -> None:
        """Hand ``outcome`` to the loop (any thread); given back here if the loop is gone."""
        with self._lock:
            if not self._finished:
                self._results.append((conn, outcome))
                self._wake()
                return
        self._undeliverable(conn, outcome)

    def wake(self) -> None:
        """Make the loop turn now (any thread): e.g. a key was revoked."""
        with self._lock:
            if not self._finished:
                self._wake()

    def _wake(self) -> None:
        """Make select() return (caller holds ``_lock`` and the loop is not finished)."""
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"\0")

    def take(self) -> Iterator[tuple[Connection, Outcome]]:
        """(loop thread) The outcomes posted so far, and any posted while they are taken."""
        results = self._results
        while results:
            yield results.popleft()

    def drain(self) -> None:
        """(loop thread) The wake pipe is readable: empty it."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    def finish(self) -> None:
        """(loop thread, stopping) Take nothing more: later posts are given back at once."""
        with self._lock:
            self._finished = True

    def close(self) -> None:
        """(loop thread, after :meth:`finish`) Give back what was posted and never taken;
        close the pipe (nobody writes it after this)."""
        for conn, outcome in self.take():
            self._undeliverable(conn, outcome)
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
