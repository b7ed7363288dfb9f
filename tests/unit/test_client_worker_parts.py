"""The parts a ``maasd.client.Worker`` hands its state to, each on its own (no daemon):
the lease renewal thread, the looked-up entries' mappings, the attachments table.

Mappings are of real memfds; the "daemon" is the callables the parts are given.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from maasd import protocol
from maasd.client.entries import MappingCache
from maasd.client.entry_maps import EntryMaps
from maasd.client.errors import ConnectionFailed, NotFound, ProtocolError, QuotaExceeded
from maasd.client.mapped import MappedBuffers
from maasd.client.mapping import BufferMapping
from maasd.client.renewal import LeaseRenewer

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


# ------------------------------------------------------------------------ LeaseRenewer


def wait_for(event: threading.Event) -> None:
    assert event.wait(10), "the renewal thread did not get there"


def test_the_renewer_renews_what_is_attached_each_round_and_stops() -> None:
    renewed: list[str] = []
    rounds = threading.Event()

    def renew(buffer_id: str) -> None:
        renewed.append(buffer_id)
        if len(renewed) >= 4:
            rounds.set()

    r = LeaseRenewer(0.01, lambda: ["a", "b"], renew, lambda: None)
    r.start()
    wait_for(rounds)
    r.stop()
    r.join(5)
    assert r._thread is not None
    assert not r._thread.is_alive()
    assert renewed[:4] == ["a", "b", "a", "b"]


def test_a_buffer_that_is_gone_is_logged_once_and_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asked: list[str] = []
    enough = threading.Event()

    def renew(buffer_id: str) -> None:
        asked.append(buffer_id)
        if asked.count("live") >= 3:
            enough.set()
        if buffer_id == "gone":
            raise NotFound(404, "Not Found", "no such buffer")
        if buffer_id == "refused" and asked.count("refused") == 1:
            raise QuotaExceeded(507, "Quota exceeded", "full")

    caplog.set_level(logging.WARNING, "maasd.client.worker")
    r = LeaseRenewer(0.01, lambda: ["gone", "refused", "live"], renew, lambda: None)
    r.start()
    wait_for(enough)
    r.stop()
    r.join(5)
    assert asked.count("gone") == 1  # released: not renewed again
    assert asked.count("refused") >= 2  # a refusal is tried again the next round
    text = caplog.text
    assert text.count("lease renewal: buffer gone is gone") == 1
    assert "lease renewal of refused failed" in text


def test_a_broken_connection_ends_the_thread_with_a_warning_unless_stopping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "maasd.client.worker")

    def broken(_buffer_id: str) -> None:
        raise ConnectionFailed("socket closed")

    r = LeaseRenewer(0.01, lambda: ["a"], broken, lambda: None)
    r.start()
    r.join(10)  # it returns by itself
    assert r._thread is not None
    assert not r._thread.is_alive()
    assert "lease renewal stopped: Connection failed: socket closed" in caplog.text

    caplog.clear()
    held: list[LeaseRenewer] = []

    def closing(_buffer_id: str) -> None:
        held[0].stop()  # the owner closes (and shuts the socket) while a renewal is sent
        raise ConnectionFailed("socket closed")

    stopping = LeaseRenewer(0.01, lambda: ["a"], closing, lambda: None)
    held.append(stopping)
    stopping.start()
    stopping.join(10)
    assert stopping._thread is not None
    assert not stopping._thread.is_alive()
    assert caplog.text == ""  # the failure that follows a close says nothing


def test_each_round_runs_even_with_nothing_attached() -> None:
    swept = threading.Event()
    r = LeaseRenewer(0.01, list, lambda _b: None, swept.set)
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

    r = LeaseRenewer(0.01, list, lambda _b: None, each_round)
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
