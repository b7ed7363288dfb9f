"""Crash safety (no accounting leak, checkpoints come back intact): SIGKILL the daemon under load, restart, check the ledger.

Each round: clients (threads, each with its own HTTP connection) reserve and
release volatile buffers while a persistent buffer is being re-checkpointed;
the daemon is killed with SIGKILL at a random moment and started again. After
every restart:

* ledger = live buffers: the sizes of the buffers the admin sees, the tenants'
  ``used_bytes`` and the pools' ``used_bytes`` all add up to the same number,
  and every pool has ``used + free == capacity``;
* no volatile buffer survived;
* the persistent buffer checkpointed before the kill is back, byte-identical
  (read through a fresh worker mapping), with the same checksum; the buffer
  whose checkpoint may have been cut short holds exactly the bytes of one
  complete checkpoint, whose checksum is the ledger's;
* the in-process accounting did not leak: the whole free capacity of the
  volatile pool can be reserved in one buffer.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from maasd.client import Worker
from recovered import POOLS, ledger_totals, read_buffer, write_buffer
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20
ROUNDS = 4
CLIENTS = 6


class Churn:
    """Client threads reserving and releasing until the daemon dies (or ``stop``)."""

    def __init__(self, url: str, key: str, n: int) -> None:
        self.stop = threading.Event()
        self.granted = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(url, key, i), daemon=True) for i in range(n)
        ]

    def __enter__(self) -> Churn:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _run(self, url: str, key: str, seed: int) -> None:
        rnd = random.Random(seed)
        held: list[str] = []
        with httpx.Client(
            base_url=url, timeout=10.0, headers={"Authorization": f"Bearer {key}"}
        ) as c:
            while not self.stop.is_set():
                try:
                    if held and (len(held) > 3 or rnd.random() < 0.4):
                        r = c.delete(f"/v1/buffers/{held.pop(rnd.randrange(len(held)))}")
                        ok = r.status_code in (204, 404)
                    else:
                        r = c.post(
                            "/v1/pools/vol/reserve",
                            json={
                                "size_bytes": rnd.choice((4096, MiB, 3 * MiB + 5)),
                                "evictable": rnd.random() < 0.3,
                            },
                        )
                        ok = r.status_code in (201, 409, 507)
                        if r.status_code == 201:
                            held.append(r.json()["id"])
                            with self._lock:
                                self.granted += 1
                    if not ok:
                        with self._lock:
                            self.errors.append(f"{r.status_code} {r.text}")
                except httpx.TransportError:
                    return  # the daemon is gone


def checkpoint_hot(
    d: Daemon, key: str, hot_id: str, first: int, stop: threading.Event, fills: set[int]
) -> None:
    """Fill the hot buffer with one byte value after another, checkpointing each, until
    ``stop`` or the daemon dies; every value asked for is added to ``fills``."""
    fill = first
    try:
        with (
            Worker(d.socket_path, key, renew_interval_s=0) as w,
            httpx.Client(
                base_url=d.url, timeout=10.0, headers={"Authorization": f"Bearer {key}"}
            ) as c,
        ):
            m = w.attach(hot_id)
            while not stop.is_set():
                m.array[:] = fill
                fills.add(fill)  # before asking: the kill may land mid-checkpoint
                c.post(f"/v1/buffers/{hot_id}/checkpoint")
                fill = (fill + 1) % 256
    except Exception:
        return  # the daemon died under us


def assert_recovered(
    d: Daemon,
    user: httpx.Client,
    key: str,
    stable_id: str,
    hot_id: str,
    checksum: str,
    content: bytes,
    rnd_no: int,
) -> None:
    """After the restart: only persistent buffers survived, the ledger counts exactly
    them, and the stable buffer is byte-identical to its checkpoint."""
    used = ledger_totals(d)
    survivors = d.admin.get("/v1/buffers").json()
    assert {b["id"] for b in survivors} <= {stable_id, hot_id}
    assert all(b["persistence"] == "persistent" for b in survivors)
    assert used == sum(b["size_bytes"] for b in survivors)
    assert d.metric("maasd_pool_used_bytes", pool="vol") == 0

    # The stable buffer: byte-identical to its checkpoint, same checksum.
    got = user.get(f"/v1/buffers/{stable_id}")
    assert got.status_code == 200, f"round {rnd_no}: persistent buffer lost\n{d.log()}"
    assert got.json()["checksum"] == checksum
    assert read_buffer(d, key, stable_id) == content


@pytest.mark.timeout(120)
def test_sigkill_under_load_then_restart(fresh_daemon, tmp_path: Path) -> None:
    d = fresh_daemon
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(POOLS.format(vol=64 * MiB, pers=16 * MiB))
    d.env["MAASD_CONFIG"] = str(cfg)
    d.start()
    _, key = d.tenant("crash", 512 * MiB)
    user = d.client(key)
    rnd = random.Random(7)

    # The "stable" buffer is checkpointed once per round, before the load starts;
    # the "hot" one is re-checkpointed during the load, so the kill may cut one short.
    stable = user.post("/v1/pools/pers/reserve", json={"size_bytes": 2 * MiB, "ttl_s": 3600})
    hot = user.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
    assert stable.status_code == hot.status_code == 201, (stable.text, hot.text)
    stable_id, hot_id = stable.json()["id"], hot.json()["id"]
    hot_fills: set[int] = set()

    for rnd_no in range(ROUNDS):
        content = rnd.randbytes(2 * MiB)
        write_buffer(d, key, stable_id, content)
        ck = user.post(f"/v1/buffers/{stable_id}/checkpoint")
        assert ck.status_code == 200, ck.text
        checksum = ck.json()["checksum"]
        assert checksum == hashlib.sha256(content).hexdigest()
        assert ck.json()["bytes"] == 2 * MiB
        # Written after the checkpoint: must not come back after a SIGKILL.
        write_buffer(d, key, stable_id, b"\xff" * 4096 + content[4096:])

        stop_hot = threading.Event()

        hot_thread = threading.Thread(
            target=checkpoint_hot,
            args=(d, key, hot_id, rnd_no * 50 + 1, stop_hot, hot_fills),
            daemon=True,
        )
        with Churn(d.url, key, CLIENTS) as churn:
            hot_thread.start()
            wait_until(lambda: churn.granted > 0, timeout=60, message="load under way")
            time.sleep(rnd.uniform(0.2, 0.8))
            d.kill()
        stop_hot.set()
        hot_thread.join(10)
        assert churn.granted > 0, "the load never got going"
        assert not churn.errors, churn.errors[:5]

        d.start()
        assert_recovered(d, user, key, stable_id, hot_id, checksum, content, rnd_no)

        # The hot buffer: the bytes of one whole checkpoint, matching the ledger's checksum.
        hot_now = user.get(f"/v1/buffers/{hot_id}")
        if hot_now.status_code == 200:
            data = read_buffer(d, key, hot_id)
            assert hashlib.sha256(data).hexdigest() == hot_now.json()["checksum"]
            assert len(set(data)) == 1, "a torn checkpoint came back"
            assert data[0] in hot_fills, "a torn checkpoint came back"
        else:  # never checkpointed before the first kill: released, and not counted
            assert hot_now.status_code == 404, hot_now.text
            assert rnd_no == 0, hot_now.text
            hot = user.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
            assert hot.status_code == 201, hot.text
            hot_id = hot.json()["id"]

        # No leak in the daemon's own accounting: the whole volatile pool is reservable.
        vol = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == "vol")
        assert vol["free_bytes"] == vol["capacity_bytes"]
        whole = user.post("/v1/pools/vol/reserve", json={"size_bytes": vol["capacity_bytes"]})
        assert whole.status_code == 201, whole.text
        assert user.delete(f"/v1/buffers/{whole.json()['id']}").status_code == 204

    # Spill dir holds exactly the live checkpoints (no orphans, no temp files).
    spill = Path(d.data_dir) / "spill" / "pers"
    files = sorted(p.name for p in spill.iterdir())
    assert len(files) == 2, files
    assert all(f.endswith(".ckpt") for f in files), files
    assert {f.split(".")[0] for f in files} == {stable_id, hot_id}
    ledger_totals(d)
    assert d.stop() == 0
    user.close()


def save_entries(d: Daemon, key: str, prefix: str, n: int, size: int) -> list[str]:
    """Save ``n`` entries of ``size`` bytes into the volatile pool, as a KV save does (put,
    write, commit), looking each one up once (a use and a lease extension to write);
    every fourth is aborted instead. Returns the committed entries' keys."""
    committed = []
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        for i in range(n):
            m = w.put(f"{prefix}-{i}", size, pool="vol")
            m.array[:] = i % 251 + 1
            if i % 4 == 3:
                w.abort(m)
                continue
            w.commit(m)
            committed.append(f"{prefix}-{i}")
            hit = w.lookup([f"{prefix}-{i}"])
            assert hit is not None
            hit.close()
    return committed


@pytest.mark.timeout(120)
def test_sigkill_right_after_a_burst_of_volatile_saves(fresh_daemon, tmp_path: Path) -> None:
    """A volatile entry's ledger writes do not wait for the disk (docs/operations.md,
    "Crash safety"); a daemon killed right after a burst of them, or in the middle of
    one, comes back with the ledger equal to its memory: no volatile row, no bytes
    counted for them, the whole volatile pool reservable, and the persistent buffer
    checkpointed before the burst byte-identical."""
    d = fresh_daemon
    cfg = tmp_path / "maasd.toml"
    cfg.write_text(POOLS.format(vol=16 * MiB, pers=4 * MiB))
    d.env["MAASD_CONFIG"] = str(cfg)
    d.start()
    # A quota below what the burst saves: later puts evict the tenant's older entries.
    _, key = d.tenant("burst", 8 * MiB)
    user = d.client(key)
    other = d.client(d.tenant("other", 64 * MiB)[1])  # to reserve the whole pool
    kept = user.post("/v1/pools/pers/reserve", json={"size_bytes": MiB, "ttl_s": 3600})
    assert kept.status_code == 201, kept.text
    kept_id = kept.json()["id"]
    content = random.Random(3).randbytes(MiB)
    write_buffer(d, key, kept_id, content)
    ck = user.post(f"/v1/buffers/{kept_id}/checkpoint")
    assert ck.status_code == 200, ck.text

    for round_no in range(3):
        if round_no == 0:  # killed right after the burst's last commit
            assert len(save_entries(d, key, "r0", 40, MiB // 2)) == 30
            assert d.metric("maasd_evictions_total") > 0  # the quota made it evict
            d.kill()
        else:  # killed in the middle of one
            saver = threading.Thread(
                target=lambda n=round_no: _saves_until_killed(d, key, f"r{n}"), daemon=True
            )
            saver.start()
            time.sleep(random.Random(round_no).uniform(0.2, 0.8))
            d.kill()
            saver.join(10)
        d.start()
        used = ledger_totals(d)
        survivors = d.admin.get("/v1/buffers").json()
        assert [b["id"] for b in survivors] == [kept_id], survivors
        assert used == MiB
        assert d.metric("maasd_pool_used_bytes", pool="vol") == 0
        assert read_buffer(d, key, kept_id) == content
        with Worker(d.socket_path, key, renew_interval_s=0) as w:
            assert w.lookup(["r0-0", "r0-39", f"r{round_no}-1"]) is None
        vol = next(p for p in d.admin.get("/v1/pools").json() if p["name"] == "vol")
        assert vol["free_bytes"] == vol["capacity_bytes"]
        whole = other.post("/v1/pools/vol/reserve", json={"size_bytes": vol["capacity_bytes"]})
        assert whole.status_code == 201, whole.text
        assert other.delete(f"/v1/buffers/{whole.json()['id']}").status_code == 204
    assert d.stop() == 0
    user.close()
    other.close()


def _saves_until_killed(d: Daemon, key: str, prefix: str) -> None:
    try:
        save_entries(d, key, prefix, 10_000, MiB // 2)
    except Exception:
        return  # the daemon died under us
