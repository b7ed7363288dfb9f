"""The broker's pure parts: caps, back-off, rate-limited logging, deadlines, the slow pool,
the op table and the one error-frame builder."""

from __future__ import annotations

import array
import errno
import functools
import logging
import os
import socket
import threading
import time

import pytest

from maasd import errors
from maasd.broker import OPS, Limits
from maasd.broker.connection import Connection
from maasd.broker.deadlines import Deadlines
from maasd.broker.dispatch import Dispatcher
from maasd.broker.limits import ConnectionCounts
from maasd.broker.pacing import Backoff, LogLimiter
from maasd.broker.slowpool import SlowPool
from maasd.problems import problem_of
from maasd.protocol import Abort, Attach, Commit, Detach, Error, Lookup, Publish, Put, Renew
from maasd.settings import SOCKET_BOUNDS, load
from waiting import wait_until

# --- caps ----------------------------------------------------------------------------


def test_each_cap_refuses_with_its_setting_named_and_counts_nothing() -> None:
    counts = ConnectionCounts(
        Limits(max_connections=6, max_unauthenticated=4, max_per_uid=3, max_per_tenant=1)
    )
    assert counts.admit_peer(1) is None
    assert counts.admit_peer(1) is None
    # uid 1 holds half of the unauthenticated slots: a flood from it cannot take the rest
    assert "socket_max_unauthenticated" in (counts.admit_peer(1) or "")
    assert counts.admit_tenant(1, "a") is None
    assert counts.admit_peer(1) is None
    assert counts.admit_tenant(1, "a") == (
        "tenant a has 1 connections open (socket_max_per_tenant = 1)"
    )
    assert counts.admit_tenant(1, "b") is None  # three connections of uid 1, two past hello
    assert "socket_max_per_uid = 3" in (counts.admit_peer(1) or "")
    assert (counts.total, counts.unauthenticated, counts.by_uid[1]) == (3, 1, 3)
    for uid in (2, 3, 4):
        assert counts.admit_peer(uid) is None
    assert "socket_max_connections = 6" in (counts.admit_peer(5) or "")


def test_the_unauthenticated_total_cap() -> None:
    counts = ConnectionCounts(Limits(max_unauthenticated=2))
    assert counts.admit_peer(1) is None
    assert counts.admit_peer(2) is None
    assert counts.admit_peer(3) == (
        "2 connections are waiting for hello (socket_max_unauthenticated = 2)"
    )
    counts.leave(1, None)
    assert counts.admit_peer(3) is None


def test_who_sheds_a_connection_waiting_for_hello() -> None:
    counts = ConnectionCounts(Limits(max_unauthenticated=6, max_per_uid=4, max_connections=8))
    for uid in (1, 1, 2):
        assert counts.shed_for(uid) is None
        assert counts.admit_peer(uid) is None
    assert counts.shed_for(1) is None  # room for one more of uid 1
    assert counts.admit_peer(1) is None
    assert counts.shed_for(1) == 1  # at its share (3): its own oldest goes
    assert counts.shed_for(2) is None
    assert counts.admit_peer(2) is None
    assert counts.admit_peer(3) is None
    assert counts.shed_for(3) == 1  # at the total (6): the uid holding most
    assert counts.admit_tenant(1, "t") is None
    assert counts.admit_tenant(1, "t") is None
    assert counts.admit_peer(1) is None  # uid 1: 4 open, at socket_max_per_uid
    assert counts.shed_for(1) is None  # refused at a cap shedding would not lift
    assert counts.admit_peer(2) is None  # 8 open, at socket_max_connections
    assert counts.shed_for(4) is None
    assert counts.admit_peer(4) is not None


def test_leaving_gives_every_count_back() -> None:
    counts = ConnectionCounts(Limits())
    assert counts.admit_peer(7) is None
    assert counts.admit_peer(7) is None
    assert counts.admit_tenant(7, "t") is None
    counts.leave(7, "t")
    counts.leave(7, None)
    assert counts.total == 0
    assert counts.unauthenticated == 0
    assert not counts.by_uid
    assert not counts.by_tenant
    assert not counts.unauthenticated_by_uid


def test_limits_come_from_settings_and_env() -> None:
    s = load({}, {"MAASD_SOCKET_MAX_PER_TENANT": "3", "MAASD_SOCKET_HELLO_TIMEOUT_S": "1.5"})
    lim = Limits.from_settings(s)
    assert lim.max_per_tenant == 3
    assert lim.hello_timeout_s == 1.5
    assert lim.max_per_uid == Limits().max_per_uid
    assert {"socket_" + f for f in Limits.__struct_fields__} == {*SOCKET_BOUNDS, "socket_lowered"}


@pytest.mark.parametrize(
    ("nofile", "share", "total", "per_tenant"),
    [
        (20000, 0.25, 1024, 128),  # the setting binds
        (1024, 0.25, 85, 21),  # a quarter of what the open-files limit leaves
        (1024, 1.0, 85, 85),
        (64, 0.25, 16, 4),
    ],
)
def test_a_tenants_connections_are_its_share_of_what_the_open_files_allow(
    nofile: int, share: float, total: int, per_tenant: int
) -> None:
    import resource

    s = load({}, {"MAASD_TENANT_REGION_SHARE": str(share)})
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, before[1]))
    try:
        lim = Limits.from_settings(s)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    assert (lim.max_connections, lim.max_per_tenant) == (total, per_tenant)


@pytest.mark.parametrize("name", SOCKET_BOUNDS)
def test_a_bound_must_be_positive(name: str) -> None:
    with pytest.raises(errors.ConfigError, match=name):
        load({name: 0}, {})


# --- pacing ----------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_a_success_ends_the_streak() -> None:
    b = Backoff(first_s=0.01, cap_s=1.0)
    pauses = [b.fail(now=10.0 + i) for i in range(10)]
    assert pauses[:3] == [0.01, 0.02, 0.04]
    assert pauses[-1] == 1.0
    assert max(pauses) == 1.0
    assert b.failing_for(now=20.0) == 10.0
    b.succeed()
    assert b.failing_for(now=30.0) == 0.0
    assert b.fail(now=31.0) == 0.01


def test_log_limiter_writes_one_line_per_interval_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    built: list[int] = []

    def fields() -> dict[str, object]:
        built.append(1)
        return {"conn": "1"}

    lim = LogLimiter(logging.getLogger("test.limiter"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.limiter"):
        assert lim.log(logging.WARNING, "accept", "accept failed", fields)
        for _ in range(500):
            now[0] += 0.01
            assert not lim.log(logging.WARNING, "accept", "accept failed", fields)
        assert lim.log(logging.WARNING, "other", "another kind", {})  # kinds are separate
        now[0] = 20.0
        assert lim.log(logging.WARNING, "accept", "accept failed", fields)
    lines = [r for r in caplog.records if r.msg == "accept failed"]
    assert len(lines) == 2
    assert lines[1].__dict__["suppressed"] == 500
    assert len(built) == 2  # fields of suppressed lines are never built


def test_deadlines_expire_in_start_order() -> None:
    d: Deadlines[str] = Deadlines(5.0)
    d.start("a", now=0.0)
    d.start("b", now=1.0)
    d.start("c", now=2.0)
    d.start("a", now=3.0)  # restarted: now the last
    d.cancel("c")
    assert d.next() == 6.0
    assert d.expired(now=5.9) == []
    assert d.expired(now=8.0) == ["b", "a"]
    assert len(d) == 0
    assert d.next() is None


# --- the slow pool -------------------------------------------------------------------------


def test_one_key_cannot_take_every_thread_or_queue_others_behind_it() -> None:
    pool = SlowPool(workers=3, per_key=2)
    pool.start()
    release = threading.Event()
    running: list[str] = []
    lock = threading.Lock()

    def job(name: str) -> None:
        with lock:
            running.append(name)
        release.wait(30)

    try:
        for i in range(10):
            pool.submit("hog", functools.partial(job, f"hog{i}"))
        wait_until(lambda: len(running) == 2, message="two of the hog's jobs run")
        done = threading.Event()
        pool.submit("other", done.set)
        assert done.wait(10), "another key's job ran while the hog's queue waited"
        assert sorted(running) == ["hog0", "hog1"]  # the hog stays at its cap
    finally:
        release.set()
        assert pool.stop(timeout_s=10)
    assert len(running) < 10  # queued jobs were dropped at stop


def test_a_failing_job_does_not_kill_its_thread() -> None:
    pool = SlowPool(workers=1, per_key=1)
    pool.start()
    try:
        pool.submit("k", functools.partial(divmod, 1, 0))
        done = threading.Event()
        pool.submit("k", done.set)
        assert done.wait(10)
        assert pool.alive == 1
    finally:
        assert pool.stop(timeout_s=10)


# --- dispatch ----------------------------------------------------------------------------


def test_the_op_table_serves_each_request_once() -> None:
    assert set(OPS) == {Attach, Detach, Renew, Lookup, Put, Commit, Abort, Publish}
    # the hot path, answered from memory: no thread hop
    assert not OPS[Attach].slow
    assert not OPS[Detach].slow
    assert not OPS[Lookup].slow
    assert OPS[Renew].slow  # writes the ledger
    assert OPS[Put].slow  # a reserve: eviction, prefault
    assert OPS[Commit].slow  # a copy
    assert OPS[Abort].slow  # a scrub
    assert OPS[Publish].slow  # a reserve and a copy
    assert {t for t, op in OPS.items() if op.settles_staged} == {Commit, Abort}
    # only a publish reads the fds sent with its frame; any other op's are closed unread
    assert {t for t, op in OPS.items() if op.takes_fds} == {Publish}


@pytest.mark.parametrize(
    ("exc", "status", "code", "closes"),
    [
        (errors.NotFound("no buffer 'x'"), 404, "not-found", False),
        (errors.Unauthorized("revoked"), 401, "unauthorized", True),
        (errors.LimitExceeded("tenant t has 4 connections open"), 429, "limit-exceeded", False),
        (OSError(errno.EMFILE, "Too many open files"), 507, "resource-limit", False),
        (ValueError("secret internals"), 500, "internal", False),
    ],
)
def test_error_frames_come_from_the_one_problem_mapping(
    exc: BaseException, status: int, code: str, closes: bool
) -> None:
    dispatcher = Dispatcher(None, LogLimiter(logging.getLogger("test.dispatch")))  # type: ignore[arg-type]
    outcome = dispatcher.error(exc, {})
    frame = outcome.reply
    assert isinstance(frame, Error)
    assert frame.status == status
    assert frame.type is not None
    assert frame.type.endswith("/" + code)
    assert outcome.close is closes
    assert outcome.fds == ()
    assert "secret" not in frame.detail
    if isinstance(exc, errors.MaasdError):
        p = problem_of(exc)
        assert (frame.title, frame.detail) == (p.title, p.detail)


# --- fds in flight ---------------------------------------------------------------------


def test_a_reply_with_fds_waits_until_the_peer_has_read_the_one_before() -> None:
    ours, theirs = socket.socketpair()
    conn = Connection(ours, "1")
    try:

        def fd() -> tuple[int, ...]:
            return (os.open("/dev/null", os.O_RDONLY),)

        def read_one() -> tuple[bytes, int]:
            data, anc, _, _ = theirs.recvmsg(64, socket.CMSG_SPACE(4))
            fds = [n for _, _, payload in anc for n in array.array("i", payload)]
            for n in fds:
                os.close(n)
            return data, len(fds)

        assert conn.send(b"a", fd())  # nothing unread: it goes at once
        assert conn.unread() > 0
        assert not conn.send(b"b", fd())  # the peer has not read "a": held
        assert conn.awaiting_peer
        assert not conn.flush()  # still held
        assert conn.send(b"c") is False  # queued behind it, in order
        assert read_one() == (b"a", 1)
        assert conn.unread() == 0
        assert conn.flush()  # "b" and "c" go now
        assert not conn.awaiting_peer
        assert read_one() == (b"b", 1)
        assert read_one() == (b"c", 0)
    finally:
        conn.close()
        theirs.close()


def test_a_slow_thread_sends_only_what_the_loop_would_send_at_once() -> None:
    """``try_send`` (a slow operation answering from its own thread) sends when nothing is
    queued and the peer owes no read of earlier fds; otherwise it leaves the reply, fds
    included, to the loop — and never touches a closed connection."""
    ours, theirs = socket.socketpair()
    conn = Connection(ours, "1")
    try:
        devnull = os.open("/dev/null", os.O_RDONLY)
        assert conn.try_send(b"a") is True  # idle: sent from this thread
        assert theirs.recv(8) == b"a"
        assert conn.try_send(b"b", (devnull,)) is True  # an fd goes too, and is closed here
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(devnull)
        assert conn.unread() > 0
        second = os.open("/dev/null", os.O_RDONLY)
        assert conn.try_send(b"c", (second,)) is None  # the peer has not read "b"'s fd yet
        os.fstat(second)  # still the caller's
        assert not conn.send(b"c", (second,))  # the loop's way: held for the peer
        assert conn.try_send(b"d") is None  # something is queued: behind it, by the loop
        data, anc, _, _ = theirs.recvmsg(64, socket.CMSG_SPACE(4))
        for _, _, payload in anc:
            for n in array.array("i", payload):
                os.close(n)
        assert data == b"b"
        conn.close()
        assert conn.try_send(b"e") is None  # closed: nothing is sent, from any thread
    finally:
        conn.close()
        theirs.close()


def test_hellos_that_need_the_ledger_queue_per_peer_uid() -> None:
    """A flood of unknown keys from one uid waits in its own queue of the slow pool (fair
    between queues), not in front of another uid's first hello."""
    from types import SimpleNamespace

    from maasd.broker.hellos import Hellos

    submitted: list[str] = []
    pool = SimpleNamespace(submit=lambda key, _job: submitted.append(key))
    dispatcher = SimpleNamespace(hello_inline=lambda _body: False)
    hellos = Hellos(table=None, admission=None, dispatcher=dispatcher, pool=pool, post=None)  # type: ignore[arg-type]
    flooder = [SimpleNamespace(uid=1000, busy=False) for _ in range(3)]
    tenant = SimpleNamespace(uid=0, busy=False)
    for conn in [*flooder, tenant]:
        hellos.hello(conn, b"{}")  # type: ignore[arg-type]
    assert submitted == ["hello:uid=1000"] * 3 + ["hello:uid=0"]
    assert all(c.busy for c in [*flooder, tenant])  # each reads nothing more meanwhile


# --- who owns a connection's state -----------------------------------------------------


def _connections(n: int) -> tuple[list[Connection], list[socket.socket]]:
    pairs = [socket.socketpair() for _ in range(n)]
    return [Connection(ours, str(i)) for i, (ours, _) in enumerate(pairs)], [t for _, t in pairs]


def test_admission_sheds_the_oldest_waiting_of_a_uid_and_times_out_hellos() -> None:
    """The caps' counts and the hello deadline have one owner, tested without a loop."""
    from maasd.broker.admission import ConnectionAdmission
    from maasd.models import Principal

    events: list[str] = []
    limits = Limits(max_unauthenticated=4, hello_timeout_s=5.0)
    admission = ConnectionAdmission(
        limits, LogLimiter(logging.getLogger("test.admission")), events.append
    )
    (a, b, c), peers = _connections(3)
    try:
        assert admission.admit(a) is None
        assert admission.admit(b) is None
        shed = admission.shed_first(c.uid)  # the uid holds its share (2 of 4): its oldest goes
        assert shed is not None
        assert shed[0] is a
        assert "socket_max_unauthenticated = 4" in shed[1].detail
        admission.closing(a)
        admission.leave(a)
        assert admission.shed_first(c.uid) is None
        assert admission.admit(c) is None
        tenant = Principal(is_admin=False, tenant_id="t")
        assert admission.welcome(b, tenant, "key", 3) is None
        assert (b.principal, b.api_key, b.generation) == (tenant, "key", 3)
        assert admission.counts.by_tenant["t"] == 1
        late = admission.overdue(time.monotonic() + limits.hello_timeout_s + 1)
        assert [conn for conn, _ in late] == [c]  # b said hello in time, a was shed
        assert "no hello within 5 s" in late[0][1].detail
        assert events == ["shed", "hello_timeout"]
    finally:
        for sock in [*(x.sock for x in (a, b, c)), *peers]:
            sock.close()


def test_what_a_connection_takes_is_given_back_once_whichever_way_it_ends() -> None:
    """Holdings: an attachment or staged entry taken before its reply is sent is given back
    exactly once — undone if the reply never went, dropped by a detach, or at close."""
    from types import SimpleNamespace

    from maasd.broker.dispatch import Outcome
    from maasd.broker.holdings import Holdings
    from maasd.models import Principal

    dropped: list[str] = []
    abandoned: list[str] = []
    service = SimpleNamespace(
        handles=SimpleNamespace(drop=lambda _who, buffer_id: dropped.append(buffer_id)),
        entries=SimpleNamespace(
            staged=lambda _buffer_id: True,
            abandon=lambda _who, buffer_id: abandoned.append(buffer_id),
        ),
    )
    pool = SimpleNamespace(submit=lambda _key, job: job())  # the scrub runs at once here
    log = LogLimiter(logging.getLogger("test.holdings"))
    holdings = Holdings(service, pool, log)  # type: ignore[arg-type]
    (conn,), peers = _connections(1)
    conn.principal = Principal(is_admin=False, tenant_id="t")
    try:
        holdings.take(conn, Outcome(None, attached="a"))
        holdings.take(conn, Outcome(None, attached="a"))
        holdings.take(conn, Outcome(None, staged="e"))
        lost = Outcome(None, attached="b", staged="f")
        holdings.take(conn, lost)
        holdings.undo(conn, lost)  # its reply never reached the peer
        assert (dropped, abandoned) == (["b"], ["f"])
        holdings.take(conn, Outcome(None, detached="a"))  # the peer gave one back
        holdings.take(conn, Outcome(None, detached="b"))  # not held (any more): nothing owed
        assert dropped == ["b", "a"]
        holdings.give_back(conn)  # closed
        assert (dropped, abandoned) == (["b", "a", "a"], ["f", "e"])
        assert not conn.held
        assert not conn.staged
    finally:
        conn.sock.close()
        for sock in peers:
            sock.close()
