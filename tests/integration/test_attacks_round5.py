"""A hostile tenant or unauthenticated client against the round's new paths: /v1's
authentication as a ``before_request`` hook, the REST hop on a thread pool with
per-caller semaphores, and keys taken from memory through a ledger outage.

Each test is a real daemon (SPEC §2: a refused call changes nothing, the daemon stays
healthy, another tenant is still served).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from test_ledger_outage import Proxy

from conftest import Daemon
from maasd.protocol import Error, Lookup
from pgdb import PG_URL, fresh_pg_database
from sockpeer import Raw, miss
from waiting import wait_until

MiB = 1 << 20


# --- 3. a key revoked during an outage, after the ledger is back ---------------------


class ListenerGate(Proxy):
    """The ledger proxy, with a middle state: :meth:`listener_only` lets the revocation
    listener's connection through (its startup message names ``maasd-listener``) and
    refuses every other one, so the listener is back while the pool's circuit stays open.
    Needs ``sslmode=disable`` (the startup message is then the first thing sent)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.only_listener = False
        super().__init__(upstream)

    def listener_only(self) -> None:
        self.only_listener = True
        self.open.set()

    def resume(self) -> None:
        self.only_listener = False
        self.open.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                client.settimeout(5)
                (length,) = struct.unpack("!I", _exactly(client, 4))
                startup = struct.pack("!I", length) + _exactly(client, length - 4)
                client.settimeout(None)
                if self.only_listener and b"maasd-listener" not in startup:
                    client.close()
                    continue
                server = socket.create_connection(self.upstream)
                server.sendall(startup)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.socks |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()


def _exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed before its startup message")
        data += chunk
    return data


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[Daemon, ListenerGate, sa.Engine]]:
    """A daemon whose PostgreSQL ledger is reached through a :class:`ListenerGate`, and an
    engine straight to that database (another daemon's, or an operator's, session)."""
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        u = sa.engine.make_url(url)
        gate = ListenerGate((u.host or "127.0.0.1", u.port or 5432))
        via = u.set(host="127.0.0.1", port=gate.port).update_query_dict({"sslmode": "disable"})
        env = {"MAASD_DB_URL": via.render_as_string(hide_password=False)}
        d = Daemon(tmp_path / "maasd", env={**env, "MAASD_NODE_NAME": "gated"})
        direct = sa.create_engine(url)
        try:
            d.start()
            yield d, gate, direct
        finally:
            gate.resume()
            d.close()
            gate.close()
            direct.dispose()


def _listening(direct: sa.Engine) -> bool:
    with direct.connect() as conn:
        n = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'maasd-listener'"
        ).scalar_one()
    return bool(n)


@pytest.mark.postgres
def test_a_socket_connection_whose_key_was_revoked_in_an_outage_is_closed_once_the_ledger_is_back(
    gated,
) -> None:
    """A worker's connection keeps its key through an outage (taken from memory). The key is
    revoked meanwhile by someone the outage does not cut off (an operator's SQL, another
    daemon). The revocation listener comes back first: the connection's key is checked
    again, the pool's circuit is still open, so memory answers and the connection is
    marked current. Then the pool comes back: its key must be checked against the ledger
    again, and the connection closed — not served with a revoked key for good."""
    d, gate, direct = gated
    tenant_id, key = d.tenant(quota_bytes=16 * MiB)
    raw = Raw(d.socket_path)
    try:
        raw.hello(key)  # checked against the ledger: remembered for an outage
        miss(raw, ["nothing-here"])
        wait_until(lambda: _listening(direct), timeout=30, message="the listener is in place")

        gate.cut()
        # the pool's next statement finds the ledger gone: the circuit opens
        r = d.admin.post("/v1/tenants", json={"name": "during-outage", "quota_bytes": MiB})
        assert r.status_code == 507, r.text
        wait_until(lambda: not _listening(direct), timeout=30, message="the listener is gone")
        with direct.begin() as conn:  # revoked where the outage does not reach
            conn.execute(
                sa.text("UPDATE api_keys SET revoked_at = :now WHERE tenant_id = :t"),
                {"now": time.time(), "t": tenant_id},
            )

        gate.listener_only()
        wait_until(lambda: _listening(direct), timeout=30, message="the listener is back")
        # The generation moved: the connection's key is checked again, from memory (the
        # circuit is open). Served (a 404 miss) or 507, never refused yet: it is the outage.
        reply, fds = raw.call(Lookup(keys=["nothing-here"]))
        assert fds == []
        assert isinstance(reply, Error), reply
        assert reply.status in (404, 507), reply

        gate.resume()
        wait_until(
            lambda: d.admin.get("/v1/tenants").status_code == 200,
            timeout=30,
            message="the pool reads the ledger again",
        )
        assert d.client(key).get("/v1/usage").status_code == 401  # REST reads the ledger

        def refused() -> bool:
            try:
                reply, _ = raw.call(Lookup(keys=["nothing-here"]))
            except (ConnectionResetError, BrokenPipeError):
                return True
            return reply is None or (isinstance(reply, Error) and reply.status == 401)

        wait_until(refused, timeout=10, message="the revoked key's connection is refused")
        assert raw.closed_by_peer()
    finally:
        raw.close()
    assert d.healthy()
    other_id, other = d.tenant(name="other", quota_bytes=16 * MiB)
    assert d.client(other).post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201


# --- 2. the REST hop: a flood of key checks must not take every thread ----------------


@pytest.fixture
def pg_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, sa.Engine]]:
    """A daemon on a PostgreSQL ledger of its own, and an engine straight to that database."""
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        env = {"MAASD_DB_URL": url, "MAASD_DB_STATEMENT_TIMEOUT_S": "60"}
        d = Daemon(tmp_path / "maasd", env=env)
        direct = sa.create_engine(url)
        try:
            d.start()
            yield d, direct
        finally:
            d.close()
            direct.dispose()


def _lock_waiters(direct: sa.Engine) -> int:
    with direct.connect() as conn:
        return int(
            conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND application_name = 'maasd'"
            ).scalar_one()
        )


@pytest.mark.postgres
def test_a_flood_of_unknown_keys_does_not_take_every_rest_thread(pg_daemon) -> None:
    """An unauthenticated client sends many requests, each with a key never seen: each
    needs the ledger to be refused, and the ledger is slow to say (here: its keys table
    locked by another session). Those checks are one caller's: they wait in their own
    share of the threads, and a tenant whose key is known is served meanwhile."""
    d, direct = pg_daemon
    _, key = d.tenant(quota_bytes=16 * MiB)
    tenant = d.client(key)
    assert tenant.get("/v1/usage").status_code == 200  # its key is remembered now
    flood = 96  # more than the daemon's REST threads (64) and than one caller's share (16)
    answers: list[int] = []

    def unknown_key() -> None:
        headers = {"Authorization": f"Bearer maasd_{secrets.token_hex(16)}"}
        with contextlib.suppress(httpx.HTTPError):
            answers.append(httpx.get(f"{d.url}/v1/usage", headers=headers, timeout=90).status_code)

    threads = [threading.Thread(target=unknown_key) for _ in range(flood)]
    with direct.connect() as conn, conn.begin():
        conn.exec_driver_sql("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        for t in threads:
            t.start()
        wait_until(lambda: _lock_waiters(direct) >= 16, timeout=30, message="checks wait")
        time.sleep(1)  # the rest of the flood arrives (a thread each, before the fix)
        # served while every key check still waits for the lock
        r = tenant.get("/v1/usage", timeout=20)
        assert r.status_code == 200, r.text
        assert _lock_waiters(direct) >= 1
    for t in threads:
        t.join(timeout=90)
    assert set(answers) == {401}, sorted(set(answers))
    assert len(answers) == flood
    assert d.healthy()
    assert tenant.post("/v1/reserve", json={"size_bytes": MiB}).status_code == 201
