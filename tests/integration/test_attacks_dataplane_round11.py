"""SPEC §5 (the worker socket) and §2 invariants 2, 3, 8, 9 on the data plane, attacked
from angles the earlier rounds did not take: maps that name a field twice, lease
lengths of every wrong shape, puts into pools that are gone, frames trickled byte by
byte or left half sent on many connections, two tenants interleaving their entries,
and one tenant's flood of long lookups next to another tenant's work.

Every test runs a real ``maasd serve`` (``tests/conftest.py``) through the test's own
socket peer (``tests/sockpeer.py``); floods are judged by counting answers, never by
timing them.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from conftest import Daemon
from hardening import tenant_usage, wait_ledger_matches_memfds
from maasd.protocol import (
    HEADER,
    Abort,
    Attach,
    Commit,
    Detach,
    Error,
    Hello,
    Lookup,
    Ok,
    Put,
    Renew,
    Reserved,
    Welcome,
    encode_frame,
)
from rawentries import commit, connect, pattern, put, put_committed, write
from sockpeer import Raw, lookup, miss
from waiting import wait_until

KiB = 1 << 10
MiB = 1 << 20


def _refused(reply: Any, fds: list[int], status: int) -> None:
    """An error frame of ``status``, with no fd."""
    for fd in fds:
        os.close(fd)
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == status, reply


def _refuses(r: Raw, msg: Any, status: int) -> None:
    """``msg`` on ``r`` answers an error frame of ``status``, with no fd."""
    reply, fds = r.call(msg)
    _refused(reply, fds, status)


def _map(*pairs: tuple[str, Any]) -> bytes:
    """One frame of a msgpack map of ``pairs`` as written, a name given twice included
    (a dict could not say that)."""
    assert len(pairs) < 16
    body = bytes([0x80 | len(pairs)])
    for name, value in pairs:
        body += msgspec.msgpack.encode(name) + msgspec.msgpack.encode(value)
    return HEADER.pack(len(body)) + body


def _buffers(d: Daemon, key: str) -> list[dict[str, Any]]:
    with d.client(key) as c:
        r = c.get("/v1/buffers")
        assert r.status_code == 200, r.text
        items = r.json()
        return list(items["items"] if isinstance(items, dict) else items)


# --- a map that names a field twice ------------------------------------------------------


def test_a_frame_naming_a_field_twice_is_a_400_and_changes_nothing(daemon: Daemon) -> None:
    """§2.7 ("Any malformed … request gets a 4xx … and changes nothing") and §5 ("the
    connection survives a bad frame"): msgspec keeps a repeated name's last value, so a
    `put` of 4 KiB then 8 MiB reserved 8 MiB where a proxy or log keeping the first saw
    4 KiB. REST refuses such a body (400); the socket now does too, for every op."""
    _tid, key = daemon.tenant()
    _other_tid, other_key = daemon.tenant()
    theirs = put_committed(connect(daemon, other_key), "theirs", pattern(4 * KiB))
    r = connect(daemon, key)
    mine = put_committed(r, "mine", pattern(4 * KiB, 1))
    before = _buffers(daemon, key)
    frames = [
        _map(("op", "put"), ("key", "k"), ("size_bytes", 4 * KiB), ("size_bytes", 8 * MiB)),
        _map(("op", "put"), ("key", "a"), ("key", "b"), ("size_bytes", 4 * KiB)),
        _map(("op", "put"), ("key", "k"), ("size_bytes", 4096), ("pool", None), ("pool", "x")),
        _map(("op", "put"), ("key", "k"), ("size_bytes", 4096), ("ttl_s", 5), ("ttl_s", 9)),
        _map(("op", "lookup"), ("keys", ["nothing"]), ("keys", ["mine"])),
        _map(("op", "attach"), ("buffer_id", theirs), ("buffer_id", mine)),
        _map(("op", "renew"), ("buffer_id", mine), ("ttl_s", 60), ("ttl_s", 61)),
        _map(("op", "op"), ("op", "commit"), ("buffer_id", mine)),
        _map(("op", "commit"), ("op", "commit"), ("buffer_id", mine)),
    ]
    for frame in frames:
        r.send_raw(frame)
        reply, fds = r.recv()
        _refused(reply, fds, 400)
        if "more than once" not in reply.detail:
            assert "Invalid value" in reply.detail, reply  # ("op", "op") is no op at all
    assert _buffers(daemon, key) == before
    found, fd = lookup(r, ["mine"])  # the connection survived every one of them
    os.close(fd)
    assert found.buffer_id == mine
    # A put that gives its optional fields as nil, each once, is no repeat.
    r.send_raw(_map(("op", "put"), ("key", "n"), ("size_bytes", 4096), ("pool", None)))
    reply, fds = r.recv()
    assert isinstance(reply, Reserved), reply
    for fd in fds:
        os.close(fd)
    r.close()


def test_a_hello_naming_its_key_twice_is_refused_and_closed(daemon: Daemon) -> None:
    """§5: "The first frame must be `hello {api_key}`" — a hello naming another tenant's
    key then its own is no hello of either: 400, closed, no welcome."""
    _tid, key = daemon.tenant()
    _other, other_key = daemon.tenant()
    for first, last in ((other_key, key), ("maasd_nonsense", key), (key, daemon.admin_key)):
        r = Raw(daemon.socket_path)
        r.send_raw(_map(("op", "hello"), ("api_key", first), ("api_key", last)))
        reply, fds = r.recv()
        _refused(reply, fds, 400)
        assert r.closed_by_peer()
        r.close()


def test_a_second_hello_is_a_400_and_the_connection_stays_its_first_tenants(
    daemon: Daemon,
) -> None:
    """§5: hello is the first frame; a second one, of another tenant's key or the admin's,
    answers 400 and the connection still speaks for the first tenant only."""
    _tid, key = daemon.tenant()
    _other, other_key = daemon.tenant()
    theirs = put_committed(connect(daemon, other_key), "theirs", pattern(4 * KiB))
    r = connect(daemon, key)
    for again in (other_key, daemon.admin_key, key):
        _refuses(r, Hello(api_key=again), 400)
    _refuses(r, Attach(buffer_id=theirs), 404)
    miss(r, ["theirs"])
    mine = put_committed(r, "mine", pattern(4 * KiB))
    assert [b["id"] for b in _buffers(daemon, key)] == [mine]
    r.close()
    # Pipelined, behind a first hello whose key the socket has not seen yet (checked
    # against the ledger off the loop): the second is still the second.
    fresh_tid, fresh = daemon.tenant()
    p = Raw(daemon.socket_path)
    p.send_raw(
        encode_frame(Hello(api_key=fresh))
        + encode_frame(Hello(api_key=other_key))
        + encode_frame(Attach(buffer_id=theirs))
        + encode_frame(Lookup(keys=["theirs"]))
    )
    replies, fds = zip(*(p.recv() for _ in range(4)), strict=True)
    assert [fd for some in fds for fd in some] == []
    assert replies[0] == Welcome(tenant_id=fresh_tid, pid=os.getpid())
    assert [(type(x), x.status) for x in replies[1:]] == [(Error, 400), (Error, 404), (Error, 404)]
    p.close()


# --- renew: every wrong shape of a lease length --------------------------------------------


@pytest.mark.parametrize(
    "ttl_s", [0, -1, -(2**63), 2**31 + 1, 2**63, 60.0, 60.5, True, False, "60", None, [60]]
)
def test_a_renew_of_a_bad_ttl_is_a_400_and_keeps_the_lease(daemon: Daemon, ttl_s: Any) -> None:
    """§2.7 on the socket: `renew {buffer_id, ttl_s}` with a zero, negative, huge, float,
    bool, string, nil or list ttl answers 400, the lease unchanged, the connection alive."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    bid = put_committed(r, "leased", pattern(4 * KiB))
    (before,) = _buffers(daemon, key)
    r.send_raw(_map(("op", "renew"), ("buffer_id", bid), ("ttl_s", ttl_s)))
    reply, fds = r.recv()
    _refused(reply, fds, 400)
    (after,) = _buffers(daemon, key)
    assert after["expires_at"] == before["expires_at"]
    assert r.call(Renew(buffer_id=bid, ttl_s=30)) == (Ok(), [])
    r.close()


def test_a_renew_beyond_the_daemons_max_ttl_is_a_4xx_never_a_5xx(daemon: Daemon) -> None:
    """The largest ttl the frame's shape allows (2^31) meets the daemon's `max_ttl_s`: a
    clear 4xx and the lease unchanged (or, under a larger limit, an `ok`), never a 5xx."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    bid = put_committed(r, "long", pattern(4 * KiB))
    (before,) = _buffers(daemon, key)
    reply, fds = r.call(Renew(buffer_id=bid, ttl_s=2**31))
    assert fds == []
    if isinstance(reply, Error):
        assert 400 <= reply.status < 500, reply
        (after,) = _buffers(daemon, key)
        assert after["expires_at"] == before["expires_at"]
    else:
        assert reply == Ok()
    assert r.call(Renew(buffer_id=bid, ttl_s=30)) == (Ok(), [])
    r.close()


def test_a_put_beyond_the_max_ttl_reserves_nothing(daemon: Daemon) -> None:
    """§5: a put's rules are a REST reserve's: a `ttl_s` past the daemon's `max_ttl_s` is
    a 4xx with no fd and nothing reserved."""
    _tid, key = daemon.tenant()
    r = connect(daemon, key)
    reply, fds = r.call(Put(key="long", size_bytes=4 * KiB, ttl_s=2**31))
    if isinstance(reply, Reserved):  # a daemon whose max_ttl_s is that large
        for fd in fds:
            os.close(fd)
        pytest.skip("max_ttl_s allows 2^31")
    _refused(reply, fds, reply.status if isinstance(reply, Error) else 400)
    assert 400 <= reply.status < 500, reply
    assert _buffers(daemon, key) == []
    r.close()


# --- put into a pool that is gone ------------------------------------------------------------


def test_a_put_into_a_deleted_pool_is_a_404_with_no_fd(daemon: Daemon) -> None:
    """§5: `put {…, pool?: str (id or name)}` follows the REST reserve's rules: a pool
    deleted (by name or by id) is unknown, 404, no fd and nothing reserved."""
    _tid, key = daemon.tenant()
    name = f"gone{os.urandom(3).hex()}"
    info = daemon.pool(name, 8 * MiB, prefault=False)
    r = connect(daemon, key)
    assert daemon.admin.delete(f"/v1/pools/{info['id']}").status_code == 204
    for ref in (name, info["id"]):
        reply, fds = r.call(Put(key=f"in-{ref}", size_bytes=4 * KiB, pool=ref))
        _refused(reply, fds, 404)
    assert _buffers(daemon, key) == []
    r.close()


# --- two tenants interleaving ----------------------------------------------------------------


def test_two_tenants_interleaving_their_entries_never_reach_each_others(daemon: Daemon) -> None:
    """§2.2, §2.3, §2.4, §2.8 with two tenants putting, committing and aborting the same
    keys on interleaved connections: no fd of the other's entry (staged, committed or
    aborted) ever arrives; a committed entry's writer fd writes nothing readers see; a
    released entry's stale mapping reads zeros."""
    _a, key_a = daemon.tenant("a")
    _b, key_b = daemon.tenant("b")
    wa, ra = connect(daemon, key_a), connect(daemon, key_a)
    wb = connect(daemon, key_b)
    staged_a, fd_a = put(wa, "shared", 4 * KiB)
    staged_b, fd_b = put(wb, "shared", 4 * KiB)
    write(fd_a, pattern(4 * KiB, 1))
    write(fd_b, pattern(4 * KiB, 2))
    for peer, foreign in ((wb, staged_a.buffer_id), (wa, staged_b.buffer_id)):
        for msg in (Attach(buffer_id=foreign), Renew(buffer_id=foreign, ttl_s=60)):
            _refuses(peer, msg, 404)
    commit(wa, staged_a.buffer_id)
    miss(wb, ["shared"])  # b's own is still staged; a's is no business of b
    _refuses(wb, Attach(buffer_id=staged_a.buffer_id), 404)
    _refuses(wb, Lookup(keys=["shared"]), 404)
    found, ro = lookup(ra, ["shared"])
    assert found.buffer_id == staged_a.buffer_id
    again, fds = wa.call(Attach(buffer_id=staged_a.buffer_id))  # the writer's own attach
    assert again.buffer_id == staged_a.buffer_id, again
    assert len(fds) == 1
    with pytest.raises(PermissionError):
        mmap.mmap(fds[0], 4 * KiB)  # is read-only too, once committed
    os.close(fds[0])
    with mmap.mmap(fd_a, 4 * KiB) as mm:  # the writer's fd, kept past its commit
        mm[:] = b"\xff" * (4 * KiB)
    with mmap.mmap(ro, 4 * KiB, prot=mmap.PROT_READ) as view:
        assert view[:] == pattern(4 * KiB, 1)
        with pytest.raises(PermissionError):
            mmap.mmap(ro, 4 * KiB)  # read-only: no writable mapping of it
        _refuses(wb, Attach(buffer_id=found.buffer_id), 404)
        with daemon.client(key_b) as c:
            assert c.delete(f"/v1/buffers/{found.buffer_id}").status_code == 404
        with daemon.client(key_a) as c:
            assert c.delete(f"/v1/buffers/{found.buffer_id}").status_code in (200, 204)
        assert view[:] == bytes(4 * KiB)  # released: the stale mapping reads zeros
    for fd in (fd_a, ro):
        os.close(fd)
    commit(wb, staged_b.buffer_id)
    os.close(fd_b)
    got, fd = lookup(connect(daemon, key_b), ["shared"])
    with mmap.mmap(fd, 4 * KiB, prot=mmap.PROT_READ) as view:
        assert view[:] == pattern(4 * KiB, 2)
    os.close(fd)
    assert got.buffer_id == staged_b.buffer_id
    miss(ra, ["shared"])
    for r in (wa, ra, wb):
        r.close()


# --- frames trickled or left half sent --------------------------------------------------------


def test_frames_trickled_byte_by_byte_and_half_frames_stall_no_one(daemon: Daemon) -> None:
    """§2.9 ("disconnecting mid-frame … can[not] … stall or starve the daemon or another
    tenant"): 32 connections each leave half a frame unsent and one sends its frames a byte
    per `send`; another tenant's worker is answered all along, the trickled frames are
    answered as whole ones, and the half frames, completed, are answered too."""
    _tid, hog = daemon.tenant("hog")
    _tid2, key = daemon.tenant("worker")
    worker = connect(daemon, key)
    bid = put_committed(worker, "w", pattern(4 * KiB))
    halves = [connect(daemon, hog) for _ in range(32)]
    frame = encode_frame(Lookup(keys=["k" * 400] * 8))
    for h in halves:
        h.send_raw(frame[: len(frame) // 2])
    trickle = connect(daemon, hog)
    mine = encode_frame(Put(key="trickled", size_bytes=4 * KiB))
    answered = 0
    for i, byte in enumerate(mine):
        trickle.send_raw(bytes([byte]))
        if i % 8 == 0:
            found, fd = lookup(worker, ["w"])
            os.close(fd)
            assert found.buffer_id == bid
            answered += 1
    assert answered == (len(mine) + 7) // 8
    reply, fds = trickle.recv()
    assert isinstance(reply, Reserved), reply
    assert len(fds) == 1
    os.close(fds[0])
    for h in halves:
        h.send_raw(frame[len(frame) // 2 :])
    for h in halves:
        reply, fds = h.recv()
        _refused(reply, fds, 404)
        h.close()
    trickle.close()
    worker.close()
    assert daemon.healthy()


# --- one tenant's flood next to another's work ----------------------------------------------


def _flood(
    d: Daemon, key: str, frame: bytes, per_conn: int, conns: int, status: int, got: list[int]
) -> list[Any]:
    """Threads that each pipeline ``per_conn`` copies of ``frame`` on a connection of their
    own, each answered by an error of ``status`` (no fd), counting answers into ``got``."""
    lock = threading.Lock()

    def run() -> None:
        r = Raw(d.socket_path, timeout=120)
        r.hello(key)
        sender = threading.Thread(target=lambda: r.send_raw(frame * per_conn), daemon=True)
        sender.start()
        for _ in range(per_conn):
            reply, fds = r.recv()
            _refused(reply, fds, status)
            with lock:
                got[0] += 1
        sender.join()
        r.close()

    return [threading.Thread(target=run, daemon=True) for _ in range(conns)]


def _work_while_flooded(worker: Raw, threads: list[Any], got: list[int]) -> int:
    """Start the flood; once it is answered, 10 puts, commits and 3 lookups of each on
    ``worker``: how many flood answers had come by the time the last was answered."""
    for t in threads:
        t.start()
    while got[0] < len(threads):  # the flood is being served
        miss(worker, ["warm-up"])
    for i in range(10):
        bid = put_committed(worker, f"e{os.urandom(4).hex()}", pattern(4 * KiB, i))
        for _ in range(3):
            reply, fds = worker.call(Attach(buffer_id=bid))
            assert len(fds) == 1, reply
            os.close(fds[0])
    seen = got[0]
    for t in threads:
        t.join(timeout=600)
    return seen


LONG_KEYS = [f"{i:04d}" + "k" * 56 for i in range(1024)]


@pytest.mark.parametrize(
    ("flood", "status"),
    [
        (Lookup(keys=LONG_KEYS), 404),  # the most keys a frame may name, each long
        (Put(key="over", size_bytes=8 * KiB), 409),  # each past the tenant's quota
        (Renew(buffer_id="0" * 32, ttl_s=60), 404),  # each looked for in the ledger
    ],
    ids=["lookups-of-1024-keys", "puts-at-quota", "renews-of-unknown-ids"],
)
def test_a_tenants_flood_leaves_another_tenant_answered(
    daemon: Daemon, flood: Any, status: int
) -> None:
    """§2.9: "Nothing a worker does … can … starve the daemon or another tenant." Four
    connections of one tenant pipeline 400 frames each (lookups of 1024 keys that miss,
    puts its quota refuses, renews of unknown ids); another tenant's 10 puts, commits and 30 attaches are all
    answered while most of the flood is still unanswered: its answers interleave with the
    flood's, they do not wait behind its whole backlog."""
    _hog_tid, hog = daemon.tenant("hog", quota_bytes=4 * KiB)
    _tid, key = daemon.tenant("worker", quota_bytes=16 * MiB)
    worker = connect(daemon, key)
    per_conn, conns = 400, 4
    got = [0]
    threads = _flood(daemon, hog, encode_frame(flood), per_conn, conns, status, got)
    seen = _work_while_flooded(worker, threads, got)
    assert got[0] == per_conn * conns
    assert seen < per_conn * conns // 2, (seen, "the worker waited behind the flood")
    worker.close()


# --- ids of every kind answer alike ----------------------------------------------------------


def test_every_op_answers_a_foreign_id_as_an_unknown_one(daemon: Daemon) -> None:
    """§2.2: "foreign or unknown ids answer 404 alike, and no fd is ever sent for them" —
    for attach, detach, renew, commit and abort, another tenant's committed, staged or
    released id, an unknown id and a garbage one answer the very same frame (the id
    aside): nothing tells them apart."""
    _a, key_a = daemon.tenant("a")
    _b, key_b = daemon.tenant("b")
    wa, wb = connect(daemon, key_a), connect(daemon, key_b)
    committed = put_committed(wa, "c", pattern(4 * KiB))
    staged, fd = put(wa, "s", 4 * KiB)
    os.close(fd)
    released = put_committed(wa, "r", pattern(4 * KiB))
    with daemon.client(key_a) as c:
        assert c.delete(f"/v1/buffers/{released}").status_code == 204
    ids = [committed, staged.buffer_id, released, os.urandom(16).hex(), "x" * 64]
    for make in (
        lambda b: Attach(buffer_id=b),
        lambda b: Detach(buffer_id=b),
        lambda b: Renew(buffer_id=b, ttl_s=60),
        lambda b: Commit(buffer_id=b),
        lambda b: Abort(buffer_id=b),
    ):
        answers = set()
        for bid in ids:
            reply, fds = wb.call(make(bid))
            _refused(reply, fds, 404)
            answers.add((reply.title, reply.detail.replace(bid, "<id>"), reply.type))
        assert len(answers) == 1, answers
    assert wb.pushed == []  # nor a push of a's release
    commit(wa, staged.buffer_id)  # a's own entries were not touched by any of it
    found, fd = lookup(wa, ["s"])
    os.close(fd)
    assert found.buffer_id == staged.buffer_id
    wa.close()
    wb.close()


# --- a commit racing the writer's hang-up ----------------------------------------------------


def test_a_commit_racing_the_writers_hang_up_is_all_or_nothing(daemon: Daemon) -> None:
    """§5: "a commit that cannot be honoured … leaves nothing behind"; "the writer's
    connection closing before commit … releases it". A commit sent and the connection
    reset at once, 20 times: each entry is then either committed with its bytes or gone,
    the tenant's usage is exactly the committed ones and the ledger matches the memfds."""
    _tid, key = daemon.tenant("racer", quota_bytes=16 * MiB)
    sizes: dict[str, str] = {}
    for i in range(20):
        w = connect(daemon, key)
        reply, fd = put(w, f"race-{i}", 64 * KiB)
        write(fd, pattern(64 * KiB, i))
        os.close(fd)
        w.send(Commit(buffer_id=reply.buffer_id))
        if i % 2:
            w.sock.recv(1, socket.MSG_PEEK)  # half the time: after the commit was answered
        w.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.close()
        sizes[f"race-{i}"] = reply.buffer_id
    r = connect(daemon, key)
    kept = 0
    for i, (name, bid) in enumerate(sizes.items()):
        got, fds = r.call(Lookup(keys=[name]))
        if isinstance(got, Error) and i % 2 == 0:  # hung up before the commit's answer
            _refused(got, fds, 404)
            continue
        assert got.buffer_id == bid
        assert os.pread(fds[0], 64 * KiB, 0) == pattern(64 * KiB, i)
        os.close(fds[0])
        kept += 1
    assert kept >= 10
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == kept * 64 * KiB, timeout=15)
    wait_ledger_matches_memfds(daemon)
    r.close()


# --- a key revoked under a staged entry --------------------------------------------------------


def test_a_key_revoked_under_a_staged_entry_commits_nothing_and_gives_it_back(
    daemon: Daemon,
) -> None:
    """§5 and §2.2: a connection whose key is revoked speaks for no one — its commit (sent
    at once, racing the daemon's own close) answers 401, the connection closes, and the
    entry it staged is released like any whose writer left before its commit; the
    tenant's other key finds nothing and its usage is back where it was."""
    tid, key = daemon.tenant("revoked")
    r = daemon.admin.post(f"/v1/tenants/{tid}/keys")
    assert r.status_code == 201, r.text
    second = r.json()
    w = connect(daemon, second["api_key"])
    staged, fd = put(w, "revoked", 64 * KiB)
    write(fd, pattern(64 * KiB))
    assert tenant_usage(daemon, key)["used_bytes"] == 64 * KiB
    r = daemon.admin.delete(f"/v1/tenants/{tid}/keys/{second['id']}")
    assert r.status_code == 204, r.text
    reply, fds = w.call_racing_close(Commit(buffer_id=staged.buffer_id))
    _refused(reply, fds, 401)
    assert w.closed_by_peer()
    w.close()
    mine = connect(daemon, key)
    miss(mine, ["revoked"])
    _refuses(mine, Attach(buffer_id=staged.buffer_id), 404)
    wait_until(lambda: tenant_usage(daemon, key)["used_bytes"] == 0, timeout=15)
    assert os.pread(fd, 8, 0) == bytes(8)  # scrubbed: the writer's fd reads zeros
    os.close(fd)
    mine.close()


class _PutStream:
    """Writers putting into ``pool`` by name, each put committed and released, or aborted,
    at once; the answers to the puts sent after :attr:`deleted` was set go to :attr:`late`."""

    def __init__(self, d: Daemon, key: str, pool: str, writers: int = 3) -> None:
        self.d, self.key, self.pool = d, key, pool
        self.deleted, self.stop = threading.Event(), threading.Event()
        self.late: list[Any] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(writers)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        try:
            w = connect(self.d, self.key)
            n = 0
            while not self.stop.is_set():
                after = self.deleted.is_set()
                msg = Put(key=f"{self.pool}-{i}-{n}", size_bytes=4 * KiB, pool=self.pool)
                reply, fds = w.call(msg)
                n += 1
                for fd in fds:
                    os.close(fd)
                if after:
                    self.late.append(reply)
                if isinstance(reply, Reserved) and n % 2:
                    commit(w, reply.buffer_id)
                    with self.d.client(self.key) as c:
                        assert c.delete(f"/v1/buffers/{reply.buffer_id}").status_code == 204
                elif isinstance(reply, Reserved):
                    assert w.call(Abort(buffer_id=reply.buffer_id)) == (Ok(), [])
            w.close()
        except BaseException as e:
            self.errors.append(e)

    def finish(self, late: int) -> None:
        """Once ``late`` puts were answered after the delete (or a writer failed): stop."""
        wait_until(lambda: len(self.late) >= late or bool(self.errors), timeout=60)
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
        assert not self.errors, self.errors


def test_a_pool_deleted_under_a_stream_of_puts_keeps_none_of_them(daemon: Daemon) -> None:
    """§5 put rules = a REST reserve's; a pool is deleted only when empty. Three writers
    put into a pool by name (committing and releasing, or aborting, each at once) while the
    admin deletes it until it is gone: every put sent after the delete's 204 is a 404, and
    no buffer row of the pool is left behind."""
    _tid, key = daemon.tenant("streamer", quota_bytes=256 * MiB)
    for round_ in range(3):
        name = f"doomed{os.urandom(3).hex()}"
        info = daemon.pool(name, 16 * MiB, prefault=False)
        stream = _PutStream(daemon, key, name)
        for _ in range(5000):
            r = daemon.admin.delete(f"/v1/pools/{info['id']}")
            assert r.status_code in (204, 409), r.text
            if r.status_code == 204:
                stream.deleted.set()
                break
        stream.finish(late=30)
        assert stream.deleted.is_set(), f"round {round_}: the pool was never empty"
        for reply in stream.late:
            assert isinstance(reply, Error), reply
            assert reply.status == 404, reply
        assert not [b for b in _buffers(daemon, key) if b["pool_id"] == info["id"]]
        r = daemon.admin.get(f"/v1/pools/{info['id']}")
        assert r.status_code == 404, r.text


# --- a memfd is never another buffer's -------------------------------------------------------


@pytest.mark.parametrize("warm", ["0", "32MiB"], ids=["no-stock", "warm-stock"])
def test_an_fd_kept_past_its_entrys_end_never_shows_the_next_tenants_bytes(
    tmp_path: Path, warm: str
) -> None:
    """§2.3: "A memfd is never reused for another buffer" (§2.4: a stale fd reads zeros).
    One tenant keeps the fds of 20 entries it aborted or committed and released; another
    tenant then puts and writes 40 entries, from a warm stock too: no kept fd ever reads
    a byte of them, and none is the same file as any of theirs."""
    d = Daemon(tmp_path / "d", env={"MAASD_DEFAULT_WARM_BYTES": warm}).start()
    try:
        _a, key_a = d.tenant("a")
        _b, key_b = d.tenant("b")
        a, b = connect(d, key_a), connect(d, key_b)
        kept = []
        for i in range(20):
            reply, fd = put(a, f"a{i}", 64 * KiB)
            write(fd, b"\x01" * (64 * KiB))
            if i % 2:
                assert a.call(Abort(buffer_id=reply.buffer_id)) == (Ok(), [])
            else:
                commit(a, reply.buffer_id)
                with d.client(key_a) as c:
                    assert c.delete(f"/v1/buffers/{reply.buffer_id}").status_code == 204
            kept.append(fd)
        theirs = []
        for i in range(40):
            reply, fd = put(b, f"b{i}", 64 * KiB)
            write(fd, b"\x42" * (64 * KiB))
            commit(b, reply.buffer_id)
            theirs.append(fd)
        for fd in kept:
            assert os.pread(fd, 64 * KiB, 0) == bytes(64 * KiB)
        assert not {os.fstat(fd).st_ino for fd in kept} & {os.fstat(fd).st_ino for fd in theirs}
        for fd in kept + theirs:
            os.close(fd)
        a.close()
        b.close()
    finally:
        d.close()
