"""Persistent pools (checkpoints, restored with their checksum after a restart) against a real daemon.

A persistent buffer is a memfd like any other; ``checkpoint`` writes it to the
pool's spill dir with a SHA-256 in the ledger, and a restarted daemon loads it
back into a fresh memfd, checksum verified. A checkpoint that no longer
matches its checksum is never served: that buffer is released instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from maasd.client import Worker

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


def make_persistent_pool(d: Daemon, name: str = "durable", cap: int = 16 * MiB) -> dict:
    pool = d.pool(name, cap, persistence="persistent")
    assert pool["persistence"] == "persistent"
    return pool


def fill(d: Daemon, key: str, buffer_id: str, data: np.ndarray) -> None:
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        w.attach(buffer_id).array[:] = data


def contents(d: Daemon, key: str, buffer_id: str) -> np.ndarray:
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        return w.attach(buffer_id).array.copy()


def spill_files(d: Daemon, pool: str = "durable") -> list[Path]:
    return sorted((Path(d.data_dir) / "spill" / pool).iterdir())


def test_checkpoint_survives_sigkill_byte_identical(fresh_daemon) -> None:
    d = fresh_daemon.start()
    pool = make_persistent_pool(d)
    _, key = d.tenant("durable", 64 * MiB)
    user = d.client(key)
    r = user.post(
        "/v1/reserve",
        json={"size_bytes": 5 * MiB + 1, "persistence": "persistent", "ttl_s": 3600, "label": "kv"},
    )
    assert r.status_code == 201, r.text
    buf = r.json()
    assert buf["pool_id"] == pool["id"]
    assert buf["size_bytes"] == 5 * MiB + 4096
    data = np.random.default_rng(3).integers(0, 256, buf["size_bytes"], dtype=np.uint8)
    fill(d, key, buf["id"], data)
    ck = user.post(f"/v1/buffers/{buf['id']}/checkpoint")
    assert ck.status_code == 200, ck.text
    assert ck.json() == {
        "checksum": hashlib.sha256(data.tobytes()).hexdigest(),
        "bytes": buf["size_bytes"],
    }
    assert d.metric("maasd_checkpoints_total") == 1
    fill(d, key, buf["id"], np.zeros_like(data))  # after the checkpoint: lost on SIGKILL
    d.kill()

    d.start()
    got = user.get(f"/v1/buffers/{buf['id']}")
    assert got.status_code == 200, d.log()
    body = got.json()
    assert body["checksum"] == ck.json()["checksum"]
    assert (body["label"], body["size_bytes"], body["expires_at"]) == (
        "kv",
        buf["size_bytes"],
        buf["expires_at"],
    )
    assert np.array_equal(contents(d, key, buf["id"]), data)
    assert len(spill_files(d)) == 1
    # Releasing a persistent buffer removes its checkpoint too.
    assert user.delete(f"/v1/buffers/{buf['id']}").status_code == 204
    assert spill_files(d) == []
    user.close()


def test_a_corrupt_checkpoint_is_never_served(fresh_daemon) -> None:
    d = fresh_daemon.start()
    make_persistent_pool(d)
    _, key = d.tenant("corrupt", 64 * MiB)
    user = d.client(key)
    good = user.post("/v1/pools/durable/reserve", json={"size_bytes": MiB, "ttl_s": 3600}).json()
    bad = user.post("/v1/pools/durable/reserve", json={"size_bytes": MiB, "ttl_s": 3600}).json()
    for b, v in ((good, 1), (bad, 2)):
        fill(d, key, b["id"], np.full(MiB, v, dtype=np.uint8))
        assert user.post(f"/v1/buffers/{b['id']}/checkpoint").status_code == 200
    d.kill()
    victim = next(p for p in spill_files(d) if p.name.startswith(bad["id"]))
    with open(victim, "r+b") as f:  # flip one byte in the middle
        f.seek(MiB // 2)
        f.write(b"\x03")

    d.start()
    assert user.get(f"/v1/buffers/{bad['id']}").status_code == 404
    assert user.get(f"/v1/buffers/{good['id']}").status_code == 200
    assert np.all(contents(d, key, good["id"]) == 1)
    assert user.get("/v1/usage").json()["used_bytes"] == MiB
    pool = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == "durable")
    assert pool["used_bytes"] == MiB
    assert pool["used_bytes"] + pool["free_bytes"] == pool["capacity_bytes"]
    assert [p.name.split(".")[0] for p in spill_files(d)] == [good["id"]]
    assert "checksum mismatch" in d.log()
    user.close()


def test_never_checkpointed_buffer_does_not_survive_sigkill(fresh_daemon) -> None:
    d = fresh_daemon.start()
    make_persistent_pool(d)
    _, key = d.tenant("unsaved", 64 * MiB)
    user = d.client(key)
    buf = user.post("/v1/pools/durable/reserve", json={"size_bytes": MiB}).json()
    d.kill()
    d.start()
    assert user.get(f"/v1/buffers/{buf['id']}").status_code == 404
    assert user.get("/v1/usage").json() | {"tenant_id": None} == {
        "tenant_id": None,
        "quota_bytes": 64 * MiB,
        "used_bytes": 0,
        "buffers": 0,
        "max_buffers": 4096,
        "held_bytes": 0,
        "disk_quota_bytes": 4 * 64 * MiB,
        "disk_used_bytes": 0,
    }
    user.close()


def test_checkpoint_rules(fresh_daemon) -> None:
    d = fresh_daemon.start()
    make_persistent_pool(d)
    _, key = d.tenant("rules", 64 * MiB)
    _, other = d.tenant("other", 64 * MiB)
    user, stranger = d.client(key), d.client(other)
    vol = user.post("/v1/pools/node0/reserve", json={"size_bytes": MiB}).json()
    r = user.post(f"/v1/buffers/{vol['id']}/checkpoint")
    assert r.status_code == 409, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    pers = user.post("/v1/pools/durable/reserve", json={"size_bytes": MiB}).json()
    assert stranger.post(f"/v1/buffers/{pers['id']}/checkpoint").status_code == 404
    assert d.admin.post(f"/v1/buffers/{pers['id']}/checkpoint").status_code == 403
    # A persistence the pool does not have is a QoS no pool meets.
    r = user.post("/v1/pools/node0/reserve", json={"size_bytes": MiB, "persistence": "persistent"})
    assert r.status_code == 422, r.text
    # Repeated checkpoints keep one file, the newest.
    for v in (5, 6, 7):
        fill(d, key, pers["id"], np.full(MiB, v, dtype=np.uint8))
        assert user.post(f"/v1/buffers/{pers['id']}/checkpoint").status_code == 200
    files = spill_files(d)
    assert len(files) == 1
    assert files[0].read_bytes() == bytes([7]) * MiB
    # Deleting the pool with drain releases the buffer and its checkpoint.
    assert d.admin.delete("/v1/pools/durable").status_code == 409
    assert d.admin.delete("/v1/pools/durable?drain=true").status_code == 204
    assert user.get(f"/v1/buffers/{pers['id']}").status_code == 404
    assert not any((Path(d.data_dir) / "spill" / "durable").iterdir())
    user.close()
    stranger.close()
