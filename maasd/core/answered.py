"""Work a use-case owes that its caller's answer need not wait for: run after the answer.

A commit's tail — handing the staging region to the reclaimer (which wakes its thread)
and the L2 write-behind's hook — changes nothing the answer says, but on a host whose
CPUs are shared every thread it wakes competes with the reply for the interpreter and
a CPU. A caller that answers a peer wraps the use-case in :func:`answering`, hands the
answer over, then runs what was deferred; anywhere else (REST, a test calling the
service in process) :func:`after_answer` runs the work at once, so a use-case behaves
the same whoever calls it. Nothing deferred here may be needed for the answer to be
true: the ledger and the in-memory index are settled before it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

__all__ = ["Deferred", "after_answer", "answering"]

logger = logging.getLogger(__name__)

_local = threading.local()


class Deferred:
    """What a use-case deferred while it served one request (:func:`answering`)."""

    __slots__ = ("_work",)

    def __init__(self) -> None:
        self._work: list[Callable[[], object]] = []

    def __bool__(self) -> bool:
        return bool(self._work)

    def add(self, fn: Callable[[], object]) -> None:
        self._work.append(fn)

    def run(self) -> None:
        """Run every deferred call in order, also those they defer in turn; one that
        raises is logged, the rest still run (the answer is out: there is no one left to
        tell)."""
        while self._work:
            work, self._work = self._work, []
            for fn in work:
                try:
                    fn()
                except Exception:
                    logger.exception("work deferred past an answer failed")


@contextlib.contextmanager
def answering() -> Iterator[Deferred]:
    """While the block runs, :func:`after_answer` on this thread defers to the yielded
    :class:`Deferred`; the caller runs it once the answer is handed over (also when the
    block raised: what was deferred is still owed)."""
    outer = getattr(_local, "deferred", None)
    deferred = Deferred()
    _local.deferred = deferred
    try:
        yield deferred
    finally:
        _local.deferred = outer


def after_answer(fn: Callable[[], object]) -> None:
    """Run ``fn`` once the current request is answered: later, inside :func:`answering`;
    now, anywhere else."""
    deferred: Deferred | None = getattr(_local, "deferred", None)
    if deferred is None:
        fn()
    else:
        deferred.add(fn)
