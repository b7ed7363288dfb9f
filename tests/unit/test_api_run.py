"""The REST API's service-call runner (maasd.api.auth.Run): each caller's share of the threads.

A caller flooding the API holds at most its share of the threads; its further calls wait
in its own queue, without a thread, and another caller's call takes a free thread at once.
Counted, not timed: calls block on an event until the test lets them go.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from maasd.api.auth import Run
from maasd.models import Principal

THREADS = 4
SHARE = 2
FLOOD = 10


def tenant(name: str) -> Principal:
    return Principal(is_admin=False, tenant_id=name)


def test_a_caller_holds_at_most_its_share_and_another_one_is_served_meanwhile() -> None:
    run = Run(THREADS, per_caller=SHARE)
    release = threading.Event()
    lock = threading.Lock()
    running = 0
    most = 0

    def slow() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(30)
        with lock:
            running -= 1

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            flooder = run.of(tenant("flooder"))
            for _ in range(FLOOD):
                tg.start_soon(flooder, slow)
            while True:  # until the flood holds its share
                await anyio.sleep(0.01)
                with lock:
                    if running == SHARE:
                        break
            # The flood waits in its own queue: another tenant gets a thread at once,
            # and so does the admin, while every call of the flood is still blocked.
            assert await run.of(tenant("bystander"))(lambda: "served") == "served"
            assert await run.of(Principal(is_admin=True))(lambda: "served") == "served"
            with lock:
                assert running == SHARE
            assert run.in_pool == SHARE
            assert run.callers() == 1  # the bystanders' shares are gone with their calls
            release.set()
        assert run.callers() == 0

    anyio.run(main)
    assert most == SHARE


def test_the_share_defaults_to_every_thread() -> None:
    run = Run(THREADS)
    assert run.per_caller == THREADS


def test_a_failing_call_gives_its_share_back() -> None:
    run = Run(THREADS, per_caller=1)

    def boom() -> None:
        raise ValueError("refused")

    async def main() -> None:
        caller = run.of(tenant("t"))
        with anyio.fail_after(30):  # with a share of 1, one not given back would block
            for _ in range(3):
                with pytest.raises(ValueError, match="refused"):
                    await caller(boom)
        assert run.callers() == 0
        assert await caller(lambda: 1) == 1

    anyio.run(main)


def test_a_call_cancelled_while_it_runs_is_waited_for_and_one_not_started_never_runs() -> None:
    """A request cancelled (its client gone) does not give its thread or its share back
    while its call still runs: the call cannot be stopped, and a caller that cancelled
    and retried would otherwise hold more than its share. A call still queued for a
    thread when it is cancelled is dropped."""
    run = Run(1, per_caller=1)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(30)
        ran.append("slow")

    async def main() -> None:
        caller = run.of(tenant("t"))
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                running, queued = anyio.CancelScope(), anyio.CancelScope()

                async def call_slow() -> None:
                    with running:
                        await caller(slow)

                async def never() -> None:
                    with queued:
                        await run(lambda: ran.append("never"))

                tg.start_soon(call_slow)
                await anyio.to_thread.run_sync(started.wait)
                tg.start_soon(never)
                await anyio.sleep(0.05)  # queued behind slow (one thread)
                queued.cancel()
                running.cancel()  # slow's request too, while slow runs
                await anyio.sleep(0.05)
                assert run.callers() == 1  # its share is still held: slow runs
                assert run.in_pool == 1
                release.set()
            assert run.callers() == 0
            assert run.in_pool == 0
            assert await run(lambda: "next") == "next"  # the thread is free again

    anyio.run(main)
    assert ran == ["slow"]


def test_a_call_refused_at_the_thread_limit_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the thread limit the pool cannot start a thread: the call is refused (REST answers
    507, maasd.api.problems) and, although the pool had queued it, no thread runs it later."""
    run = Run(THREADS)
    ran: list[str] = []

    def refuse(_self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async def main() -> None:
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", refuse)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                await run(lambda: ran.append("refused"))
        assert run.in_pool == 0
        # a thread starts now and goes through the queue: the refused call is skipped
        assert await run(lambda: "next") == "next"

    anyio.run(main)
    assert ran == []
