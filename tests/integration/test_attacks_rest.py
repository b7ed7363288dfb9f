"""Attacks on the REST API of a real daemon, kept as regression tests (SPEC §2.7, §2.9, §4).

Each test is a hostile tenant's requests, then what another tenant must still get.
No wall-clock time is asserted: a starved tenant is one whose request waits while
the attacker's requests go on completing — counted, not timed.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Daemon
from hardening import after_attack

MiB = 1 << 20
#: More concurrent requests than the REST API has service threads (create_app's 64).
FLOOD = 100


def persistent_pool(daemon: Daemon, spill_dir: Path, capacity: int) -> str:
    """A new persistent pool spilling to ``spill_dir``; its id."""
    name = f"spill-{secrets.token_hex(3)}"
    pool = daemon.pool(name, capacity, persistence="persistent", spill_dir=str(spill_dir))
    return str(pool["id"])


def test_a_checkpoint_flood_does_not_starve_another_tenant(daemon: Daemon, tmp_path: Path) -> None:
    pool = persistent_pool(daemon, tmp_path / "spill", 64 * MiB)
    _, evil = daemon.tenant("checkpointer", 64 * MiB)
    _, good = daemon.tenant("bystander", 16 * MiB)
    with daemon.client(evil) as c:
        r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 32 * MiB})
        assert r.status_code == 201, r.text
    path = f"/v1/buffers/{r.json()['id']}/checkpoint"

    done = 0  # the attacker's checkpoints written so far
    refused = 0  # ... and refused, while another of the buffer was being written
    unexpected: list[str] = []  # any other answer (asserted once the threads are joined)
    lock = threading.Lock()
    stop = threading.Event()
    flooding = threading.Barrier(FLOOD + 1)

    def checkpoint_forever() -> None:
        nonlocal done, refused
        with daemon.client(evil) as c:
            flooding.wait()
            while not stop.is_set():
                try:
                    r = c.post(path, timeout=300)
                except httpx.HTTPError:
                    continue
                with lock:
                    if r.status_code == 200:
                        done += 1
                    elif r.status_code == 409 and "is in progress" in r.json()["detail"]:
                        refused += 1  # not a wait for the buffer's lock on a thread: at once
                    else:
                        unexpected.append(f"{r.status_code} {r.text}")

    threads = [threading.Thread(target=checkpoint_forever) for _ in range(FLOOD)]
    for t in threads:
        t.start()
    try:
        flooding.wait()
        with daemon.client(good) as c:
            while True:  # until the flood has filled the threads: some are answered
                with lock:
                    if done >= 2:
                        break
                assert c.get("/v1/usage").status_code == 200
            with lock:
                before = done
            r = c.post("/v1/reserve", json={"size_bytes": 64 << 10})
            with lock:
                waited_for = done - before
        assert r.status_code == 201, r.text
        # Fair service: the bystander's reserve waits for the checkpoints in progress at
        # most, not for the attacker's queue.
        assert waited_for <= 4, f"the bystander's reserve waited for {waited_for} checkpoints"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert unexpected == []
    assert refused > 0  # the flood met the one checkpoint in progress
    assert daemon.admin.delete(f"/v1/pools/{pool}", params={"drain": "true"}).status_code == 204
    after_attack(daemon)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a spill directory that fills up."""
    where = tmp_path / "tiny"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_checkpoint_into_a_full_spill_dir_is_507_and_leaves_nothing(
    daemon: Daemon, tiny_fs: Path
) -> None:
    spill = tiny_fs / "spill"
    pool = persistent_pool(daemon, spill, 16 * MiB)
    _, key = daemon.tenant("spiller", 16 * MiB)
    with daemon.client(key) as c:
        big = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 4 * MiB}).json()["id"]
        small = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 256 << 10}).json()["id"]
        for _ in range(3):  # more than the filesystem holds: a clear 507, every time
            r = c.post(f"/v1/buffers/{big}/checkpoint")
            assert r.status_code == 507, r.text
            assert r.json()["type"].endswith("resource-limit"), r.text
            assert str(spill) in r.json()["detail"]
            assert os.listdir(spill) == []  # no partial file keeps the filesystem full
        assert c.get(f"/v1/buffers/{big}").json()["checksum"] is None  # nothing recorded
        # So another buffer of the pool still checkpoints there.
        r = c.post(f"/v1/buffers/{small}/checkpoint")
        assert r.status_code == 200, r.text
        assert len(os.listdir(spill)) == 1
    r = daemon.admin.delete(f"/v1/pools/{pool}", params={"drain": "true"})
    assert r.status_code == 204, r.text
    assert os.listdir(spill) == []
    after_attack(daemon)


@pytest.mark.parametrize("kind", ["tenants", "pools"])
def test_a_name_that_is_another_ones_id_is_refused(daemon: Daemon, kind: str) -> None:
    if kind == "tenants":
        victim, _ = daemon.tenant("victim", MiB)
        body: dict[str, object] = {"name": victim, "quota_bytes": MiB}
    else:
        victim = daemon.admin.get("/v1/pools").json()[0]["id"]
        body = {"name": victim, "numa_node": 0, "capacity_bytes": MiB}
    r = daemon.admin.post(f"/v1/{kind}", json=body)
    created = r.json().get("id") if r.status_code == 201 else None
    try:
        # Another one's id is no name: `/v1/{kind}/{ref}` resolves ids first.
        assert r.status_code == 409, r.text
        assert "is the id of another" in r.json()["detail"], r.text
    finally:
        if created is not None:
            assert daemon.admin.delete(f"/v1/{kind}/{created}").status_code == 204
    assert daemon.admin.get(f"/v1/{kind}/{victim}").json()["id"] == victim
    after_attack(daemon)
