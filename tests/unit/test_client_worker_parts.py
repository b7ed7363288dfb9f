"""The parts a ``maasd.client.Worker`` hands its state to, each on its own (no daemon):
the lease renewal schedule and thread, the looked-up entries' mappings, the attachments table.

Mappings are of real memfds; the "daemon" is the callables the parts are given.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import pytest

from maasd import protocol
from maasd.bounds import DEFAULT_TTL_S
from maasd.client.entries import MappingCache
from maasd.client.entry_maps import EntryMaps
from maasd.client.errors import ConnectionFailed, NotFound, ProtocolError, QuotaExceeded
from maasd.client.mapped import MappedBuffers
from maasd.client.mapping import BufferMapping
from maasd.client.renewal import (
    FIRST_RENEWAL_S,
    MIN_PERIOD_S,
    LeaseRenewer,
    RenewalSchedule,
    period_s,
)

SIZE = 8192


def memfd(size: int = SIZE, fill: int = 0) -> int:
    fd = os.memfd_create("maasd-test")
    os.ftruncate(fd, size)
    if fill:
        os.pwrite(fd, bytes([fill]) * size, 0)
    return fd


def found(buffer_id: str, key: str, size: int = SIZE) -> protocol.Found:
    return protocol.Found(key=key, buffer_id=buffer_id, size_bytes=size, numa_node=0)


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ------------------------------------------------------------------- RenewalSchedule


def test_a_buffer_is_first_renewed_soon_then_every_third_of_its_lease() -> None:
    s = RenewalSchedule()
    s.watch("long", 600, now=100.0)
    s.watch("short", 3, now=100.0)
    assert s.next_at() == 100.0 + FIRST_RENEWAL_S  # how much of a lease is left is unknown
    assert s.due(100.5) == []
    assert sorted(s.due(101.0)) == [("long", 600), ("short", 3)]
    assert s.next_at() is None  # both in flight: not due again until sent
    s.renewed("long", 101.0)
    s.renewed("short", 101.0)
    assert s.next_at() == 102.0  # 3 s lease: a third of it
    assert s.due(102.0) == [("short", 3)]
    s.renewed("short", 102.0)
    assert s.due(300.9) == [("short", 3)]  # (only "short" when it comes up; not spun)
    s.renewed("short", 300.9)
    assert s.due(301.0) == [("long", 600)]  # 200 s after its last renewal


def test_a_renewal_is_due_before_the_lease_ends_whatever_its_length() -> None:
    for ttl in (1, 2, 3, 5, 30, 600, 86400):
        s = RenewalSchedule()
        s.watch("b", ttl, now=0.0)
        first = s.next_at()
        assert first is not None
        assert 0 < first <= min(FIRST_RENEWAL_S, ttl / 2)
        assert s.due(first) == [("b", ttl)]
        s.renewed("b", first)
        nxt = s.next_at()
        assert nxt is not None
        assert nxt - first < ttl
        if ttl >= 2:  # two renewals may fail in a row and the lease still holds
            assert 2 * (nxt - first) < ttl
        assert nxt - first >= min(MIN_PERIOD_S, ttl / 2)  # a 1 s lease does not spin


def test_the_period_is_a_third_of_the_lease_with_a_floor_and_an_optional_cap() -> None:
    assert period_s(600) == 200
    assert period_s(3) == 1
    assert period_s(1) == MIN_PERIOD_S
    assert period_s(600, max_period_s=5) == 5
    assert period_s(3, max_period_s=5) == 1
    assert period_s(1, max_period_s=0.01) == 0.01  # an interval asked for is kept
    s = RenewalSchedule(max_period_s=0.05)
    s.watch("b", 30, now=0.0)
    assert s.next_at() == 0.05


def test_a_buffer_is_watched_per_attachment_and_dropped_after_the_last() -> None:
    s = RenewalSchedule()
    s.watch("b", 3, now=0.0)
    s.watch("b", 3, now=0.5)  # a second mapping: the time stays
    assert s.next_at() == 1.0
    s.unwatch("b")
    assert len(s) == 1
    assert s.due(1.0) == [("b", 3)]
    s.unwatch("b")  # detached while its renewal was in flight
    s.renewed("b", 1.0)
    assert len(s) == 0
    assert s.next_at() is None
    assert s.due(100.0) == []
    s.unwatch("b")  # more unwatches than watches change nothing
    s.watch("b", 3, now=200.0)  # attached again: due again soon
    assert s.next_at() == 201.0


def test_a_detached_buffer_is_not_renewed_and_a_forgotten_one_never_again() -> None:
    s = RenewalSchedule()
    s.watch("a", 3, now=0.0)
    s.watch("b", 3, now=0.0)
    s.unwatch("a")
    assert "a" not in s
    assert "b" in s
    assert s.due(1.0) == [("b", 3)]
    s.forget("b")  # the daemon no longer knows it
    s.renewed("b", 1.0)
    s.unwatch("b")
    assert s.next_at() is None
    assert len(s) == 0


def test_many_buffers_are_one_heap() -> None:
    s = RenewalSchedule()
    for i in range(1000):
        s.watch(f"b{i}", 3 + i % 7, now=0.0)
    due = s.due(1.0)
    assert len(due) == 1000
    for bid, _ttl in due:
        s.renewed(bid, 1.0)
    assert s.next_at() == 2.0  # the 3 s leases come first
    assert {b for b, _ in s.due(2.0)} == {f"b{i}" for i in range(0, 1000, 7)}


# ------------------------------------------------------------------------ LeaseRenewer


def wait_for(event: threading.Event) -> None:
    assert event.wait(10), "the renewal thread did not get there"


def renewer(
    renew: Callable[[str, int], object],
    each_round: Callable[[], object] = lambda: None,
    watch: tuple[str, ...] = (),
    ttl_s: int = 30,
) -> LeaseRenewer:
    r = LeaseRenewer(0.01, renew, each_round, max_period_s=0.01)
    for bid in watch:
        r.watch(bid, ttl_s)
    return r


def test_the_renewer_renews_what_is_watched_and_stops() -> None:
    renewed: list[tuple[str, int]] = []
    rounds = threading.Event()

    def renew(buffer_id: str, ttl_s: int) -> None:
        renewed.append((buffer_id, ttl_s))
        if len(renewed) >= 4:
            rounds.set()

    r = renewer(renew, watch=("a", "b"))
    r.start()
    wait_for(rounds)
    r.stop()
    r.join(5)
    assert r._thread is not None
    assert not r._thread.is_alive()
    assert sorted(renewed[:4]) == [("a", 30), ("a", 30), ("b", 30), ("b", 30)]


def test_a_short_lease_is_renewed_soon_after_the_watch_by_a_default_renewer() -> None:
    """No interval given: the first renewal comes within FIRST_RENEWAL_S of the watch,
    whatever the round (here an hour: the thread is woken by the watch)."""
    renewed = threading.Event()
    r = LeaseRenewer(3600, lambda _b, _t: renewed.set(), lambda: None)
    r.start()
    r.watch("b", 3)
    wait_for(renewed)
    r.stop()
    r.join(5)


def test_an_unwatched_buffer_is_not_renewed() -> None:
    asked: list[str] = []
    enough = threading.Event()

    def renew(buffer_id: str, _ttl: int) -> None:
        asked.append(buffer_id)
        if asked.count("kept") >= 3:
            enough.set()

    r = renewer(renew, watch=("kept", "dropped"))
    r.unwatch("dropped")
    r.start()
    wait_for(enough)
    r.stop()
    r.join(5)
    assert "dropped" not in asked


def test_a_buffer_that_is_gone_is_logged_once_and_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asked: list[str] = []
    enough = threading.Event()

    def renew(buffer_id: str, _ttl: int) -> None:
        asked.append(buffer_id)
        if asked.count("live") >= 3:
            enough.set()
        if buffer_id == "gone":
            raise NotFound(404, "Not Found", "no such buffer")
        if buffer_id == "refused" and asked.count("refused") == 1:
            raise QuotaExceeded(507, "Quota exceeded", "full")

    caplog.set_level(logging.WARNING, "maasd.client.worker")
    r = renewer(renew, watch=("gone", "refused", "live"))
    r.start()
    wait_for(enough)
    r.stop()
    r.join(5)
    assert asked.count("gone") == 1  # released: not renewed again
    assert asked.count("refused") >= 2  # a refusal is tried again a period later
    text = caplog.text
    assert text.count("lease renewal: buffer gone is gone") == 1
    assert "lease renewal of refused failed" in text


def test_a_broken_connection_ends_the_thread_with_a_warning_unless_stopping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "maasd.client.worker")

    def broken(_buffer_id: str, _ttl: int) -> None:
        raise ConnectionFailed("socket closed")

    r = renewer(broken, watch=("a",))
    r.start()
    r.join(10)  # it returns by itself
    assert r._thread is not None
    assert not r._thread.is_alive()
    assert "lease renewal stopped: Connection failed: socket closed" in caplog.text

    caplog.clear()
    held: list[LeaseRenewer] = []

    def closing(_buffer_id: str, _ttl: int) -> None:
        held[0].stop()  # the owner closes (and shuts the socket) while a renewal is sent
        raise ConnectionFailed("socket closed")

    stopping = renewer(closing, watch=("a",))
    held.append(stopping)
    stopping.start()
    stopping.join(10)
    assert stopping._thread is not None
    assert not stopping._thread.is_alive()
    assert caplog.text == ""  # the failure that follows a close says nothing


def test_each_round_runs_even_with_nothing_attached() -> None:
    swept = threading.Event()
    r = renewer(lambda _b, _t: None, swept.set)
    r.start()
    wait_for(swept)
    r.stop()
    r.join(5)


def test_a_close_from_the_renewal_thread_does_not_wait_for_itself() -> None:
    done = threading.Event()
    holder: list[LeaseRenewer] = []

    def each_round() -> None:
        holder[0].stop()
        holder[0].join(5)  # would raise (joining itself) if not skipped
        done.set()

    r = renewer(lambda _b, _t: None, each_round)
    holder.append(r)
    r.start()
    wait_for(done)
    r.join(5)


# ---------------------------------------------------------------------------- EntryMaps


class Detaches:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, buffer_id: str, attached: bool) -> None:
        self.calls.append((buffer_id, attached))


def test_a_second_hit_reuses_the_mapping_and_closes_the_new_fd() -> None:
    detach = Detaches()
    maps = EntryMaps(MappingCache(1 << 20, 60), detach)
    first = maps.found(found("e1", "k"), memfd(fill=7))
    second_fd = memfd()
    second = maps.found(found("e1", "k"), second_fd)
    assert not fd_open(second_fd)  # not needed: the cached mapping answers
    assert int(second.array[0]) == 7  # the first fd's pages
    assert second.key == "k"
    assert second.size == SIZE
    first.close()
    second.close()
    assert len(maps.cache) == 1  # idle, kept for the next lookup
    assert detach.calls == []
    maps.sweep(force=True)
    assert len(maps.cache) == 1  # not aged yet (60 s)


def test_a_miss_and_a_new_entry_under_the_key_let_the_old_mapping_go() -> None:
    detach = Detaches()
    maps = EntryMaps(MappingCache(1 << 20, 60), detach)
    maps.found(found("old", "k"), memfd()).close()
    newer = maps.found(found("new", "k"), memfd())  # published again: the old one goes
    assert detach.calls == [("old", True)]
    assert "old" not in maps.cache
    newer.close()
    maps.missed(["k"])  # the daemon found nothing under k now
    assert detach.calls == [("old", True), ("new", True)]
    assert len(maps.cache) == 0


def test_a_released_entry_is_dropped_without_a_detach() -> None:
    detach = Detaches()
    maps = EntryMaps(MappingCache(1 << 20, 60), detach)
    hit = maps.found(found("e1", "k"), memfd())
    maps.cache.released("e1")  # pushed by the daemon while it is in use
    hit.close()
    assert "e1" not in maps.cache
    assert detach.calls == [("e1", False)]  # not attached: the daemon owes no detach


def test_the_idle_budget_and_age_unmap_and_detach() -> None:
    detach = Detaches()
    maps = EntryMaps(MappingCache(0, 60), detach)  # nothing kept idle
    fd = memfd()
    hit = maps.found(found("e1", "k"), fd)
    assert detach.calls == []  # in use: kept
    hit.close()
    assert detach.calls == [("e1", True)]
    assert not fd_open(fd)
    aging = EntryMaps(MappingCache(1 << 20, 0), detach)
    aging.found(found("e2", "k2"), memfd()).close()
    aging.sweep(force=True)
    assert ("e2", True) in detach.calls


def test_a_short_memfd_is_refused_closed_and_detached() -> None:
    detach = Detaches()
    maps = EntryMaps(MappingCache(1 << 20, 60), detach)
    fd = memfd(SIZE // 2)
    with pytest.raises(ProtocolError, match="memfd is 4096 bytes, daemon said 8192"):
        maps.found(found("e1", "k"), fd)
    assert not fd_open(fd)
    assert detach.calls == [("e1", True)]
    assert len(maps.cache) == 0


def test_clear_hands_every_mapping_back_to_be_closed() -> None:
    maps = EntryMaps(MappingCache(1 << 20, 60), Detaches())
    hit = maps.found(found("e1", "k"), memfd())
    (m,) = maps.clear()
    assert m.buffer_id == "e1"
    assert len(maps.cache) == 0
    hit.close()
    m.unmap()


# -------------------------------------------------------------------------- MappedBuffers


def mapping(buffer_id: str) -> BufferMapping:
    return BufferMapping(None, buffer_id, memfd(), SIZE, 0)


def test_attachments_count_each_mapping_and_stage_puts() -> None:
    a = MappedBuffers()
    one, two, other = mapping("b1"), mapping("b1"), mapping("b2")
    for m in (one, two, other):
        a.add(m)
    assert a.ids() == ["b1", "b2"]
    assert a.remove(one)
    assert not a.remove(one)
    assert a.ids() == ["b1", "b2"]
    assert a.take("b1") == [two]
    assert a.ids() == ["b2"]
    assert a.take("b1") == []
    staged = mapping("p1")
    a.stage(staged)
    assert a.ids() == ["b2"]  # a put is not renewed
    assert a.unstage("p1") is staged
    assert a.unstage("p1") is None
    a.stage(staged)
    assert {m.buffer_id for m in a.clear()} == {"b2", "p1"}
    assert a.ids() == []
    assert a.unstage("p1") is None
    for m in (one, two, other, staged):
        m.unmap()


def test_the_attached_buffers_are_watched_exactly_while_mapped_and_leased_their_own() -> None:
    clock = [0.0]
    r = LeaseRenewer(3600, lambda _b, _t: None, lambda: None, clock=lambda: clock[0])
    a = MappedBuffers()
    a.renewer = r
    one, two, other = mapping("b1"), mapping("b1"), mapping("b2")
    a.add(one, 3)
    a.add(two, 3)
    a.add(other)  # a daemon that did not say the lease
    assert (a.lease("b1"), a.lease("b2"), a.lease("b3")) == (3, DEFAULT_TTL_S, DEFAULT_TTL_S)
    assert sorted(r.schedule.due(1.0)) == [("b1", 3), ("b2", DEFAULT_TTL_S)]
    assert a.remove(one)
    assert len(r.schedule) == 2  # b1 is still mapped once
    assert a.take("b2") == [other]
    assert a.remove(two)
    assert len(r.schedule) == 0
    assert a.lease("b1") == DEFAULT_TTL_S  # no longer attached here
    fixed = MappedBuffers(ttl_s=30)  # the worker's ttl_s wins
    fixed.add(mapping("b1"), 3)
    assert fixed.lease("b1") == 30
    for m in a.clear() + fixed.clear() + [one, two, other]:
        m.unmap()
