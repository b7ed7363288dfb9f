"""Ledger calls on a hot path (an event loop) are counted; elsewhere they are not."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from maasd.api.loop import GuardedLoop
from maasd.store import Store, hotpath
from maasd.tenancy import keys


def test_only_calls_on_a_marked_thread_count(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    store.upgrade()
    try:
        before = hotpath.calls()
        store.tenants.add_tenant(keys.new_id(), "t", 1 << 20, time.time())
        store.tenants.tenants()
        assert hotpath.calls() == before  # this thread is no hot path

        def on_a_loop() -> None:
            hotpath.mark()
            store.tenants.tenants()  # a read
            store.tenants.add_tenant(keys.new_id(), "u", 1 << 20, time.time())  # a write

        t = threading.Thread(target=on_a_loop)
        t.start()
        t.join()
        assert hotpath.calls() == before + 2
        store.tenants.tenants()
        assert hotpath.calls() == before + 2  # the mark is the other thread's only
    finally:
        store.dispose()


def test_the_rest_servers_loop_is_a_hot_path() -> None:
    seen: list[int] = []

    def on_its_thread() -> None:
        loop = GuardedLoop()
        before = hotpath.calls()

        async def call() -> None:
            hotpath.count()

        try:
            loop.run_until_complete(call())
        finally:
            loop.close()
        seen.append(hotpath.calls() - before)

    t = threading.Thread(target=on_its_thread)
    t.start()
    t.join()
    assert seen == [1]
