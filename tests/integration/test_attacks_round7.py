"""A hostile tenant against the reserve path and the disk tier's three parts (SPEC §2,
invariants 1, 2 and 4; §12): reserves racing releases at the quota's edge, a reserve
that fails after its admission, a key re-put after its demotion, a tenant deleted while
its demotions are queued or its entries promoted, and a disk quota over two tiers.

Each attack is a real daemon and real tenants on its REST API and socket, and ends with
:func:`hardening.after_attack` (healthy, the ledger = the daemon's memfds) and exact usage.
"""

from __future__ import annotations

import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import Daemon
from hardening import after_attack, tenant_usage
from maasd.core.disktier import DiskTiers, OnDisk, Tier
from maasd.core.livepools import LivePools
from maasd.disk.store import DiskDir
from maasd.metrics import Metrics
from maasd.protocol import Detach, Error, Found, Lookup, Ok
from maasd.store import BufferRow, PoolRow
from rawentries import (
    FILE_OVERHEAD,
    commit,
    connect,
    demote_one,
    entry_file_bytes,
    entry_files,
    pattern,
    put,
    put_committed,
    tier_pool,
    write,
)
from sockpeer import Raw, lookup
from waiting import wait_until

MiB = 1 << 20


def _tier(d: Daemon, pool: str) -> dict[str, int]:
    return dict({p["name"]: p for p in d.admin.get("/v1/pools").json()}[pool]["disk"])


def _read(r: Raw, key: str) -> bytes | None:
    """The bytes a lookup of ``key`` answers (detached at once), or None on a miss."""
    reply, fds = r.call(Lookup(keys=[key]))
    if not isinstance(reply, Found):
        assert fds == []
        return None
    (fd,) = fds
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)
        _detach(r, reply.buffer_id)


def _torn_by_release(got: bytes, want: bytes) -> bool:
    """Whether every byte of ``got`` is ``want``'s or zero: a read racing the release's
    scrub (a read of 1 MiB is no snapshot: it may see a page half zeroed)."""
    return len(got) == len(want) and all(g in (w, 0) for g, w in zip(got, want, strict=True))


def _detach(r: Raw, buffer_id: str) -> None:
    """Detach a looked-up entry: Ok, or 404 if another put evicted it meanwhile."""
    reply, fds = r.call(Detach(buffer_id=buffer_id))
    assert fds == []
    assert reply == Ok() or (isinstance(reply, Error) and reply.status == 404), reply


def _use(r: Raw, key: str) -> None:
    """A second use of ``key`` (worth a disk write at its eviction), then let go."""
    reply, fds = r.call(Lookup(keys=[key]))
    for fd in fds:
        os.close(fd)
    if isinstance(reply, Found):
        _detach(r, reply.buffer_id)


def test_reserves_racing_releases_at_the_quota_edge(daemon: Daemon) -> None:
    """Eight threads reserve and release 1 MiB buffers of a 4 MiB tenant in a prefaulted
    pool (the placement check runs): its usage never passes the quota, and is exact."""
    pool = f"q7-{secrets.token_hex(3)}"
    daemon.pool(pool, 16 * MiB, prefault=True)
    tid, key = daemon.tenant("edge", 4 * MiB)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with daemon.client(key) as c:
            while not stop.is_set():
                seen.append(c.get("/v1/usage").json()["used_bytes"])

    def churn(n: int) -> list[int]:
        codes = []
        with daemon.client(key) as c:
            for _ in range(12):
                r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": MiB})
                codes.append(r.status_code)
                if r.status_code == 201 and n % 2 == 0:  # half the threads keep theirs
                    codes.append(c.delete(f"/v1/buffers/{r.json()['id']}").status_code)
                elif r.status_code == 201:
                    held = c.get("/v1/buffers").json()
                    if len(held) >= 3:
                        codes.append(c.delete(f"/v1/buffers/{held[0]['id']}").status_code)
        return codes

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(8) as ex:
        codes = [c for cs in ex.map(churn, range(8)) for c in cs]
    stop.set()
    watcher.join()
    assert set(codes) <= {201, 204, 404, 409}, codes
    assert 201 in codes
    assert 409 in codes
    assert max(seen) <= 4 * MiB
    with daemon.client(key) as c:
        live = c.get("/v1/buffers").json()
    usage = tenant_usage(daemon, key)
    assert usage["used_bytes"] == len(live) * MiB <= 4 * MiB
    assert daemon.admin.get(f"/v1/pools/{pool}").json()["used_bytes"] == len(live) * MiB
    after_attack(daemon)
    assert daemon.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    assert daemon.admin.get(f"/v1/pools/{pool}").json()["used_bytes"] == 0


def test_a_reserve_refused_after_admission_rolls_back(daemon: Daemon) -> None:
    """A pool no reserve can be placed in (hugetlb with no free pages, or a NUMA node the
    host lacks): each refused reserve leaves no row, no byte and no fd behind."""
    tid, key = daemon.tenant("refused", 64 * MiB)
    made = []
    for fields in ({"backing": "hugetlb"}, {"numa_node": 63}):
        name = f"nf-{secrets.token_hex(3)}"
        body = {"name": name, "numa_node": 0, "capacity_bytes": 64 * MiB, **fields}
        r = daemon.admin.post("/v1/pools", json=body)
        assert r.status_code in (201, 409, 422, 400), r.text
        if r.status_code == 201:
            made.append(name)
    free_huge = int(
        next(
            (ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
             if ln.startswith("HugePages_Free:")),
            "0",
        )
    )  # fmt: skip
    with daemon.client(key) as c:
        for name in made:
            for _ in range(5):
                r = c.post(f"/v1/pools/{name}/reserve", json={"size_bytes": 4 * MiB})
                if free_huge == 0:
                    assert r.status_code in (409, 507), r.text
                    assert r.headers["content-type"].startswith("application/problem+json")
                elif r.status_code == 201:
                    assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code == 204
        assert c.get("/v1/buffers").json() == []
    assert tenant_usage(daemon, key)["used_bytes"] == 0
    for name in made:
        assert daemon.admin.get(f"/v1/pools/{name}").json()["used_bytes"] == 0
    after_attack(daemon)
    assert daemon.admin.delete(f"/v1/tenants/{tid}").status_code == 204


def test_a_stale_disk_copy_is_never_promoted(disk_daemon: Daemon, tmp_path: Path) -> None:
    """``hot`` demoted with bytes A, then put again with bytes B: a lookup while B is
    staged, after B is committed, and after B is evicted (cold or worth a write) never
    answers A."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    tid, key = d.tenant(quota_bytes=64 * MiB)
    old, new = pattern(MiB, 1), pattern(MiB, 2)
    r = demote_one(d, key, pool, old, fill=9)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    assert len(entry_files(disk)) == 1
    # B staged: the key is taken, a lookup neither promotes A nor returns B.
    reply, fd = put(r, "hot", MiB, pool=pool)
    assert _read(r, "hot") is None
    write(fd, new)
    os.close(fd)
    commit(r, reply.buffer_id)
    assert _read(r, "hot") == new
    # B evicted: either demoted (it was used) or dropped; A never comes back.
    for i in range(9):
        put_committed(r, f"more-{i}", pattern(MiB, 50 + i), pool)
    wait_until(lambda: len(entry_files(disk)) <= 2)
    got = _read(r, "hot")
    assert got in (None, new)
    # B once more, cold this time (no use): evicted, its predecessor's copy must go too.
    for i in range(9):
        put_committed(r, f"again-{i}", pattern(MiB, 80 + i), pool)
    assert _read(r, "hot") in (None, new)
    r.close()
    assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    wait_until(lambda: entry_files(disk) == [])
    assert _tier(d, pool)["used_bytes"] == 0
    after_attack(d)


def test_a_tenant_deleted_while_its_demotions_are_queued(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """Writers of one tenant churn entries through a tiered pool (each worth a disk
    write) and the tenant is deleted mid-churn: none of its bytes stay on disk, the tier
    counts only the bystander's entry, whose file and bytes are untouched."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB, disk_bytes=128 * MiB)
    other_id, other = d.tenant("bystander", quota_bytes=64 * MiB)
    kept = pattern(MiB, 7)
    b = demote_one(d, other, pool, kept, fill=8)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    (theirs,) = entry_files(disk)
    theirs_bytes = (disk / theirs).read_bytes()
    # the bystander's fillers leave DRAM (so the victim's churn demotes the victim's own)
    b.close()
    victim_id, victim = d.tenant("victim", quota_bytes=64 * MiB)
    started = threading.Event()
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        try:
            r = connect(d, victim)
        except BaseException:  # deleted before it connected
            return
        try:
            for i in range(40):
                put_committed(r, f"w{n}-{i}", pattern(MiB, 100 * n + i), pool)
                _use(r, f"w{n}-{i}")
                if i == 6:
                    started.set()
        except BaseException as e:  # the tenant is gone: its connection fails
            errors.append(e)
        finally:
            r.close()

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    assert started.wait(60)
    assert d.admin.delete(f"/v1/tenants/{victim_id}").status_code == 204
    for t in threads:
        t.join(120)
    assert errors, "the churn never noticed its tenant was deleted"
    wait_until(lambda: entry_files(disk) == [theirs], timeout=30)
    assert (disk / theirs).read_bytes() == theirs_bytes
    tier = _tier(d, pool)
    assert (tier["entries"], tier["used_bytes"]) == (1, MiB)
    assert int(d.metric("maasd_disk_bytes", pool=pool)) == MiB
    r = connect(d, other)
    assert _read(r, "hot") == kept  # promoted from its untouched file
    r.close()
    # (a promoted entry's memfd is the reserve's own, and a lookup keeps a read-only fd
    # of it: the ledger is compared with the daemon's fds once it is gone)
    assert d.admin.delete(f"/v1/tenants/{other_id}").status_code == 204
    wait_until(lambda: entry_files(disk) == [])
    after_attack(d)


def test_promotions_racing_a_tenant_delete(disk_daemon: Daemon, tmp_path: Path) -> None:
    """Lookups that promote a tenant's entries from disk race its deletion: nothing of
    it stays in DRAM or on disk, and the daemon's books are exact."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=8 * MiB, disk_bytes=128 * MiB)
    tid, key = d.tenant("promoted", quota_bytes=16 * MiB)
    r = connect(d, key)
    for i in range(12):  # each used once: its eviction is worth a write
        put_committed(r, f"k{i}", pattern(MiB, i), pool)
        _use(r, f"k{i}")
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) >= 4, timeout=30)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) >= 4 * MiB)
    r.close()
    go, deleted = threading.Event(), threading.Event()
    wrong: list[str] = []

    def promote(n: int) -> None:
        p = connect(d, key)
        go.wait()
        try:
            for j in range(24):
                k = (n * 5 + j) % 12
                got = _read(p, f"k{k}")
                if got is not None and got != pattern(MiB, k):
                    if _torn_by_release(got, pattern(MiB, k)):
                        # read while a release zeroed it — the deletion, or an eviction
                        # by another thread's promotion (the pool holds 8): its bytes,
                        # then zeros, never another entry's
                        continue
                    wrong.append(f"k{k}")
        except Exception:
            if not deleted.is_set():  # only the tenant's deletion may end it
                raise
        finally:
            p.close()

    with ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(promote, n) for n in range(3)]
        go.set()
        wait_until(lambda: d.metric("maasd_disk_promotions_total", pool=pool) >= 1, timeout=30)
        deleted.set()
        assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
        for f in futures:
            f.result(timeout=120)
    assert wrong == []
    wait_until(lambda: entry_files(disk) == [], timeout=30)
    tier = _tier(d, pool)
    assert (tier["entries"], tier["used_bytes"]) == (0, 0)
    assert d.admin.get(f"/v1/pools/{pool}").json()["used_bytes"] == 0
    after_attack(d)


def test_disk_quota_across_two_tiers_with_concurrent_writers(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """A tenant of 6 MiB (24 MiB on disk) demotes through two tiered pools at once, two
    writers each: its bytes on both tiers together never pass 24 MiB, and the books
    agree with the files."""
    d = disk_daemon
    disks = [tmp_path / "a", tmp_path / "b"]
    pools = [tier_pool(d, p, capacity=8 * MiB, disk_bytes=128 * MiB) for p in disks]
    tid, key = d.tenant("twotier", quota_bytes=6 * MiB)
    assert tenant_usage(d, key)["disk_quota_bytes"] == 24 * MiB
    seen: list[int] = []
    stop = threading.Event()
    errors: list[str] = []

    def watch() -> None:
        while not stop.is_set():
            seen.append(sum(entry_file_bytes(p) for p in disks))

    def churn(n: int) -> None:
        try:
            r = connect(d, key)
            pool = pools[n % 2]
            for i in range(14):
                put_committed(r, f"w{n}-{i}", pattern(MiB, 100 * n + i), pool)
                _use(r, f"w{n}-{i}")
            r.close()
        except BaseException:
            import traceback

            errors.append(traceback.format_exc())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        wait_until(
            lambda: sum(d.metric("maasd_disk_demotions_total", pool=p) for p in pools) >= 20,
            timeout=60,
        )
    finally:
        stop.set()
        watcher.join()
    assert max(seen) <= 24 * (MiB + FILE_OVERHEAD)
    used = tenant_usage(d, key)["disk_used_bytes"]
    assert used <= 24 * MiB
    assert used == sum(_tier(d, p)["used_bytes"] for p in pools)
    wait_until(
        lambda: (
            sum(len(entry_files(p)) for p in disks) * MiB == tenant_usage(d, key)["disk_used_bytes"]
        )
    )
    assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    wait_until(lambda: all(entry_files(p) == [] for p in disks))
    after_attack(d)


def test_leftovers_of_a_crash_in_the_disk_dir(disk_daemon: Daemon, tmp_path: Path) -> None:
    """A SIGKILL mid-write leaves a torn temporary and whole files of dead keys; a file
    truncated to nothing and one of garbage join them. After the restart none of them
    is promotable or counted, and the tier works."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    tid, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 5), fill=9)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    r.close()
    (name,) = entry_files(disk)
    (disk / f".{name}.tmp").write_bytes(b"torn")
    (disk / f"{'0' * 32}.ent").write_bytes(b"")
    (disk / f"{'f' * 32}.ent").write_bytes(os.urandom(MiB + FILE_OVERHEAD))
    d.stop(9)
    d.start()
    # the pool came back from the ledger; its tier is emptied of what it cannot read
    wait_until(lambda: entry_files(disk) == [], timeout=30)
    assert _tier(d, pool)["used_bytes"] == 0
    r = connect(d, key)
    assert _read(r, "hot") is None
    data = pattern(MiB, 6)
    r.close()
    r = demote_one(d, key, pool, data, fill=9)
    wait_until(lambda: len(entry_files(disk)) == 1, timeout=20)
    wait_until(lambda: _tier(d, pool)["entries"] == 1)
    wait_until(lambda: d.metric("maasd_disk_write_bytes_total", pool=pool) > 0, timeout=20)
    found, fd = lookup(r, ["hot"])
    assert os.pread(fd, MiB, 0) == data
    os.close(fd)
    r.close()
    assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    wait_until(lambda: entry_files(disk) == [])
    after_attack(d)


# --- the books of the disk at the moments a daemon's threads interleave ----------------
#
# An eviction's demotion reads the tenant from the ledger and encrypts the entry between
# the admission filter (``worth_writing``) and its admission: long enough for the key to
# be put again and that newer entry to end (a DELETE, its own eviction) or for the
# tenant to be deleted. The interleavings below are those, step by step, on the real
# books and a real directory.


def _books(disk: Path) -> tuple[DiskTiers, Tier]:
    tiers = DiskTiers(LivePools(), Metrics())
    row = PoolRow(
        id="p1", host="h", name="p1", numa_node=0, backing="memfd", persistence="volatile",
        latency_us=1, capacity_bytes=64 * MiB, page_bytes=4096, prefault=False,
        scrub="zero", spill_dir=None, created_at=0.0, disk_dir=str(disk), disk_bytes=64 * MiB,
    )  # fmt: skip
    tiers.add(row)
    tier = tiers.tier("p1")
    assert tier is not None
    return tiers, tier


def _entry(tenant: str, key: str) -> BufferRow:
    return BufferRow(
        id=secrets.token_hex(16), tenant_id=tenant, pool_id="p1", host="h", size_bytes=4096,
        numa_node=0, persistence="volatile", label=None, key=key, evictable=True,
        state="releasing", created_at=0.0, expires_at=1e12, last_used_at=0.0, kind="entry",
    )  # fmt: skip


def _admit(tiers: DiskTiers, tier: Tier, row: BufferRow, data: bytes) -> bool:
    """The rest of a demotion: sealed, admitted, then written (the writer thread's part,
    run here once the admission let go of the books' lock)."""
    assert row.key is not None
    sealed, blob = DiskDir.seal(row.tenant_id, row.key, memoryview(data))
    queued: list[tuple[OnDisk, list[OnDisk]]] = []
    admitted = tiers.admit(
        tier, row, sealed, 64 * MiB, lambda e, doomed: queued.append((e, doomed))
    )
    for entry, doomed in queued:
        for victim in doomed:
            victim.erase_file()
        if not entry.gone:
            tier.disk.write(entry.sealed, blob)
            tiers.written(entry)
    return admitted


def _promotable(tiers: DiskTiers, tenant: str, key: str) -> bytes | None:
    found = tiers.longest_written(tenant, [key])
    if found is None:
        return None
    tier, entry = found
    out = bytearray(entry.sealed.size)
    tier.disk.read_into(entry.sealed, memoryview(out))
    return bytes(out)


@pytest.mark.parametrize("newer_ends_by", ["delete", "eviction"])
def test_a_demotion_overtaken_by_a_newer_entry_of_its_key(
    tmp_path: Path, newer_ends_by: str
) -> None:
    """Entry 1 of ``k`` (bytes A) is evicted; while its demotion encrypts, ``k`` is put
    again (bytes B) and that entry ends. A is never what ``k`` promotes afterwards."""
    tiers, tier = _books(tmp_path / "disk")
    old, new = _entry("t", "k"), _entry("t", "k")
    a, b = pattern(4096, 1), pattern(4096, 2)
    tiers.hit("t", "k")  # looked up: worth a write
    assert tiers.worth_writing(old) is tier
    if newer_ends_by == "delete":
        tiers.ended("t", "k")
        _admit(tiers, tier, old, a)
        assert _promotable(tiers, "t", "k") is None  # deleted: no copy of k at all
    else:
        tiers.hit("t", "k")
        assert tiers.worth_writing(new) is tier
        sealed_new = (new, b)
        _admit(tiers, tier, old, a)  # the older demotion's admission comes first
        _admit(tiers, tier, *sealed_new)
        assert _promotable(tiers, "t", "k") in (None, b)
    assert tiers.tenant_usage().get("t", 0) == MiB // 256 * len(entry_files(tmp_path / "disk"))


def test_a_demotion_overtaken_by_its_tenants_deletion(tmp_path: Path) -> None:
    """The tenant is deleted while one of its evictions is being encrypted: nothing of
    it is admitted afterwards (no file, no bytes counted)."""
    tiers, tier = _books(tmp_path / "disk")
    row = _entry("t", "k")
    tiers.hit("t", "k")
    assert tiers.worth_writing(row) is tier
    tiers.drop_tenant("t")
    assert not _admit(tiers, tier, row, pattern(4096, 3))
    assert entry_files(tmp_path / "disk") == []
    assert tiers.tenant_usage() == {}
