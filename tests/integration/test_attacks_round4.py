"""A hostile local process or tenant against the round's new paths: hellos checked on the
broker's slow pool, the socket's bounded ``renew``, and the per-layer state views.

Each test is a real daemon (SPEC §2: at a limit the caller gets a clear 4xx/507, nothing
changes, the daemon stays healthy).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from test_maasctl import maasctl, ok_json

from conftest import Daemon
from maasd.client import Worker
from maasd.llama.views import MAX_LAYERS, StateError, view_state
from maasd.protocol import (
    Commit,
    Error,
    Found,
    Hello,
    Lookup,
    Ok,
    Put,
    Renew,
    Reserved,
    Welcome,
    encode_frame,
)
from pgdb import PG_URL, fresh_pg_database
from sockpeer import Raw, miss
from waiting import wait_until

MiB = 1 << 20


@pytest.fixture
def pg_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    """A daemon on a PostgreSQL ledger of its own, one connection per tenant, hellos due
    within a second."""
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        env = {
            "MAASD_DB_URL": url,
            "MAASD_SOCKET_MAX_PER_TENANT": "1",
            "MAASD_SOCKET_HELLO_TIMEOUT_S": "1",
        }
        d = Daemon(tmp_path / "maasd", env=env)
        try:
            d.start()
            yield d, url
        finally:
            d.close()


@contextlib.contextmanager
def keys_locked(url: str) -> Iterator[None]:
    """Another session holds ``api_keys`` in ACCESS EXCLUSIVE mode: a key's check waits."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn, conn.begin():
            conn.exec_driver_sql("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        engine.dispose()


def test_a_hello_closed_while_its_key_is_checked_is_not_counted_for_the_tenant(pg_daemon):
    """A hello whose key needs the ledger runs on the slow pool. Its connection ends (its
    hello deadline passes — or a peer at the pre-hello cap sheds it) while the check waits
    on the ledger. When the check comes back, the closed connection must not be admitted:
    counting it for its tenant would hold one of the tenant's connections forever (at
    ``socket_max_per_tenant`` the tenant is locked out of the socket for good) and count the
    pre-hello total below zero (the pre-hello cap bypassed)."""
    d, url = pg_daemon
    _, key = d.tenant("victim", 8 * MiB)
    with keys_locked(url):
        peer = Raw(d.socket_path, timeout=10)
        peer.send(Hello(api_key=key))
        # The deadline passes while the check waits for the lock: the daemon closes it.
        reply, _ = peer.recv()
        assert isinstance(reply, Error), reply
        assert reply.status == 400, reply
        time.sleep(0.3)  # the check is still waiting, on a slow-pool thread
    # The lock is gone, the check answers; its connection closed long ago.
    time.sleep(0.5)
    fresh = Raw(d.socket_path, timeout=10)
    try:
        reply, _ = fresh.call(Hello(api_key=key))
        assert isinstance(reply, Welcome), reply  # the tenant's one connection is free
    finally:
        fresh.close()
    assert d.healthy()


def test_a_hello_flood_of_unknown_keys_does_not_starve_a_tenant(daemon: Daemon):
    """Unauthenticated peers send hellos with random keys as fast as they can (each a
    ledger check on the slow pool); a tenant's first hello and its puts are served."""
    stop = threading.Event()
    refused = [0]

    def flood() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                r = Raw(daemon.socket_path, timeout=5)
                try:
                    reply, _ = r.call(Hello(api_key="maasd_" + secrets.token_urlsafe(24)))
                    if isinstance(reply, Error):
                        refused[0] += 1
                finally:
                    r.close()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: refused[0] > 50, timeout=30, message="the flood is refused")
        _, key = daemon.tenant("legit", 8 * MiB)
        w = Worker(daemon.socket_path, key, renew_interval_s=0)
        try:
            for i in range(5):
                w.commit(w.put(f"legit:{i}", 4096))
        finally:
            w.close()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert daemon.healthy()


# --- renew's ttl_s ------------------------------------------------------------------


def _renew_frame(buffer_id: str, ttl: object) -> bytes:
    import msgspec

    body = msgspec.msgpack.encode({"op": "renew", "buffer_id": buffer_id, "ttl_s": ttl})
    return struct.pack(">I", len(body)) + body


def _expires(d: Daemon, key: str, buffer_id: str) -> str:
    r = d.client(key).get(f"/v1/buffers/{buffer_id}")
    assert r.status_code == 200, r.text
    return str(r.json()["expires_at"])


@pytest.mark.parametrize(
    "ttl",
    [0, -1, -(2**63), 2**63, 2**64 - 1, 2**53 + 1, 7 * 24 * 3600 + 1, 1.5, "60", True, None, [60]],
    ids=repr,
)
def test_renew_with_an_absurd_ttl_is_a_400_and_changes_nothing(daemon: Daemon, ttl):
    """A tenant renews its own buffer with a ttl_s at or past every bound, or of the wrong
    type: a 4xx on the same connection (still usable), its lease unchanged."""
    _, key = daemon.tenant("renewer", 8 * MiB)
    r = daemon.client(key).post("/v1/reserve", json={"size_bytes": 4096, "ttl_s": 60})
    assert r.status_code == 201, r.text
    buffer_id = r.json()["id"]
    before = _expires(daemon, key, buffer_id)
    peer = Raw(daemon.socket_path, timeout=10)
    try:
        peer.hello(key)
        peer.send_raw(_renew_frame(buffer_id, ttl))
        reply, _ = peer.recv()
        assert isinstance(reply, Error), reply
        assert 400 <= reply.status < 500, reply
        assert _expires(daemon, key, buffer_id) == before
        reply, _ = peer.call(Renew(buffer_id=buffer_id, ttl_s=120))  # the connection serves
        assert isinstance(reply, Ok), reply
    finally:
        peer.close()
    assert daemon.healthy()


# --- state views of untrusted bytes ---------------------------------------------------


def _many_layers_state(n_stream: int, n_layer: int, page: int = 4096) -> bytes:
    """A get_data state that is well formed, byte for byte, but far past any model: one
    cache of ``n_stream`` streams, each one cell and ``n_layer`` layers of one byte (the
    very last V row longer, so that the state fills whole pages: an entry's mapping)."""
    stream = struct.pack("<I", 1) + struct.pack("<iIi", 0, 1, 0) + struct.pack("<II", 0, n_layer)
    layer = struct.pack("<iQ", 0, 1) + b"\0"
    stream += layer * n_layer * 2  # K, then V
    head = struct.pack("<II", 0xAF143CD8, 0) + struct.pack("<I", n_stream)
    data = head + stream * n_stream
    pad = -len(data) % page
    return data[: -len(layer)] + struct.pack("<iQ", 0, 1 + pad) + b"\0" * (1 + pad)


def test_a_state_of_more_layers_than_any_model_is_refused_not_viewed():
    """Each layer costs the parse a Python object and two arrays: a state of 13 bytes a
    layer makes ~50x its size in memory (27 MB of bytes → 1.3 GB, many CPU seconds, in
    the router's layout check of a tenant's entry and in ``maasctl entries show``). The
    layers of a state, all streams and caches together, are bounded."""
    data = _many_layers_state(256, 64)
    assert MAX_LAYERS < 256 * 64
    with pytest.raises(StateError, match="layers"):
        view_state(data)
    ok_state = _many_layers_state(1, 64)  # the same shape, within the bound, still parses
    assert len(view_state(ok_state).layers) == 64


def test_maasctl_entries_show_of_a_crafted_entry_says_not_a_state(daemon: Daemon):
    """A tenant writes that crafted state as an entry; ``maasctl entries show`` answers
    that it is no llama state (exit 0, no traceback), the daemon stays healthy."""
    _, key = daemon.tenant("crafter", 8 * MiB)
    data = _many_layers_state(256, 64)
    w = Worker(daemon.socket_path, key, renew_interval_s=0)
    try:
        with w.entry("crafted:" + secrets.token_hex(8), len(data)) as e:
            e.array[: len(data)] = np.frombuffer(data, np.uint8)
            buffer_id = e.buffer_id
    finally:
        w.close()
    env = {"MAASD_KEY": key, "MAASD_SOCKET": daemon.socket_path}
    j = ok_json(maasctl(daemon, "--json", "entries", "show", buffer_id, **env))
    assert j["state"]["llama"] is False, str(j)[:300]
    assert "layers" in j["state"]["why"]
    assert daemon.healthy()


def test_a_key_revoked_while_its_hello_is_checked_serves_nothing(pg_daemon):
    """A hello's key is checked on the slow pool, the check waits on the ledger (the
    tenants table locked), and the key is revoked meanwhile: whichever the check read,
    the connection gets no entry — its hello is refused, or its first op is a 401."""
    d, url = pg_daemon
    tid, owner_key = d.tenant("revoked", 8 * MiB)
    w = Worker(d.socket_path, owner_key, renew_interval_s=0)
    try:
        w.commit(w.put("secret", 4096))
    finally:
        w.close()
    info = d.admin.post(f"/v1/tenants/{tid}/keys").json()
    peer = Raw(d.socket_path, timeout=10)
    revoked: list[int] = []
    revoker = threading.Thread(
        target=lambda: revoked.append(
            d.admin.delete(f"/v1/tenants/{tid}/keys/{info['id']}").status_code
        )
    )
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn, conn.begin():
            conn.exec_driver_sql("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE")
            peer.send(Hello(api_key=info["api_key"]))
            time.sleep(0.2)  # the check waits for the lock
            revoker.start()
            time.sleep(0.2)  # so does the revocation, behind it
        revoker.join(10)
        assert revoked == [204]
        reply, _ = peer.recv()
        if isinstance(reply, Welcome):  # the check read the key before its revocation
            reply, fds = peer.call_racing_close(Lookup(keys=["secret"]))
            assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status == 401, reply
    finally:
        peer.close()
        engine.dispose()
    assert d.healthy()


def test_frames_sent_behind_a_hello_checked_off_the_loop_wait_for_its_outcome(daemon: Daemon):
    """A peer sends its hello and a lookup in one write, so that both are read before the
    hello's check (on the slow pool) answers. With a key the daemon has not seen, the
    lookup is served only after the welcome; with an unknown key, never (401, closed)."""
    tid, key = daemon.tenant("pipeliner", 8 * MiB)
    w = Worker(daemon.socket_path, key, renew_interval_s=0)
    try:
        w.commit(w.put("piped", 4096))
    finally:
        w.close()
    fresh = daemon.admin.post(f"/v1/tenants/{tid}/keys").json()["api_key"]  # not yet seen
    for api_key, welcomed in ((fresh, True), ("maasd_" + secrets.token_urlsafe(24), False)):
        peer = Raw(daemon.socket_path, timeout=10)
        try:
            peer.send_raw(
                encode_frame(Hello(api_key=api_key)) + encode_frame(Lookup(keys=["piped"]))
            )
            reply, _ = peer.recv()
            if welcomed:
                assert isinstance(reply, Welcome), reply
                reply, fds = peer.recv()
                assert isinstance(reply, Found), reply
                for fd in fds:
                    os.close(fd)
            else:
                assert isinstance(reply, Error), reply
                assert reply.status == 401, reply
                assert peer.closed_by_peer()
        finally:
            peer.close()
    assert daemon.healthy()


def _memfds(d: Daemon, name: str) -> int:
    """How many of the daemon's open fds are memfds called ``name``."""
    assert d.proc is not None
    fds = Path(f"/proc/{d.proc.pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith(f"/memfd:{name}")
    return count


def test_a_commit_refused_while_the_sqlite_ledger_is_locked_changes_nothing(
    fresh_daemon: Daemon,
):
    """A tenant puts an entry, then the ledger file's write lock is held by another
    process (the circuit opens for writes only). Its commit is a 507 and changes
    nothing: no lookup finds the entry, its usage is what the put made it, the commit's
    copy (a prefaulted memfd of the entry's size, which no pool counts) is not left open
    in the daemon, and once the file is writable again the same connection's retried
    commit works (the entry is still its own to commit) and the entry is found."""
    d = fresh_daemon
    d.start()
    _, key = d.tenant("committer", 8 * MiB)
    peer = Raw(d.socket_path, timeout=60)
    other = sqlite3.connect(d.data_dir / "maasd.db", isolation_level=None, timeout=30)
    try:
        peer.hello(key)
        reply, fds = peer.call(Put(key="locked", size_bytes=4096))
        assert isinstance(reply, Reserved), reply
        staged = reply.buffer_id
        os.pwrite(fds[0], b"\x5a" * 4096, 0)
        os.close(fds[0])
        usage = d.client(key).get("/v1/usage").json()
        other.execute("BEGIN EXCLUSIVE")
        try:
            reply, _ = peer.call(Commit(buffer_id=staged))  # waits out the busy timeout
            assert isinstance(reply, Error), reply
            assert reply.status == 507, reply
            assert "ledger" in (reply.type or ""), reply
            probe = Raw(d.socket_path, timeout=10)
            try:
                probe.hello(key)
                miss(probe, ["locked"])
            finally:
                probe.close()
            assert d.client(key).get("/v1/usage").json() == usage
            assert _memfds(d, f"maasd-e-{staged[:8]}") == 0
            h = d.admin.get("/healthz")
            assert h.status_code == 200, h.text
            assert h.json()["status"] == "degraded"
        finally:
            other.execute("ROLLBACK")
        wait_until(
            lambda: d.admin.get("/healthz").json()["status"] == "ok",
            timeout=30,
            message="the circuit closed once the file is writable",
        )
        reply, _ = peer.call(Commit(buffer_id=staged))
        assert isinstance(reply, Ok), reply
        found, fds = peer.call(Lookup(keys=["locked"]))
        assert isinstance(found, Found), found
        assert os.pread(fds[0], 4, 0) == b"\x5a" * 4
        for fd in fds:
            os.close(fd)
    finally:
        other.close()
        peer.close()
    assert d.healthy()
