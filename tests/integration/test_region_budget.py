"""The region budget in a real daemon at its default settings (SPEC §2.9): every limit
answers before the kernel does.

Three tenants, each with a 1 GiB quota, put and commit 4 KiB entries until they are
refused. Each is refused by its fair share of the budget — a 507 ``resource-limit``
naming it, never the kernel's ``EMFILE`` — while ``/healthz`` stays fast and a fourth
tenant reserves over REST, looks up over the socket and releases. The daemon's
``RLIMIT_NOFILE`` is lowered to 4,096 (``prlimit``) only to keep the run short: the
budget scales with it (maasd.core.limits). That run keeps one fd per idle entry
(``entry_fds = "keep"``); where idle entries park (the default, where the daemon may
re-open its mappings: maasd.allocator.parking), the same tenants put more entries than
the whole files budget, and only what holds an fd (entries being written) meets it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from budgets import default_limits
from conftest import Daemon
from hardening import another_tenant_works, healthz
from maasd.allocator import parking
from maasd.client import BufferMapping, Client, Worker
from maasd.client.errors import ResourceLimit
from maasd.core.limits import MIN_USEFUL_REGIONS, open_files_needed

KiB = 1 << 10
GiB = 1 << 30
OPEN_FILES = 4096
#: Idle entries keep their fd: the budget of open files binds them (the run above).
KEEP = {"MAASD_ENTRY_FDS": "keep"}
needs_parking = pytest.mark.skipif(
    not parking.can_park(), reason="this process cannot re-open its mappings' files"
)


def fill(w: Worker, tenant: str, most: int) -> tuple[int, ResourceLimit]:
    """Put and commit 4 KiB entries until refused; how many went in, and the refusal."""
    for i in range(most):
        try:
            with w.entry(f"{tenant}-{i}", 4 * KiB) as m:
                m.array[:8] = 1
        except ResourceLimit as e:
            return i, e
    raise AssertionError(f"{tenant} put {most} entries and was never refused")


def fourth_tenant_is_served(d: Daemon) -> None:
    """A tenant new to the daemon reserves over REST, puts, commits and looks up over the
    socket, and releases."""
    _tid, key = d.tenant("t4", GiB)
    with Client(d.url, key) as c:
        buf = c.reserve(size_bytes=64 * KiB, ttl_s=300)
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            with w.entry("t4-hit", 4 * KiB) as m:
                m.array[:4] = 9
            hit = w.lookup(["t4-hit"])
            assert hit is not None
            assert bytes(hit.array[:4]) == b"\x09" * 4
            hit.close()
        c.release(buf.id)


def persistent_entries(d: Daemon, n: int, byte: Callable[[int], int]) -> str:
    """``n`` committed 4 KiB entries ``k0``… in a new persistent pool, entry ``i`` starting
    with four bytes ``byte(i)``, of a new tenant; its API key."""
    d.pool("keep", 64 << 20, persistence="persistent")
    _tid, key = d.tenant("keeper", GiB)
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for i in range(n):
            with w.entry(f"k{i}", 4 * KiB, pool="keep") as m:
                m.array[:4] = byte(i)
    return key


def test_three_tenants_meet_their_shares_and_a_fourth_is_served(tmp_path: Path) -> None:
    lim = default_limits(OPEN_FILES, None)
    share = lim.tenant_budget
    d = Daemon(
        tmp_path / "d",
        env={"MAASD_DEFAULT_POOL_BYTES": str(4 * GiB), **KEEP},
        wrapper=["prlimit", f"--nofile={OPEN_FILES}:{OPEN_FILES}", "--"],
    ).start()
    try:
        assert d.proc is not None
        for name in ("t1", "t2", "t3"):
            _tid, key = d.tenant(name, GiB)
            with Worker(d.socket_path, key, renew_interval_s=0) as w:
                n, refusal = fill(w, name, 4 * share)
            assert n == share, f"{name} put {n} entries, its share is {share}"
            assert refusal.status == 507
            assert "its share of the daemon's budget" in refusal.detail
            r = httpx.get(f"{d.url}/healthz", timeout=5)
            assert r.status_code == 200, r.text
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert fds < OPEN_FILES - lim.headroom // 2, f"{fds} open files"
        assert "Too many open files" not in d.log()
        # A fourth tenant: reserve over REST, put/commit/lookup over the socket, release.
        fourth_tenant_is_served(d)
        assert healthz(d) == (200, {"status": "ok"})
        another_tenant_works(d)
    finally:
        d.close()


def test_a_limit_with_no_room_for_buffers_stops_the_daemon_naming_what_it_needs(
    tmp_path: Path,
) -> None:
    need = open_files_needed(default_limits(256, None))
    assert need is not None
    d = Daemon(tmp_path / "d", wrapper=["prlimit", "--nofile=256:256", "--"])
    with pytest.raises(RuntimeError, match="maasd exited") as e:
        d.start(timeout=30)
    assert f"raise LimitNOFILE (ulimit -Hn) to at least {need}" in str(e.value)
    assert f"room for {MIN_USEFUL_REGIONS} at least" in str(e.value)
    # and at the limit it names, the daemon starts
    d = Daemon(tmp_path / "d2", wrapper=["prlimit", f"--nofile={need}:{need}", "--"])
    try:
        d.start()
        assert httpx.get(f"{d.url}/healthz", timeout=5).status_code == 200
    finally:
        d.close()


def test_persistent_entries_beyond_the_budget_stop_the_start_and_are_kept(
    tmp_path: Path,
) -> None:
    entries = 100
    d = Daemon(tmp_path / "d", env=KEEP)
    d.start()
    try:
        key = persistent_entries(d, entries, lambda _i: 7)
        assert d.stop() == 0  # every persistent entry checkpointed
        # A limit whose budget holds fewer: the daemon says so and releases nothing.
        files = open_files_needed(default_limits(4096, None), entries - 20)
        assert files is not None
        low = Daemon(
            tmp_path / "d", env=KEEP, wrapper=["prlimit", f"--nofile={files}:{files}", "--"]
        )
        with pytest.raises(RuntimeError, match="maasd exited") as e:
            low.start()
        assert f"the ledger holds {entries} persistent buffers and entries to restore" in str(
            e.value
        )
        assert "raise LimitNOFILE to at least" in str(e.value)
        assert "nothing was released" in str(e.value)
        # With the limit back, every entry is restored.
        d = Daemon(tmp_path / "d", env=KEEP).start()
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            for i in (0, entries // 2, entries - 1):
                hit = w.lookup([f"k{i}"])
                assert hit is not None
                assert bytes(hit.array[:4]) == b"\x07" * 4
                hit.close()
    finally:
        d.close()


@needs_parking
def test_parked_entries_go_past_the_files_budget_and_only_writers_meet_it(
    tmp_path: Path,
) -> None:
    """Three tenants commit more entries than the daemon's whole budget of open files
    (idle entries hold none); a tenant's entries being written (each holding an fd) meet
    its share of that budget with a 507 naming it; the daemon never nears EMFILE, and
    everyone else — a fourth tenant's reserve, put, lookup and release — is served."""
    lim = default_limits(OPEN_FILES, None, parks_entries=True)
    files, share = lim.file_budget, lim.tenant_file_budget
    per_tenant = files // 3 + 200  # together past the files budget, each past its share
    d = Daemon(
        tmp_path / "d",
        env={"MAASD_DEFAULT_POOL_BYTES": str(4 * GiB)},
        wrapper=["prlimit", f"--nofile={OPEN_FILES}:{OPEN_FILES}", "--"],
    ).start()
    try:
        assert d.proc is not None
        keys = {}
        for name in ("t1", "t2", "t3"):
            _tid, keys[name] = d.tenant(name, GiB)
            with Worker(d.socket_path, keys[name], renew_interval_s=0) as w:
                for i in range(per_tenant):
                    with w.entry(f"{name}-{i}", 4 * KiB) as m:
                        m.array[:8] = 1
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert fds < OPEN_FILES - lim.headroom // 2, f"{fds} open files"
        assert int(d.metric("maasd_buffer_regions")) >= 3 * per_tenant > files
        # Entries being written hold an fd each: t1's meet its share of the files budget.
        staged: list[BufferMapping] = []
        with Worker(d.socket_path, keys["t1"], renew_interval_s=0) as w:
            refused: ResourceLimit | None = None
            for i in range(2 * share):
                try:
                    staged.append(w.put(f"t1-staged-{i}", 4 * KiB))
                except ResourceLimit as e:
                    refused = e
                    break
            assert refused is not None, f"{len(staged)} entries being written, never refused"
            assert refused.status == 507
            assert "holding an open file" in refused.detail
            assert len(staged) <= share
            assert healthz(d) == (200, {"status": "ok"})
            # meanwhile everyone else is served, and t1's committed entries are found
            with Worker(d.socket_path, keys["t2"], renew_interval_s=0) as other:
                hit = other.lookup(["t2-7"])
                assert hit is not None
                assert bytes(hit.array[:8]) == b"\x01" * 8
                hit.close()
            fourth_tenant_is_served(d)
            for m in staged:
                w.abort(m)
        assert "Too many open files" not in d.log()
        another_tenant_works(d)
    finally:
        d.close()


@needs_parking
def test_persistent_entries_past_the_files_budget_are_restored_parked(tmp_path: Path) -> None:
    """A restart restores persistent entries beyond what the open-files budget would
    hold: each comes back parked (no fd), with its bytes."""
    d = Daemon(tmp_path / "d").start()
    files = open_files_needed(default_limits(4096, None), MIN_USEFUL_REGIONS + 16)
    assert files is not None
    entries = 2 * (MIN_USEFUL_REGIONS + 16)  # twice what that limit's files budget holds
    try:
        key = persistent_entries(d, entries, lambda i: i % 251)
        assert d.stop() == 0
        low = Daemon(tmp_path / "d", wrapper=["prlimit", f"--nofile={files}:{files}", "--"])
        d = low.start()
        assert d.proc is not None
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            for i in (0, entries // 2, entries - 1):
                hit = w.lookup([f"k{i}"])
                assert hit is not None
                assert bytes(hit.array[:4]) == bytes([i % 251]) * 4
                hit.close()
        assert int(d.metric("maasd_buffer_region_fds")) < entries // 2
        assert int(d.metric("maasd_buffer_regions")) >= entries
    finally:
        d.close()
