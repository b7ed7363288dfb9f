"""What no worker can do to the socket: crash it, starve it, stall it.

Each test performs the attack: connection floods from one uid, one tenant and
before hello; a hello trickled one byte at a time; a peer that never reads; a
disconnect mid-frame; slow operations that hang; stop() against all of that.
They run against a real :class:`maasd.broker.Broker` over the fake service of
``tests/sockpeer.py`` (real sockets, real memfds, real processes for the
floods); ``test_broker_daemon_limits.py`` repeats the floods against the
daemon and adds the process limits (threads, open files).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from maasd.broker import Limits
from maasd.protocol import (
    HEADER,
    Attach,
    Attached,
    Error,
    Found,
    Hello,
    Lookup,
    Ok,
    Renew,
    encode_frame,
)
from sockflood import flood
from sockpeer import FakeEnv, MiB, Raw
from waiting import wait_until

NOBODY = 65534


@contextlib.contextmanager
def broker(where: Path, **limits: float) -> Iterator[FakeEnv]:
    """A broker whose socket the nobody group may connect to, with ``limits``."""
    env = FakeEnv(where, Limits(**limits), group=NOBODY)  # type: ignore[arg-type]
    try:
        yield env
    finally:
        env.close()


def attach_works(env: FakeEnv, tenant: tuple[str, str] | None = None) -> bool:
    """A new connection of ``tenant`` (a fresh one by default) says hello and attaches."""
    tenant = tenant or env.new_tenant()
    bid = env.reserve(tenant)
    with contextlib.closing(Raw(env.socket_path)) as r:
        r.hello(tenant[1])
        reply, fds = r.call(Attach(buffer_id=bid))
        for fd in fds:
            os.close(fd)
    return isinstance(reply, Attached) and len(fds) == 1


def refusals(summary: dict, setting: str) -> list[str]:
    return [d for status, d in summary["errors"] if status == 429 and setting in d]


# --- floods -------------------------------------------------------------------------------


def test_flood_of_one_tenant_is_capped_and_others_keep_working(open_dir: Path) -> None:
    with broker(open_dir, max_per_tenant=4) as env:
        hog = env.new_tenant()
        with contextlib.closing(Raw(env.socket_path)) as first:
            first.hello(hog[1])
            with flood(env.socket_path, 10, key=hog[1]) as got:
                assert got["welcome"] == 3
                assert len(refusals(got, "socket_max_per_tenant = 4")) == 7
                assert got["closed"] == 7  # refused connections are closed
                assert env.broker.connections == 4
                assert attach_works(env)  # another tenant
                bid = env.reserve(hog)
                reply, fds = first.call(Attach(buffer_id=bid))  # the hog's own old one
                assert isinstance(reply, Attached)
                os.close(fds[0])
                assert env.broker.healthy()[0]
            # the flood's connections closed: the tenant may connect again
            wait_until(lambda: env.broker.connections == 1, message="flood connections closed")
            assert attach_works(env, hog)


def test_flood_from_one_uid_is_capped_and_other_uids_keep_working(open_dir: Path) -> None:
    with broker(open_dir, max_per_uid=5) as env:
        tenant = env.new_tenant()
        with flood(env.socket_path, 12, key=tenant[1], euid=NOBODY, egid=NOBODY) as got:
            assert got["connected"] == 12
            assert got["welcome"] == 5
            assert len(refusals(got, f"peer uid {NOBODY} has 5 connections open")) == 7
            assert attach_works(env)  # from root
            assert attach_works(env, tenant)  # the same tenant, from another uid
            assert env.broker.healthy()[0]


def shed(summary: dict) -> list[str]:
    return [d for status, d in summary["errors"] if status == 429 and "the oldest is closed" in d]


def test_flood_before_hello_from_one_uid_sheds_its_own_oldest(open_dir: Path) -> None:
    with (
        broker(open_dir, max_unauthenticated=8) as env,
        flood(env.socket_path, 20, euid=NOBODY, egid=NOBODY) as got,
    ):
        # Half of the unauthenticated slots, held by its 4 newest: each new connection
        # closed the oldest of the uid's connections waiting for hello, with a 429.
        assert got["open"] == 4
        assert len(shed(got)) == 16
        assert got["closed"] == 16
        assert env.broker.connections == 4
        assert attach_works(env)  # root still gets in, says hello, attaches
        assert env.broker.healthy()[0]
        # Root takes the other half; one more from root sheds root's own oldest.
        held = [Raw(env.socket_path) for _ in range(4)]
        try:
            wait_until(lambda: env.broker.connections == 8, message="root's connections in")
            with contextlib.closing(Raw(env.socket_path)) as late:
                reply, _ = held[0].recv()
                assert isinstance(reply, Error)
                assert reply.status == 429
                assert "the oldest is closed" in reply.detail
                assert held[0].closed_by_peer()
                # At the total cap (8), a third uid sheds from the uid holding most; the
                # connections waiting for hello never exceed the cap.
                with flood(env.socket_path, 3, euid=NOBODY - 1, egid=NOBODY) as third:
                    assert third["open"] == 3
                    assert env.broker.connections == 8
                late.hello(env.new_tenant()[1])  # the newest says hello: it was kept
        finally:
            for r in held:
                r.close()


def test_a_refused_worker_reads_the_429_even_after_sending_hello(open_dir: Path) -> None:
    with broker(open_dir, max_per_uid=1) as env:
        tenant = env.new_tenant()
        with contextlib.closing(Raw(env.socket_path)) as first:
            first.hello(tenant[1])
            with contextlib.closing(Raw(env.socket_path)) as second:
                # the broker refuses at accept; the peer's hello arrives after that
                with contextlib.suppress(BrokenPipeError):
                    second.send(Hello(api_key=tenant[1]))
                reply, _ = second.recv()
                assert isinstance(reply, Error)
                assert reply.status == 429
                assert reply.type is not None
                assert reply.type.endswith("/limit-exceeded")
                assert "socket_max_per_uid = 1" in reply.detail


# --- deadlines ------------------------------------------------------------------------------


def test_a_hello_trickled_byte_by_byte_is_cut_off_at_the_absolute_deadline(
    tmp_path: Path,
) -> None:
    env = FakeEnv(tmp_path, Limits(hello_timeout_s=1.0))
    try:
        tenant = env.new_tenant()
        frame = encode_frame(Hello(api_key=tenant[1] + "x" * 60))  # > 30 bytes: > 3 s of trickle
        with contextlib.closing(Raw(env.socket_path)) as r:
            sent = 0
            closed = threading.Event()
            while sent < len(frame) and not closed.is_set():
                try:
                    r.sock.send(frame[sent : sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += 1
                closed.wait(0.1)  # one byte every 100 ms, each one "activity"
                if env.broker.connections == 0:
                    closed.set()
            assert sent < len(frame), "the hello completed: no deadline cut it off"
            reply, _ = r.recv()
            assert isinstance(reply, Error)
            assert reply.status == 400
            assert "no hello within 1 s" in reply.detail
            assert r.closed_by_peer()
        assert env.healthy()
    finally:
        env.close()


def test_a_peer_that_never_reads_is_closed_and_others_are_not_held_up(tmp_path: Path) -> None:
    env = FakeEnv(tmp_path, Limits(send_timeout_s=1.0))
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant, 4096)
        base = env.attached(tenant[0])
        stuck = Raw(env.socket_path)
        stuck.hello(tenant[1])
        # Attaches pipelined, no reads: one reply (and its fd) goes out, the next waits
        # until the peer reads that one, and no further frame is read meanwhile.
        stuck.sock.sendall(encode_frame(Attach(buffer_id=bid)) * 100)
        wait_until(lambda: env.attached(tenant[0]) - base == 2, message="two attaches served")
        assert attach_works(env)  # others are served meanwhile
        assert env.attached(tenant[0]) - base == 2
        # The send deadline closes it and drops its attachments; the fd it has not read
        # keeps it counted (half-shut) until it reads or hangs up.
        wait_until(lambda: env.attached(tenant[0]) == base, message="attachments dropped")
        assert env.broker.connections == 1
        assert attach_works(env)
        reply, fds = stuck.recv()  # the one reply it was sent, then the end
        assert isinstance(reply, Attached)
        assert len(fds) == 1
        os.close(fds[0])
        assert stuck.closed_by_peer()
        wait_until(lambda: env.broker.connections == 0, message="the drained connection ends")
        stuck.close()
        assert attach_works(env, tenant)
    finally:
        env.close()


def test_a_disconnect_mid_frame_ends_only_that_connection(tmp_path: Path) -> None:
    env = FakeEnv(tmp_path)
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant)
        with contextlib.closing(Raw(env.socket_path)) as other:
            other.hello(tenant[1])
            r = Raw(env.socket_path)
            r.hello(tenant[1])
            _, fds = r.call(Attach(buffer_id=bid))
            os.close(fds[0])
            frame = encode_frame(Renew(buffer_id=bid, ttl_s=60))
            r.send_raw(frame[: len(frame) // 2])
            r.close()
            wait_until(lambda: env.broker.connections == 1, message="it is cleaned up")
            assert env.attached(tenant[0]) == 0
            assert other.call(Renew(buffer_id=bid, ttl_s=60)) == (Ok(), [])
            # and a header alone, then gone
            r = Raw(env.socket_path)
            r.send_raw(HEADER.pack(100))
            r.close()
            wait_until(lambda: env.broker.connections == 1, message="it is cleaned up")
    finally:
        env.close()


# --- slow operations ----------------------------------------------------------------------------


def test_hanging_slow_operations_block_neither_other_tenants_nor_fast_ops(tmp_path: Path) -> None:
    env = FakeEnv(tmp_path, Limits(slow_workers=3, slow_per_tenant=2))
    gate = threading.Event()
    try:
        hog, other = env.new_tenant(), env.new_tenant()
        hog_bid, other_bid = env.reserve(hog), env.reserve(other)
        env.svc.renew_gates[hog[0]] = gate  # the hog's renews hang (a stuck ledger)
        hanging = [Raw(env.socket_path, timeout=30) for _ in range(4)]
        for r in hanging:
            r.hello(hog[1])
            r.send(Renew(buffer_id=hog_bid, ttl_s=60))
        assert attach_works(env, hog)  # fast ops run inline, beside the hanging ones
        with contextlib.closing(Raw(env.socket_path)) as r:
            r.hello(other[1])
            assert r.call(Renew(buffer_id=other_bid, ttl_s=60)) == (Ok(), [])
        assert env.broker.healthy()[0]
        gate.set()
        for r in hanging:
            assert r.recv() == (Ok(), [])
            r.close()
    finally:
        gate.set()
        env.close()


def test_a_lookup_waiting_for_the_shared_tier_never_holds_the_loop(tmp_path: Path) -> None:
    """A local miss asked of L2 runs on the slow pool: while it waits (a slow L2), the
    loop serves everyone else, other lookups of the same tenant included; without a
    tier, or with its breaker open, a miss is answered inline."""
    env = FakeEnv(tmp_path, Limits(slow_workers=2, slow_per_tenant=1))
    gate = threading.Event()
    try:
        tenant = env.new_tenant()
        with contextlib.closing(Raw(env.socket_path)) as r:
            r.hello(tenant[1])
            reply, _ = r.call(Lookup(keys=["k"]))
            assert isinstance(reply, Error) and reply.status == 404  # noqa: PT018
        assert env.svc.fill_threads == []  # no tier: answered on the loop
        env.svc.remote = {(tenant[0], "k"): MiB}
        env.svc.fill_gate = gate
        waiting = Raw(env.socket_path, timeout=30)
        waiting.hello(tenant[1])
        waiting.send(Lookup(keys=["j", "k"]))
        wait_until(lambda: len(env.svc.fill_threads) == 1, message="the fill started")
        assert env.svc.fill_threads[0] != "maasd-broker"  # the loop thread
        assert attach_works(env, tenant)  # the loop serves the same tenant meanwhile
        gate.set()
        reply, fds = waiting.recv()
        assert isinstance(reply, Found) and reply.key == "k"  # noqa: PT018
        assert len(fds) == 1
        os.close(fds[0])
        reply, fds = waiting.call(Lookup(keys=["k"]))  # now local: no second fill
        assert isinstance(reply, Found)
        os.close(fds[0])
        assert len(env.svc.fill_threads) == 1
        waiting.close()
    finally:
        gate.set()
        env.close()


def test_stop_is_bounded_whatever_the_peers_do(tmp_path: Path) -> None:
    env = FakeEnv(tmp_path, Limits(slow_workers=1, send_timeout_s=60))
    gate = threading.Event()
    peers: list[Raw] = []
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant)
        env.svc.renew_gates[tenant[0]] = gate
        hung = Raw(env.socket_path)
        hung.hello(tenant[1])
        hung.send(Renew(buffer_id=bid, ttl_s=60))  # occupies the only slow thread, forever
        deaf = Raw(env.socket_path)
        deaf.hello(tenant[1])
        deaf.sock.sendall(encode_frame(Attach(buffer_id=bid)) * 3000)  # never reads
        mute = Raw(env.socket_path)  # never says hello
        half = Raw(env.socket_path)
        half.send_raw(HEADER.pack(1000) + b"x")  # half a frame
        peers += [hung, deaf, mute, half]
        wait_until(lambda: env.broker.connections == 4, message="all four are in")
        stopper = threading.Thread(target=env.broker.stop)
        stopper.start()
        stopper.join(60)  # far beyond STOP_TIMEOUT_S: a hang, not a slow stop, fails this
        assert not stopper.is_alive(), "stop() did not return"
        assert not os.path.exists(env.socket_path)
        assert env.attached(tenant[0]) == 0
        ok, why = env.broker.healthy()
        assert not ok
        assert "not serving" in why
    finally:
        gate.set()
        for r in peers:
            r.close()
        env.close()


def test_health_says_what_is_wrong(tmp_path: Path) -> None:
    env = FakeEnv(tmp_path)
    ok, why = env.broker.healthy()
    assert ok, why
    assert "serving 0 connections" in why
    env.close()
    ok, why = env.broker.healthy()
    assert not ok
    assert why == "the worker socket is not serving"


def test_health_is_false_while_an_inline_call_holds_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("maasd.broker.server.STALL_UNHEALTHY_S", 0.5)
    env = FakeEnv(tmp_path)
    gate = threading.Event()
    try:
        tenant = env.new_tenant()
        bid = env.reserve(tenant)
        env.svc.attach_gates[tenant[0]] = gate  # open_handle blocks: a stuck inline call
        with contextlib.closing(Raw(env.socket_path, timeout=30)) as r:
            r.hello(tenant[1])
            r.send(Attach(buffer_id=bid))
            wait_until(lambda: not env.broker.healthy()[0], message="health sees the stall")
            assert "has not turned" in env.broker.healthy()[1]
            gate.set()
            reply, fds = r.recv()
            assert isinstance(reply, Attached)
            os.close(fds[0])
        wait_until(lambda: env.broker.healthy()[0], message="healthy again")
    finally:
        gate.set()
        env.close()
