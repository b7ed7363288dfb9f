"""What an entry's release does to the value it wrote to L2 (maasd.l2.ends, the queue's
delete lane, the tier's deletes), over the fake client of test_l2_parts. (With a real
Redis and two daemons: integration/test_l2_release.py.)"""

from __future__ import annotations

import threading

import pytest

from maasd.l2.ends import Ends, Written
from maasd.l2.queue import Job, WriteQueue
from waiting import wait_until

pytest.importorskip("xxhash", reason="needs the l2 extra (xxhash)")

from test_l2_parts import encode, sample, tier

DATA = b"d" * 256


def source_of(data: bytes = DATA):  # -> a Source that serves every buffer id
    def source(_buffer_id: str, _tenant_id: str, _key: str, head: int) -> bytearray | None:
        return bytearray(head) + data

    return source


# ---------------------------------------------------------------------------- ends
@pytest.mark.parametrize(
    ("reason", "drops", "drops_restored"),
    [
        ("release", True, True),  # a tenant's or an admin's DELETE
        ("expire", True, False),
        ("pool_drain", True, False),
        ("evict", False, False),  # L2 is the tier below: an evicted entry's value stays
        ("tenant_delete", False, False),  # drop_tenant does all of them at once
        ("abort", False, False),
    ],
)
def test_which_releases_delete_the_value(reason: str, drops: bool, drops_restored: bool) -> None:
    ends = Ends()
    written, restored = Written("t", "k", b"1" * 16), Written("t", "r", b"2" * 16, True)
    assert ends.offered("t", "b1")
    assert ends.stored("b1", written) is None  # remembered for its release
    ends.restored("b2", restored)
    assert len(ends) == 2
    assert ends.ended("b1", reason) == (written if drops else None)
    assert ends.ended("b2", reason) == (restored if drops_restored else None)
    assert len(ends) == 0  # forgotten whatever the reason
    assert ends.ended("b1", "release") is None  # once


def test_a_release_during_its_write_is_caught_either_side() -> None:
    ends = Ends(recent=2)
    value = Written("t", "k", b"1" * 16)
    # released while queued or being stored: the writer skips it, or deletes what it stored
    assert ends.offered("t", "b1")
    assert ends.ended("b1", "release") is None
    assert not ends.wanted("b1")
    assert ends.stored("b1", value) == value
    # evicted while being stored: the value stays, and is not remembered
    assert ends.offered("t", "b2")
    assert ends.ended("b2", "evict") is None
    assert ends.stored("b2", value) is None
    assert len(ends) == 0
    # released before its write was even offered: the offer is refused
    assert ends.ended("b3", "release") is None
    assert not ends.offered("t", "b3")
    ends.restored("b3", value)  # restored, then released before it was recorded
    assert len(ends) == 0
    # a store that left nothing, or a tenant dropped meanwhile: nothing to do
    assert ends.offered("t", "b4")
    assert ends.stored("b4", None) is None
    assert ends.offered("gone", "b5")
    ends.drop_tenant("gone")
    assert ends.stored("b5", value) is None
    assert len(ends) == 0


# ---------------------------------------------------------------------------- queue
def test_deletes_go_first_in_a_lane_of_their_own() -> None:
    q = WriteQueue(max_entries=2, max_bytes=1 << 20, max_deletes=2)
    write = Job("t", "k", "b1", 10)
    assert q.offer(write)
    assert q.offer(Job("t", "k2", "b2", 10)) is False  # the tenant's share is full …
    first, second = Job("t", "k", digest=b"a"), Job("t", "k", digest=b"b")
    assert q.offer_delete(first)  # … the delete lane is not
    assert q.offer_delete(second)
    assert not q.offer_delete(Job("t", "k", digest=b"c"))  # bounded on its own
    assert q.deletes == 2
    assert q.take(0, deletes=False) == write  # L2 not answering: deletes wait
    assert q.take(0, deletes=False) is None
    assert q.take(0) == first
    assert q.offer_delete(first, first=True)  # tried again: first
    assert q.take(0) == first
    assert q.take(0) == second
    assert q.take(0) is None


def test_a_released_entrys_queued_write_is_taken_out() -> None:
    q = WriteQueue(max_entries=8, max_bytes=1 << 20)
    jobs = [Job("t", f"k{i}", f"b{i}", 10) for i in range(3)]
    for job in jobs:
        assert q.offer(job)
    assert q.drop_buffer("t", "b1")
    assert not q.drop_buffer("t", "b1")
    assert not q.drop_buffer("other", "b0")
    assert (q.entries, q.bytes) == (2, 20)
    assert q.take(0) == jobs[0]
    assert q.drop_buffer("t", "b2")
    assert (q.entries, q.bytes) == (0, 0)
    assert q.take(0) is None
    assert q.offer(jobs[0])  # the tenant's accounting starts over cleanly


# ---------------------------------------------------------------------------- tier
def test_a_release_deletes_the_value_its_entry_wrote_and_an_eviction_keeps_it() -> None:
    t, fake, reg = tier(source_of())
    t.start()
    try:
        for buffer_id, key in (("b1", "deleted"), ("b2", "evicted"), ("b3", "replaced")):
            t.write_behind("t", key, buffer_id, len(DATA))
        wait_until(lambda: len(fake.values) == 3, message="written behind")
        # another host stored a newer value of "replaced" since: not this entry's any more
        newer = encode("t", "replaced", b"newer")
        fake.values[("t", "replaced")] = newer
        t.ended("t", "b1", "release")
        t.ended("t", "b2", "evict")
        t.ended("t", "b3", "expire")
        wait_until(lambda: sample(reg, "maasd_l2_deletes_total", outcome="absent") == 1)
        assert sample(reg, "maasd_l2_deletes_total", outcome="deleted") == 1
        assert ("t", "deleted") not in fake.values
        assert ("t", "evicted") in fake.values
        assert fake.values[("t", "replaced")] == newer
    finally:
        t.close()


def test_a_write_queued_or_in_flight_when_its_entry_is_released_leaves_nothing() -> None:
    storing, proceed = threading.Event(), threading.Event()

    def source(buffer_id: str, _tenant_id: str, _key: str, head: int) -> bytearray | None:
        if buffer_id == "slow":
            storing.set()
            proceed.wait(10)
        return bytearray(head) + DATA

    t, fake, reg = tier(source)
    t.start()
    try:
        t.write_behind("t", "inflight", "slow", len(DATA))
        assert storing.wait(10)
        t.write_behind("t", "queued", "b2", len(DATA))
        t.ended("t", "slow", "release")  # its bytes read, its store not yet landed
        t.ended("t", "b2", "expire")  # still queued: taken out
        assert t.queue.entries == 0
        proceed.set()
        wait_until(lambda: sample(reg, "maasd_l2_deletes_total", outcome="deleted") == 1)
        assert fake.values == {}
        assert sample(reg, "maasd_l2_dropped_writes_total", reason="gone") == 1
        t.ended("t", "late", "release")  # released before its commit hook ran
        t.write_behind("t", "late", "late", len(DATA))
        assert sample(reg, "maasd_l2_dropped_writes_total", reason="gone") == 2
    finally:
        t.close()


def test_a_delete_while_l2_is_down_never_waits_and_is_done_once_it_is_back() -> None:
    t, fake, reg = tier(source_of(), l2_breaker_failures=2, l2_breaker_backoff_s=0.2)
    t.start()
    try:
        t.write_behind("t", "k", "b1", len(DATA))
        wait_until(lambda: ("t", "k") in fake.values, message="written behind")
        fake.down = True
        calls = fake.calls
        t.ended("t", "b1", "release")  # the caller's thread makes no call to L2
        assert fake.calls == calls
        wait_until(lambda: sample(reg, "maasd_l2_breaker_open") == 1, message="breaker open")
        assert sample(reg, "maasd_l2_deletes_total", outcome="error") >= 1
        assert ("t", "k") in fake.values
        fake.down = False  # back: the writer's probe closes the breaker, the delete goes
        wait_until(lambda: sample(reg, "maasd_l2_deletes_total", outcome="deleted") == 1)
        assert fake.values == {}
        assert sample(reg, "maasd_l2_deletes_total", outcome="given_up") == 0
    finally:
        t.close()


def test_a_restored_entrys_delete_drops_the_value_it_came_from() -> None:
    t, fake, reg = tier()
    for key in ("deleted", "expired"):
        fake.values[("t", key)] = encode("t", key, DATA)
    t.start()
    try:
        for buffer_id, key in (("r1", "deleted"), ("r2", "expired")):
            fetched = t.fetch("t", [key])
            assert fetched is not None
            t.restored(buffer_id, "t", fetched)
        t.ended("t", "r1", "release")
        t.ended("t", "r2", "expire")  # this host's copy ended, not the value's writer
        wait_until(lambda: sample(reg, "maasd_l2_deletes_total", outcome="deleted") == 1)
        assert list(fake.values) == [("t", "expired")]
    finally:
        t.close()


def test_a_value_being_deleted_is_not_restored_here_meanwhile() -> None:
    """Its delete not done yet (queued; L2 refusing it, say): a lookup here misses it
    rather than restore what was just deleted; a delete still queued at shutdown is
    counted."""
    t, fake, reg = tier()  # never started: nothing is taken from the queue
    fake.values[("t", "k")] = encode("t", "k", DATA)
    fetched = t.fetch("t", ["k"])
    assert fetched is not None
    t.restored("r1", "t", fetched)
    t.ended("t", "r1", "release")
    assert sample(reg, "maasd_l2_delete_queue_entries") == 1
    assert ("t", "k") in fake.values
    assert t.fetch("t", ["k"]) is None
    assert sample(reg, "maasd_l2_lookups_total", outcome="miss") == 1
    t.close()
    assert sample(reg, "maasd_l2_deletes_total", outcome="shutdown") == 1
