"""Attacks on crash safety (SPEC §2 invariant 6), on running the daemon (§3: flags and
their environment variables, the config file, migrations, SIGTERM) and on scrubbing
persistent pools' buffers (invariant 4).

After a SIGKILL at any point and a restart: ledger = live buffers (tenants' and pools'
``used_bytes`` are the sum of the live buffers), volatile buffers gone and uncounted,
persistent buffers back with the content of their last checkpoint (checksum verified),
and no file in a spill dir that no live buffer names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest

from maasd.client import Worker
from maasd.client.errors import ConnectionFailed
from maasd.protocol import Abort, Ok
from pgdb import BACKENDS, fresh_pg_database
from rawentries import connect, pattern, put, put_committed, write
from recovered import POOLS, ledger_totals, read_buffer, spill_ids, write_buffer
from sockpeer import lookup
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def ledger_daemon(request: pytest.FixtureRequest, fresh_daemon: Daemon) -> Iterator[Daemon]:
    """``fresh_daemon`` on the SQLite ledger, and on a PostgreSQL one of its own when
    ``MAASD_TEST_PG_URL`` is set: recovery reads and settles the ledger on both."""
    if request.param == "sqlite":
        yield fresh_daemon
        return
    with fresh_pg_database() as url:
        fresh_daemon.env["MAASD_DB_URL"] = url
        yield fresh_daemon
        fresh_daemon.close()  # before the database is dropped


def _configured(d: Daemon, tmp_path: Path, vol: int = 64 * MiB, pers: int = 64 * MiB) -> Daemon:
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(POOLS.format(vol=vol, pers=pers))
    d.env["MAASD_CONFIG"] = str(cfg)
    return d.start()


def _spill(d: Daemon, pool: str = "pers") -> Path:
    return Path(d.data_dir) / "spill" / pool


def _checkpointed(d: Daemon, c: httpx.Client, key: str, n: int, seed: int) -> dict[str, bytes]:
    """``n`` persistent 1 MiB buffers, each filled with bytes of its own and checkpointed:
    their ids and contents."""
    rnd = random.Random(seed)
    out: dict[str, bytes] = {}
    for _ in range(n):
        r = c.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
        assert r.status_code == 201, r.text
        data = rnd.randbytes(MiB)
        write_buffer(d, key, r.json()["id"], data)
        ck = c.post(f"/v1/buffers/{r.json()['id']}/checkpoint")
        assert ck.status_code == 200, ck.text
        out[r.json()["id"]] = data
    return out


def _one_checkpointed(
    d: Daemon, c: httpx.Client, key: str, pool: str, fill: bytes, *, ttl_s: int
) -> dict[str, Any]:
    """A 1 MiB buffer of ``pool`` filled with ``fill`` and checkpointed: the buffer."""
    r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB, "ttl_s": ttl_s})
    assert r.status_code == 201, r.text
    write_buffer(d, key, r.json()["id"], fill * MiB)
    ck = c.post(f"/v1/buffers/{r.json()['id']}/checkpoint")
    assert ck.status_code == 200, ck.text
    return dict(r.json())


def _volatile(c: httpx.Client, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        r = c.post("/v1/pools/vol/reserve", json={"size_bytes": MiB})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def _kill_during(d: Daemon, request: Any, delay: float) -> None:
    """Start ``request()`` on a thread, SIGKILL the daemon ``delay`` seconds later."""
    t = threading.Thread(target=_swallow, args=(request,), daemon=True)
    t.start()
    time.sleep(delay)
    d.kill()
    t.join(30)


def _swallow(request: Any) -> None:
    with contextlib.suppress(httpx.TransportError):  # the daemon died under it
        request()


def _survivors_intact(d: Daemon, key: str, expected: dict[str, bytes]) -> list[str]:
    """After a restart: the ledger adds up, the persistent buffers of ``expected`` that are
    still there hold their checkpoint's bytes, the spill dir holds exactly their files;
    returns the ids still there."""
    ledger_totals(d)
    live = {b["id"]: b for b in d.admin.get("/v1/buffers").json()}
    assert all(b["persistence"] == "persistent" for b in live.values()), live
    back = [i for i in expected if i in live]
    for buffer_id in back:
        assert read_buffer(d, key, buffer_id) == expected[buffer_id], buffer_id
        assert live[buffer_id]["checksum"] == hashlib.sha256(expected[buffer_id]).hexdigest()
    assert spill_ids(_spill(d)) == sorted(i for i in live if live[i]["pool_id"] == _pool_id(d))
    return back


def _pool_id(d: Daemon, name: str = "pers") -> str | None:
    return next((p["id"] for p in d.admin.get("/v1/pools").json() if p["name"] == name), None)


# -- SIGKILL in the middle of a tenant delete ----------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_sigkill_during_a_tenant_delete(ledger_daemon: Daemon, tmp_path: Path, delay) -> None:
    """A tenant with checkpointed persistent buffers and volatile ones is deleted, and the
    daemon killed while the delete runs. After the restart the delete is either whole
    (the tenant 404, its key 401, none of its buffers or checkpoint files left, nothing
    counted) or never began (everything of it back); another tenant's persistent buffers
    are back byte-identical either way."""
    d = _configured(ledger_daemon, tmp_path)
    victim_id, victim_key = d.tenant("victim", 256 * MiB)
    _, other_key = d.tenant("other", 64 * MiB)
    with d.client(victim_key) as v, d.client(other_key) as o:
        victims = _checkpointed(d, v, victim_key, 24, seed=1)
        _volatile(v, 24)
        others = _checkpointed(d, o, other_key, 2, seed=2)

    _kill_during(d, lambda: d.admin.delete(f"/v1/tenants/{victim_id}"), delay)
    d.start()

    def settled() -> bool:  # a delete that began is finished at start (finish_deletes)
        status = d.admin.get(f"/v1/tenants/{victim_id}").status_code
        with d.client(victim_key) as v:
            usage = v.get("/v1/usage").status_code
        return (status, usage) in ((404, 401), (200, 200))

    wait_until(settled, timeout=30, message="the tenant delete settled")
    assert _survivors_intact(d, other_key, others) == list(others)
    back = _survivors_intact(d, victim_key, victims)
    if d.admin.get(f"/v1/tenants/{victim_id}").status_code == 404:
        assert back == []
        assert not any(b["tenant_id"] == victim_id for b in d.admin.get("/v1/buffers").json())
    else:
        assert back == list(victims), "half a tenant delete came back"
    assert d.stop() == 0, d.log()


# -- SIGKILL in the middle of a pool drain -------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_sigkill_during_a_persistent_pool_drain(
    fresh_daemon: Daemon, tmp_path: Path, delay
) -> None:
    """``DELETE /v1/pools/pers?drain=true`` of a persistent pool holding checkpointed
    buffers, killed while it runs. After the restart: either the pool is gone with every
    buffer and checkpoint file of it, or it is whole; a delete that began ends at start."""
    d = fresh_daemon
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(POOLS.format(vol=16 * MiB, pers=64 * MiB).replace('"pers"', '"keep"'))
    d.env["MAASD_CONFIG"] = str(cfg)
    d.start()
    d.pool("pers", 64 * MiB, persistence="persistent")  # a POSTed pool: drained, it stays gone
    _, key = d.tenant("drained", 256 * MiB)
    with d.client(key) as c:
        saved = _checkpointed(d, c, key, 32, seed=3)
        kept = _one_checkpointed(d, c, key, "keep", b"\x07", ttl_s=3600)

    _kill_during(d, lambda: d.admin.delete("/v1/pools/pers", params={"drain": "true"}), delay)
    d.start()

    def settled() -> bool:  # a drain that began is finished at start
        pools = {p["name"]: p for p in d.admin.get("/v1/pools").json()}
        return "pers" not in pools or pools["pers"]["buffers"] == len(saved)

    wait_until(settled, timeout=30, message="the drain settled")
    ledger_totals(d)
    assert read_buffer(d, key, kept["id"]) == b"\x07" * MiB
    live = {b["id"] for b in d.admin.get("/v1/buffers").json()}
    if _pool_id(d) is None:
        assert live == {kept["id"]}, live
        assert spill_ids(_spill(d)) == [], "checkpoint files of a drained pool stayed"
    else:
        assert _survivors_intact(d, key, saved) == list(saved), "half a drain came back"
    assert spill_ids(_spill(d, "keep")) == [kept["id"]]
    assert d.stop() == 0, d.log()


# -- SIGKILL during a flood of persistent reserves, checkpoints and releases ----------------


@pytest.mark.timeout(180)
def test_sigkill_during_persistent_churn_leaves_no_orphan_checkpoint(
    ledger_daemon: Daemon, tmp_path: Path
) -> None:
    """Clients reserve persistent buffers, checkpoint them and release them (over REST)
    while the daemon is killed. After the restart every surviving buffer holds the bytes
    of a checkpoint its client asked for, the spill dir holds exactly one file per
    surviving buffer, and the ledger adds up."""
    d = _configured(ledger_daemon, tmp_path, pers=32 * MiB)
    _, key = d.tenant("churn", 256 * MiB)
    asked: dict[str, set[int]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def churn(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            with d.client(key) as c, Worker(d.socket_path, key, renew_interval_s=0) as w:
                while not stop.is_set():
                    r = c.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
                    if r.status_code != 201:
                        assert r.status_code == 507, r.text
                        continue
                    bid = r.json()["id"]
                    m = w.attach(bid)
                    for _ in range(rnd.randint(1, 3)):
                        fill = rnd.randrange(1, 256)
                        m.array[:] = fill
                        with lock:
                            asked.setdefault(bid, set()).add(fill)
                        assert c.post(f"/v1/buffers/{bid}/checkpoint").status_code == 200
                    m.close()
                    if rnd.random() < 0.6:
                        assert c.delete(f"/v1/buffers/{bid}").status_code == 204
        except (httpx.TransportError, OSError, ConnectionFailed):
            return  # the daemon died under us

    threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(asked) >= 8, timeout=60, message="churn under way")
    time.sleep(random.Random(11).uniform(0.1, 0.5))
    d.kill()
    stop.set()
    for t in threads:
        t.join(30)

    d.start()
    ledger_totals(d)
    live = d.admin.get("/v1/buffers").json()
    for b in live:
        data = read_buffer(d, key, b["id"])
        assert len(set(data)) == 1, "a torn checkpoint came back"
        assert data[0] in asked[b["id"]], "bytes never checkpointed came back"
        assert hashlib.sha256(data).hexdigest() == b["checksum"]
    assert spill_ids(_spill(d)) == sorted(b["id"] for b in live)
    pool = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == "pers")
    assert pool["used_bytes"] == MiB * len(live)
    assert d.stop() == 0, d.log()


# -- checkpoint files damaged while the daemon is down ----------------------------------------


@pytest.mark.timeout(120)
def test_checkpoint_files_damaged_while_down_never_come_back_as_good(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """While the daemon is down, checkpoint files are truncated (to half, to nothing),
    deleted, grown by a byte, swapped for another buffer's checkpoint, or replaced by a
    directory; stray files are dropped beside them. After the restart only the untouched
    buffer is back; the others are released, uncounted, and the spill dir holds nothing
    but the good one's file."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("damaged", 256 * MiB)
    with d.client(key) as c:
        saved = _checkpointed(d, c, key, 7, seed=5)
    # A buffer of one page: a directory's size on tmpfs and ext4 can equal it.
    with d.client(key) as c:
        small = c.post("/v1/pools/pers/reserve", json={"size_bytes": 4096, "ttl_s": 3600}).json()
        assert c.post(f"/v1/buffers/{small['id']}/checkpoint").status_code == 200
    d.kill()

    ids = list(saved)
    files = {p.name.split(".")[0]: p for p in _spill(d).iterdir()}
    good, half, empty, gone, longer, swapped, trunc_then_pad = ids
    with open(files[half], "r+b") as f:
        f.truncate(MiB // 2)
    files[empty].write_bytes(b"")
    files[gone].unlink()
    with open(files[longer], "ab") as f:
        f.write(b"\0")
    shutil.copyfile(files[good], files[swapped])
    with open(files[trunc_then_pad], "r+b") as f:  # same size, last page zeroed
        f.truncate(MiB - 4096)
        f.truncate(MiB)
    files[small["id"]].unlink()
    files[small["id"]].mkdir()
    (files[small["id"]] / "x").write_bytes(b"\0" * 4096)
    (_spill(d) / "stray.123.ckpt").write_bytes(b"\0" * MiB)
    (_spill(d) / f"{good}.999.ckpt.tmp").write_bytes(saved[good][: MiB // 2])

    d.start()
    with d.client(key) as c:
        for bid in (half, empty, gone, longer, swapped, trunc_then_pad, small["id"]):
            assert c.get(f"/v1/buffers/{bid}").status_code == 404, bid
        assert c.get(f"/v1/buffers/{good}").status_code == 200
        usage = c.get("/v1/usage").json()
    assert (usage["used_bytes"], usage["buffers"]) == (MiB, 1)
    assert read_buffer(d, key, good) == saved[good]
    ledger_totals(d)
    # The directory put in a checkpoint's place is not the daemon's to remove.
    leftovers = sorted(p.name for p in _spill(d).iterdir() if not p.is_dir())
    assert [n.split(".")[0] for n in leftovers] == [good], leftovers
    assert [p.name for p in _spill(d).iterdir() if p.is_dir()] == [files[small["id"]].name]
    assert "is a directory" in d.log().lower()
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_spill_dir_gone_read_only_never_fails_a_release(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """Invariant 7 (no 5xx) and 4: the persistent pool's spill filesystem goes read-only
    (what ext4 does on an I/O error) after a checkpoint; releasing the buffer still answers
    204, scrubbed, uncounted; so does a pool drain; and the daemon restarts (the files it
    could not remove are orphans, released)."""
    d = fresh_daemon.start()
    spill = tmp_path / "spillfs"
    spill.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(spill)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        d.pool("rospill", 16 * MiB, persistence="persistent", spill_dir=str(spill))
        _, key = d.tenant("ro", 64 * MiB)
        with d.client(key) as c, Worker(d.socket_path, key, renew_interval_s=0) as w:
            ids = []
            for _ in range(2):
                b = c.post("/v1/pools/rospill/reserve", json={"size_bytes": MiB}).json()
                w.attach(b["id"]).array[:] = 3
                assert c.post(f"/v1/buffers/{b['id']}/checkpoint").status_code == 200
                ids.append(b["id"])
            m = w.attach(ids[0])
            subprocess.run(["mount", "-o", "remount,ro", str(spill)], check=True)
            r = c.delete(f"/v1/buffers/{ids[0]}")
            assert r.status_code == 204, r.text
            assert not np.any(m.array)
            m.close()
            r = c.post(f"/v1/buffers/{ids[1]}/checkpoint")
            assert r.status_code < 500 or r.status_code == 507, r.text
            assert r.headers["content-type"].startswith("application/problem+json")
            r = d.admin.delete("/v1/pools/rospill", params={"drain": "true"})
            assert r.status_code == 204, r.text
        ledger_totals(d)
        assert d.healthy()
        d.restart()
        ledger_totals(d)
        assert d.stop() == 0, d.log()
    finally:
        subprocess.run(["umount", "-l", str(spill)], check=False)


# -- a persistent buffer whose lease ends while the daemon is down -------------------------


@pytest.mark.timeout(120)
def test_a_lease_that_ended_while_down_releases_the_persistent_buffer(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """A checkpointed persistent buffer with a 2 s lease, the daemon killed, restarted
    after the lease ended: the buffer is released (its checkpoint file removed, its
    bytes uncounted); a buffer with a long lease is back."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("lease", 64 * MiB)
    with d.client(key) as c:
        short = _one_checkpointed(d, c, key, "pers", b"\x05", ttl_s=2)
        long_ = _checkpointed(d, c, key, 1, seed=6)
    d.kill()
    expires = time.time() + 2.5
    while time.time() < expires:  # the short lease ends while the daemon is down
        time.sleep(0.1)
    d.start()
    with d.client(key) as c:
        wait_until(lambda: c.get(f"/v1/buffers/{short['id']}").status_code == 404, timeout=30)
        # Over for REST from its lease's end; uncounted once the reaper's pass released it.
        wait_until(lambda: c.get("/v1/usage").json()["used_bytes"] == MiB, timeout=30)
        usage = c.get("/v1/usage").json()
    assert (usage["used_bytes"], usage["buffers"]) == (MiB, 1)
    assert _survivors_intact(d, key, long_) == list(long_)
    assert d.stop() == 0, d.log()


# -- entries of a persistent pool: SIGKILL during puts and commits over the socket ---------


@pytest.mark.timeout(180)
def test_sigkill_during_puts_into_a_persistent_pool(fresh_daemon: Daemon, tmp_path: Path) -> None:
    """One tenant's entries committed into a persistent pool are checkpointed by a graceful
    stop; the daemon, started again, is killed while another tenant floods the pool with
    puts and commits (evicting its own older entries: its quota is below what it saves)
    and always holds one entry staged. After the restart: the first tenant's entries are
    all back, found by key, read-only, byte-identical; none of the flood's (never
    checkpointed, or staged) is; the spill dir names exactly the survivors; the ledger
    adds up."""
    d = _configured(fresh_daemon, tmp_path, pers=32 * MiB)
    _, key = d.tenant("kv", 8 * MiB)
    _, flooder = d.tenant("flood", 8 * MiB)
    r = connect(d, key)
    first = {f"first-{i}": pattern(MiB, i) for i in range(6)}
    for k, data in first.items():
        put_committed(r, k, data, "pers")
    r.close()
    assert d.stop() == 0, d.log()  # checkpoints the committed entries
    d.start()
    killing = threading.Event()
    saved: list[int] = []

    def flood() -> None:
        try:
            r = connect(d, flooder)
            staged: str | None = None
            while True:  # until the kill
                i = len(saved)
                put_committed(r, f"flood-{i}", pattern(MiB, 1000 + i), "pers")
                if staged is not None:
                    assert r.call(Abort(buffer_id=staged)) == (Ok(), [])
                reply, fd = put(r, f"staged-{i}", MiB, pool="pers")
                write(fd, pattern(MiB, 5000 + i))
                os.close(fd)
                staged = reply.buffer_id
                saved.append(i)
        except (OSError, EOFError, AssertionError) as e:
            if not killing.is_set():
                failed.append(repr(e))  # not the kill: a reply the flood did not expect
            return

    failed: list[str] = []
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    wait_until(lambda: len(saved) > 12, timeout=60, message="the flood evicts")
    time.sleep(random.Random(13).uniform(0.0, 0.3))
    killing.set()  # from here on, an error is the kill's
    d.kill()
    t.join(30)
    assert not failed, failed

    d.start()
    ledger_totals(d)
    live = d.admin.get("/v1/buffers").json()
    assert sorted(b["key"] for b in live) == sorted(first), [b["key"] for b in live]
    assert spill_ids(_spill(d)) == sorted(b["id"] for b in live)
    r = connect(d, key)
    for b in live:
        found, fd = lookup(r, [b["key"]])
        try:
            assert found.buffer_id == b["id"]
            assert os.pread(fd, MiB, 0) == first[b["key"]]
            with pytest.raises(OSError, match="Bad file descriptor"):  # an O_RDONLY fd
                os.pwrite(fd, b"x", 0)
        finally:
            os.close(fd)
    r.close()
    assert d.stop() == 0, d.log()


# -- SIGTERM with a request in flight ---------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_finishes_an_in_flight_reserve_and_checkpoints_it(
    fresh_daemon: Daemon, tmp_path: Path, sig: int
) -> None:
    """§3: "SIGTERM/SIGINT: stop accepting, finish in-flight requests, checkpoint
    persistent buffers". A reserve into the persistent pool whose head has arrived, its
    body not yet, when SIGTERM comes: new connections are refused, the reserve, once its
    body arrives, is answered 201, the daemon exits 0, and the buffer it made comes back
    after the restart (checkpointed on the way out)."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("inflight", 64 * MiB)
    body = b'{"size_bytes": 1048576, "ttl_s": 3600}'
    head = (
        f"POST /v1/pools/pers/reserve HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
    s.sendall(head + body[:5])
    time.sleep(0.3)  # the head is read: the request is in flight
    assert d.proc is not None
    d.proc.send_signal(sig)
    wait_until(lambda: not _accepts(d.port), timeout=20, message="listening stopped")
    s.sendall(body[5:])
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 201"), reply[:300]
    buffer_id = reply.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    assert d.proc.wait(30) == 0, d.log()

    d.start()
    with d.client(key) as c:
        got = c.get(f"/v1/buffers/{buffer_id}")
    assert got.status_code == 200, d.log()
    assert got.json()["checksum"] == hashlib.sha256(b"\0" * MiB).hexdigest()
    assert spill_ids(_spill(d)) == [buffer_id]
    ledger_totals(d)
    assert d.stop() == 0


@pytest.mark.timeout(120)
def test_sigterm_releases_a_staged_entry_and_keeps_the_committed_one(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """A worker holds, at SIGTERM, one entry of the persistent pool committed and one put
    but not committed (its bytes written). The graceful stop checkpoints the committed
    one and releases the staged one (§5: only a commit publishes an entry): after the
    restart the first is found by its key with its bytes, the second is nowhere — not
    listed, not counted, no checkpoint file."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("staged", 64 * MiB)
    r = connect(d, key)
    committed = put_committed(r, "done", pattern(MiB, 1), "pers")
    reply, fd = put(r, "half", MiB, pool="pers")
    write(fd, pattern(MiB, 2))
    os.close(fd)
    assert d.stop() == 0, d.log()
    r.close()

    d.start()
    live = d.admin.get("/v1/buffers").json()
    assert [b["id"] for b in live] == [committed], live
    assert reply.buffer_id not in spill_ids(_spill(d))
    assert spill_ids(_spill(d)) == [committed]
    ledger_totals(d)
    r = connect(d, key)
    found, fd = lookup(r, ["half", "done"])
    try:
        assert found.key == "done"
        assert os.pread(fd, MiB, 0) == pattern(MiB, 1)
    finally:
        os.close(fd)
    r.close()
    assert d.stop() == 0, d.log()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# -- invariant 4 for persistent pools ----------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_restored_persistent_buffer_is_scrubbed_on_every_kind_of_release(
    fresh_daemon: Daemon,
) -> None:
    """Persistent buffers restored from their checkpoints after a SIGKILL, each mapped by
    a worker, then released by the tenant, by the admin, by tenant deletion and by a pool
    drain: every stale mapping reads zeros once the release is answered, and the
    checkpoint files are gone."""
    d = fresh_daemon.start()
    d.pool("pers", 64 * MiB, persistence="persistent")
    d.pool("pers2", 16 * MiB, persistence="persistent", scrub="punch")
    tenant_id, key = d.tenant("scrub", 64 * MiB)
    with d.client(key) as c:
        bufs = _checkpointed(d, c, key, 3, seed=7)
        other = _one_checkpointed(d, c, key, "pers2", b"\x09", ttl_s=3600)
    d.kill()
    d.start()
    by_tenant, by_admin, by_delete = list(bufs)
    with d.client(key) as c, Worker(d.socket_path, key, renew_interval_s=0) as w:
        maps = {bid: w.attach(bid) for bid in [*bufs, other["id"]]}
        for bid, data in bufs.items():
            assert maps[bid].array.tobytes() == data
        assert c.delete(f"/v1/buffers/{by_tenant}").status_code == 204
        assert not np.any(maps[by_tenant].array)
        assert d.admin.delete(f"/v1/buffers/{by_admin}").status_code == 204
        assert not np.any(maps[by_admin].array)
        assert d.admin.delete("/v1/pools/pers2", params={"drain": "true"}).status_code == 204
        assert not np.any(maps[other["id"]].array)
        assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
        assert not np.any(maps[by_delete].array)
        for m in maps.values():
            m.close()
    assert spill_ids(_spill(d)) == []
    assert spill_ids(_spill(d, "pers2")) == []
    ledger_totals(d)
    assert d.stop() == 0


# -- §3: the config file, refused readably -----------------------------------------------------

_POOL = 'name = "p"\nnuma_node = 0\ncapacity_bytes = "8MiB"\n'


def _serve(
    data_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    return subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "serve", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **base,
            "MAASD_DEFAULT_POOL_BYTES": str(8 * MiB),
            "MAASD_LATENCY_PROBE": "false",
            "MAASD_PORT": "1",  # never reached: every case fails before listening
            **(env or {}),
        },
    )


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Any:
    """A directory on a read-only tmpfs (not writable even by root), unmounted after."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield ro
    subprocess.run(["umount", "-l", str(ro)], check=False)


CONFIGS = {
    "broken TOML": ("[[pools]\n" + _POOL, "config file"),
    "unknown top-level field": ("bogus = 1\n", "bogus"),
    "unknown pool field": ("[[pools]]\n" + _POOL + "scrubb = 'punch'\n", "scrubb"),
    "negative capacity": ("[[pools]]\n" + _POOL.replace('"8MiB"', "-5"), "capacity_bytes"),
    "negative size string": ("[[pools]]\n" + _POOL.replace('"8MiB"', '"-8MiB"'), "capacity_bytes"),
    "negative latency": ("[[pools]]\n" + _POOL + "latency_us = -1\n", "latency_us"),
    "negative max_ttl_s": ("max_ttl_s = -1\n", "max_ttl_s"),
    "duplicate pool names": ("[[pools]]\n" + _POOL + "[[pools]]\n" + _POOL, "duplicate pool"),
    "spill_dir under a file": (
        "[[pools]]\n" + _POOL + 'persistence = "persistent"\nspill_dir = "{tmp}/file/spill"\n',
        "spill_dir",
    ),
    "spill_dir read-only": (
        "[[pools]]\n" + _POOL + 'persistence = "persistent"\nspill_dir = "{ro}"\n',
        "spill_dir",
    ),
    "spill_dir relative": (
        "[[pools]]\n" + _POOL + 'persistence = "persistent"\nspill_dir = "spill"\n',
        "spill_dir",
    ),
    "spill_dir of a volatile pool": (
        "[[pools]]\n" + _POOL + 'spill_dir = "{tmp}/s"\n',
        "spill_dir",
    ),
    "pools not a list": ("pools = 3\n", "pools"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_bad_config_file_stops_serve_with_one_clear_line(
    tmp_path: Path, read_only_dir: Path, case: str
) -> None:
    text, names = CONFIGS[case]
    (tmp_path / "file").write_text("")
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(text.format(tmp=tmp_path, ro=read_only_dir))
    for how in (["--config", str(cfg)], []):  # the flag, then MAASD_CONFIG
        r = _serve(tmp_path / "data", *how, env={} if how else {"MAASD_CONFIG": str(cfg)})
        assert r.returncode != 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, r.stderr
        assert names in errors[0], errors[0]
    assert not (tmp_path / "data" / "maasd.sock").exists()


def test_a_missing_config_file_stops_serve(tmp_path: Path) -> None:
    r = _serve(tmp_path / "data", env={"MAASD_CONFIG": str(tmp_path / "nope.toml")})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert str(tmp_path / "nope.toml") in r.stderr


# -- §3: every flag's environment variable, end to end ------------------------------------------


@pytest.mark.timeout(120)
def test_every_serve_setting_from_its_environment_variable(tmp_path: Path) -> None:
    """MAASD_HOST, MAASD_PORT, MAASD_SOCKET, MAASD_DATA_DIR, MAASD_DB_URL, MAASD_CONFIG and
    MAASD_ADMIN_KEY, and nothing on the command line: the daemon listens where they say,
    keeps its ledger where MAASD_DB_URL says, makes the config's pool, takes the admin key;
    a flag beats its variable."""
    from conftest import Daemon

    db = tmp_path / "elsewhere" / "ledger.db"
    db.parent.mkdir()
    sock = tmp_path / "run" / "w.sock"
    sock.parent.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text("[[pools]]\n" + _POOL.replace('"p"', '"fromconfig"'))
    d = Daemon(
        tmp_path / "data",
        env={
            "MAASD_HOST": "127.0.0.2",
            "MAASD_SOCKET": str(sock),
            "MAASD_DB_URL": f"sqlite:///{db}",
            "MAASD_CONFIG": str(cfg),
        },
    )
    d.url = f"http://127.0.0.2:{d.port}"
    d.admin = httpx.Client(
        base_url=d.url, timeout=30.0, headers={"Authorization": f"Bearer {d.admin_key}"}
    )
    try:
        d.start()
        assert d.socket_path == str(sock)
        assert not _accepts(d.port)  # 127.0.0.1: not where MAASD_HOST said
        assert [p["name"] for p in d.admin.get("/v1/pools").json()] == ["fromconfig"]
        assert not (d.data_dir / "maasd.db").exists()
        names = {r[0] for r in sqlite3.connect(db).execute("select name from pools")}
        assert names == {"fromconfig"}
        with httpx.Client(base_url=d.url, headers={"Authorization": "Bearer wrong"}) as bad:
            assert bad.get("/v1/tenants").status_code == 401
        _, key = d.tenant("env", 8 * MiB)
        with Worker(str(sock), key, renew_interval_s=0):
            pass
        assert d.stop() == 0, d.log()
        # A flag beats its variable: --host and --port on the command line.
        port = d.port + 1 if d.port < 65000 else d.port - 1
        d.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "maasd.cli.daemon",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=d.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: _accepts(port), timeout=30, message="serving on the flag's port")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        assert d.stop() == 0
    finally:
        d.close()


def test_migrate_alone_from_environment_variables(tmp_path: Path) -> None:
    """``maasd migrate`` with MAASD_DATA_DIR and MAASD_DB_URL only: the ledger is at head
    where the URL says, and a ``serve`` on it starts without migrating again."""
    db = tmp_path / "l.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env |= {"MAASD_DATA_DIR": str(tmp_path / "data"), "MAASD_DB_URL": f"sqlite:///{db}"}
    r = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "migrate"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    (rev,) = sqlite3.connect(db).execute("select version_num from alembic_version").fetchone()
    assert rev
    assert not (tmp_path / "data" / "maasd.db").exists()
    # The generated admin key: not made by migrate (it serves nothing).
    assert not (tmp_path / "data" / "admin.key").exists()


def test_a_ledger_a_newer_maasd_migrated_stops_migrate_and_serve_readably(
    tmp_path: Path,
) -> None:
    """§3 ("Schema changes only through Alembic migrations"): the package rolled back after
    a newer maasd migrated the ledger. ``maasd migrate`` and ``maasd serve`` each exit
    non-zero with one line that says so — no Alembic traceback — and leave it as it is."""
    data = tmp_path / "data"
    db = data / "maasd.db"
    r = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "migrate", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_future'")
    migrate = subprocess.run(
        [sys.executable, "-m", "maasd.cli.daemon", "migrate", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    for out in (migrate, _serve(data)):
        assert out.returncode != 0
        assert "Traceback" not in out.stderr, out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, out.stderr
        assert "9999_future" in errors[0]
        assert "newer maasd" in errors[0]
    (rev,) = sqlite3.connect(db).execute("select version_num from alembic_version").fetchone()
    assert rev == "9999_future"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delay", [0.05, 0.1, 0.2])
def test_sigkill_during_the_shutdown_checkpoints(
    ledger_daemon: Daemon, tmp_path: Path, delay: float
) -> None:
    """SIGTERM checkpoints every persistent buffer on the way out (files written, one
    syncfs, one ledger transaction, previous files removed); a SIGKILL in the middle of
    that leaves every buffer with one whole checkpoint — the one before, or the one of
    the shutdown — matching the ledger's checksum, and no other file."""
    d = _configured(ledger_daemon, tmp_path, pers=128 * MiB)
    _, key = d.tenant("shutdown", 256 * MiB)
    with d.client(key) as c:
        before = _checkpointed(d, c, key, 48, seed=17)
    after = {bid: bytes(reversed(data)) for bid, data in before.items()}
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for bid, data in after.items():
            m = w.attach(bid)
            m.array[:] = np.frombuffer(data, dtype=np.uint8)
            m.close()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(delay)
    d.kill()  # SIGKILL, or the exit status of a shutdown that had ended

    d.start()
    ledger_totals(d)
    live = {b["id"]: b for b in d.admin.get("/v1/buffers").json()}
    assert sorted(live) == sorted(before), "a persistent buffer was lost"
    for bid in before:
        data = read_buffer(d, key, bid)
        assert data in (before[bid], after[bid]), "a torn checkpoint came back"
        assert hashlib.sha256(data).hexdigest() == live[bid]["checksum"]
    assert spill_ids(_spill(d)) == sorted(before)
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_pool_table_edited_between_starts_keeps_the_ledgers_pool_and_says_so(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """§3 config file: the persistent pool's table shrunk below what its buffers hold and
    given another spill_dir while the daemon was down (killed). The pool keeps the
    ledger's capacity and spill dir — its checkpointed buffers come back, from where they
    are, and no pool is over its capacity — and the start's log names what differs."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("edited", 256 * MiB)
    with d.client(key) as c:
        saved = _checkpointed(d, c, key, 24, seed=23)
    d.kill()
    cfg = Path(d.env["MAASD_CONFIG"])
    cfg.write_text(
        POOLS.format(vol=64 * MiB, pers=16 * MiB) + f'spill_dir = "{tmp_path / "moved"}"\n'
    )
    d.start()
    pool = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == "pers")
    assert (pool["capacity_bytes"], pool["used_bytes"]) == (64 * MiB, 24 * MiB)
    assert _survivors_intact(d, key, saved) == list(saved)
    assert "differs from its configuration in capacity_bytes, spill_dir" in d.log()
    assert d.stop() == 0, d.log()


def _signal_during_startup(d: Daemon, sig: int, again_after: float | None = None) -> int:
    """Start the daemon and send ``sig`` once its startup is under way (the ledger being
    migrated, persistent buffers not yet restored, REST not listening); ``again_after``
    seconds later, a second one. Returns its exit status."""
    offset = d.log_path.stat().st_size if d.log_path.exists() else 0
    log = open(d.log_path, "ab")  # noqa: SIM115 - handed to the child
    d.proc = subprocess.Popen(
        [sys.executable, "-m", "maasd.cli.daemon", "serve"],
        env=d.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    wait_until(
        lambda: b"msg=starting" in d.log_path.read_bytes()[offset:],
        timeout=60,
        interval=0.002,
        message="startup under way",
    )
    d.proc.send_signal(sig)
    if again_after is not None:
        time.sleep(again_after)
        d.proc.send_signal(sig)
    return d.proc.wait(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_asked_for_during_startup_is_graceful(
    fresh_daemon: Daemon, tmp_path: Path, sig: int
) -> None:
    """§3 "SIGTERM/SIGINT: … exit 0", also while the daemon starts (recovering persistent
    buffers): it exits 0, through its shutdown, and its persistent buffers come back
    intact at the next start. A second signal aborts the start at once (exit 1, one line,
    no traceback), and that too leaves nothing to repair."""
    d = _configured(fresh_daemon, tmp_path, pers=128 * MiB)
    _, key = d.tenant("startup", 256 * MiB)
    with d.client(key) as c:
        saved = _checkpointed(d, c, key, 48, seed=29)
    assert d.stop() == 0, d.log()

    offset = d.log_path.stat().st_size
    assert _signal_during_startup(d, sig) == 0, d.log()
    graceful = d.log_path.read_text()[offset:]
    assert "while starting or stopping" in graceful
    assert "msg=stopped" in graceful  # through the shutdown
    assert "Traceback" not in graceful, graceful
    offset = d.log_path.stat().st_size
    assert _signal_during_startup(d, sig, again_after=0.01) == 1
    aborted = d.log_path.read_text()[offset:]
    assert "Traceback" not in aborted, aborted
    assert "Aborted!" in aborted

    d.start()
    assert _survivors_intact(d, key, saved) == list(saved)
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_restored_persistent_buffer_whose_lease_ends_is_scrubbed(
    fresh_daemon: Daemon, tmp_path: Path
) -> None:
    """Invariant 4, by lease expiry, for a buffer restored after a SIGKILL: its lease (kept
    across the restart) ends while a worker maps it; the mapping then reads zeros, the
    checkpoint file is gone, nothing is counted."""
    d = _configured(fresh_daemon, tmp_path)
    _, key = d.tenant("expiry", 64 * MiB)
    with d.client(key) as c:
        b = _one_checkpointed(d, c, key, "pers", b"\x0b", ttl_s=8)
    d.kill()
    d.start()
    with d.client(key) as c, Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(b["id"])
        assert m.array.tobytes() == b"\x0b" * MiB
        wait_until(lambda: c.get(f"/v1/buffers/{b['id']}").status_code == 404, timeout=30)
        wait_until(lambda: not np.any(m.array), timeout=10, message="the mapping reads zeros")
        m.close()
        assert c.get("/v1/usage").json()["used_bytes"] == 0
    assert spill_ids(_spill(d)) == []
    ledger_totals(d)
    assert d.stop() == 0, d.log()
