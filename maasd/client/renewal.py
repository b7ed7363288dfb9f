"""``LeaseRenewer``: the thread that keeps a worker's attached buffers leased.

A buffer's lease runs out unless it is renewed; a worker that attached it means to
keep it while it maps it, whatever its lease. So each attached buffer has its own
time in one schedule (:class:`RenewalSchedule`, a heap): the first renewal comes soon
after the attach (at most ``FIRST_RENEWAL_S`` later: how much of the lease is left then
is not known), and each one after that a third of the lease after the last one was
sent (``period_s``), never more often than every ``MIN_PERIOD_S`` unless the owner
caps the period lower (``max_period_s``). A renew sets the
lease to ``ttl_s`` from when the daemon serves it, so it ends no sooner than
``ttl_s`` after the request was sent: for a lease of 2 s or more, two renewals may
fail in a row before it ends.

The thread sleeps until the first renewal due, or the owner's next round (every
``round_s`` it runs ``each_round``: the worker ages idle entry mappings out there,
so a worker that makes no lookups still lets them go), whichever is sooner; an
attach or a detach costs a heap push or a dict update, not a thread.

A buffer the daemon no longer knows (released, expired) is logged once and not
asked about again: its stale mapping reads zeros. A broken connection or a revoked
key ends the thread (logged, unless the owner is closing; the daemon closes a
connection whose key it revoked); any other refusal is logged and tried again a
period later.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from maasd.client.errors import ConnectionFailed, MaasdClientError, NotFound, Unauthorized

__all__ = ["FIRST_RENEWAL_S", "MIN_PERIOD_S", "LeaseRenewer", "RenewalSchedule", "period_s"]

logger = logging.getLogger("maasd.client.worker")

#: A buffer is first renewed at most this long after it is attached.
FIRST_RENEWAL_S = 1.0
#: No buffer is renewed more often than this, however short its lease.
MIN_PERIOD_S = 0.5


def period_s(ttl_s: int, max_period_s: float | None = None) -> float:
    """Seconds between two renewals of a buffer leased ``ttl_s`` at each: a third of the
    lease (at least ``MIN_PERIOD_S``), or ``max_period_s`` if that is shorter."""
    period = max(MIN_PERIOD_S, ttl_s / 3)
    return period if max_period_s is None else min(period, max_period_s)


class RenewalSchedule:
    """When each watched buffer is renewed next (pure: the caller says what time it is).

    A buffer is watched once per attachment (:meth:`watch`, :meth:`unwatch`): it is
    scheduled from its first attachment until its last one ends. The heap may hold
    stale times (a buffer unwatched or renewed since): they are skipped when they come up.
    """

    def __init__(self, max_period_s: float | None = None) -> None:
        self.max_period_s = max_period_s
        #: buffer_id -> [attachments, ttl_s, sequence of its live heap item]
        self._watched: dict[str, list[int]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._watched)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._watched

    def watch(self, buffer_id: str, ttl_s: int, now: float) -> None:
        """One more attachment of ``buffer_id``, to be renewed to ``ttl_s``; the first one
        is renewed within ``FIRST_RENEWAL_S``."""
        w = self._watched.get(buffer_id)
        if w is not None:
            w[0] += 1
            return
        first = min(FIRST_RENEWAL_S, period_s(ttl_s, self.max_period_s))
        self._watched[buffer_id] = [1, ttl_s, -1]
        self._push(buffer_id, now + first)

    def unwatch(self, buffer_id: str) -> None:
        """One attachment fewer; after the last one the buffer is not renewed again."""
        w = self._watched.get(buffer_id)
        if w is None:
            return
        w[0] -= 1
        if w[0] <= 0:
            del self._watched[buffer_id]

    def forget(self, buffer_id: str) -> None:
        """Never renew ``buffer_id`` again (the daemon no longer knows it)."""
        self._watched.pop(buffer_id, None)

    def next_at(self) -> float | None:
        """When the next renewal is due; ``None`` with nothing to renew."""
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[tuple[str, int]]:
        """The buffers to renew now, with the ``ttl_s`` of each; they are not due again
        until :meth:`renewed` says when the renewal was sent."""
        out: list[tuple[str, int]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if self._current(item):
                w = self._watched[item[2]]
                w[2] = -1
                out.append((item[2], w[1]))
        return out

    def renewed(self, buffer_id: str, sent_at: float) -> None:
        """A renewal of ``buffer_id`` was sent at ``sent_at`` (or failed then, to be tried
        again): the next one is a period later, if it is still watched."""
        w = self._watched.get(buffer_id)
        if w is not None and w[2] == -1:
            self._push(buffer_id, sent_at + period_s(w[1], self.max_period_s))

    def _push(self, buffer_id: str, at: float) -> None:
        seq = next(self._seq)
        self._watched[buffer_id][2] = seq
        heapq.heappush(self._heap, (at, seq, buffer_id))

    def _current(self, item: tuple[float, int, str]) -> bool:
        w = self._watched.get(item[2])
        return w is not None and w[2] == item[1]


class LeaseRenewer:
    """Renews watched buffers with ``renew(buffer_id, ttl_s)`` as :class:`RenewalSchedule`
    says, and runs ``each_round()`` every ``round_s`` seconds, in a daemon thread
    started by :meth:`start` and ended by :meth:`stop`."""

    def __init__(
        self,
        round_s: float,
        renew: Callable[[str, int], object],
        each_round: Callable[[], object],
        max_period_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.round_s = round_s
        self.schedule = RenewalSchedule(max_period_s)
        self._renew = renew
        self._each_round = each_round
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        self._thread: threading.Thread | None = None

    def watch(self, buffer_id: str, ttl_s: int) -> None:
        """One more attachment of ``buffer_id``: keep it leased (``ttl_s`` at each renewal)."""
        with self._cond:
            self.schedule.watch(buffer_id, ttl_s, self._clock())
            self._cond.notify()

    def unwatch(self, buffer_id: str) -> None:
        """One attachment of ``buffer_id`` fewer: after the last, it is renewed no more."""
        with self._cond:
            self.schedule.unwatch(buffer_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="maasd-worker-renew", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end: it leaves at its next wait or check, or when the request
        it is in fails (the owner shuts the connection down to wake it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end, unless it is the caller (a close from the thread)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _next(self, round_at: float) -> list[tuple[str, int]] | None:
        """Wait until a round or a renewal is due: the renewals due (empty: a round);
        ``None`` once stopping."""
        with self._cond:
            while not self._stopping:
                now = self._clock()
                due = self.schedule.due(now)
                if due or now >= round_at:
                    return due
                at = self.schedule.next_at()
                self._cond.wait(round_at - now if at is None else min(at, round_at) - now)
            return None

    def _run(self) -> None:
        round_at = self._clock() + self.round_s
        while (due := self._next(round_at)) is not None:
            if self._clock() >= round_at:
                self._each_round()
                round_at = self._clock() + self.round_s
            for buffer_id, ttl_s in due:
                if self._stopping or not self._renew_one(buffer_id, ttl_s):
                    return

    def _renew_one(self, buffer_id: str, ttl_s: int) -> bool:
        """Renew one buffer and schedule its next renewal; False: the thread ends."""
        with self._cond:
            if buffer_id not in self.schedule:  # detached since it came up: not renewed
                return True
        sent_at = self._clock()
        try:
            self._renew(buffer_id, ttl_s)
        except NotFound:
            # Released or expired: a stale mapping now reads zeros.
            logger.warning("lease renewal: buffer %s is gone", buffer_id)
            with self._cond:
                self.schedule.forget(buffer_id)
            return True
        except (ConnectionFailed, Unauthorized) as exc:
            if not self._stopping:
                logger.warning("lease renewal stopped: %s", exc)
            return False
        except MaasdClientError as exc:
            logger.warning("lease renewal of %s failed: %s", buffer_id, exc)
        with self._cond:
            self.schedule.renewed(buffer_id, sent_at)
        return True
