"""Memory held after release counts as its tenant's until it is really gone (SPEC §2, 1).

A committed entry is sealed, so a release zeroes its pages but cannot free them while any
process holds its memfd. Each attack below is a real tenant process (``holder_attack``)
that keeps released entries in one way; its next ``put`` is refused 409 quota-exceeded
once what it holds reaches its quota, its usage shows the held bytes, and when it exits
everything comes back. Honest workers, whose own mapping caches hold entries, are told
to let go (a pushed ``released`` frame) and never pay for it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hugepages
from conftest import Daemon
from hardening import after_attack
from hardening import tenant_usage as usage
from maasd.client import QuotaExceeded, Worker
from maasd.protocol import Commit, Found, Lookup, Ok, Put, Reserved
from processes import signal_and_wait
from sockpeer import Raw
from waiting import wait_until

MiB = 1 << 20
HELPER = Path(__file__).resolve().parent.parent / "holder_attack.py"


def shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    return 0


@contextlib.contextmanager
def attacker(d: Daemon, key: str, mode: str, size: int, cycles: int, pool: str | None = None):
    args = [mode, d.socket_path, d.url, key, str(size), str(cycles), *([pool] if pool else [])]
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPER.parent), os.getcwd()])},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the attacker ({mode}) died: {proc.wait()}"
        yield proc, json.loads(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # it, its child and its helper let go and exit
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            signal_and_wait(proc, 9, 10)
            raise


@pytest.mark.parametrize(
    "mode", ["attached", "detached", "mapping", "dup", "reopen", "fork", "scm"]
)
def test_released_entries_a_tenant_keeps_count_until_they_are_gone(daemon: Daemon, mode: str):
    quota, size = 8 * MiB, 4 * MiB
    tenant_id, key = daemon.tenant(f"keeper-{mode}", quota)
    assert daemon.proc is not None
    with attacker(daemon, key, mode, size, cycles=6) as (proc, out):
        # Two entries fill the quota; both are released, both still held: the third put
        # is refused, and nothing it holds is more than its quota.
        assert out["cycles"] == 2, out
        refused = out["refused"]
        assert refused is not None, out
        assert refused["status"] == 409, out
        assert refused["type"].endswith("quota-exceeded"), out
        if mode not in ("fork", "scm"):  # the kernel's count of what it holds itself
            assert out["resident"] <= quota, out
        u = usage(daemon, key)
        assert (u["used_bytes"], u["held_bytes"], u["buffers"]) == (quota, quota, 2), u
        assert daemon.metric("maasd_held_bytes", tenant=tenant_id) == quota
        for buffer_id in out["ids"]:  # the admin sees them, their tenant no more
            assert daemon.admin.get(f"/v1/buffers/{buffer_id}").json()["state"] == "releasing"
        # who holds them: the attacker, its child or its helper (the daemon's /proc scan)
        r = daemon.admin.get("/v1/buffers", params={"held": "true", "tenant_id": tenant_id})
        assert r.status_code == 200, r.text
        held = {b["id"]: b["holder_pids"] for b in r.json()}
        assert sorted(held) == sorted(out["ids"]), held
        assert all(pids and daemon.proc.pid not in pids for pids in held.values()), held
        if mode not in ("fork", "scm"):
            assert all(pids == [proc.pid] for pids in held.values()), (held, proc.pid)
    # The attacker (and its child or helper) exited: its memory is gone, its quota free.
    wait_until(lambda: usage(daemon, key)["used_bytes"] == 0, message="held entries freed")
    assert usage(daemon, key)["held_bytes"] == 0
    assert daemon.metric("maasd_held_bytes", tenant=tenant_id) == 0
    events = daemon.admin.get("/v1/events", params={"tenant_id": tenant_id}).json()
    assert sorted(e["kind"] for e in events if e["buffer_id"] in out["ids"]) == sorted(
        ["release", "reserve"] * 2
    )
    after_attack(daemon)


def test_held_huge_pages_count_and_another_tenant_gets_what_the_pool_says_is_free(
    daemon: Daemon,
):
    """On a hugetlb pool: a tenant of 4 MiB keeps what it released; the pool's free figure
    counts it, and another tenant gets exactly what that figure says fits."""
    with hugepages.configured(8):
        pool = daemon.pool(f"huge-{os.getpid()}", 16 * MiB, backing="hugetlb")
        try:
            _, key = daemon.tenant("huge-keeper", 4 * MiB)
            _, other = daemon.tenant("huge-other", 64 * MiB)
            with attacker(daemon, key, "detached", 2 * MiB, 6, pool["id"]) as (_proc, out):
                assert out["cycles"] == 2, out
                assert out["refused"]["type"].endswith("quota-exceeded"), out
                info = daemon.admin.get(f"/v1/pools/{pool['id']}").json()
                assert (info["used_bytes"], info["held_bytes"]) == (4 * MiB, 4 * MiB), info
                assert info["free_bytes"] == 12 * MiB
                with daemon.client(other) as c:
                    body = {"size_bytes": 12 * MiB}
                    r = c.post(f"/v1/pools/{pool['id']}/reserve", json=body)
                    assert r.status_code == 201, r.text  # what "free" said fits, fits
                    more = c.post(f"/v1/pools/{pool['id']}/reserve", json={"size_bytes": MiB})
                    assert more.status_code == 507, more.text
                    assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
            wait_until(
                lambda: daemon.admin.get(f"/v1/pools/{pool['id']}").json()["used_bytes"] == 0,
                message="the held huge pages freed",
            )
        finally:
            daemon.admin.delete(f"/v1/pools/{pool['id']}", params={"drain": "true"})
    after_attack(daemon)


def test_maasctl_lists_held_entries_and_who_holds_them(daemon: Daemon):
    _, key = daemon.tenant("listed-keeper", 8 * MiB)
    with attacker(daemon, key, "mapping", 4 * MiB, 1) as (proc, out):
        env = {
            **os.environ,
            "MAASD_URL": daemon.url,
            "MAASD_ADMIN_KEY": daemon.admin_key,
            "COLUMNS": "200",  # every column whole, wherever it runs
            "NO_COLOR": "1",
        }
        cmd = [sys.executable, "-m", "maasd.cli.maasctl"]
        listed = subprocess.run(
            [*cmd, "--json", "buffers", "list", "--held"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert [(b["id"], b["holder_pids"]) for b in json.loads(listed.stdout)] == [
            (out["ids"][0], [proc.pid])
        ]
        table = subprocess.run(
            [*cmd, "buffers", "list", "--held"], env=env, capture_output=True, text=True, timeout=60
        )
        assert table.returncode == 0, table.stderr
        assert str(proc.pid) in table.stdout
        status = subprocess.run(
            [*cmd, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert "HELD" in status.stdout
        usage_out = subprocess.run(
            [*cmd, "usage"],
            env={**env, "MAASD_KEY": key},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert usage_out.returncode == 0, usage_out.stderr
        assert "held after release" in usage_out.stdout
        assert "4.0 MiB" in usage_out.stdout or "4 MiB" in usage_out.stdout, usage_out.stdout
    with daemon.client(key) as c:  # a tenant may not ask who holds what
        assert c.get("/v1/buffers", params={"held": "true"}).status_code == 403


def _honest(d: Daemon, key: str, name: str, n: int, size: int) -> subprocess.Popen[bytes]:
    """A worker process that saves, looks up and restores ``n`` entries in a loop."""
    code = f"""
import json, sys
import numpy as np
from maasd.client import Worker, MaasdClientError
errors, hits = [], 0
with Worker({d.socket_path!r}, {key!r}) as w:
    for i in range({n}):
        try:
            with w.entry("{name}-" + str(i), {size}) as e:
                e.array[:] = i % 251
            for k in (i, i - 3):  # restore this one, and one saved a little earlier
                hit = w.lookup(["{name}-" + str(k)])
                if hit is not None:
                    with hit:
                        ok = bool((hit.array[:4096] == k % 251).all()) or not hit.array.any()
                        assert ok, "wrong bytes"
                        hits += 1
        except MaasdClientError as exc:
            errors.append(f"{{i}}: {{exc}}")
print(json.dumps({{"errors": errors, "hits": hits}}), flush=True)
"""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_two_honest_workers_never_pay_for_their_own_caches(daemon: Daemon):
    """Two worker processes of one tenant save and restore 500 entries under a quota of 20:
    every eviction picks an entry some cache maps; the daemon tells it, it lets go, and
    the save fits. No 409, and the daemon's memory stays within the quota."""
    size = MiB
    tenant_id, key = daemon.tenant("honest", 20 * size)
    assert daemon.proc is not None
    base_kib = shmem_kib(daemon.proc.pid)
    procs = [_honest(daemon, key, f"w{j}", 250, size) for j in range(2)]
    peak_used = peak_kib = 0
    while any(p.poll() is None for p in procs):
        peak_used = max(peak_used, usage(daemon, key)["used_bytes"])
        peak_kib = max(peak_kib, shmem_kib(daemon.proc.pid) - base_kib)
        time.sleep(0.05)
    outs = []
    for p in procs:
        assert p.stdout is not None
        outs.append(json.loads(p.stdout.read()))
        assert p.wait() == 0
    assert [o["errors"] for o in outs] == [[], []], outs
    assert all(o["hits"] >= 250 for o in outs), outs
    # the ledger counts a victim until its row is gone, and the save that evicted it
    # from its admission on: one such pair per worker at a time
    assert peak_used <= 20 * size + 2 * size, peak_used
    # resident in the daemon: the entries (within the quota) and one save's copy at a time
    # per worker (its staging region until the reclaimer punches it)
    assert peak_kib * 1024 <= 20 * size + 2 * 2 * size, peak_kib
    wait_until(lambda: usage(daemon, key)["held_bytes"] == 0, message="nothing held at the end")
    assert daemon.metric("maasd_entry_evictions_total", tenant=tenant_id) >= 480
    assert daemon.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204


def test_an_eviction_of_a_held_entry_frees_nothing_and_the_put_gets_409(daemon: Daemon):
    """The only evictable entry is held by a process that does not listen (a raw socket
    that never reads): evicting it would free nothing, so the put is refused and the
    ledger never holds more than the quota."""
    size = 4 * MiB
    tenant_id, key = daemon.tenant("held-victim", size)
    w = Raw(daemon.socket_path, timeout=30)
    w.hello(key)
    reply, fds = w.call(Put(key="victim", size_bytes=size))
    assert isinstance(reply, Reserved), reply
    os.close(fds[0])
    assert isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
    found, (fd,) = w.call(Lookup(keys=["victim"]))
    assert isinstance(found, Found)
    try:
        with Worker(daemon.socket_path, key) as other:
            with pytest.raises(QuotaExceeded, match="still held"):
                other.put("next", size)
            u = usage(daemon, key)
            assert (u["used_bytes"], u["held_bytes"]) == (size, size), u
            # the victim was evicted (it reads zeros) but stays counted while held
            assert os.pread(fd, 4096, 0) == bytes(4096)
            os.close(fd)
            fd = -1
            wait_until(lambda: usage(daemon, key)["used_bytes"] == 0, message="victim freed")
            other.abort(other.put("next", size))  # the room is there now
    finally:
        if fd >= 0:
            os.close(fd)
        w.close()
    assert usage(daemon, key)["held_bytes"] == 0
    assert daemon.metric("maasd_held_bytes", tenant=tenant_id) == 0
    after_attack(daemon)


def test_a_restart_while_workers_hold_entries_leaks_nothing(daemon: Daemon):
    """The fresh daemon holds none of the old memfds and cannot see who holds them: the
    rows of held entries are released at its start; the worker keeps zeroed pages."""
    size = 2 * MiB
    tenant_id, key = daemon.tenant("held-over-restart", 8 * size)
    w = Raw(daemon.socket_path, timeout=30)
    w.hello(key)
    reply, fds = w.call(Put(key="kept", size_bytes=size))
    assert isinstance(reply, Reserved), reply
    os.pwrite(fds[0], b"\x5a" * size, 0)
    os.close(fds[0])
    assert isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
    found, (fd,) = w.call(Lookup(keys=["kept"]))
    assert isinstance(found, Found)
    try:
        with daemon.client(key) as c:
            assert c.delete(f"/v1/buffers/{reply.buffer_id}").status_code == 204
        assert usage(daemon, key)["held_bytes"] == size
        w.close()
        daemon.restart()
        u = usage(daemon, key)
        assert (u["used_bytes"], u["held_bytes"], u["buffers"]) == (0, 0, 0), u
        assert daemon.admin.get(f"/v1/buffers/{reply.buffer_id}").status_code == 404
        assert os.pread(fd, 4096, 0) == bytes(4096)  # still the worker's: zeroed
    finally:
        os.close(fd)
    after_attack(daemon)


def test_concurrent_keepers_of_one_tenant_never_hold_more_than_its_quota(daemon: Daemon):
    """Eight connections of one tenant race put, commit, lookup, keep the fd, release: what
    they hold all together, as the kernel counts it, stays within the quota."""
    quota, size = 8 * MiB, MiB
    _, key = daemon.tenant("racing-keepers", quota)
    kept: list[int] = []
    lock = threading.Lock()

    def keeper(n: int) -> None:
        w = Raw(daemon.socket_path, timeout=30)
        w.hello(key)
        with daemon.client(key) as rest:
            for i in range(8):
                reply, fds = w.call(Put(key=f"k{n}-{i}", size_bytes=size))
                if not isinstance(reply, Reserved):
                    continue  # refused (409): what is held counts
                with mmap.mmap(fds[0], size) as staged:
                    staged[:] = b"\x11" * size
                os.close(fds[0])
                if not isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok):
                    continue
                found, got = w.call(Lookup(keys=[f"k{n}-{i}"]))
                if isinstance(found, Found):
                    with lock:
                        kept.extend(got)
                rest.delete(f"/v1/buffers/{reply.buffer_id}")
        w.close()

    threads = [threading.Thread(target=keeper, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        resident = sum(os.fstat(fd).st_blocks * 512 for fd in kept)
        assert resident <= quota, f"{resident >> 20} MiB held by a tenant of {quota >> 20} MiB"
        assert len(kept) == quota // size  # the quota, all of it held, no more
        u = usage(daemon, key)
        assert u["used_bytes"] == u["held_bytes"] == quota, u
    finally:
        for fd in kept:
            os.close(fd)
    wait_until(lambda: usage(daemon, key)["used_bytes"] == 0, message="all let go")
    after_attack(daemon)
