"""Many live entries on one daemon: latency, cost per entry, eviction, restart.

    .venv/bin/python tests/bench/bench_scale.py [--steps 1000,10000] [--ops 300]
    .venv/bin/python tests/bench/bench_scale.py --steps 1000,10000,100000 --raise-limits

Starts a throw-away ``maasd serve`` (temp data dir, SQLite, free port) with one
tenant allowed the whole region budget (``tenant_region_share`` 1.0, its
``max_buffers`` above the largest step) and a persistent pool of 4 KiB entries,
then fills it with committed 4 KiB entries up to each step and measures there:

* put + commit (Worker.entry: put, write 8 bytes, commit) and lookup (raw: the
  ``lookup`` frame, recvmsg, close the fd) — medians of ``--ops`` operations, and
  their ratio to the same at the first step (flat: ≈ 1);
* a put that evicts the tenant's least recently used entry (its ``max_buffers``
  lowered to the count): the eviction scan must stay O(victims), not O(entries);
* the daemon's fds, mappings and anonymous RSS per entry (from /proc);

and at the end the shutdown (every persistent entry checkpointed) and the restart
to ``/healthz`` 200 (every entry restored from its checkpoint).

The daemon's ``RLIMIT_NOFILE`` and the host's ``vm.max_map_count`` bound the entries
(docs/operations.md, "Sizing a host"). ``--raise-limits`` (root) starts the daemon
under ``prlimit`` with the ``LimitNOFILE`` ``maasd doctor`` names for the largest
step and raises ``vm.max_map_count`` for the run if it is lower (restored after).
CI never runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import Daemon
from maasd.client import Client, Worker
from maasd.core.limits import maps_needed, open_files_needed, settings_limits
from maasd.protocol import Found, Lookup
from maasd.settings import Settings
from sockpeer import Raw

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZE = 4 * KiB
MAP_COUNT = "/proc/sys/vm/max_map_count"


def proc_counts(pid: int) -> tuple[int, int, int]:
    """(fds, mappings, anonymous RSS bytes) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    rss = next(
        int(line.split()[1]) * KiB
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("RssAnon:")
    )
    return fds, maps, rss


@contextlib.contextmanager
def map_count_at_least(n: int) -> Iterator[None]:
    """``vm.max_map_count`` ≥ ``n`` for the block (root), the old value restored after."""
    old = int(Path(MAP_COUNT).read_text())
    if old >= n:
        yield
        return
    Path(MAP_COUNT).write_text(str(n))
    try:
        yield
    finally:
        Path(MAP_COUNT).write_text(str(old))


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def put_ms(w: Worker, prefix: str, start: int, n: int) -> float:
    times = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        with w.entry(f"{prefix}{i}", SIZE, pool="scale") as m:
            m.array[:8] = 1
        times.append(time.perf_counter() - t0)
    return median_ms(times)


def lookup_ms(raw: Raw, keys: list[str]) -> float:
    times = []
    for key in keys:
        t0 = time.perf_counter()
        reply, fds = raw.call(Lookup(keys=[key]))
        for fd in fds:
            os.close(fd)
        times.append(time.perf_counter() - t0)
        assert isinstance(reply, Found), reply
    return median_ms(times)


def fill(w: Worker, have: int, want: int) -> int:
    """Committed entries ``e<have>`` … ``e<want - 1>``; returns ``want``."""
    for i in range(have, want):
        with w.entry(f"e{i}", SIZE, pool="scale") as m:
            m.array[:8] = 1
    return want


def table(d: Daemon, tenant_id: str, key: str, steps: list[int], ops: int, top: int) -> int:
    """Fill to each step and print its row; returns the tenant's live entries at the end."""
    print(
        f"{'entries':>8} {'put ms':>8} {'x':>5} {'lookup ms':>9} {'x':>5} "
        f"{'evicting put ms':>15} {'x':>5} {'fd/entry':>8} {'map/entry':>9} "
        f"{'RSS B/entry':>11} {'fill s':>7}"
    )
    assert d.proc is not None
    pid = d.proc.pid
    base = proc_counts(pid)
    first: tuple[float, float, float] | None = None
    have = total = 0  # e-keys made; live entries of the tenant
    with Client(d.url, d.admin_key) as admin_c, Worker(d.socket_path, key, renew_interval_s=0) as w:
        raw = Raw(d.socket_path, timeout=30)
        raw.hello(key)
        for step in steps:
            t0 = time.perf_counter()
            total += step - have
            have = fill(w, have, step)
            filled_s = time.perf_counter() - t0
            fds, maps, rss = proc_counts(pid)
            per = [(now - was) / total for now, was in zip((fds, maps, rss), base, strict=True)]
            put = put_ms(w, f"p{step}-", 0, ops)
            total += ops
            look = lookup_ms(raw, [f"e{(i * 7919) % step}" for i in range(ops)])
            admin_c.set_max_buffers(tenant_id, total)
            evict = put_ms(w, f"v{step}-", 0, ops)  # each evicts the least recently used
            admin_c.set_max_buffers(tenant_id, top + 1000)
            if first is None:
                first = (put, look, evict)
            print(
                f"{step:>8} {put:>8.3f} {put / first[0]:>5.2f} {look:>9.3f} "
                f"{look / first[1]:>5.2f} {evict:>15.3f} {evict / first[2]:>5.2f} "
                f"{per[0]:>8.3f} {per[1]:>9.3f} {per[2]:>11.0f} {filled_s:>7.1f}",
                flush=True,
            )
            # put back the e-keys the evictions took, so the next fill starts whole
            for i in range(step):
                reply, got = raw.call(Lookup(keys=[f"e{i}"]))
                for fd in got:
                    os.close(fd)
                if not isinstance(reply, Found):
                    with w.entry(f"e{i}", SIZE, pool="scale") as m:
                        m.array[:8] = 1
                    total += 1
        raw.close()
    return total


def run(steps: list[int], ops: int, raise_limits: bool) -> None:
    top = steps[-1] + 2 * ops + 64
    wrapper: list[str] = []
    settings = Settings(tenant_region_share=1.0)
    files = open_files_needed(settings_limits(settings, 0, None, postgres=False), top) or 0
    if raise_limits:
        wrapper = ["prlimit", f"--nofile={files}:{files}", "--"]
    with contextlib.ExitStack() as stack:
        if raise_limits:
            stack.enter_context(map_count_at_least(maps_needed(top)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="maasd-scale-")))
        d = Daemon(
            tmp / "d",
            env={
                "MAASD_TENANT_REGION_SHARE": "1.0",
                "MAASD_MAX_BUFFERS_PER_TENANT": str(top + 1000),
                "MAASD_LOG_LEVEL": "warning",
                "MAASD_REAPER_INTERVAL_S": "1",
            },
            wrapper=wrapper,
        )
        d.start()
        stack.callback(d.close)
        assert d.proc is not None
        d.pool("scale", 3 * top * SIZE + 64 * MiB, persistence="persistent")
        with Client(d.url, d.admin_key) as admin:
            tenant = admin.create_tenant("scale", 4 * top * SIZE + GiB)
        key = tenant.api_key
        print(
            f"LimitNOFILE {files if raise_limits else 'as inherited'}, vm.max_map_count "
            f"{Path(MAP_COUNT).read_text().strip()}; {SIZE} B entries; {ops} ops per cell"
        )
        total = table(d, tenant.id, key, steps, ops, top)
        t0 = time.perf_counter()
        d.stop(timeout=3600)
        stopped = time.perf_counter() - t0
        t0 = time.perf_counter()
        d.start(timeout=3600)
        ready = time.perf_counter() - t0
        r = httpx.get(f"{d.url}/v1/buffers?limit=1", headers={"Authorization": f"Bearer {key}"})
        print(
            f"restart with {total} persistent entries: shutdown "
            f"(checkpoint each) {stopped:.1f} s, start to /healthz 200 {ready:.1f} s "
            f"(listing answers {r.status_code})"
        )
        d.stop(timeout=3600)  # checkpoints every entry again: longer than close() waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1000,10000", help="entry counts, ascending")
    ap.add_argument("--ops", type=int, default=300, help="timed operations per cell")
    ap.add_argument(
        "--raise-limits",
        action="store_true",
        help="root: run the daemon under the LimitNOFILE and vm.max_map_count it needs",
    )
    args = ap.parse_args()
    steps = sorted(int(s) for s in args.steps.split(","))
    run(steps, args.ops, args.raise_limits)


if __name__ == "__main__":
    main()
