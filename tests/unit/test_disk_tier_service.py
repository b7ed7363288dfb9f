"""The disk tier inside the service (in-process, a real ledger and real memfds): after a
release no key still in the daemon's memory opens the file that was there; pools without
a tier remember nothing of their entries' uses."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hits import hit
from maasd.core import Service
from maasd.disk.store import NONCE
from maasd.models import PoolSpec, Principal
from maasd.settings import Settings
from maasd.store import Extension
from waiting import wait_until

MiB = 1 << 20


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(
        Settings(
            data_dir=str(tmp_path / "data"),
            admin_key="admin-key-for-tests",
            node_name="unit-host",
            pools=[
                PoolSpec(
                    name="tiered",
                    numa_node=0,
                    capacity_bytes=4 * MiB,
                    prefault=False,
                    disk_dir=str(tmp_path / "disk"),
                    disk_bytes=16 * MiB,
                ),
                PoolSpec(name="plain", numa_node=0, capacity_bytes=4 * MiB, prefault=False),
            ],
        )  # fmt: skip
    )
    s.start(reaper=False)
    yield s
    s.close()


def put(svc: Service, who: Principal, key: str, pool: str, fill: int) -> str:
    h = svc.entries.put(who, key, MiB, pool=pool)
    with mmap.mmap(h.fd, MiB) as m:
        m[:] = bytes([fill]) * MiB
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    return h.buffer_id


def used_once(svc: Service, who: Principal, key: str) -> None:
    found = hit(svc.tiers.find(who, [key]))
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)


def test_after_a_release_no_key_in_memory_opens_the_file(svc: Service, tmp_path: Path) -> None:
    who = svc.auth.authenticate(svc.tenants.create("t", 64 * MiB).api_key)
    put(svc, who, "hot", "tiered", 7)
    used_once(svc, who, "hot")
    put(svc, who, "warm", "tiered", 8)
    used_once(svc, who, "warm")
    for i in range(4):  # the pool holds 4: "hot" and "warm" are evicted, and demoted
        put(svc, who, f"f{i}", "tiered", i)
    disk = tmp_path / "disk"
    tiers = svc.disk  # the keys this daemon holds
    wait_until(lambda: len([p for p in disk.iterdir() if p.suffix == ".ent"]) == 2)
    wait_until(lambda: tiers.fill_ready(who.tenant_id or "", ["hot"]))  # written: promotable
    path = disk / tiers._index[(who.tenant_id or "", "hot")].sealed.name
    raw = path.read_bytes()
    found = hit(svc.tiers.find(who, ["hot"]))  # promoted; then released by its owner
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)
    svc.buffers.release(who, found.buffer_id)
    assert not path.exists()
    assert list(k for _t, k in tiers._index) == ["warm"]
    for sealed in [e.sealed for t in tiers._tiers.values() for e in t.entries.values()]:
        with pytest.raises(InvalidTag):  # no key still held opens those bytes
            AESGCM(sealed.key).decrypt(raw[:NONCE], raw[NONCE:], sealed.aad)


def test_pools_without_a_tier_remember_no_uses(svc: Service) -> None:
    who = svc.auth.authenticate(svc.tenants.create("u", 64 * MiB).api_key)
    for i in range(12):  # every one used, then evicted or released
        buffer_id = put(svc, who, f"k{i}", "plain", i)
        used_once(svc, who, f"k{i}")
    svc.buffers.release(who, buffer_id)
    held = [k for k in svc.disk._admission._uses if isinstance(k, tuple)]
    assert len(held) <= 3  # only the entries still in DRAM


def test_a_key_put_again_replaces_its_copy_on_disk(svc: Service, tmp_path: Path) -> None:
    who = svc.auth.authenticate(svc.tenants.create("r", 64 * MiB).api_key)
    disk = tmp_path / "disk"

    def evict_all(round_: int) -> None:
        for i in range(4):
            put(svc, who, f"f{round_}-{i}", "tiered", i)

    def files() -> list[Path]:
        return [p for p in disk.iterdir() if p.suffix == ".ent"]

    put(svc, who, "k", "tiered", 1)  # the first bytes of "k": used, evicted, demoted
    used_once(svc, who, "k")
    evict_all(0)
    wait_until(lambda: len(files()) == 1)
    first = files()[0]
    put(svc, who, "k", "tiered", 2)  # "k" put again, with other bytes, then evicted
    used_once(svc, who, "k")
    evict_all(1)
    wait_until(lambda: len(files()) == 1 and files()[0] != first)
    tenant_id = who.tenant_id
    assert tenant_id is not None
    wait_until(lambda: svc.disk.fill_ready(tenant_id, ["k"]))  # written: promotable
    found = hit(svc.tiers.find(who, ["k"]))  # promoted: the second bytes
    with mmap.mmap(found.fd, MiB, prot=mmap.PROT_READ) as m:
        assert m[:] == bytes([2]) * MiB
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)
    evict_all(2)  # its promoted entry evicted: its copy is on disk, nothing written
    assert svc.disk.usage(svc.pools.info("tiered").id).demotions == 2  # type: ignore[union-attr]


def test_an_entry_on_disk_keeps_its_lease_and_its_end_erases_it(
    svc: Service, tmp_path: Path
) -> None:
    """A lease goes on on disk: past it the copy is no hit (nor promoted), and the
    reaper's pass erases it; a promotion leases the entry its own ttl again."""
    who = svc.auth.authenticate(svc.tenants.create("l", 64 * MiB).api_key)
    tenant_id = who.tenant_id
    assert tenant_id is not None
    disk = tmp_path / "disk"
    h = svc.entries.put(who, "k", MiB, pool="tiered", ttl_s=600)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    used_once(svc, who, "k")
    for i in range(4):  # evicted, demoted
        put(svc, who, f"f{i}", "tiered", i)
    wait_until(lambda: svc.disk.fill_ready(tenant_id, ["k"]))
    on_disk = svc.disk._index[(tenant_id, "k")]
    assert on_disk.ttl_s == 600
    assert on_disk.expires_at > time.time() + 500
    found = hit(svc.tiers.find(who, ["k"]))  # promoted: leased 600 s again
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)
    held = svc.regions.held(found.buffer_id)
    assert held is not None
    assert held.ttl_s == 600  # what its hits extend its lease by
    for i in range(4):  # evicted again: its copy is on disk still, nothing written
        put(svc, who, f"g{i}", "tiered", i)
    assert svc.disk.expire(time.time() + 100) == 0  # within its lease: kept
    assert svc.disk.fill_ready(tenant_id, ["k"])
    on_disk.expires_at = time.time() - 1  # as if its lease had run out on disk
    assert not svc.disk.fill_ready(tenant_id, ["k"])  # no hit past it
    assert svc.disk.expire() == 1
    assert (tenant_id, "k") not in svc.disk._index
    assert [p for p in disk.iterdir() if p.suffix == ".ent" and p.name == on_disk.sealed.name] == []


def test_an_entry_demoted_after_a_renew_keeps_the_length_its_tenant_gave(svc: Service) -> None:
    """Demoted, an entry carries its lease's length as its tenant last gave it (a renew's),
    not the span from its put to its lease's end, which the hits since stretched: what its
    promotion leases it again, and its hits extend it by."""
    who = svc.auth.authenticate(svc.tenants.create("l", 64 * MiB).api_key)
    tenant_id = who.tenant_id
    assert tenant_id is not None
    h = svc.entries.put(who, "k", MiB, pool="tiered", ttl_s=600)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    used_once(svc, who, "k")  # seen twice: the admission keeps it
    svc.buffers.renew(who, h.buffer_id, 30)
    later = time.time() + 100  # and a hit 100 s on (its use aside): its lease ends at 130 s
    svc.store.buffers.touch_many({}, {h.buffer_id: Extension(later + 30, later)})
    for i in range(4):  # evicted, demoted
        put(svc, who, f"f{i}", "tiered", i)
    wait_until(lambda: svc.disk.fill_ready(tenant_id, ["k"]))
    on_disk = svc.disk._index[(tenant_id, "k")]
    assert on_disk.ttl_s == 30
    assert on_disk.expires_at == later + 30
    found = hit(svc.tiers.find(who, ["k"]))  # promoted: leased 30 s again
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)
    held = svc.regions.held(found.buffer_id)
    assert held is not None
    assert held.ttl_s == 30


def test_an_entry_on_disk_longer_than_a_reserve_may_ask_is_promoted_at_the_most(
    svc: Service,
) -> None:
    """A copy's length longer than ``max_ttl_s`` (a row from before the ledger kept it,
    whose hits stretched it; or the limit lowered since): the promotion leases it
    ``max_ttl_s``, where it failed for good before (every lookup of it a miss)."""
    who = svc.auth.authenticate(svc.tenants.create("l", 64 * MiB).api_key)
    tenant_id = who.tenant_id
    assert tenant_id is not None
    h = svc.entries.put(who, "k", MiB, pool="tiered", ttl_s=600)
    os.close(h.fd)
    svc.entries.commit(who, h.buffer_id, owned=True)
    used_once(svc, who, "k")
    for i in range(4):  # evicted, demoted
        put(svc, who, f"f{i}", "tiered", i)
    wait_until(lambda: svc.disk.fill_ready(tenant_id, ["k"]))
    on_disk = svc.disk._index[(tenant_id, "k")]
    on_disk.ttl_s = svc.settings.max_ttl_s + 1000
    found = hit(svc.tiers.find(who, ["k"]))
    os.close(found.fd)
    svc.handles.drop(who, found.buffer_id)
    held = svc.regions.held(found.buffer_id)
    assert held is not None
    assert held.ttl_s == svc.settings.max_ttl_s
