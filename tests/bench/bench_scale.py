"""Many live entries on one daemon: latency, cost per entry, eviction, restart.

    .venv/bin/python tests/bench/bench_scale.py [--steps 1000,10000] [--ops 300]
    sudo .venv/bin/python tests/bench/bench_scale.py --steps 1000,10000,100000 --raise-limits
    # where the daemon cannot park idle entries' fds (no CAP_CHECKPOINT_RESTORE) and root
    # may not raise RLIMIT_NOFILE (no CAP_SYS_RESOURCE): in the QEMU guest, real root
    # with every capability (docs/performance.md, "Many entries on one daemon")
    scripts/numa-guest --node-mem 3G --timeout 10800 -- \\
        .venv/bin/python tests/bench/bench_scale.py --steps 1000,10000,100000 --raise-limits

Starts a throw-away ``maasd serve`` (temp data dir, SQLite, free port) with one
tenant allowed the whole region budget (``tenant_region_share`` 1.0, its
``max_buffers`` above the largest step) and a persistent pool of 4 KiB entries,
then fills it with committed 4 KiB entries (``--fill-workers`` connections at once)
up to each step and measures there, p50 and p99 of ``--ops`` operations each, and
their ratio to the same at the first step (flat: ≈ 1):

* put + commit (``Worker.entry``: put, write 8 bytes, commit);
* lookup (raw: the ``lookup`` frame, recvmsg, close the fd) of entries spread over
  the whole set;
* each of those two also back to back with the same on a second daemon that holds
  the first step's entries (the floor): their ratio (× floor) is free of the load's
  drift between steps, which the ratio to the first step (× 1st) is not;
* a put that evicts the tenant's least recently used entry (its ``max_buffers``
  lowered to its count), and one that evicts 16 (its quota lowered to its use, the
  put 16 entries large): the eviction scan costs O(victims) — the same at every
  step, more for 16 victims than for 1 — not O(entries). The daemon's eviction
  counter says how many victims each kind took;
* the daemon's fds, mappings and anonymous RSS per entry (from /proc);

and at the end the shutdown (every persistent entry checkpointed) and the restart
to ``/healthz`` 200 (every entry restored from its checkpoint), then a lookup of a
sample of them.

The host's ``vm.max_map_count`` bounds the entries, and the daemon's ``RLIMIT_NOFILE``
too where idle entries keep their fd (docs/operations.md, "Sizing a host").
``--raise-limits`` (root) raises ``vm.max_map_count`` and ``fs.inotify.max_user_watches``
for the run if they are lower, and, only where entries keep their fd, starts the daemon
under ``prlimit`` with the ``LimitNOFILE`` ``maasd doctor`` names for the largest step
(``fs.nr_open`` raised first if it is lower); each restored after. CI never runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import Daemon
from maasd.client import Client, Worker
from maasd.client.errors import NotFound
from maasd.core.limits import maps_needed, open_files_needed, settings_limits
from maasd.protocol import Found, Lookup
from maasd.settings import Settings
from sockpeer import Raw

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZE = 4 * KiB
#: Victims of the put that evicts by quota.
MANY = 16
#: The entries' lease: longer than any run (nothing renews them).
TTL_S = 7 * 24 * 3600
MAP_COUNT = "/proc/sys/vm/max_map_count"
NR_OPEN = "/proc/sys/fs/nr_open"
INOTIFY_WATCHES = "/proc/sys/fs/inotify/max_user_watches"


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
def sysctl_at_least(path: str, n: int) -> Iterator[None]:
    """The sysctl at ``path`` ≥ ``n`` for the block (root), the old value restored after."""
    old = int(Path(path).read_text())
    if old >= n:
        yield
        return
    Path(path).write_text(str(n))
    try:
        yield
    finally:
        Path(path).write_text(str(old))


def pct(times: list[float], q: float) -> float:
    """The ``q`` quantile of ``times`` (seconds), in milliseconds (nearest rank)."""
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


@dataclass
class Cell:
    """p50 and p99 of one kind of operation at one step, in ms."""

    p50: float
    p99: float

    @classmethod
    def of(cls, times: list[float]) -> Cell:
        return cls(pct(times, 0.5), pct(times, 0.99))


@dataclass
class Run:
    """What the bench has made so far, and the figures of the first step (the floor)."""

    d: Daemon
    tenant_id: str
    key: str
    top: int
    live: int = 0  # the tenant's live entries
    made: int = 0  # e-keys made: e0 … e<made - 1>
    evicted: int = 0  # entries evicted so far (the oldest e-keys, mostly)
    looked_up: int = 0
    first: dict[str, Cell] = field(default_factory=dict)


@dataclass
class Floor:
    """A second daemon holding the first step's entries, measured back to back with the
    big one: the ratio to it is free of the load's drift between steps."""

    w: Worker
    raw: Raw
    keys: list[str]


def paired(big: Callable[[int], float], floor: Callable[[int], float], n: int):
    """``big(i)`` and ``floor(i)`` (each returns its time, or -1: not counted) back to back
    ``n`` times; their times."""
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        for fn, out in ((big, a), (floor, b)):
            t = fn(i)
            if t >= 0:
                out.append(t)
    return a, b


def put_one(w: Worker, key: str, size: int = SIZE) -> float:
    t0 = time.perf_counter()
    with w.entry(key, size, pool="scale") as m:
        m.array[:8] = 1
    return time.perf_counter() - t0


def lookup_one(raw: Raw, key: str) -> float:
    """One lookup's time; -1 for a miss."""
    t0 = time.perf_counter()
    reply, fds = raw.call(Lookup(keys=[key]))
    for fd in fds:
        os.close(fd)
    return time.perf_counter() - t0 if isinstance(reply, Found) else -1.0


def puts(w: Worker, prefix: str, n: int, size: int = SIZE, made: list[str] | None = None):
    """Times of ``n`` put + commit (the ids of the entries go to ``made``)."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        m = w.put(f"{prefix}{i}", size, pool="scale")
        m.array[:8] = 1
        entry = w.commit(m)
        times.append(time.perf_counter() - t0)
        if made is not None:
            made.append(entry.id)
    return times


def lookups(raw: Raw, keys: list[str]) -> tuple[list[float], int]:
    """Times of the lookups that hit, and how many missed."""
    times, missed = [], 0
    for key in keys:
        t0 = time.perf_counter()
        reply, fds = raw.call(Lookup(keys=[key]))
        for fd in fds:
            os.close(fd)
        if isinstance(reply, Found):
            times.append(time.perf_counter() - t0)
        else:
            missed += 1
    return times, missed


def fill_keys(socket_path: str, key: str, names: list[str], workers: int) -> float:
    """Commit an entry under each of ``names``, ``workers`` connections at once (round
    robin over them, so that creation follows their order); seconds."""
    errors: list[BaseException] = []

    def work(w_no: int) -> None:
        try:
            with Worker(socket_path, key, renew_interval_s=0, ttl_s=TTL_S, timeout=600) as w:
                for name in names[w_no::workers]:
                    with w.entry(name, SIZE, pool="scale") as m:
                        m.array[:8] = 1
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def fill(run: Run, want: int, workers: int) -> float:
    """Committed entries up to ``want`` live ones (:func:`fill_keys`); seconds."""
    start, n = run.made, want - run.live
    took = fill_keys(
        run.d.socket_path, run.key, [f"e{i}" for i in range(start, start + n)], workers
    )
    run.made, run.live = start + n, want
    return took


def evictions(d: Daemon) -> int:
    return int(d.metric("maasd_evictions_total"))


def measure(
    run: Run, w: Worker, raw: Raw, admin: Client, step: int, ops: int, floor: Floor
) -> dict[str, Cell]:
    """The cells of one step (the tenant at ``run.live`` entries)."""
    big, low = paired(
        lambda i: put_one(w, f"p{step}-{i}"), lambda i: put_one(floor.w, f"p{step}-{i}"), ops
    )
    cells = {"put": Cell.of(big), "put floor": Cell.of(low)}
    run.live += ops
    # spread over the e-keys still live: the evictions took the oldest, skipping at most
    # the ones looked up (which a use made younger)
    lo = min(run.evicted + run.looked_up + 512, run.made - ops)
    keys = [f"e{lo + (i * 7919) % (run.made - lo)}" for i in range(ops)]
    big, low = paired(
        lambda i: lookup_one(raw, keys[i]),
        lambda i: lookup_one(floor.raw, floor.keys[(i * 7919) % len(floor.keys)]),
        ops,
    )
    missed = ops - len(big)
    run.looked_up += ops
    cells["lookup"], cells["lookup floor"] = Cell.of(big), Cell.of(low)
    before = evictions(run.d)
    admin.set_max_buffers(run.tenant_id, run.live)
    cells["evict 1"] = Cell.of(puts(w, f"v{step}-", ops))  # each evicts 1
    admin.set_max_buffers(run.tenant_id, run.top + 1000)
    one = evictions(run.d) - before
    used = admin.tenant(run.tenant_id).used_bytes
    quota = admin.tenant(run.tenant_id).quota_bytes
    admin.set_quota(run.tenant_id, used)
    n_many, big = max(8, ops // 4), list[str]()
    cells[f"evict {MANY}"] = Cell.of(puts(w, f"m{step}-", n_many, MANY * SIZE, big))
    admin.set_quota(run.tenant_id, quota)
    many = evictions(run.d) - before - one
    with Client(run.d.url, run.key, timeout=600) as mine:  # not the next step's victims
        for buffer_id in big:
            # a later quota-evicting put may have taken an earlier one (the oldest left
            # once the small entries run short: a small step, or many ops)
            with contextlib.suppress(NotFound):
                mine.release(buffer_id)
    run.evicted += one + many
    run.live -= many
    print(
        f"  step {step}: {one} victims for {ops} count-evicting puts, {many} for {n_many} "
        f"quota-evicting puts of {MANY * SIZE} B; {missed} lookups missed",
        flush=True,
    )
    return cells


HEAD = ("put", "lookup", "evict 1", f"evict {MANY}")


#: The cells measured back to back with the floor daemon.
PAIRED = ("put", "lookup")


def row(step: int, cells: dict[str, Cell], first: dict[str, Cell], per: list[float]) -> str:
    parts = [f"| {step:,} "]
    for k in HEAD:
        c, f = cells[k], first[k]
        parts.append(f"| {c.p50:.3f} / {c.p99:.3f} | {c.p50 / f.p50:.2f} / {c.p99 / f.p99:.2f} ")
        if k in PAIRED:
            low = cells[f"{k} floor"]
            parts.append(f"| {c.p50 / low.p50:.2f} / {c.p99 / low.p99:.2f} ")
    parts.append(f"| {per[0]:.3f} | {per[1]:.3f} | {per[2] / 1000:.2f} KB |")
    return "".join(parts)


def connect(run: Run, stack: contextlib.ExitStack) -> tuple[Worker, Raw]:
    w = stack.enter_context(
        Worker(run.d.socket_path, run.key, renew_interval_s=0, ttl_s=TTL_S, timeout=600)
    )
    raw = Raw(run.d.socket_path, timeout=600)
    stack.callback(raw.close)
    raw.hello(run.key)
    return w, raw


def table(run: Run, low: Run, steps: list[int], ops: int, workers: int) -> None:
    """Fill to each step and print its row (``low``: the floor daemon's, filled to the
    first step)."""
    names = " | ".join(
        f"{k} p50 / p99 ms | × 1st" + (" | × floor" if k in PAIRED else "") for k in HEAD
    )
    print(f"| entries | {names} | fd / entry | map / entry | RSS / entry |")
    print("|---:" * (1 + 2 * len(HEAD) + len(PAIRED) + 3) + "|")
    assert run.d.proc is not None
    pid = run.d.proc.pid
    base = proc_counts(pid)
    fill(low, steps[0], workers)
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(Client(run.d.url, run.d.admin_key, timeout=600))
        w, raw = connect(run, stack)
        fw, fraw = connect(low, stack)
        floor = Floor(fw, fraw, [f"e{i}" for i in range(steps[0])])
        for step in steps:
            filled_s = fill(run, step, workers)
            now = proc_counts(pid)
            per = [(a - b) / run.live for a, b in zip(now, base, strict=True)]
            print(f"  step {step}: filled in {filled_s:.1f} s", flush=True)
            cells = measure(run, w, raw, admin, step, ops, floor)
            run.first = run.first or cells
            print(row(step, cells, run.first, per), flush=True)


def restart(run: Run) -> None:
    """Shut down (checkpointing every entry), start again, and look a sample up."""
    t0 = time.perf_counter()
    run.d.stop(timeout=4 * 3600)
    stopped = time.perf_counter() - t0
    t0 = time.perf_counter()
    run.d.start(timeout=4 * 3600)
    ready = time.perf_counter() - t0
    with Client(run.d.url, run.d.admin_key, timeout=600) as admin:
        held = admin.tenant(run.tenant_id).buffers
    raw = Raw(run.d.socket_path, timeout=600)
    raw.hello(run.key)
    lo = min(run.evicted + run.looked_up + 512, run.made - 100)
    sample = [f"e{lo + (i * 7919) % (run.made - lo)}" for i in range(100)]
    times, missed = lookups(raw, sample)
    raw.close()
    print(
        f"restart with {held:,} persistent entries: shutdown (a checkpoint each) "
        f"{stopped:.1f} s, start to /healthz 200 {ready:.1f} s; then {len(times)} of 100 "
        f"lookups hit, p50 {pct(times, 0.5) if times else 0:.3f} ms ({missed} missed)",
        flush=True,
    )


def start_daemon(data: Path, top: int, wrapper: list[str], stack: contextlib.ExitStack) -> Run:
    """A daemon with a persistent pool and one tenant allowed ``top`` entries."""
    d = Daemon(
        data,
        env={
            "MAASD_TENANT_REGION_SHARE": "1.0",
            "MAASD_MAX_BUFFERS_PER_TENANT": str(top + 1000),
            "MAASD_LOG_LEVEL": "warning",
            "MAASD_REAPER_INTERVAL_S": "1",
        },
        wrapper=wrapper,
    )
    d.start(timeout=3600)
    stack.callback(d.close)
    d.pool("scale", 3 * top * SIZE + 64 * MiB, persistence="persistent")
    with Client(d.url, d.admin_key) as admin:
        tenant = admin.create_tenant("scale", 4 * top * SIZE + GiB)
    return Run(d, tenant.id, tenant.api_key, top)


def run_bench(
    steps: list[int], ops: int, workers: int, raise_limits: bool, nofile: int, map_count: int
) -> None:
    top = steps[-1] + 4 * ops * len(steps) + 64
    settings = Settings(tenant_region_share=1.0)
    limits = settings_limits(settings, 0, None, postgres=False)
    # Idle entries that keep no fd (maasd.allocator.parking) need mappings only: the
    # inherited RLIMIT_NOFILE serves; else LimitNOFILE must hold every entry.
    need = 0 if limits.parks_entries else open_files_needed(limits, top) or 0
    files = max(nofile, need)
    prlimit = raise_limits and files > 0
    wrapper = ["prlimit", f"--nofile={files}:{files}", "--"] if prlimit else []
    with contextlib.ExitStack() as stack:
        if raise_limits:
            if prlimit:
                stack.enter_context(sysctl_at_least(NR_OPEN, files))
            stack.enter_context(sysctl_at_least(MAP_COUNT, max(map_count, maps_needed(top))))
            stack.enter_context(sysctl_at_least(INOTIFY_WATCHES, top + 8192))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="maasd-scale-")))
        run = start_daemon(tmp / "d", top, wrapper, stack)
        low = start_daemon(tmp / "floor", steps[0] + 4 * ops * len(steps) + 64, [], stack)
        d = run.d
        budget = int(d.metric("maasd_buffer_region_budget"))
        print(
            f"LimitNOFILE {files if prlimit else 'as inherited'}, vm.max_map_count "
            f"{Path(MAP_COUNT).read_text().strip()}: the daemon's region budget {budget:,} "
            f"(idle entries {'keep no fd' if limits.parks_entries else 'keep one fd each'}); "
            f"{os.cpu_count()} CPUs; {SIZE} B entries; {ops} ops per cell; filled by "
            f"{workers} connections",
            flush=True,
        )
        table(run, low, steps, ops, workers)
        low.d.close()
        restart(run)
        r = httpx.get(f"{d.url}/healthz", timeout=60)
        assert r.status_code == 200, r.text
        d.stop(timeout=4 * 3600)  # checkpoints every entry again: longer than close() waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1000,10000", help="entry counts, ascending")
    ap.add_argument("--ops", type=int, default=300, help="timed operations per cell")
    ap.add_argument("--fill-workers", type=int, default=4, help="connections filling at once")
    ap.add_argument(
        "--raise-limits",
        action="store_true",
        help="root: run the daemon under the LimitNOFILE and vm.max_map_count it needs",
    )
    ap.add_argument("--nofile", type=int, default=0, help="with --raise-limits: at least this")
    ap.add_argument(
        "--max-map-count", type=int, default=0, help="with --raise-limits: at least this"
    )
    args = ap.parse_args()
    steps = sorted(int(s) for s in args.steps.split(","))
    run_bench(
        steps, args.ops, args.fill_workers, args.raise_limits, args.nofile, args.max_map_count
    )


if __name__ == "__main__":
    main()
