"""Pacing for the broker's failure paths: accept back-off and rate-limited log lines.

A peer can make the same failure happen thousands of times a second (connect
until the daemon runs out of fds, send garbage, say a wrong key). Neither the
retry nor the log line may then cost more than a small fixed rate.

    >>> b = Backoff(first_s=0.01, cap_s=1.0)
    >>> [round(b.fail(now=0.0) , 2) for _ in range(9)]
    [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]
    >>> b.succeed()
    >>> b.failing_for(now=5.0)
    0.0
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Backoff", "Fields", "LogLimiter"]

#: Structured-logging fields, or a callable that builds them only when a line is written.
Fields = dict[str, object] | Callable[[], dict[str, object]]


class Backoff:
    """A pause that doubles with each consecutive failure, from ``first_s`` up to ``cap_s``.

    :meth:`fail` returns the pause to take now; :meth:`succeed` ends the streak.
    :meth:`failing_for` says how long the current streak of failures has lasted
    (0 when there is none), which is what a health check wants to know.
    """

    def __init__(self, first_s: float = 0.01, cap_s: float = 1.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = 0.0
        self.since: float | None = None

    def fail(self, now: float) -> float:
        self.delay_s = self.first_s if self.delay_s == 0 else min(self.cap_s, self.delay_s * 2)
        if self.since is None:
            self.since = now
        return self.delay_s

    def succeed(self) -> None:
        self.delay_s = 0.0
        self.since = None

    def failing_for(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since


class LogLimiter:
    """At most one line per ``key`` every ``interval_s``; the next line counts the rest.

    ``key`` names a kind of event ("accept", "hello-timeout", …), never a peer, so
    the table stays as small as the set of kinds. Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when logged, suppressed since)

    def log(
        self,
        level: int,
        key: str,
        msg: str,
        fields: Fields | None = None,
        *,
        exc_info: BaseException | None = None,
    ) -> bool:
        """Log ``msg`` with ``fields`` unless ``key`` was logged within the interval.

        Returns whether the line was written. A written line after suppressed ones
        carries ``suppressed=N``.
        """
        now = self.clock()
        with self._lock:
            when, suppressed = self._last.get(key, (None, 0))
            if when is not None and now - when < self.interval_s:
                self._last[key] = (when, suppressed + 1)
                return False
            self._last[key] = (now, 0)
        extra = dict((fields() if callable(fields) else fields) or {})
        if suppressed:
            extra["suppressed"] = suppressed
        self.logger.log(level, msg, extra=extra, exc_info=exc_info)
        return True
