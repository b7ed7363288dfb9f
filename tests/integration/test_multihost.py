"""Several daemons on one PostgreSQL ledger (the control plane).

Three real ``maasd serve`` processes — hosts ``host-a``, ``host-b``, ``host-c``,
each with its own data dir, port and socket — share one fresh PostgreSQL
database (``MAASD_TEST_PG_URL``; ``scripts/test`` starts a server). Checked:

* one tenant's concurrent reserves spread over all three never exceed its
  quota, at any moment (sampled in the ledger) nor at the end, and every
  reserve answered 201 is in the ledger unless it was released;
* a key revoked through one daemon answers 401 on the others within 1 s, on
  REST and on the socket, where the open connection is then closed; and the
  key cache that makes this a question at all (PostgreSQL too) is in use;
* pool names repeat per host and resolve to the local host's pool; the admin
  lists every host's pools with their host, a tenant its daemon's;
* a dead host: its buffers count until it restarts (recovery releases them) or
  the admin forgets it — refused while it beats; a host forgotten while only
  frozen fences itself when it wakes: its memory is scrubbed, it joins anew.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from conftest import Daemon
from hardening import buffer_memfds
from maasd import protocol
from maasd.client import Worker
from maasd.core.auth import Auth
from maasd.errors import Unauthorized
from maasd.settings import Settings
from maasd.store import KEYS_CHANNEL, KeyRow, Store
from maasd.store.notify import Listener
from maasd.tenancy import keys
from pgdb import PG_URL, fresh_pg_database
from waiting import wait_until

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"),
]

MiB = 1 << 20
HOSTS = ("host-a", "host-b", "host-c")
#: What "within 1 s" of a revocation means here ("at once"; docs/scale-out.md).
REVOCATION_BOUND_S = 1.0
HOST_TIMEOUT_S = 3.0


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ledger_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def ledger(ledger_url: str) -> Iterator[sa.Engine]:
    """A connection pool of the test's own on the shared ledger, to look at it directly."""
    engine = sa.create_engine(ledger_url, pool_size=2, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ledger_url: str) -> Iterator[list[Daemon]]:
    daemons = [
        Daemon(
            tmp_path_factory.mktemp(name),
            env={
                "MAASD_DB_URL": ledger_url,
                "MAASD_NODE_NAME": name,
                "MAASD_HOST_TIMEOUT_S": str(HOST_TIMEOUT_S),
                "MAASD_DB_POOL_SIZE": "4",
                "MAASD_DB_MAX_OVERFLOW": "24",
            },
        )
        for name in HOSTS
    ]
    try:
        for d in daemons:
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()


def tenant_on(d: Daemon, quota: int) -> tuple[str, str]:
    return d.tenant("fleet", quota_bytes=quota)


def pools_by_host(d: Daemon) -> dict[str, dict[str, dict[str, Any]]]:
    """The admin's listing of ``d``: host → pool name → pool."""
    r = d.admin.get("/v1/pools")
    assert r.status_code == 200, r.text
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in r.json():
        out.setdefault(p["host"], {})[p["name"]] = p
    return out


def tenant_used(d: Daemon, tenant_id: str) -> int:
    r = d.admin.get(f"/v1/tenants/{tenant_id}")
    assert r.status_code == 200, r.text
    return int(r.json()["used_bytes"])


def host_entry(d: Daemon, name: str) -> dict[str, Any] | None:
    r = d.admin.get("/v1/hosts")
    assert r.status_code == 200, r.text
    return next((h for h in r.json() if h["name"] == name), None)


# ------------------------------------------------------------------ pools, by host
def test_each_host_has_its_own_node0_and_the_admin_sees_them_all(fleet: list[Daemon]) -> None:
    a, b, _c = fleet
    listing = pools_by_host(a)
    assert set(listing) == set(HOSTS)
    ids = {listing[h]["node0"]["id"] for h in HOSTS}
    assert len(ids) == 3  # one node0 per host, each its own pool
    assert pools_by_host(b) == listing  # the same ledger, seen through any daemon

    _tid, key = tenant_on(a, 64 * MiB)
    with b.client(key) as tb:
        mine = tb.get("/v1/pools").json()
        assert {p["host"] for p in mine} == {"host-b"}  # a tenant sees its daemon's pools
        assert tb.get("/v1/pools/node0").json()["id"] == listing["host-b"]["node0"]["id"]
        # a name means the local pool: the buffer lands in B's node0
        r = tb.post("/v1/pools/node0/reserve", json={"size_bytes": MiB})
        assert r.status_code == 201, r.text
        on_b = r.json()
        assert on_b["pool_id"] == listing["host-b"]["node0"]["id"]
        # another host's pool, by id: unknown here
        a_node0 = listing["host-a"]["node0"]["id"]
        r = tb.post(f"/v1/pools/{a_node0}/reserve", json={"size_bytes": MiB})
        assert r.status_code == 404, r.text
        assert tb.get(f"/v1/pools/{a_node0}").status_code == 404

    # a buffer is released by the host holding its memory: elsewhere, a 409 that says where
    with a.client(key) as ta:
        assert ta.get(f"/v1/buffers/{on_b['id']}").status_code == 200  # the ledger is shared
        r = ta.delete(f"/v1/buffers/{on_b['id']}")
        assert r.status_code == 409
        assert "host-b" in r.json()["detail"], r.text
        assert ta.get(f"/v1/buffers/{on_b['id']}").json()["state"] == "live"
    with b.client(key) as tb:
        assert tb.delete(f"/v1/buffers/{on_b['id']}").status_code == 204

    # the admin may look at another host's pool by id, not delete it from here
    r = b.admin.get(f"/v1/pools/{a_node0}")
    assert r.status_code == 200
    assert r.json()["host"] == "host-a"
    r = b.admin.delete(f"/v1/pools/{a_node0}")
    assert r.status_code == 404
    assert "host-a" in r.json()["detail"], r.text
    assert a_node0 in {p["id"] for p in a.admin.get("/v1/pools").json()}


def maasctl(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """maasctl as a user runs it, with ``d``'s URL and admin key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env.update(MAASD_URL=d.url, MAASD_ADMIN_KEY=d.admin_key, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_maasctl_groups_pools_by_host(fleet: list[Daemon]) -> None:
    a = fleet[0]
    status = maasctl(a, "status")
    assert status.returncode == 0, status.stderr
    at = {h: status.stdout.index(f"Pools on {h}") for h in HOSTS}
    assert sorted(at, key=at.__getitem__) == list(HOSTS), status.stdout
    assert "on 3 hosts" in status.stdout
    listing = maasctl(a, "pools", "list")
    assert listing.returncode == 0, listing.stderr
    assert "HOST" in listing.stdout
    assert all(h in listing.stdout for h in HOSTS)
    hosts = maasctl(a, "hosts", "list")
    assert hosts.returncode == 0, hosts.stderr
    assert all(h in hosts.stdout for h in HOSTS)
    assert "this daemon" in hosts.stdout


# ------------------------------------------------------------------ the quota race
def _reserve_until_refused(d: Daemon, key: str, size: int, granted: list[str]) -> None:
    with d.client(key) as c:
        while True:
            r = c.post("/v1/pools/node0/reserve", json={"size_bytes": size, "ttl_s": 600})
            if r.status_code == 409:
                assert r.json()["type"].endswith("quota-exceeded"), r.text
                return
            assert r.status_code == 201, r.text
            granted.append(r.json()["id"])


@dataclass
class Log:
    """What one churning thread saw."""

    granted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    refused: int = 0


def _churn(d: Daemon, key: str, size: int, rounds: int, seed: int, log: Log) -> None:
    rng = np.random.default_rng(seed)
    with d.client(key) as c:
        for _ in range(rounds):
            r = c.post("/v1/pools/node0/reserve", json={"size_bytes": size, "ttl_s": 600})
            if r.status_code == 409:
                assert r.json()["type"].endswith("quota-exceeded"), r.text
                log.refused += 1
                continue
            assert r.status_code == 201, r.text
            bid = r.json()["id"]
            log.granted.append(bid)
            if rng.random() < 0.6:
                assert c.delete(f"/v1/buffers/{bid}").status_code == 204
                log.released.append(bid)


def _sum_in_ledger(ledger: sa.Engine, tenant_id: str) -> int:
    with ledger.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT COALESCE(SUM(size_bytes), 0) FROM buffers WHERE tenant_id = :t"),
                {"t": tenant_id},
            ).scalar_one()
        )


def _ids_in_ledger(ledger: sa.Engine, tenant_id: str) -> set[str]:
    with ledger.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id FROM buffers WHERE tenant_id = :t"), {"t": tenant_id}
        )
        return {r[0] for r in rows}


def _run_all(targets: list[tuple[Any, tuple[Any, ...]]]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def run(fn: Any, args: tuple[Any, ...]) -> None:
        barrier.wait()
        try:
            fn(*args)
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_a_global_quota_holds_under_concurrent_reserves_on_every_host(
    fleet: list[Daemon], ledger: sa.Engine
) -> None:
    size, slots, per_daemon = 256 << 10, 12, 6
    quota = slots * size
    tenant_id, key = tenant_on(fleet[0], quota)

    # The burst: every thread of every daemon reserves until its first 409. No release,
    # so a 409 means "full": exactly `slots` reserves are granted, fleet-wide.
    granted: list[str] = []
    _run_all([(_reserve_until_refused, (d, key, size, granted)) for d in fleet] * per_daemon)
    assert len(granted) == len(set(granted)) == slots
    assert _ids_in_ledger(ledger, tenant_id) == set(granted)
    assert _sum_in_ledger(ledger, tenant_id) == quota
    released: list[str] = []
    for d in fleet:  # each buffer is released (scrubbed) by the daemon holding it, only
        with d.client(key) as c:
            for bid in granted:
                status = c.delete(f"/v1/buffers/{bid}").status_code
                assert status in (204, 404, 409), status  # 409: held by another host
                if status == 204:
                    released.append(bid)
    assert sorted(released) == sorted(granted)
    assert _sum_in_ledger(ledger, tenant_id) == 0

    # The churn: reserves and releases everywhere while a sampler reads the ledger's sum.
    stop = threading.Event()
    sums: list[int] = []

    def sample() -> None:
        while not stop.is_set():
            sums.append(_sum_in_ledger(ledger, tenant_id))

    sampler = threading.Thread(target=sample)
    sampler.start()
    logs = [Log() for _ in range(len(fleet) * per_daemon)]
    try:
        _run_all(
            [
                (_churn, (fleet[i % len(fleet)], key, size, 25, i, logs[i]))
                for i in range(len(fleet) * per_daemon)
            ]
        )
    finally:
        stop.set()
        sampler.join()
    kept = {b for log in logs for b in log.granted} - {b for log in logs for b in log.released}
    assert len(sums) > 10
    assert max(sums) <= quota, (len(sums), max(sums))
    assert _ids_in_ledger(ledger, tenant_id) == kept  # no 201 lost, nothing unaccounted
    assert len(kept) * size == _sum_in_ledger(ledger, tenant_id) <= quota
    assert sum(log.refused for log in logs) > 0  # the race did reach the quota


# ------------------------------------------------------------------ revocation
class Conn:
    """A raw worker-socket connection (frames as maasd.protocol has them)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.reader = protocol.FrameReader()

    def call(self, msg: protocol.Request) -> protocol.Reply:
        protocol.send_message(self.sock, msg)
        return self.recv()

    def recv(self) -> protocol.Reply:
        body, fds = protocol.recv_message(self.sock, self.reader)
        for fd in fds:
            os.close(fd)
        assert body is not None, "connection closed"
        return protocol.decode_reply(body)

    def closed_by_peer(self) -> bool:
        body, fds = protocol.recv_message(self.sock, self.reader)
        for fd in fds:
            os.close(fd)
        return body is None

    def close(self) -> None:
        self.sock.close()


def test_a_key_revoked_through_one_daemon_is_refused_by_all_within_a_second(
    fleet: list[Daemon],
) -> None:
    a, b, c = fleet
    tenant_id, _first = tenant_on(a, 64 * MiB)
    r = a.admin.post(f"/v1/tenants/{tenant_id}/keys")
    assert r.status_code == 201, r.text
    key, key_id = r.json()["api_key"], r.json()["id"]
    clients = {d.port: d.client(key) for d in (b, c)}
    try:
        for cl in clients.values():  # each daemon has checked the key (and remembers it)
            assert cl.get("/v1/usage").status_code == 200
        buf = clients[b.port].post("/v1/pools/node0/reserve", json={"size_bytes": MiB}).json()
        conn = Conn(b.socket_path)
        assert isinstance(conn.call(protocol.Hello(api_key=key)), protocol.Welcome)
        assert isinstance(conn.call(protocol.Attach(buffer_id=buf["id"])), protocol.Attached)
        idle = Conn(c.socket_path)  # a worker that will send nothing more
        assert isinstance(idle.call(protocol.Hello(api_key=key)), protocol.Welcome)

        assert a.admin.delete(f"/v1/tenants/{tenant_id}/keys/{key_id}").status_code == 204
        revoked = time.monotonic()
        late: dict[str, float] = {}
        told = idle.recv()  # unprompted: the daemon on C re-checks its idle connections
        late["socket-c-idle"] = time.monotonic() - revoked
        assert isinstance(told, protocol.Error), told
        assert told.status == 401
        assert idle.closed_by_peer()
        idle.close()
        for name, cl in (("rest-b", clients[b.port]), ("rest-c", clients[c.port])):
            while cl.get("/v1/usage").status_code != 401:
                time.sleep(0.005)
            late[name] = time.monotonic() - revoked
        reply = conn.recv()  # B told its connection unprompted too (it holds an attachment)
        late["socket-b"] = time.monotonic() - revoked
        assert isinstance(reply, protocol.Error), reply
        assert reply.status == 401, reply
        assert conn.closed_by_peer()  # the connection of the revoked key is closed
        conn.close()
        assert max(late.values()) < REVOCATION_BOUND_S, late
    finally:
        for cl in clients.values():
            cl.close()


def test_a_tenant_deleted_through_one_daemon_is_scrubbed_on_every_host(
    fleet: list[Daemon], ledger: sa.Engine
) -> None:
    """Each host scrubs its own share of a deleted tenant's buffers (none can reach another
    host's memory): the DELETE through A releases A's, B and C release theirs at their next
    reaper pass, and the last one deletes the tenant. Nothing stays in any daemon's fds."""
    a, b, c = fleet
    tenant_id, key = tenant_on(a, 64 * MiB)
    before = {d.port: buffer_memfds(d.proc.pid) for d in fleet}  # type: ignore[union-attr]
    held: dict[int, list[str]] = {}
    for d in fleet:
        with d.client(key) as cl:
            for _ in range(2):
                r = cl.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "ttl_s": 600})
                assert r.status_code == 201, r.text
                held.setdefault(d.port, []).append(r.json()["id"][:8])
    with Worker(b.socket_path, key) as w:  # B's worker holds a mapping of one of them
        view = w.attach(_ids_in_ledger_on(ledger, tenant_id, "host-b")[0])
        view.array[:4] = 7
        assert a.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
        wait_until(lambda: not _ids_in_ledger(ledger, tenant_id), timeout=10)
        assert a.admin.get(f"/v1/tenants/{tenant_id}").status_code == 404
        assert not view.array.any()  # scrubbed under the worker's own mapping
    for d in fleet:
        assert d.proc is not None
        wait_until(
            lambda d=d: buffer_memfds(d.proc.pid) == before[d.port],  # type: ignore[misc]
            timeout=10,
            message=f"{d.port}: the deleted tenant's memfds are closed",
        )
        assert not set(held[d.port]) & {n[len("maasd-") :] for n in buffer_memfds(d.proc.pid)}
        assert d.admin.get("/healthz").status_code == 200
    with ledger.connect() as conn:
        kinds = conn.execute(
            sa.text("SELECT kind FROM events WHERE tenant_id = :t"), {"t": tenant_id}
        ).scalars()
        assert "tenant_delete" in set(kinds)


def _ids_in_ledger_on(ledger: sa.Engine, tenant_id: str, host: str) -> list[str]:
    with ledger.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id FROM buffers WHERE tenant_id = :t AND host = :h ORDER BY id"),
            {"t": tenant_id, "h": host},
        )
        return [r[0] for r in rows]


def test_the_key_cache_answers_on_postgresql_and_forgets_a_remote_revocation(
    ledger_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is real (a remembered key needs no database read), and a revocation made
    by another store — another daemon — empties it through the listener."""
    here = Store(ledger_url)
    here.upgrade()  # (when this test runs without the fleet)
    there = Store(ledger_url)
    auth = Auth(Settings(data_dir=str(tmp_path), admin_key="x" * 32), here.tenants)
    auth.load_admin_key()
    tenant_id, key_id, token = keys.new_id(), keys.new_id(), keys.new_token()
    there.tenants.add_tenant(tenant_id, f"cache-{secrets.token_hex(3)}", MiB, time.time())
    there.tenants.add_key(key_id, tenant_id, keys.digest(token), time.time())
    auth.start()
    try:
        wait_until(lambda: auth.caching, message="the listener is in place")
        assert auth.authenticate(token).key_id == key_id
        reads: list[bytes] = []
        real = here.tenants.key_by_digest

        def counted(digest: bytes) -> KeyRow | None:
            reads.append(digest)
            return real(digest)

        monkeypatch.setattr(here.tenants, "key_by_digest", counted)
        assert auth.authenticate(token).key_id == key_id
        assert auth.known_principal(token) is not None
        assert reads == []  # answered from the cache
        generation = auth.generation
        assert there.tenants.revoke_key(tenant_id, key_id)
        wait_until(lambda: auth.generation != generation, message="the notification arrived")
        with pytest.raises(Unauthorized):
            auth.authenticate(token)
        assert len(reads) == 1
    finally:
        auth.stop()
        here.dispose()
        there.dispose()
    assert not auth.caching  # a stopped listener leaves nothing trusted


def test_a_listener_hears_revocations_but_not_other_listeners_probes(ledger_url: str) -> None:
    store = Store(ledger_url)
    store.upgrade()  # (when this test runs without the fleet)
    seen: dict[str, list[str]] = {"first": [], "second": []}

    def listener(name: str) -> Listener:
        return store.db.listener(
            KEYS_CHANNEL,
            on_up=lambda: seen[name].append("up"),
            on_event=lambda: seen[name].append("event"),
            on_down=lambda: seen[name].append("down"),
        )

    first, second = listener("first"), listener("second")
    try:
        first.start()
        wait_until(lambda: first.listening)
        second.start()  # proves its connection with a probe that first hears too
        wait_until(lambda: second.listening)
        tenant_id, key_id = keys.new_id(), keys.new_id()
        store.tenants.add_tenant(tenant_id, f"probe-{secrets.token_hex(3)}", MiB, time.time())
        store.tenants.add_key(key_id, tenant_id, keys.digest(keys.new_token()), time.time())
        assert seen["first"] == ["up"]  # a probe, a new tenant, a new key: no news
        store.tenants.revoke_key(tenant_id, key_id)
        wait_until(lambda: seen["first"] == seen["second"] == ["up", "event"])
    finally:
        first.stop()
        second.stop()
        store.dispose()
    assert seen["first"][-1] == seen["second"][-1] == "down"


# ------------------------------------------------------------------ hosts
def test_a_second_daemon_for_a_host_name_in_use_is_refused(
    fleet: list[Daemon], ledger_url: str, tmp_path: Path
) -> None:
    twin = Daemon(
        tmp_path / "twin",
        env={
            "MAASD_DB_URL": ledger_url,
            "MAASD_NODE_NAME": "host-b",
            "MAASD_HOST_TIMEOUT_S": "120",  # b is live to it for sure: the claim must watch
        },
    )
    b = fleet[1]
    before = host_entry(b, "host-b")
    try:
        with pytest.raises(RuntimeError, match="another daemon is serving as host 'host-b'"):
            twin.start()
    finally:
        twin.close()
    assert b.healthy()
    entry = host_entry(b, "host-b")
    assert before is not None
    assert entry is not None
    assert entry["live"]
    assert entry["started_at"] == before["started_at"]  # still b's claim, never taken
    assert "lost its claim" not in b.log()


def test_a_host_that_beats_cannot_be_forgotten(fleet: list[Daemon]) -> None:
    a, b, _c = fleet
    entry = host_entry(a, "host-b")
    assert entry is not None
    assert entry["live"]
    assert not entry["local"]
    assert host_entry(a, "host-a")["local"]  # type: ignore[index]
    r = a.admin.delete("/v1/hosts/host-b")
    assert r.status_code == 409
    assert "serving" in r.json()["detail"], r.text
    refused = maasctl(a, "hosts", "forget", "host-b")
    assert refused.returncode == 1
    assert "serving" in refused.stderr
    assert a.admin.delete("/v1/hosts/host-a").status_code == 409  # itself
    assert a.admin.delete("/v1/hosts/nowhere").status_code == 404
    assert set(pools_by_host(a)) == set(HOSTS)


def test_a_killed_host_counts_until_it_restarts(fleet: list[Daemon]) -> None:
    a, _b, c = fleet
    tenant_id, key = tenant_on(a, 8 * MiB)
    with c.client(key) as tc:
        for _ in range(3):
            assert (
                tc.post("/v1/pools/node0/reserve", json={"size_bytes": 2 * MiB}).status_code == 201
            )
    c.kill()
    assert tenant_used(a, tenant_id) == 6 * MiB  # its buffers still count...
    with a.client(key) as ta:  # ...so the quota still holds them
        r = ta.post("/v1/pools/node0/reserve", json={"size_bytes": 4 * MiB})
        assert r.status_code == 409, r.text
    c.start()  # takes over its own host at once (the dead run no longer beats)
    assert tenant_used(a, tenant_id) == 0  # recovery released the volatile buffers
    with a.client(key) as ta:
        assert ta.post("/v1/pools/node0/reserve", json={"size_bytes": 4 * MiB}).status_code == 201


def test_a_host_that_never_comes_back_is_forgotten(fleet: list[Daemon]) -> None:
    a, _b, c = fleet
    tenant_id, key = tenant_on(a, 8 * MiB)
    with c.client(key) as tc:
        r = tc.post("/v1/pools/node0/reserve", json={"size_bytes": 2 * MiB})
        assert r.status_code == 201
    c.kill()
    wait_until(lambda: not host_entry(a, "host-c")["live"], timeout=30)  # type: ignore[index]
    forgot = maasctl(a, "hosts", "forget", "host-c")
    assert forgot.returncode == 0, forgot.stderr
    assert "1 buffer(s)" in forgot.stdout
    assert tenant_used(a, tenant_id) == 0
    assert host_entry(a, "host-c") is None
    assert "host-c" not in pools_by_host(a)
    events = a.admin.get("/v1/events", params={"tenant_id": tenant_id}).json()
    assert [e["kind"] for e in events][:1] == ["host_forget"]
    c.start()  # it comes back after all: a new host, with fresh pools
    assert host_entry(a, "host-c")["live"]  # type: ignore[index]
    assert pools_by_host(a)["host-c"]["node0"]["used_bytes"] == 0


def test_a_frozen_host_forgotten_meanwhile_fences_itself_when_it_wakes(
    fleet: list[Daemon],
) -> None:
    a, _b, c = fleet
    tenant_id, key = tenant_on(a, 8 * MiB)
    old_pool = pools_by_host(a)["host-c"]["node0"]["id"]
    with c.client(key) as tc:
        buf = tc.post("/v1/pools/node0/reserve", json={"size_bytes": MiB}).json()
    worker = Worker(c.socket_path, key, renew_interval_s=0)
    try:
        mapping = worker.attach(buf["id"])
        mapping.array[:] = 0xA5
        assert c.proc is not None
        c.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: not host_entry(a, "host-c")["live"], timeout=30)  # type: ignore[index]
            assert a.admin.delete("/v1/hosts/host-c").status_code == 204
            assert tenant_used(a, tenant_id) == 0
        finally:
            c.proc.send_signal(signal.SIGCONT)
        # it wakes, finds its claim gone, scrubs what it held and joins again
        wait_until(lambda: not mapping.array.any(), timeout=30, message="the region was scrubbed")
        wait_until(lambda: "host-c" in pools_by_host(a), timeout=30)
        assert pools_by_host(a)["host-c"]["node0"]["id"] != old_pool
        assert c.healthy()
        with c.client(key) as tc:
            assert tc.get(f"/v1/buffers/{buf['id']}").status_code == 404
            assert tc.post("/v1/pools/node0/reserve", json={"size_bytes": MiB}).status_code == 201
        mapping.close()
    finally:
        worker.close()


def test_a_dead_run_is_taken_over_from_another_data_dir(
    fleet: list[Daemon], ledger_url: str, tmp_path: Path
) -> None:
    """host-c moves to a new data dir: its old run, killed, stops beating and is taken over."""
    a, _b, c = fleet
    c.kill()
    moved = Daemon(
        tmp_path / "moved",
        env={
            "MAASD_DB_URL": ledger_url,
            "MAASD_NODE_NAME": "host-c",
            # long: however slow this start, the dead run is not yet silent, so the claim
            # must watch it to take over
            "MAASD_HOST_TIMEOUT_S": "120",
        },
    )
    try:
        moved.start()
        assert "watching it" in moved.log()  # not its own previous run: it watched first
        entry = host_entry(a, "host-c")
        assert entry is not None
        assert entry["live"]
        assert "host-c" in pools_by_host(a)
    finally:
        moved.close()
