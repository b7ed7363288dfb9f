"""``Worker``'s entry API through a real daemon: put / commit / abort / entry / lookup /
forget, and the mapping cache (one mapping per entry, bounded in bytes and idle time).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maasd import protocol
from maasd.client import (
    DuplicateKey,
    Entry,
    LimitExceeded,
    NotFound,
    StateConflict,
    Worker,
)
from maasd.client import worker as worker_module
from maasd.client.entries import CachedMapping, MappingCache
from maasd.protocol import Error
from waiting import wait_until

MiB = 1 << 20


def attached(daemon: Any, tenant_id: str) -> float:
    return daemon.metric("maasd_attached_handles", tenant=tenant_id)


@pytest.fixture
def tenant(daemon: Any) -> tuple[str, str]:
    return daemon.tenant("worker-entries", 64 * MiB)


def test_what_runs_while_a_request_is_answered_keeps_the_stream_in_step(daemon, tenant):
    """A commit unmaps its staged mapping while the daemon copies; a ``meanwhile`` that
    fails still has its reply read, so the connection stays usable."""
    with Worker(daemon.socket_path, tenant[1]) as w:
        m = w.put("wk:meanwhile", 10_000)

        def fails() -> None:
            raise RuntimeError("meanwhile")

        with pytest.raises(RuntimeError, match="meanwhile"):
            w._channel.request(protocol.Commit(buffer_id=m.buffer_id), fails)
        assert w.lookup(["wk:meanwhile"]) is not None  # committed, and the stream in step
        m2 = w.put("wk:meanwhile:2", 10_000)
        w.commit(m2)
        assert m2.closed


def test_entry_block_commits_and_another_worker_finds_it_read_only(daemon, tenant):
    tid, key = tenant
    with Worker(daemon.socket_path, key) as w, Worker(daemon.socket_path, key) as r:
        with w.entry("wk:a", 10_000) as m:
            assert m.writable
            assert m.key == "wk:a"
            m.array[:4] = [1, 2, 3, 4]
            assert r.lookup(["wk:a"]) is None  # not before the commit
        assert m.closed  # the staging mapping goes with the commit
        hit = r.lookup(["wk", "wk:a", "wk:ab"])
        assert hit is not None
        with hit:
            assert (hit.key, hit.size) == ("wk:a", 12288)
            assert hit.array[:4].tolist() == [1, 2, 3, 4]
            assert not hit.array.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                hit.array[0] = 9
            with pytest.raises(ValueError, match="cannot set WRITEABLE"):
                hit.array.flags.writeable = True
        assert hit.closed
        with pytest.raises(ValueError, match="closed"):
            _ = hit.array
        assert attached(daemon, tid) == 1  # the cached mapping holds one handle


def test_put_commit_abort_and_duplicates(daemon, tenant):
    _tid, key = tenant
    with Worker(daemon.socket_path, key) as w:
        m = w.put("wk:b", 4096, ttl_s=60)
        with pytest.raises(DuplicateKey):
            w.put("wk:b", 4096)  # being written: the key is taken
        m.array[:] = 7
        entry = w.commit(m)
        assert entry == Entry(id=m.buffer_id, key="wk:b", size_bytes=4096, numa_node=0)
        with pytest.raises(DuplicateKey):
            w.put("wk:b", 4096)  # committed: the key is taken
        with pytest.raises(StateConflict):
            w.commit(entry.id)  # once only
        gone = w.put("wk:c", 4096)
        w.abort(gone)
        assert gone.closed
        assert w.lookup(["wk:c"]) is None
        with pytest.raises(NotFound):
            w.abort(gone.buffer_id)  # nothing left of it
        with contextlib.suppress(RuntimeError), w.entry("wk:d", 4096) as failing:
            failing.array[:] = 1
            raise RuntimeError("the writer failed")
        assert w.lookup(["wk:d"]) is None  # aborted
        hit = w.lookup(["wk:b"])
        assert hit is not None
        assert int(hit.array.sum()) == 7 * 4096
        hit.close()


def test_a_second_lookup_reuses_the_cached_mapping(daemon, tenant):
    _tid, key = tenant
    with Worker(daemon.socket_path, key) as w:
        with w.entry("wk:cache", 64 * 1024) as m:
            m.array[:] = 3
        first = w.lookup(["wk:cache"])
        second = w.lookup(["wk:cache"])
        assert first is not None
        assert second is not None
        assert first is not second
        # one mapping behind both: the same memory, no second mmap
        assert np.shares_memory(first.array, second.array)
        address = first.array.ctypes.data
        assert second.array.ctypes.data == address
        first.close()
        second.close()
        third = w.lookup(["wk:cache"])
        assert third is not None
        assert third.array.ctypes.data == address  # still cached when idle
        third.close()
        assert len(w.cache) == 1


def test_idle_mappings_age_out_and_detach(daemon, tenant):
    tid, key = tenant
    with Worker(daemon.socket_path, key, renew_interval_s=0.1, cache_age_s=0.3) as w:
        with w.entry("wk:age", 4096):
            pass
        hit = w.lookup(["wk:age"])
        assert hit is not None
        assert attached(daemon, tid) == 1
        time.sleep(0.5)
        assert len(w.cache) == 1  # in use: never aged out
        hit.close()
        wait_until(lambda: len(w.cache) == 0, message="aged out by the renewal thread")
        wait_until(lambda: attached(daemon, tid) == 0, message="and detached")


def test_the_cache_is_bounded_in_bytes(daemon, tenant):
    tid, key = tenant
    with Worker(daemon.socket_path, key, cache_bytes=150 * 1024) as w:
        for i in range(4):
            with w.entry(f"wk:bound{i}", 64 * 1024):
                pass
        for i in range(4):
            hit = w.lookup([f"wk:bound{i}"])
            assert hit is not None
            hit.close()
        assert w.cache.nbytes <= 150 * 1024  # the least recently used went
        assert [f"wk:bound{i}" in {s.key for s in w.cache._slots.values()} for i in range(4)] == [
            False,
            False,
            True,
            True,
        ]
        assert attached(daemon, tid) == 2
    with Worker(daemon.socket_path, key, cache_bytes=0) as w:
        hit = w.lookup(["wk:bound0"])
        assert hit is not None
        assert attached(daemon, tid) == 1
        hit.close()  # nothing kept idle: unmapped and detached at once
        assert len(w.cache) == 0
        assert attached(daemon, tid) == 0


def test_forget_and_a_released_entry(daemon, tenant):
    tid, key = tenant
    with Worker(daemon.socket_path, key) as w, daemon.client(key) as rest:
        with w.entry("wk:rel", 4096) as m:
            m.array[:] = 5
        hit = w.lookup(["wk:rel"])
        assert hit is not None
        assert rest.delete(f"/v1/buffers/{hit.buffer_id}").status_code == 204
        assert int(hit.array.max()) == 0  # scrubbed under the reader
        w.forget(hit.buffer_id)
        assert len(w.cache) == 1  # still in use
        hit.close()
        assert len(w.cache) == 0
        assert attached(daemon, tid) == 0
        # a released entry that was cached and idle goes on the next miss of its key
        with w.entry("wk:rel", 4096):
            pass
        w.lookup(["wk:rel"]).close()  # type: ignore[union-attr]
        (slot,) = w.cache._slots.values()
        assert rest.delete(f"/v1/buffers/{slot.buffer_id}").status_code == 204
        assert w.lookup(["wk:rel"]) is None
        assert len(w.cache) == 0


def test_closing_the_worker_releases_what_it_put_and_did_not_commit(daemon, tenant):
    tid, key = tenant
    w = Worker(daemon.socket_path, key)
    m = w.put("wk:open", MiB)
    m.array[:] = 1
    w.close()
    assert m.closed

    def gone() -> bool:
        return daemon.admin.get(f"/v1/tenants/{tid}").json()["buffers"] == 0

    wait_until(gone, message="the staged entry is released")


# --- the mapping cache alone ------------------------------------------------------------------


class _FakeMapping:
    def __init__(self, buffer_id: str, size: int) -> None:
        self.buffer_id, self.size, self.numa_node = buffer_id, size, 0
        self.array = np.zeros(1, np.uint8)
        self.closed = False

    def unmap(self) -> bool:
        self.closed = True
        return True


def _slot(buffer_id: str, size: int = 100, key: str = "k") -> CachedMapping:
    return CachedMapping(_FakeMapping(buffer_id, size), key)  # type: ignore[arg-type]


def test_mapping_cache_rules() -> None:
    cache = MappingCache(max_bytes=250, max_age_s=10)
    a, b, c = _slot("a", key="ka"), _slot("b", key="kb"), _slot("c", key="kc")
    assert cache.add(a) == []
    assert cache.add(b) == []
    assert cache.add(c) == []  # 300 bytes, all in use: nothing can go
    assert cache.checkin(a) == []  # idle: 100 ≤ 250
    assert cache.checkin(b) == []  # idle: 200 ≤ 250
    assert cache.checkin(c) == [a]  # idle: 300 > 250: the least recently used goes
    assert cache.checkout("a") is None
    assert cache.checkout("b") is b
    assert cache.forget("b") == []  # in use: goes when given back
    assert cache.checkout("b") is None  # forgotten: not handed out again
    assert cache.checkin(b) == [b]
    assert cache.expire(time.monotonic() + 11) == [c]
    d = _slot("d", key="k1")
    cache.add(d)
    cache.checkin(d)
    assert cache.forget_keys(["k1"], keep="d") == []
    assert cache.forget_keys(["k0", "k1"]) == [d]
    assert len(cache) == 0
    with pytest.raises(ValueError, match=">= 0"):
        MappingCache(max_bytes=-1)


def test_a_released_entry_leaves_the_cache_at_once_or_when_given_back() -> None:
    """The daemon's pushed ``released``: an idle mapping is unmapped then and there, one in
    use when its user gives it back; neither owes a detach (``released``)."""
    cache = MappingCache(max_bytes=1000, max_age_s=10)
    idle, busy = _slot("idle"), _slot("busy")
    cache.add(idle)
    cache.checkin(idle)
    cache.add(busy)
    cache.released("idle")
    assert idle.mapping.closed
    assert "idle" not in cache
    cache.released("busy")
    assert not busy.mapping.closed
    assert cache.checkout("busy") is None  # not handed out again
    assert cache.checkin(busy) == [busy]  # the worker unmaps it, without a detach
    assert busy.released
    cache.released("late")  # not cached (yet): remembered
    assert len(cache) == 0
    late = _slot("late")
    cache.add(late)  # a lookup's answer that raced the frame
    assert cache.checkout("late") is None
    assert cache.checkin(late) == [late]
    assert late.released


def test_a_worker_drops_what_the_daemon_released_before_its_next_call_returns(daemon) -> None:
    """A worker caches an entry, its tenant deletes it: the cache lets go before the
    worker's next call returns, or on its own while the worker is idle."""
    _tenant, key = daemon.tenant("cache-drops", 16 << 20)
    with Worker(daemon.socket_path, key) as a:
        with a.entry("k", 1 << 20) as e:
            e.array[:] = 1
        hit = a.lookup(["k"])
        assert hit is not None
        bid = hit.buffer_id
        hit.close()
        assert bid in a.cache
        with daemon.client(key) as rest:
            assert rest.delete(f"/v1/buffers/{bid}").status_code == 204
            # (its idle reader may be quicker) any call reads the pushed frame first
            assert a.lookup(["nothing"]) is None
            assert bid not in a.cache
            wait_until(lambda: rest.get("/v1/usage").json()["used_bytes"] == 0)
            assert rest.get("/v1/usage").json()["held_bytes"] == 0
            # an idle worker lets go too (its channel reads pushed frames when idle)
            with a.entry("k2", 1 << 20) as e:
                e.array[:] = 2
            hit = a.lookup(["k2"])
            assert hit is not None
            hit.close()
            assert rest.delete(f"/v1/buffers/{hit.buffer_id}").status_code == 204
            wait_until(
                lambda: rest.get("/v1/usage").json()["used_bytes"] == 0,
                message="the idle worker unmapped the released entry",
            )
            assert hit.buffer_id not in a.cache


# --- a refusal before hello -------------------------------------------------------------------


def test_a_refused_worker_gets_limit_exceeded_even_when_its_hello_cannot_be_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon refuses at accept (429) and closes; the worker's hello then fails with
    EPIPE — the worker reads the error frame waiting for it instead."""
    path = str(tmp_path / "refusing.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    refused = threading.Event()

    def refuse() -> None:
        conn, _ = listener.accept()
        err = Error(status=429, title="Limit exceeded", detail="socket_max_per_uid = 1 reached")
        conn.sendall(protocol.encode_frame(err))
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        refused.set()

    threading.Thread(target=refuse, daemon=True).start()
    send = worker_module.protocol.send_message
    sends: list[BaseException | None] = []

    def send_after_the_refusal(sock: socket.socket, msg: Any, fds: Any = ()) -> None:
        refused.wait(10)
        time.sleep(0.05)
        try:
            send(sock, msg, fds)
        except OSError as exc:
            sends.append(exc)
            raise
        sends.append(None)

    monkeypatch.setattr(worker_module.protocol, "send_message", send_after_the_refusal)
    with pytest.raises(LimitExceeded) as info:
        Worker(path, "key")
    assert info.value.status == 429
    assert "socket_max_per_uid = 1" in info.value.detail
    assert len(sends) == 1
    assert isinstance(sends[0], BrokenPipeError | ConnectionResetError)
    listener.close()
