"""SPEC §9 (several daemons on one PostgreSQL, the Redis L2 tier) and §2 invariants 1, 2,
7 and 9 across hosts, attacked (round 11).

Two real ``maasd serve`` processes — hosts ``r11-a`` and ``r11-b`` — share a fresh
PostgreSQL ledger and a real ``redis-server`` (``tests/l2hosts.py``). What no other test
checked:

* isolation across hosts: another tenant's buffer or entry on host A, asked for by id
  through host B (REST and socket, every verb) answers exactly what an unknown id does;
  its key string misses on B's lookups, also through L2;
* pool names on the socket: a ``put`` names the local pool, another host's pool id is a
  404 (REST was checked, the socket was not);
* a tenant's quota with entries put, evicted and materialised from L2 on both hosts at
  once, beside REST reserves: the ledger's sum never passes the quota;
* a tenant deleted through A while B holds its connections, a staged put, an attached
  entry: B refuses the key at once on the socket and scrubs; the tenant's L2 values go;
* L2 namespacing with the same key string for two tenants, a value moved to another key
  of the same tenant, values of another Redis type planted under a tenant's key, and a
  value longer than the daemon reads back;
* an L2 that accepts connections and never answers (a black hole) from the daemon's
  start: the daemon starts, and puts, lookups and releases go on;
* materialising from L2 honours ``max_buffers``, not only the quota; a quota lowered
  through A holds on B at once, for reserves, puts and L2 restores alike;
* a tenant's own buffer through the other host: shown and renewed, never mapped, pinned
  or checkpointed there;
* a tenant deleted through A loses its entries on B's disk tier too (§12).
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa

from conftest import Daemon
from l2hosts import SMALL_DB_POOL, commit, encoded, in_l2, l2_key, two_hosts
from maasd import protocol
from maasd.client import Client, Worker
from maasd.client.errors import MaasdClientError
from pgdb import PG_URL
from rawentries import demote_one, entry_files, pattern, tier_pool
from redisdb import RedisServer
from sockpeer import Raw
from waiting import wait_until

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"),
]

MiB = 1 << 20
PAGE = 4096
HOSTS = ("r11-a", "r11-b")
#: The daemons' L2 timeout, and a generous bound on a local operation while L2 is down
#: (a contract, not a measurement: see test_l2.py).
L2_TIMEOUT_S = 0.1
OUTAGE_BOUND_S = 1.0
#: Values over this are not read back (the test of a value longer than that).
MAX_VALUE = 8 * MiB


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, l2_ledger_url: str, redis_server: RedisServer
) -> Iterator[tuple[Daemon, Daemon]]:
    env = {
        "MAASD_L2_TIMEOUT_S": str(L2_TIMEOUT_S),
        "MAASD_L2_BREAKER_BACKOFF_S": "0.5",
        "MAASD_L2_MAX_VALUE_BYTES": str(MAX_VALUE),
        **SMALL_DB_POOL,
    }
    with two_hosts(tmp_path_factory, HOSTS, l2_ledger_url, redis_server, env) as pair:
        yield pair


@pytest.fixture(scope="module")
def ledger(l2_ledger_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(l2_ledger_url, pool_size=2, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


def _rows(ledger: sa.Engine, tenant_id: str) -> list[tuple[str, str, int, str]]:
    """(id, host, size_bytes, state) of every row of the tenant in the ledger."""
    with ledger.connect() as conn:
        return [
            (r[0], r[1], int(r[2]), r[3])
            for r in conn.execute(
                sa.text("SELECT id, host, size_bytes, state FROM buffers WHERE tenant_id = :t"),
                {"t": tenant_id},
            )
        ]


def _sum(ledger: sa.Engine, tenant_id: str) -> int:
    return sum(r[2] for r in _rows(ledger, tenant_id))


def _pools(d: Daemon) -> dict[str, dict[str, dict[str, Any]]]:
    """The admin's pool listing through ``d``: host → name → pool."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in d.admin.get("/v1/pools").json():
        out.setdefault(p["host"], {})[p["name"]] = p
    return out


def _error(reply: tuple[Any, list[int]]) -> protocol.Error:
    """A reply that must be an error frame with no fd."""
    msg, fds = reply
    for fd in fds:
        os.close(fd)
    assert fds == [], f"an fd was sent with {msg}"
    assert isinstance(msg, protocol.Error), msg
    return msg


# ---------------------------------------------------------------------------- isolation
def _problem(r: httpx.Response, *ids: str) -> dict[str, Any]:
    """The problem body with every id in ``ids`` replaced: what tells one 404 from another."""
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = dict(r.json())
    for k, v in body.items():
        if isinstance(v, str):
            for i in ids:
                v = v.replace(i, "<id>")
            body[k] = v
    return body


def test_another_tenants_buffers_on_another_host_answer_as_unknown_ids(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """§2.2: "A tenant can never see, map, pin, renew, release or learn the existence of
    another tenant's buffer: foreign or unknown ids answer 404 alike, and no fd is ever
    sent for them" — through either host, whichever holds the buffer."""
    a, b = hosts
    x_tid, x_key = a.tenant("r11-victim", quota_bytes=32 * MiB)
    _y_tid, y_key = b.tenant("r11-thief", quota_bytes=32 * MiB)
    with a.client(x_key) as xa:
        r = xa.post(
            "/v1/pools/node0/reserve", json={"size_bytes": MiB, "ttl_s": 600, "key": "plain:k"}
        )
        assert r.status_code == 201, r.text
        plain = r.json()
    secret = secrets.token_bytes(64 * 1024)
    with Worker(a.socket_path, x_key) as wa:
        entry = commit(wa, "secret:prefix", secret)
        staged = wa.put("staged:prefix", PAGE)  # a put not committed: its id exists too
        wait_until(lambda: in_l2(redis_server, x_tid, "secret:prefix"), message="written behind")
        unknown = secrets.token_hex(16)
        foreign = [plain["id"], entry, staged.buffer_id]
        every = [*foreign, unknown]

        for d in (b, a):  # through the other host, then through the holder's own
            with d.client(y_key) as y:
                calls = {
                    "get": lambda i, y=y: y.get(f"/v1/buffers/{i}"),
                    "delete": lambda i, y=y: y.delete(f"/v1/buffers/{i}"),
                    "renew": lambda i, y=y: y.post(f"/v1/buffers/{i}/renew", json={"ttl_s": 60}),
                    "pin": lambda i, y=y: y.patch(f"/v1/buffers/{i}/pin", json={"numa_node": 0}),
                    "checkpoint": lambda i, y=y: y.post(f"/v1/buffers/{i}/checkpoint"),
                }
                for verb, call in calls.items():
                    answers = [call(i) for i in every]
                    assert [r.status_code for r in answers] == [404] * len(every), (
                        d.url,
                        verb,
                        [r.text for r in answers],
                    )
                    bodies = [_problem(r, *every) for r in answers]
                    assert all(body == bodies[-1] for body in bodies), (verb, bodies)
                assert y.get("/v1/buffers").json() == []
                for keys in (["plain:k"], ["secret:prefix"], ["staged:prefix"]):
                    r = y.post("/v1/buffers/lookup", json={"keys": keys})
                    assert r.status_code == 404, r.text

            raw = Raw(d.socket_path)
            try:
                raw.hello(y_key)
                for op in (
                    lambda i: protocol.Attach(buffer_id=i),
                    lambda i: protocol.Renew(buffer_id=i, ttl_s=60),
                    lambda i: protocol.Commit(buffer_id=i),
                    lambda i: protocol.Abort(buffer_id=i),
                ):
                    errs = [_error(raw.call(op(i))) for i in every]
                    assert [e.status for e in errs] == [404] * len(every), errs
                    shown = {
                        (e.title, e.detail.replace(i, "<id>"), e.type)
                        for e, i in zip(errs, every, strict=True)
                    }
                    assert len(shown) == 1, shown
                for keys in (["secret:prefix"], ["plain:k", "secret:prefix"], ["staged:prefix"]):
                    assert _error(raw.call(protocol.Lookup(keys=keys))).status == 404
            finally:
                raw.close()

    # X's buffers are untouched: live, same lease, same bytes
    with a.client(x_key) as xa:
        again = xa.get(f"/v1/buffers/{plain['id']}").json()
        assert again["state"] == "live"
        assert again["expires_at"] == plain["expires_at"]
    with Worker(b.socket_path, x_key) as wx:  # and X itself does find its entry on B (L2)
        hit = wx.lookup(["secret:prefix"])
        assert hit is not None
        assert bytes(hit.array[: len(secret)]) == secret
        hit.close()


def test_a_socket_put_resolves_pool_names_on_its_own_host(hosts: tuple[Daemon, Daemon]) -> None:
    """§9: "Pool names (node0, …) repeat on every host: a name resolves to the local
    host's pool" — on the socket's put too; another host's pool id is unknown here."""
    a, b = hosts
    listing = _pools(a)
    assert set(listing) >= set(HOSTS)
    tid, key = a.tenant("r11-pools", quota_bytes=32 * MiB)
    for d, here, there in ((a, HOSTS[0], HOSTS[1]), (b, HOSTS[1], HOSTS[0])):
        raw = Raw(d.socket_path)
        try:
            raw.hello(key)
            reply, fds = raw.call(protocol.Put(key=f"named:{here}", size_bytes=PAGE, pool="node0"))
            assert isinstance(reply, protocol.Reserved), reply
            for fd in fds:
                os.close(fd)
            with d.client(key) as c:
                got = c.get(f"/v1/buffers/{reply.buffer_id}").json()
            assert got["pool_id"] == listing[here]["node0"]["id"]
            foreign = listing[there]["node0"]["id"]
            err = _error(raw.call(protocol.Put(key="elsewhere", size_bytes=PAGE, pool=foreign)))
            assert err.status == 404, err
            with d.client(key) as c:  # and the auto-placed reserve stays on this host
                r = c.post("/v1/reserve", json={"size_bytes": PAGE})
                assert r.status_code == 201, r.text
                pool_ids = {p["id"] for p in listing[here].values()}
                assert r.json()["pool_id"] in pool_ids
        finally:
            raw.close()
    with a.client(key) as c:
        assert "elsewhere" not in {x["key"] for x in c.get("/v1/buffers").json()}
    assert tid


# ---------------------------------------------------------------------------- quota race
@dataclass
class Seen:
    """What one racing thread saw: anything but a success or a quota refusal is an error."""

    ok: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)


def _refusal(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    return status in (409, 507)


def _putter(d: Daemon, key: str, tag: str, rounds: int, seen: Seen, keys: list[str]) -> None:
    """Entries put and committed on ``d`` (evicting the tenant's older ones there)."""
    data = secrets.token_bytes(384 * 1024)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for i in range(rounds):
            name = f"{tag}:{i}"
            try:
                commit(w, name, data)
            except MaasdClientError as exc:
                if _refusal(exc):
                    seen.refused += 1
                else:
                    seen.errors.append(repr(exc))
                continue
            keys.append(name)
            seen.ok += 1


def _reserver(d: Daemon, key: str, rounds: int, seen: Seen) -> None:
    """Non-evictable REST reserves on ``d``, each released after the next."""
    with d.client(key) as c:
        last = None
        for _ in range(rounds):
            r = c.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "ttl_s": 600})
            if r.status_code == 201:
                seen.ok += 1
                if last is not None and c.delete(f"/v1/buffers/{last}").status_code != 204:
                    seen.errors.append("release failed")
                last = r.json()["id"]
            elif r.status_code in (409, 507):
                seen.refused += 1
            else:
                seen.errors.append(f"{r.status_code} {r.text}")
        if last is not None:
            c.delete(f"/v1/buffers/{last}")


def _reader(d: Daemon, key: str, keys: list[str], stop: threading.Event, seen: Seen) -> None:
    """Lookups on ``d`` of keys committed on the other host: materialised from L2 here."""
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        n = 0
        while not stop.is_set():
            if not keys:
                time.sleep(0.01)
                continue
            n += 1
            try:
                hit = w.lookup([keys[-1 - (n % min(len(keys), 6))]])
            except MaasdClientError as exc:
                seen.errors.append(repr(exc))
                continue
            if hit is not None:
                seen.ok += 1
                hit.close()
            else:
                seen.refused += 1


def test_a_tenants_quota_holds_with_puts_evictions_and_l2_restores_on_both_hosts(
    hosts: tuple[Daemon, Daemon], ledger: sa.Engine
) -> None:
    """§2.1 and §9: "a tenant's quota holds across hosts under concurrent reserves on every
    host" — with entries put (and evicting) on both hosts, entries materialised from L2
    on both, and REST reserves, all at once; sampled in the ledger all along."""
    a, b = hosts
    quota = 6 * MiB
    tid, key = a.tenant("r11-quota", quota_bytes=quota)
    stop = threading.Event()
    sums: list[int] = []

    over: list[dict[str, int]] = []

    def sample() -> None:
        # Rows being released (a victim being scrubbed, a buffer its tenant released) are
        # still counted by the ledger, which admits on every state; what the quota bounds
        # is the rest: live, staged and reserving rows.
        while not stop.is_set():
            rows = _rows(ledger, tid)
            sums.append(sum(r[2] for r in rows if r[3] != "releasing"))
            if sums[-1] > quota:
                over.append({f"{r[0][:6]}@{r[1]}/{r[3]}": r[2] for r in rows})

    on_a: list[str] = []
    on_b: list[str] = []
    seen = [Seen() for _ in range(6)]
    sampler = threading.Thread(target=sample)
    threads = [
        threading.Thread(target=_putter, args=(a, key, "qa", 40, seen[0], on_a)),
        threading.Thread(target=_putter, args=(b, key, "qb", 40, seen[1], on_b)),
        threading.Thread(target=_reserver, args=(a, key, 25, seen[2])),
        threading.Thread(target=_reserver, args=(b, key, 25, seen[3])),
    ]
    readers = [
        threading.Thread(target=_reader, args=(b, key, on_a, stop, seen[4])),
        threading.Thread(target=_reader, args=(a, key, on_b, stop, seen[5])),
    ]
    sampler.start()
    for t in [*threads, *readers]:
        t.start()
    try:
        for t in threads:
            t.join(300)
    finally:
        stop.set()
        for t in [*readers, sampler]:
            t.join(60)
    assert [s.errors for s in seen] == [[]] * len(seen)
    print(f"quota race: {[(s.ok, s.refused) for s in seen]}, {len(sums)} samples")
    assert len(sums) > 10
    assert max(sums) <= quota, (max(sums), over[:2])
    assert seen[0].ok  # both hosts did put entries
    assert seen[1].ok
    assert seen[4].ok + seen[5].ok > 0  # and some came from L2
    wait_until(lambda: all(r[3] != "releasing" for r in _rows(ledger, tid)), timeout=10)
    final = _sum(ledger, tid)
    assert final <= quota
    info = a.admin.get(f"/v1/tenants/{tid}").json()
    assert info["used_bytes"] == final  # the running total agrees with the rows
    assert b.admin.get(f"/v1/tenants/{tid}").json()["used_bytes"] == final


# ---------------------------------------------------------------------------- deletion
def test_a_tenant_deleted_through_a_is_cut_off_on_b_at_once(
    hosts: tuple[Daemon, Daemon], ledger: sa.Engine, redis_server: RedisServer
) -> None:
    """§4: DELETE /v1/tenants/{id} "revokes its keys … releases (scrubs) all its buffers";
    "a revoked key answers 401 at once, on REST and on the socket" — on the other host
    too, where the tenant has an idle connection, a put not committed, an attached entry
    and a buffer; and its values in L2 are deleted with it."""
    a, b = hosts
    tid, key = a.tenant("r11-deleted", quota_bytes=32 * MiB)
    with b.client(key) as c:
        r = c.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "ttl_s": 600})
        assert r.status_code == 201, r.text
    with Worker(a.socket_path, key) as wa:
        commit(wa, "doomed:a", secrets.token_bytes(64 * 1024))
    wait_until(lambda: in_l2(redis_server, tid, "doomed:a"), message="written behind")
    idle = Raw(b.socket_path)
    idle.hello(key)
    worker = Worker(b.socket_path, key, renew_interval_s=0)
    try:
        commit(worker, "doomed:b", b"\x5a" * (64 * 1024))
        wait_until(lambda: in_l2(redis_server, tid, "doomed:b"), message="written behind")
        held = worker.lookup(["doomed:b"])
        assert held is not None
        staged = worker.put("doomed:staged", 64 * 1024)
        staged.array[:] = 0x77
        assert len(_rows(ledger, tid)) == 4

        assert a.admin.delete(f"/v1/tenants/{tid}").status_code == 204
        deleted = time.monotonic()
        told, fds = idle.recv()  # unprompted: B closes the idle connection of the key
        told_after = time.monotonic() - deleted
        assert fds == []
        assert isinstance(told, protocol.Error), told
        assert told.status == 401
        assert idle.closed_by_peer()
        assert told_after < 1.0, told_after
        with b.client(key) as c:
            assert c.get("/v1/usage").status_code == 401
        fresh = Raw(b.socket_path)
        try:
            reply, fds = fresh.call_racing_close(protocol.Hello(api_key=key))
            assert fds == []
            assert isinstance(reply, protocol.Error), reply
            assert reply.status == 401
        finally:
            fresh.close()
        # the staged put scrubbed under its writer, the attached entry under its reader
        wait_until(lambda: not staged.array.any() and not held.array.any(), message="scrubbed")
        # the entry's pages stay the tenant's while the reader maps them (§2.1), then go
        assert [r[3] for r in _rows(ledger, tid)] in ([], ["releasing"])
        held.close()
        staged.close()
        worker.close()  # its mapping cache lets go too
        wait_until(lambda: not _rows(ledger, tid), timeout=10, message="every row released")
        wait_until(lambda: a.admin.get(f"/v1/tenants/{tid}").status_code == 404)
        # L2 holds nothing of it: no host can ever restore it again, and Redis keeps none
        # of its bytes (each value also aged out on its own only after l2_ttl_s) — only
        # the mark that it is gone, which undoes a store still in flight, and expires
        r = redis_server.client()
        wait_until(
            lambda: [k for k in r.keys(f"*{{{tid}}}*") if not k.endswith(b":gone")] == [],
            timeout=10,
            message="the deleted tenant's L2 values are gone",
        )
        assert [k.rsplit(b":", 1)[1] for k in r.keys(f"*{{{tid}}}*")] == [b"gone"]
        assert r.get(next(iter(r.keys(f"*{{{tid}}}*")))) == b"1"
        assert r.pttl(next(iter(r.keys(f"*{{{tid}}}*")))) > 0
    finally:
        idle.close()
        worker.close()
    assert a.healthy() and b.healthy()  # noqa: PT018


# ---------------------------------------------------------------------------- L2 namespace
def test_two_tenants_with_the_same_key_string_each_get_their_own_bytes(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """§9: "keys are namespaced per tenant" — with the very same key string, each tenant
    restores its own bytes on the other host; a value moved under another key of the
    same tenant is refused (its namespace names the key it was written for)."""
    a, b = hosts
    tenants = [a.tenant(f"r11-ns{i}", quota_bytes=32 * MiB) for i in range(2)]
    blobs = [secrets.token_bytes(96 * 1024) for _ in tenants]
    for (tid, key), blob in zip(tenants, blobs, strict=True):
        with Worker(a.socket_path, key) as w:
            commit(w, "model:same-prefix", blob)
        wait_until(functools.partial(in_l2, redis_server, tid, "model:same-prefix"))
    for (_tid, key), blob in zip(tenants, blobs, strict=True):
        with Worker(b.socket_path, key) as w:
            hit = w.lookup(["model:same-prefix"])
            assert hit is not None
            assert bytes(hit.array[: len(blob)]) == blob
            hit.close()

    tid, key = tenants[0]
    r = redis_server.client()
    r.set(l2_key(tid, "moved:here"), r.get(l2_key(tid, "model:same-prefix")))
    before = b.metric("maasd_l2_refused_total", reason="namespace")
    with Worker(b.socket_path, key) as w:
        assert w.lookup(["moved:here"]) is None
    assert b.metric("maasd_l2_refused_total", reason="namespace") == before + 1
    wait_until(lambda: not r.exists(l2_key(tid, "moved:here")), message="dropped")


def test_values_of_another_redis_type_are_a_miss_and_dropped(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """§9: "the daemon checks size, checksum and namespace of what it reads back" — what
    sits under a tenant's key may not even be a string (an operator's mistake, another
    program on the same Redis): a miss like any refused value, dropped, and neither the
    tenant's other L2 keys nor another tenant's lookups suffer for it."""
    _a, b = hosts
    tid, key = b.tenant("r11-types", quota_bytes=32 * MiB)
    other_tid, other_key = b.tenant("r11-types-other", quota_bytes=32 * MiB)
    r = redis_server.client()
    good = secrets.token_bytes(32 * 1024)
    good_value = encoded(tid, "good", good)
    r.set(l2_key(tid, "good"), good_value)
    r.set(l2_key(other_tid, "good"), encoded(other_tid, "good", good))
    planted = {
        "hash": lambda k: r.hset(k, "f", good_value),
        "list": lambda k: r.rpush(k, good_value),
        "set": lambda k: r.sadd(k, good_value),
        "zset": lambda k: r.zadd(k, {"m": 1.0}),
        "stream": lambda k: r.xadd(k, {"f": b"v"}),
    }
    with Worker(b.socket_path, key) as w, Worker(b.socket_path, other_key) as wo:
        for kind, plant in planted.items():
            for keys in (["bad"], ["good", "bad"]):
                plant(l2_key(tid, "bad"))
                t0 = time.perf_counter()
                assert w.lookup(keys) is None, kind  # nothing of it reaches the worker
                assert time.perf_counter() - t0 < OUTAGE_BOUND_S
                wait_until(lambda: not r.exists(l2_key(tid, "bad")), message=f"{kind}: dropped")
        # the tenant's L2 still serves it, and the other tenant was never affected
        hit = w.lookup(["good"])
        assert hit is not None, "one tenant's L2 paused by what was planted under its keys"
        assert bytes(hit.array[: len(good)]) == good
        hit.close()
        other = wo.lookup(["good"])
        assert other is not None
        other.close()
    assert b.metric("maasd_l2_breaker_open") == 0
    assert b.healthy()


def test_a_value_longer_than_the_daemon_reads_is_a_miss_and_not_read(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """A well-formed value over ``l2_max_value_bytes`` (another fleet's larger limit, or
    planted): a miss, refused for its size before its bytes are read, kept in L2."""
    _a, b = hosts
    tid, key = b.tenant("r11-long", quota_bytes=64 * MiB)
    r = redis_server.client()
    r.set(l2_key(tid, "long"), encoded(tid, "long", b"\x01" * (MAX_VALUE + MiB)))
    read_before = b.metric("maasd_l2_read_bytes_total")
    refused_before = b.metric("maasd_l2_refused_total", reason="size")
    with Worker(b.socket_path, key) as w:
        assert w.lookup(["long"]) is None
    assert b.metric("maasd_l2_refused_total", reason="size") == refused_before + 1
    assert b.metric("maasd_l2_read_bytes_total") - read_before < MAX_VALUE
    assert r.exists(l2_key(tid, "long"))
    r.delete(l2_key(tid, "long"))
    with b.client(key) as c:
        assert c.get("/v1/usage").json()["used_bytes"] == 0


def test_an_entry_from_l2_is_refused_at_the_buffer_cap(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """§9: a materialised entry is "counted like any entry" — against ``max_buffers`` too:
    at the cap, with nothing evictable, the L2 hit is a miss and nothing is created."""
    a, b = hosts
    tid, key = a.tenant("r11-cap", quota_bytes=64 * MiB)
    with Worker(a.socket_path, key) as w:
        commit(w, "capped", secrets.token_bytes(64 * 1024))
    wait_until(lambda: in_l2(redis_server, tid, "capped"))
    r = a.admin.patch(f"/v1/tenants/{tid}", json={"max_buffers": 2})
    assert r.status_code == 200, r.text
    with b.client(key) as c:
        # the cap is global like the quota: A's entry and this one make two
        assert c.post("/v1/pools/node0/reserve", json={"size_bytes": PAGE}).status_code == 201
        before = c.get("/v1/usage").json()
        with Worker(b.socket_path, key) as w:
            assert w.lookup(["capped"]) is None
        after = c.get("/v1/usage").json()
    assert after["buffers"] == before["buffers"] == 2
    assert after["used_bytes"] == before["used_bytes"]


# ---------------------------------------------------------------------------- black hole
class BlackHole:
    """A TCP listener that accepts connections (the kernel does, from its backlog) and
    never reads nor answers: a Redis hung for good, as the daemon sees it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


def test_a_daemon_whose_l2_never_answers_starts_and_serves(
    l2_ledger_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """§9: "an unreachable or slow L2 never fails or stalls a local operation" — from the
    daemon's very start: put, commit, lookup (hit and miss), release and a REST reserve
    all answer, each within the bound, and the entry is found locally."""
    hole = BlackHole()
    d = Daemon(
        tmp_path_factory.mktemp("r11-hole"),
        env={
            "MAASD_DB_URL": l2_ledger_url,
            "MAASD_NODE_NAME": "r11-hole",
            "MAASD_L2_URL": f"redis://:pw@127.0.0.1:{hole.port}/0",
            "MAASD_L2_TIMEOUT_S": str(L2_TIMEOUT_S),
            **SMALL_DB_POOL,
        },
    )
    try:
        d.start()
        _tid, key = d.tenant("r11-hole", quota_bytes=32 * MiB)
        worst: dict[str, float] = {}

        def timed(name: str, fn: Any) -> Any:
            t0 = time.perf_counter()
            out = fn()
            worst[name] = max(worst.get(name, 0.0), time.perf_counter() - t0)
            return out

        with Worker(d.socket_path, key) as w, Client(d.url, key) as c:
            for i in range(8):
                data = secrets.token_bytes(64 * 1024)
                size = len(data)
                m = timed("put", lambda i=i, n=size: w.put(f"hole:{i}", n))
                m.array[: len(data)] = np.frombuffer(data, np.uint8)
                bid = timed("commit", lambda m=m: w.commit(m)).id
                hit = timed("lookup-hit", lambda i=i: w.lookup([f"hole:{i}"]))
                assert hit is not None
                assert bytes(hit.array[: len(data)]) == data
                hit.close()
                assert timed("lookup-miss", lambda i=i: w.lookup([f"absent:{i}"])) is None
                timed("release", lambda bid=bid: c.release(bid))
                buf = timed("reserve", lambda: c.reserve(size_bytes=MiB))
                c.release(buf.id)
        print(f"worst with a black-hole L2 (s): {worst}")
        assert max(worst.values()) < OUTAGE_BOUND_S, worst
        assert d.metric("maasd_l2_breaker_open") == 1
        r = httpx.get(f"{d.url}/healthz", timeout=10)
        assert r.status_code in (200, 503), r.text  # answered, saying what it says
        assert "l2" in r.text or r.status_code == 200
    finally:
        d.close()
        hole.close()


# ---------------------------------------------------------------------------- disk tier
def test_a_tenant_deleted_through_a_loses_its_entries_on_bs_disk_tier(
    hosts: tuple[Daemon, Daemon], tmp_path: Path
) -> None:
    """§12: "Release, eviction and tenant deletion drop the key, so the bytes are
    unreadable whatever the disk keeps … the file is then unlinked" — also for a tenant
    deleted through another host than the one whose disk tier holds its entries."""
    a, b = hosts
    disk = tmp_path / "disk-b"
    pool = tier_pool(b, disk)
    tid, key = a.tenant("r11-disk", quota_bytes=64 * MiB)
    r = demote_one(b, key, pool, pattern(MiB, 7), fill=8)
    r.close()
    wait_until(lambda: b.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    assert entry_files(disk)
    assert a.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    wait_until(lambda: a.admin.get(f"/v1/tenants/{tid}").status_code == 404)
    wait_until(lambda: entry_files(disk) == [], timeout=10, message="B's disk tier erased")
    disk_info = {p["name"]: p for p in b.admin.get("/v1/pools").json()}[pool]["disk"]
    assert disk_info["entries"] == 0


# ---------------------------------------------------------------------------- own, elsewhere
def test_a_tenants_own_buffer_through_the_other_host(hosts: tuple[Daemon, Daemon]) -> None:
    """docs/scale-out.md: a buffer's memory belongs to its host — the other host shows it
    (the ledger is shared) and renews its lease, but hands out no fd of it and neither
    pins nor checkpoints it (409 naming the host); nothing 5xx."""
    a, b = hosts
    _tid, key = a.tenant("r11-own", quota_bytes=32 * MiB)
    with a.client(key) as ca:
        r = ca.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "ttl_s": 60})
        assert r.status_code == 201, r.text
        buf = r.json()
    with b.client(key) as cb:
        assert cb.get(f"/v1/buffers/{buf['id']}").json()["state"] == "live"
        r = cb.post(f"/v1/buffers/{buf['id']}/renew", json={"ttl_s": 600})
        assert r.status_code == 200, r.text
        assert r.json()["expires_at"] > buf["expires_at"]
        for r in (
            cb.patch(f"/v1/buffers/{buf['id']}/pin", json={"numa_node": 0}),
            cb.post(f"/v1/buffers/{buf['id']}/checkpoint"),
        ):
            assert r.status_code == 409, r.text
            assert HOSTS[0] in r.json()["detail"], r.text
    raw = Raw(b.socket_path)
    try:
        raw.hello(key)
        assert _error(raw.call(protocol.Attach(buffer_id=buf["id"]))).status == 404
    finally:
        raw.close()
    with a.client(key) as ca:
        assert ca.delete(f"/v1/buffers/{buf['id']}").status_code == 204


def test_a_quota_lowered_through_a_holds_on_b_at_once(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """§4 PATCH: "lowering below use is allowed and blocks new reserves" — on every host
    at once (the quota is global): B's next REST reserve, put and L2 restore are refused,
    and raising it again lets them through."""
    a, b = hosts
    tid, key = a.tenant("r11-lowered", quota_bytes=16 * MiB)
    with Worker(a.socket_path, key) as w:
        commit(w, "from-a", secrets.token_bytes(64 * 1024))
    wait_until(lambda: in_l2(redis_server, tid, "from-a"))
    assert a.admin.patch(f"/v1/tenants/{tid}", json={"quota_bytes": PAGE}).status_code == 200
    with b.client(key) as c, Worker(b.socket_path, key) as w:
        r = c.post("/v1/pools/node0/reserve", json={"size_bytes": PAGE})
        assert r.status_code == 409, r.text
        assert r.json()["type"].endswith("quota-exceeded")
        with pytest.raises(MaasdClientError) as refused:
            w.put("on-b", PAGE)
        assert refused.value.status == 409
        assert w.lookup(["from-a"]) is None  # found in L2, but no room for it here
        assert c.get("/v1/usage").json()["used_bytes"] == 64 * 1024
        assert (
            a.admin.patch(f"/v1/tenants/{tid}", json={"quota_bytes": 16 * MiB}).status_code == 200
        )
        hit = w.lookup(["from-a"])
        assert hit is not None
        hit.close()


def test_many_lookups_of_one_l2_key_at_once_restore_it_once(
    hosts: tuple[Daemon, Daemon], redis_server: RedisServer
) -> None:
    """Eight workers on B look up the same key, found only in L2, at the same moment:
    each gets the same bytes from one entry restored once, counted once."""
    a, b = hosts
    tid, key = a.tenant("r11-herd", quota_bytes=32 * MiB)
    data = secrets.token_bytes(256 * 1024)
    with Worker(a.socket_path, key) as w:
        commit(w, "herd", data)
    wait_until(lambda: in_l2(redis_server, tid, "herd"))
    barrier = threading.Barrier(8)
    got: list[str] = []
    errors: list[BaseException] = []

    def look() -> None:
        try:
            with Worker(b.socket_path, key) as w:
                barrier.wait()
                hit = w.lookup(["herd"])
                if hit is None:
                    got.append("miss")
                    return
                assert bytes(hit.array[: len(data)]) == data
                got.append(hit.buffer_id)
                hit.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    hits = [g for g in got if g != "miss"]
    assert len(got) == 8
    assert len(set(hits)) <= 1, got  # one entry on B, whoever restored it
    assert len(hits) >= 1
    with b.client(key) as c:
        assert [x["key"] for x in c.get("/v1/buffers").json()].count("herd") == 2  # A's, B's
        assert c.get("/v1/usage").json()["used_bytes"] == 2 * len(data)


def test_the_hosts_routes_refuse_bad_input_and_tenants(hosts: tuple[Daemon, Daemon]) -> None:
    """§2.7 on the multi-host routes: a tenant key is a 403, odd host names a 4xx problem
    (never a 5xx), and nothing is forgotten."""
    a, b = hosts
    _tid, key = a.tenant("r11-hosts")
    with b.client(key) as c:
        assert c.get("/v1/hosts").status_code == 403
        assert c.delete(f"/v1/hosts/{HOSTS[0]}").status_code == 403
    for name in ("x" * 5000, "%00", "..%2f..", "%E2%80%AE", HOSTS[1].upper(), " "):
        r = b.admin.delete(f"/v1/hosts/{name}")
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    names = {h["name"] for h in b.admin.get("/v1/hosts").json()}
    assert set(HOSTS) <= names


def test_a_nul_byte_anywhere_is_a_400_on_the_shared_ledger(hosts: tuple[Daemon, Daemon]) -> None:
    """§2.7 "No input yields a 5xx" — on PostgreSQL, whose text cannot hold a NUL byte (its
    driver refuses the statement): one in a path segment, a query or a body field is a 400
    problem before the ledger is asked; on the socket a bad frame (or, for a lookup's
    keys, a miss)."""
    a, _b = hosts
    tid, key = a.tenant("r11-nul")
    admin_calls = [
        ("GET", "/v1/tenants/%00", None),
        ("PATCH", "/v1/tenants/a%00", {"quota_bytes": 1}),
        ("DELETE", "/v1/tenants/%00", None),
        ("POST", "/v1/tenants/%00/keys", None),
        ("DELETE", f"/v1/tenants/{tid}/keys/%00", None),
        ("GET", "/v1/pools/%00", None),
        ("DELETE", "/v1/pools/%00", None),
        ("GET", "/v1/buffers/%00", None),
        ("GET", "/v1/buffers?tenant_id=%00", None),
        ("GET", "/v1/events?tenant_id=%00", None),
        ("DELETE", "/v1/hosts/%00", None),
    ]
    tenant_calls = [
        ("GET", "/v1/buffers/%00", None),
        ("DELETE", "/v1/buffers/%00", None),
        ("POST", "/v1/buffers/%00/renew", {"ttl_s": 5}),
        ("PATCH", "/v1/buffers/%00/pin", {"numa_node": 0}),
        ("POST", "/v1/buffers/%00/checkpoint", None),
        ("POST", "/v1/pools/%00/reserve", {"size_bytes": PAGE}),
        ("POST", "/v1/buffers/lookup", {"keys": ["a\x00b"]}),
        ("POST", "/v1/pools/node0/reserve", {"size_bytes": PAGE, "key": "k\x00"}),
        ("POST", "/v1/pools/node0/reserve", {"size_bytes": PAGE, "label": "l\x00"}),
        ("POST", "/v1/reserve", {"size_bytes": PAGE, "key": "\x00"}),
    ]
    with a.client(key) as t:
        for c, calls in ((a.admin, admin_calls), (t, tenant_calls)):
            for method, path, body in calls:
                r = c.request(method, path, json=body)
                assert r.status_code == 400, (method, path, body, r.status_code, r.text)
                assert r.headers["content-type"].startswith("application/problem+json")
        assert t.get("/v1/buffers").json() == []
    raw = Raw(a.socket_path)
    try:
        raw.hello(key)
        for frame in (
            protocol.Put(key="k\x00", size_bytes=PAGE),
            protocol.Attach(buffer_id="\x00"),
            protocol.Renew(buffer_id="a\x00", ttl_s=5),
            protocol.Put(key="k", size_bytes=PAGE, pool="node0\x00"),
        ):
            assert _error(raw.call(frame)).status == 400, frame
        assert _error(raw.call(protocol.Lookup(keys=["k\x00"]))).status == 404
        assert isinstance(raw.call(protocol.Lookup(keys=["k"]))[0], protocol.Error)  # alive
    finally:
        raw.close()
    assert a.healthy()


def test_a_tenant_deleted_while_both_hosts_reserve_for_it_leaves_nothing(
    hosts: tuple[Daemon, Daemon], ledger: sa.Engine
) -> None:
    """§4 DELETE: "releases (scrubs) all its buffers — also those whose reserve was in
    flight" — on every host: REST reserves and socket puts racing on A and B while the
    tenant is deleted through A; afterwards no row of it is left anywhere, every request
    was answered (201, or 401 once its keys were revoked — never a 5xx), and both hosts
    serve another tenant."""
    a, b = hosts
    tid, key = a.tenant("r11-racing-delete", quota_bytes=64 * MiB)
    stop = threading.Event()
    statuses: list[int] = []
    errors: list[str] = []

    def rest(d: Daemon) -> None:
        with d.client(key) as c:
            while not stop.is_set():
                r = c.post("/v1/pools/node0/reserve", json={"size_bytes": 256 * 1024})
                statuses.append(r.status_code)
                if r.status_code == 401:
                    return

    def puts(d: Daemon) -> None:
        try:
            with Worker(d.socket_path, key, renew_interval_s=0) as w:
                i = 0
                while not stop.is_set():
                    i += 1
                    commit(w, f"racing:{i}", b"\x11" * 4096)
        except MaasdClientError as exc:
            if exc.status not in (0, 401, 409):  # 0: the connection the daemon closed
                errors.append(repr(exc))
        except OSError:
            pass  # the socket closed under a send: the key was revoked

    threads = [threading.Thread(target=f, args=(d,)) for d in (a, b) for f in (rest, puts)]
    for t in threads:
        t.start()
    wait_until(lambda: statuses.count(201) >= 6, timeout=30, message="the race runs")
    assert a.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert set(statuses) <= {201, 401, 409}, sorted(set(statuses))  # 409: quota, if reached
    wait_until(lambda: not _rows(ledger, tid), timeout=15, message="nothing of it is left")
    wait_until(lambda: a.admin.get(f"/v1/tenants/{tid}").status_code == 404)
    for d in (a, b):
        _other, other_key = d.tenant("r11-after-delete")
        with d.client(other_key) as c:
            r = c.post("/v1/pools/node0/reserve", json={"size_bytes": PAGE})
            assert r.status_code == 201, r.text
