"""A hostile tenant or unauthenticated client against the round's new paths: /v1's
authentication as a ``before_request`` hook, the REST hop on a thread pool with
per-caller semaphores, and keys taken from memory through a ledger outage.

Each test is a real daemon (SPEC §2: a refused call changes nothing, the daemon stays
healthy, another tenant is still served).
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from conftest import Daemon
from hardening import after_attack
from maasd.protocol import Error, Lookup
from pgdb import PG_URL, fresh_pg_database
from sockpeer import Raw, miss
from tcpproxy import Proxy
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

    def _connect(self, client: socket.socket) -> socket.socket | None:
        client.settimeout(5)
        (length,) = struct.unpack("!I", _exactly(client, 4))
        startup = struct.pack("!I", length) + _exactly(client, length - 4)
        client.settimeout(None)
        if self.only_listener and b"maasd-listener" not in startup:
            return None
        server = super()._connect(client)
        if server is not None:
            try:
                server.sendall(startup)
            except OSError:
                server.close()
                raise
        return server


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


# --- 1. /v1 authentication: every route, method and path trick, refused before the body --

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
#: path tricks on a route's path: routed as written, or refused before routing
VARIANTS = (
    lambda p: p,
    lambda p: p + "/",
    lambda p: "/" + p,
    lambda p: p.replace("/v1/", "/v1//", 1),
    lambda p: p.replace("/v1/", "/%76%31/", 1),
    lambda p: p.replace("/v1/", "/V1/", 1),
    lambda p: p + "%2F..%2F",
    lambda p: p + ";x=1",
)
#: ``opt`` roles of the routes (maasd.api.controllers): the others take any valid key
ADMIN_ONLY = (("POST", "/v1/pools"), ("DELETE", "/v1/pools/{pool_id}"))
TENANT_ONLY = {
    ("GET", "/v1/usage"),
    ("POST", "/v1/pools/{pool_id}/reserve"),
    ("POST", "/v1/reserve"),
    ("PATCH", "/v1/buffers/{buffer_id}/pin"),
    ("POST", "/v1/buffers/{buffer_id}/renew"),
    ("POST", "/v1/buffers/{buffer_id}/checkpoint"),
    ("POST", "/v1/buffers/lookup"),
}


def _admin_only(method: str, template: str) -> bool:
    rest = template.removeprefix("/v1")
    return (method, template) in ADMIN_ONLY or rest.startswith(("/tenants", "/events", "/hosts"))


def _valid_body(template: str) -> dict[str, object]:
    """A body the route would take: had the hook let the request through, it would act."""
    if template == "/v1/tenants":
        return {"name": f"evil-{secrets.token_hex(3)}", "quota_bytes": MiB}
    if template == "/v1/tenants/{tenant_id}":
        return {"quota_bytes": 2 * MiB}
    if template == "/v1/pools":
        return {"name": f"evil-{secrets.token_hex(3)}", "numa_node": 0, "capacity_bytes": MiB}
    if template.endswith("/reserve"):
        return {"size_bytes": MiB}
    if template.endswith("/renew"):
        return {"ttl_s": 60}
    if template.endswith("/pin"):
        return {"numa_node": 0}
    if template.endswith("/lookup"):
        return {"keys": ["k"]}
    return {}


def _ledger(d: Daemon) -> dict[str, list[tuple[object, ...]]]:
    """What a request could change: every row of the ledger's own tables (not the hosts'
    heartbeats nor the batched uses)."""
    conn = sqlite3.connect(f"file:{d.data_dir / 'maasd.db'}?mode=ro", uri=True, timeout=30)
    try:
        tables = ("tenants", "api_keys", "buffers", "pools", "events")
        return {t: sorted(conn.execute(f"SELECT * FROM {t}"), key=repr) for t in tables}
    finally:
        conn.close()


@pytest.fixture
def keyed(fresh_daemon: Daemon) -> tuple[Daemon, str, dict[str, str]]:
    """A daemon with a metrics key, a tenant with a buffer and an entry-less key, and the
    ids to put in the routes' paths."""
    metrics_key = "maasd-metrics-" + secrets.token_hex(16)
    fresh_daemon.env["MAASD_METRICS_KEY"] = metrics_key
    d = fresh_daemon.start()
    tenant_id, key = d.tenant(quota_bytes=16 * MiB)
    pool = d.pool(f"p-{secrets.token_hex(3)}", 8 * MiB)
    with d.client(key) as c:
        buffer = c.post("/v1/reserve", json={"size_bytes": MiB}).json()
    key_id = d.admin.post(f"/v1/tenants/{tenant_id}/keys").json()["id"]
    hosts = d.admin.get("/v1/hosts").json()
    ids = {
        **{k: str(hosts[0].get(k, "")) for k in ("name", "host_id", "id")},
        "tenant_id": tenant_id,
        "pool_id": pool["id"],
        "buffer_id": buffer["id"],
        "key_id": key_id,
        "metrics_key": metrics_key,
        "key": key,
    }
    return d, key, ids


def test_no_v1_route_is_reached_without_a_valid_key_or_with_the_wrong_role(keyed) -> None:
    d, key, ids = keyed
    openapi = d.admin.get("/schema/openapi.json").json()
    templates = [p for p in openapi["paths"] if p.startswith("/v1")]
    assert len(templates) >= 15, templates
    admin_key = d.admin.headers["authorization"].split(" ", 1)[1]
    bad = {
        "none": None,
        "empty": "Bearer",
        "unknown": f"Bearer maasd_{secrets.token_hex(16)}",
        "basic": f"Basic {admin_key}",
        "no-scheme": admin_key,
        "metrics": f"Bearer {ids['metrics_key']}",
        "tab": f"Bearer\t{admin_key}",
    }
    before = _ledger(d)
    refused: collections.Counter[int] = collections.Counter()
    with httpx.Client(base_url=d.url, timeout=30) as c:
        for template in templates:
            path = template.format(**ids)
            body = _valid_body(template)
            for method in METHODS:
                wrong = (
                    ("admin", f"Bearer {admin_key}")
                    if (method, template) in TENANT_ONLY
                    else ("tenant", f"Bearer {key}")
                    if _admin_only(method, template)
                    else None
                )
                creds = [*bad.items(), *([wrong] if wrong else [])]
                for variant in VARIANTS:
                    for name, auth in creds:
                        headers = {"Authorization": auth} if auth is not None else {}
                        r = c.request(method, variant(path), headers=headers, json=body or None)
                        what = (method, variant(path), name, r.status_code, r.text[:200])
                        assert r.status_code in (400, 401, 403, 404, 405), what
                        refused[r.status_code] += 1
    assert refused[401], refused  # the hook did refuse (not only routing)
    assert refused[403], refused
    assert _ledger(d) == before  # no refused request changed anything
    after_attack(d)


def _raw(d: Daemon, head: bytes, body: bytes = b"") -> bytes:
    """Send a request's head (and a start of its body), then read the answer's head."""
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n\r\n" not in answer:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
    return answer


@pytest.mark.parametrize(
    ("method", "path", "who"),
    [
        ("POST", "/v1/tenants", None),
        ("POST", "/v1/tenants", "unknown"),
        ("POST", "/v1/tenants", "tenant"),
        ("POST", "/v1/pools", "metrics"),
        ("POST", "/v1/reserve", None),
        ("POST", "/v1/reserve", "admin"),
        ("PATCH", "/v1/tenants/{tenant_id}", "tenant"),
        ("POST", "/v1/buffers/lookup", "unknown"),
    ],
)
def test_a_refused_request_never_reads_its_body(keyed, method: str, path: str, who) -> None:
    """The body announced (100 MB, over the 64 KiB limit; ``Expect: 100-continue``) and
    never sent, or sent in part: the answer is the refusal (401/403), not a 413, not a
    ``100 Continue`` (the server asks for the body only when the app reads it), and not a
    wait for bytes that never come."""
    d, key, ids = keyed
    admin_key = d.admin.headers["authorization"].split(" ", 1)[1]
    token = {
        None: None,
        "unknown": f"maasd_{secrets.token_hex(16)}",
        "tenant": key,
        "admin": admin_key,
        "metrics": ids["metrics_key"],
    }[who]
    want = b" 401 " if who in (None, "unknown") else b" 403 "
    before = _ledger(d)
    target = path.format(**ids).encode()
    auth = b"" if token is None else b"Authorization: Bearer " + token.encode() + b"\r\n"
    for expect, body in ((b"Expect: 100-continue\r\n", b""), (b"", b'{"name": "evil", "quo')):
        head = (
            method.encode() + b" " + target + b" HTTP/1.1\r\nHost: maasd\r\n" + auth + expect
            + b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )  # fmt: skip
        answer = _raw(d, head, body)
        status_line = answer.split(b"\r\n", 1)[0]
        assert want in status_line, answer[:300]
        assert b"100 Continue" not in answer
    assert _ledger(d) == before
    after_attack(d)


def test_huge_or_many_headers_are_refused_and_the_daemon_stays_well(keyed) -> None:
    d, key, _ = keyed
    before = _ledger(d)
    for head in (
        b"GET /v1/tenants HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + b"a" * (1 << 20),
        b"GET /v1/tenants HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + b"a" * 60000 + b"\r\n\r\n",
        b"GET /v1/usage HTTP/1.1\r\nHost: m\r\n"
        + b"".join(b"X-%d: y\r\n" % i for i in range(5000))
        + b"Authorization: Bearer maasd_" + secrets.token_hex(16).encode() + b"\r\n\r\n",
        b"GET /v1/tenants HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer a\r\n"
        + b"Authorization: Bearer " + key.encode() + b"\r\n\r\n",
    ):  # fmt: skip
        answer = _raw(d, head)
        status = answer.split(b"\r\n", 1)[0]
        # refused (a 4xx), or the connection closed without an answer; never served
        assert answer == b"" or status.split(b" ")[1].startswith(b"4"), answer[:300]
    assert _ledger(d) == before
    after_attack(d)


# --- 2. the REST hop: clients that leave mid-call, a share flooded past the quota -------


def test_clients_leaving_mid_call_leave_no_half_done_reservation_nor_a_held_share(
    keyed,
) -> None:
    """A tenant sends reserves and releases past its share (16) and its quota and closes
    each connection before the answer. Each call either happened whole or not at all:
    the quota is never exceeded, the tenant's use is its buffers' sum, the ledger is the
    live memfds; and its share of the threads is whole again (as many calls at once as
    before)."""
    d, key, ids = keyed
    quota = d.admin.get(f"/v1/tenants/{ids['tenant_id']}").json()["quota_bytes"]
    auth = f"Authorization: Bearer {key}\r\n".encode()
    with d.client(key) as c:
        held = [b["id"] for b in c.get("/v1/buffers").json()]

    def leave(method: str, path: str, body: bytes) -> None:
        head = (
            (
                f"{method} {path} HTTP/1.1\r\nHost: maasd\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
            ).encode()
            + auth
            + b"\r\n"
        )
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + body)  # and gone, before any answer

    calls = [("POST", "/v1/reserve", b'{"size_bytes": 2097152}') for _ in range(40)]
    calls += [("DELETE", f"/v1/buffers/{bid}", b"") for bid in held]
    threads = [threading.Thread(target=leave, args=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    with d.client(key) as c:

        def settled() -> bool:
            usage = c.get("/v1/usage").json()
            buffers = c.get("/v1/buffers").json()
            return usage["used_bytes"] == sum(b["size_bytes"] for b in buffers)

        wait_until(settled, timeout=30, message="the tenant's use is its buffers' sum")
        usage = c.get("/v1/usage").json()
        assert usage["used_bytes"] <= quota, usage
        # the share is whole: 16 calls at once (and more, queued) are all answered
        answers: list[int] = []
        readers = [
            threading.Thread(target=lambda: answers.append(c.get("/v1/usage").status_code))
            for _ in range(24)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=60)
        assert answers == [200] * 24
        for b in c.get("/v1/buffers").json():
            assert c.delete(f"/v1/buffers/{b['id']}").status_code == 204
        assert c.get("/v1/usage").json()["used_bytes"] == 0
    after_attack(d)
