"""A lookup misses an entry whose lease has ended, before the reaper releases it; an
attach misses such a buffer likewise.

Before, a socket ``lookup`` answered such an entry from memory until the reaper's next
pass, and the hit extended its lease: an entry looked up often enough lived on past
the lease its tenant gave it (SPEC §2 invariant 4 lists lease expiry among the
releases). Now the daemon knows each held entry's lease end (from its row, a renew, a
hit) and a lookup past it misses. A renew that only the ledger saw (through another
host's daemon on a shared ledger) is picked up by the reaper's next pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon
from maasd.client import Client, Scratch, Worker
from maasd.client.errors import NotFound, StateConflict
from maasd.protocol import Attach, Attached
from maasd.store import Store
from rawentries import connect
from waiting import wait_until

KiB = 1 << 10


@pytest.fixture(scope="module")
def slow_reaper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose reaper passes once a minute: a lease's end is the lookup's to see."""
    d = Daemon(
        tmp_path_factory.mktemp("slow-reaper"),
        env={"MAASD_REAPER_INTERVAL_S": "60", "MAASD_HOST_TIMEOUT_S": "180"},
    )
    d.start()
    yield d
    d.close()


def test_a_lookup_after_the_lease_ended_misses_and_does_not_revive_it(slow_reaper: Daemon):
    _, key = slow_reaper.tenant("lease-ends", 64 * 1024 * KiB)
    with Worker(slow_reaper.socket_path, key, renew_interval_s=0) as w, Scratch(64 * KiB) as s:
        s.array[:] = 9
        entry = w.publish("short", s, 64 * KiB, ttl_s=1)
        hit = w.lookup(["short"])
        assert hit is not None  # within its lease: a hit (which extends it by 1 s)
        hit.close()
        w.forget(entry.id)
        deadline = time.time() + 1.5  # past any lease end the hit gave it
        while time.time() < deadline:
            time.sleep(0.1)
        assert w.lookup(["short"]) is None
        assert w.lookup(["short"]) is None  # a miss extends nothing


def test_a_lease_extended_only_in_the_ledger_is_found_again(daemon: Daemon) -> None:
    tid, key = daemon.tenant("lease-elsewhere", 64 * 1024 * KiB)
    with Worker(daemon.socket_path, key, renew_interval_s=0) as w, Scratch(64 * KiB) as s:
        entry = w.publish("renewed-elsewhere", s, 64 * KiB, ttl_s=2)
        # What a renew through another host's daemon does: the ledger only.
        ledger = Store(f"sqlite:///{Path(daemon.data_dir) / 'maasd.db'}", pool_size=1)
        try:
            ledger.buffers.renew(entry.id, tid, time.time() + 600, ttl_s=600)
        finally:
            ledger.dispose()

        def found() -> bool:
            hit = w.lookup(["renewed-elsewhere"])
            if hit is None:
                return False
            hit.close()
            w.forget(entry.id)
            return True

        time.sleep(2.5)  # past the lease this daemon knew
        wait_until(found, timeout=15, message="the ledger's longer lease was not picked up")
    # ... and its length with it: an attach says what a worker renews it to
    r = connect(daemon, key)
    try:
        reply, fds = r.call(Attach(buffer_id=entry.id))
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, Attached)
        assert reply.ttl_s == 600
    finally:
        r.close()


def test_an_attach_after_the_lease_ended_misses(slow_reaper: Daemon) -> None:
    """Before, a buffer past its lease was handed out until the reaper's next pass."""
    _, key = slow_reaper.tenant("attach-ends", 64 * 1024 * KiB)
    with (
        Client(slow_reaper.url, key) as c,
        Worker(slow_reaper.socket_path, key, renew_interval_s=0) as w,
    ):
        buf = c.reserve(64 * KiB, ttl_s=1)
        w.attach(buf.id).close()  # within its lease (close detaches)
        time.sleep(1.5)
        with pytest.raises(NotFound):
            w.attach(buf.id)
        with pytest.raises(NotFound):  # a miss renews nothing either
            w.attach(buf.id)


def test_a_buffer_renewed_only_in_the_ledger_is_attached_again(daemon: Daemon) -> None:
    tid, key = daemon.tenant("attach-elsewhere", 64 * 1024 * KiB)
    with Client(daemon.url, key) as c, Worker(daemon.socket_path, key, renew_interval_s=0) as w:
        buf = c.reserve(64 * KiB, ttl_s=2)
        ledger = Store(f"sqlite:///{Path(daemon.data_dir) / 'maasd.db'}", pool_size=1)
        try:
            ledger.buffers.renew(buf.id, tid, time.time() + 600)
        finally:
            ledger.dispose()

        def attached() -> bool:
            try:
                w.attach(buf.id).close()
            except NotFound:
                return False
            return True

        time.sleep(2.5)  # past the lease this daemon knew
        wait_until(attached, timeout=15, message="the ledger's longer lease was not picked up")


def test_a_commit_after_the_put_entrys_lease_ended_is_refused(slow_reaper: Daemon) -> None:
    """Before, a staged entry past its lease was committed (until the reaper's next pass)
    while its renew already answered 404: a committed entry no lookup found, reaped later."""
    _, key = slow_reaper.tenant("commit-late", 64 * 1024 * KiB)
    with Worker(slow_reaper.socket_path, key, renew_interval_s=0) as w:
        m = w.put("late", 64 * KiB, ttl_s=1)
        m.array[:] = 3
        time.sleep(1.5)
        with pytest.raises(StateConflict):
            w.commit(m)
        assert w.lookup(["late"]) is None
