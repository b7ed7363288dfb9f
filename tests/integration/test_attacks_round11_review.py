"""Round 11 review attacks on the day's changes: NUL bytes on a PostgreSQL ledger, the
repeated and unknown query parameters, repeated socket fields in the long msgpack forms
(map16/map32, str8 names), and a start against a PostgreSQL that cannot be reached.

Daemons are real ``maasd serve`` subprocesses (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from conftest import Daemon
from maasd.protocol import HEADER, Error
from pgdb import PG_URL, fresh_pg_database
from rawentries import connect, pattern, put_committed
from sockpeer import lookup

KiB = 1 << 10
REPO = Path(__file__).resolve().parents[2]
needs_pg = pytest.mark.skipif(
    not PG_URL, reason="MAASD_TEST_PG_URL is not set (scripts/pg-test-server)"
)


@pytest.fixture(scope="module")
def pg_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        d = Daemon(tmp_path_factory.mktemp("pg"), env={"MAASD_DB_URL": url}).start()
        try:
            yield d
        finally:
            d.close()


@needs_pg
@pytest.mark.postgres
def _against_postgresql(data_dir: Path, port: int, *, connect_timeout_s: int) -> dict[str, str]:
    """The environment of a ``maasd`` whose ledger is the PostgreSQL URL of loopback ``port``
    (nothing of the test's own MAASD_* settings), with a password the log must never show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        MAASD_DATA_DIR=str(data_dir),
        MAASD_ADMIN_KEY="maasd_admin_" + "k" * 32,
        MAASD_LATENCY_PROBE="false",
        MAASD_DB_CONNECT_TIMEOUT_S=str(connect_timeout_s),
        MAASD_DB_URL=f"postgresql+psycopg://maasd:s3cretpw@127.0.0.1:{port}/maasd",
    )
    return env


def test_nul_bytes_anywhere_a_client_can_put_them_are_4xx_on_postgresql(
    pg_daemon: Daemon,
) -> None:
    """PostgreSQL cannot hold or be asked about a NUL: every route answers 4xx, never 500,
    and the daemon stays healthy (paths, query values, bodies, socket ids, pools, keys)."""
    d = pg_daemon
    tid, key = d.tenant("nul")
    a = d.admin
    answers = [
        a.post("/v1/tenants", json={"name": "a\u0000b", "quota_bytes": 1 << 20}),
        a.post("/v1/pools", json={"name": "p\u0000", "numa_node": 0, "capacity_bytes": 1 << 20}),
        a.post(
            "/v1/pools",
            json={
                "name": "pp",
                "numa_node": 0,
                "capacity_bytes": 1 << 20,
                "persistence": "persistent",
                "spill_dir": "/tmp/a\u0000b",
            },
        ),
        a.get("/v1/hosts/a%00b"),
        a.get("/v1/tenants/%00"),
        a.get("/v1/pools/%00"),
        a.get(f"/v1/tenants/{tid}/keys/%00"),
        a.get("/v1/buffers?tenant_id=%00"),
        a.get("/v1/buffers;x=%00"),
    ]
    with d.client(key) as c:
        answers.append(c.delete("/v1/entries", params={"key": "a\x00"}))
    for r in answers:
        assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text)
        assert "matching regex" not in r.text, r.text  # said in words
    # A NUL escaped twice (%2500) is the text "%00": a miss, not a refusal or a 500.
    r = a.get("/v1/buffers?tenant_id=%2500")
    assert r.status_code == 404, r.text
    # The socket: a hello key with a NUL is an unknown key; ids and pools a 400.
    s = connect(d, key)
    for msg in (
        {"op": "attach", "buffer_id": "x\x00"},
        {"op": "put", "key": "k", "size_bytes": 4096, "pool": "p\x00"},
        {"op": "put", "key": "k\x00", "size_bytes": 4096},
    ):
        s.send_raw(_frame(msgspec.msgpack.encode(msg)))
        reply, fds = s.recv()
        _error(reply, fds, 400)
    s.send_raw(_frame(msgspec.msgpack.encode({"op": "lookup", "keys": ["x\x00"]})))
    reply, fds = s.recv()
    _error(reply, fds, 404)
    s.close()
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(d.socket_path)
    raw.sendall(_frame(msgspec.msgpack.encode({"op": "hello", "api_key": "k\x00"})))
    assert b"Unauthorized" in raw.recv(4096)
    raw.close()
    assert d.healthy()
    assert "Traceback" not in d.log()


def _error(reply: object, fds: list[int], status: int) -> None:
    """An error frame of ``status``, with no fd."""
    assert fds == []
    assert isinstance(reply, Error), reply
    assert reply.status == status, reply


def _frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def _fixstr(text: str) -> bytes:
    return bytes([0xA0 | len(text)]) + text.encode()


def _str8(text: str) -> bytes:
    return bytes([0xD9, len(text)]) + text.encode()


def test_a_repeated_field_in_a_map16_or_map32_frame_or_a_str8_name_is_refused(
    daemon: Daemon,
) -> None:
    """§5: a frame naming a field twice is a 400 whatever msgpack form spells its map
    header (fixmap, map16, map32) or its names (fixstr, str8); the same frames without
    the repeat are answered, and the connection stays."""
    _tid, key = daemon.tenant("m16")
    r = connect(daemon, key)
    mine = put_committed(r, "mine", pattern(4 * KiB))
    pairs = _fixstr("op") + _fixstr("attach") + _fixstr("buffer_id") + _fixstr("nothing")
    again = _str8("buffer_id") + msgspec.msgpack.encode(mine)
    for header in (b"\x83", b"\xde\x00\x03", b"\xdf\x00\x00\x00\x03"):
        r.send_raw(_frame(header + pairs + again))
        reply, fds = r.recv()
        _error(reply, fds, 400)
        assert "more than once" in reply.detail, reply
    for header in (b"\xde\x00\x02", b"\xdf\x00\x00\x00\x02"):  # long forms, no repeat
        r.send_raw(_frame(header + _fixstr("op") + _fixstr("attach") + _str8("buffer_id")
                          + msgspec.msgpack.encode(mine)))  # fmt: skip
        reply, fds = r.recv()
        for fd in fds:
            os.close(fd)
        assert not isinstance(reply, Error), reply
        assert len(fds) == 1
    found, fd = lookup(r, ["mine"])
    os.close(fd)
    assert found.buffer_id == mine
    r.close()


def test_legitimate_queries_still_pass_and_look_alikes_are_refused(daemon: Daemon) -> None:
    """The repeated/unknown query refusals: the documented filters still work, and a
    repeat spelled with an escape, a case change or an empty name is a 400, never a
    5xx; a ``;`` is no separator (the value is the whole text); the docs routes keep
    answering."""
    tid, _key = daemon.tenant("q")
    a = daemon.admin
    assert a.get("/v1/buffers", params={"tenant_id": tid}).status_code == 200
    for query in (
        "tenant_id=a&tenant%5Fid=b",
        "tenant_id=a&Tenant_id=b",
        "=x",
        "Tenant_id=" + tid,
        "tenant_id=a&&tenant_id=b",
    ):
        r = a.get(f"/v1/buffers?{query}")
        assert r.status_code == 400, (query, r.text)
    r = a.get(f"/v1/buffers?tenant_id={tid};tenant_id=b")
    assert r.status_code == 404, r.text  # one value, "<tid>;tenant_id=b": no such tenant
    assert daemon.admin.get("/schema/openapi.json?v=1").status_code == 200
    assert daemon.admin.get("/healthz?probe=1").status_code == 200


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_a_start_against_a_postgresql_that_cannot_be_reached_is_one_line(
    tmp_path: Path, kind: str
) -> None:
    """§3 (a failed start says why and exits non-zero): a PostgreSQL URL whose server
    refuses, or accepts and never answers (past db_connect_timeout_s), stops ``maasd
    serve`` and ``maasd migrate`` with one ``Error:`` line, the password not in it —
    it was a page of SQLAlchemy's traceback."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if kind == "silent":
        listener.listen(0)
    else:
        listener.close()
    env = _against_postgresql(tmp_path, port, connect_timeout_s=1)
    try:
        for command in ("serve", "migrate"):
            done = subprocess.run(
                [sys.executable, "-m", "maasd.cli.daemon", command],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            out = done.stdout + done.stderr
            assert done.returncode == 1, out
            assert "Traceback" not in out, out
            assert "s3cretpw" not in out, out
            assert "Error:" in out, out
            assert "ledger database cannot serve now" in out, out
    finally:
        listener.close()


def test_store_upgrade_of_an_unreachable_postgresql_is_ledger_unavailable() -> None:
    """The pure part: ``Store.upgrade`` turns a connection that cannot be made into
    :class:`LedgerUnavailable` (what the CLI prints as one line), its password left out."""
    from maasd.errors import LedgerUnavailable
    from maasd.store import Store

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    store = Store(f"postgresql+psycopg://maasd:s3cretpw@127.0.0.1:{port}/maasd")
    try:
        with pytest.raises(LedgerUnavailable) as caught:
            store.upgrade()
    finally:
        store.dispose()
    assert "cannot be reached" in caught.value.detail
    assert "s3cretpw" not in caught.value.detail


def test_dropping_a_deleted_tenants_l2_values_goes_in_batches_and_spares_the_others(
    tmp_path: Path,
) -> None:
    """A tenant delete drops its L2 values: every one the accounting names (its LRU and
    its sizes), none of another tenant's, in calls of at most ``DROP_BATCH`` values each
    — one script over a tenant's 10^5 small values held Redis (every daemon's L2 calls)
    for most of a second, past the caller's own timeout."""
    pytest.importorskip("redis", reason="needs the l2 extra (redis-py)")
    from redisdb import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("no redis-server on PATH")
    from maasd.l2 import client, codec

    server = RedisServer(tmp_path).start()
    try:
        raw = server.client()
        gone, kept = codec.Keys("maasd", "gone"), codec.Keys("maasd", "kept")
        count = 3 * client.DROP_BATCH + 7
        pipe = raw.pipeline(transaction=False)
        for i in range(count):
            name = gone.entry(f"k{i}")
            pipe.set(name, b"v")
            pipe.hset(gone.sizes, name, 1)
            pipe.zadd(gone.lru, {name: i})
        for i in range(5):  # named by the sizes only (a hand-edited accounting)
            pipe.set(gone.entry(f"s{i}"), b"v")
            pipe.hset(gone.sizes, gone.entry(f"s{i}"), 1)
        pipe.set(gone.bytes, count + 5)
        pipe.set(kept.entry("k0"), b"w")
        pipe.hset(kept.sizes, kept.entry("k0"), 1)
        pipe.zadd(kept.lru, {kept.entry("k0"): 1})
        pipe.execute()
        l2 = client.RedisL2(server.url, timeout_s=5.0, connections=2, prefix="maasd")
        script = l2._drop_tenant
        calls: list[int] = []

        def counted(**kw: object) -> object:
            n = script(**kw)  # type: ignore[arg-type]
            calls.append(int(n))
            assert int(n) <= client.DROP_BATCH
            return n

        l2._drop_tenant = counted  # type: ignore[assignment]
        assert l2.drop_tenant("gone") == count + 5
        assert len(calls) > 4  # batches, then the -1 that ends them
        assert calls[-1] == -1
        left = sorted(k.decode() for k in raw.keys("*"))
        assert left == sorted([kept.entry("k0"), kept.lru, kept.sizes, gone.gone]), left
        assert l2.drop_tenant("gone") == 0  # again: nothing, no error
        l2.close()
    finally:
        server.stop()


def test_a_sigterm_while_the_start_waits_for_the_ledger_still_ends_with_its_error(
    tmp_path: Path,
) -> None:
    """A SIGTERM while ``maasd serve`` waits on a PostgreSQL that never answers (the
    daemon's connection accepted, nothing said) is remembered, not a kill: the start
    then fails as it would have, one ``Error:`` line and exit 1, nothing left behind
    (no socket, the data dir lock released: a second start says the same)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(60)
    port = listener.getsockname()[1]
    env = _against_postgresql(tmp_path, port, connect_timeout_s=2)
    held: list[socket.socket] = []
    try:
        for _ in range(2):
            proc = subprocess.Popen(
                [sys.executable, "-m", "maasd.cli.daemon", "serve"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            conn, _addr = listener.accept()  # the startup's ledger connection: handlers set
            held.append(conn)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 1, out
            assert "Traceback" not in out, out
            assert "cannot start: the ledger database cannot serve now" in out, out
            assert "SIGTERM while starting" in out, out
            assert not (tmp_path / "maasd.sock").exists()
    finally:
        for conn in held:
            conn.close()
        listener.close()


def test_a_path_refused_by_its_bounds_is_said_in_words() -> None:
    """A ``spill_dir`` (REST body or config file) that is no absolute path, or holds a
    NUL, is refused naming the rule, not msgspec's regex (as names and NUL-free text)."""
    from maasd import bounds

    for raw in (b'{"d": "/a\\u0000b"}', b'{"d": "relative"}'):
        with pytest.raises(msgspec.ValidationError) as caught:
            msgspec.json.decode(raw, type=dict[str, bounds.SpillDir])
        said = bounds.explain(str(caught.value))
        assert said.startswith(f"Expected {bounds.PATH_RULE}"), said
