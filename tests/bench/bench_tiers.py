"""The tier policy on evidence: a prefix-cache trace replayed through DRAM + disk.

The trace (seeded, reproducible) mixes what a prompt cache of an inference host sees:

* one shared system prompt, looked up by most requests;
* documents (RAG / long contexts) with Zipf popularity;
* multi-turn chats that end: each turn looks up the previous turn's state, then puts
  the longer one (a new key; the old one is never looked up again once the next exists);
* a scan of one-off prompts (each key seen once).

DRAM holds a quarter of the reusable working set (the bytes of every key used more
than once) and DRAM + disk half of it. Each policy is replayed on the same trace:

    lru        DRAM LRU; every DRAM victim written to disk; disk LRU; a promotion moves
               the entry off the disk
    lru+s3     DRAM LRU (the ledger's order, as the daemon has it); a victim written to
               disk only if maasd.disk.policy.Admission says it is worth it (used again,
               or a ghost); disk S3-FIFO
    s3+s3      the same with S3-FIFO in DRAM too
    …/k        a promotion leaves the copy on disk (its next demotion writes nothing),
               and disk hits count as uses for the disk's own policy
    lru+s3/kA  DRAM LRU, the admission filter, disk S3-FIFO, copies kept — what the
               daemon runs

Reported per policy: hit ratio per tier, bytes written to disk per disk hit, and the
mean restore cost of a lookup under a cost model (DRAM 0.1 ms, disk read 2.5 GB/s +
0.2 ms, recompute 300 ms per MiB of state — the Gemma package model's 9.27 MiB takes
2–7 s here).

Then one restore measured for real (``--restore-mib``, the Gemma state's 9.27 MiB by
default), in one run: from the disk tier (maasd.disk.store: read the file, AES-GCM
decrypt straight into a memfd mapping, tag checked) against its floor, a raw ``pread`` of
the same bytes into the same mapping, and a copy from DRAM (a memfd to memfd memmove).
The file's pages are dropped from the page cache before each read (``POSIX_FADV_DONTNEED``)
so both reads go to the device. Nothing is asserted.

With ``--gemma``, the whole restore against recompute, in one run, on the Gemma 3 270M
package model: a ~600-token prompt evaluated from nothing (recompute), its sequence state
sealed into a disk-tier file, then restored from it (read, decrypt into a memfd mapping,
``llama_state_seq_set_data`` from there) against the floor — a raw ``pread`` of the
same bytes plus the same ``set_data`` — with the page cache dropped before each read.

And with ``--churn``, a real daemon: the p50/p99 of tenant B's socket lookups (a 1 MiB
entry in a pool of its own, through ``maasd.client.Worker``) alone, then while tenant A
churns 1 MiB entries through a small pool with a disk tier (put, commit, one lookup:
each eviction is worth a write), in the same run.

    python tests/bench/bench_tiers.py [--requests 200000] [--seed 1] [--restore-mib 9.27]
                                      [--churn] [--lookups 3000] [--gemma [--threads 2]]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's Daemon

from maasd.disk.policy import Admission, Evicted, Lru, S3Fifo
from maasd.disk.store import NONCE, DiskDir

MIB = 1 << 20


@dataclass(frozen=True)
class Access:
    key: str
    size: int
    lookup: bool  # False: a put of a new state that no one looked up first


def trace(requests: int, seed: int, docs: int = 400, zipf_s: float = 1.1) -> Iterator[Access]:
    """The prefix trace (see the module docstring); ``requests`` lookups in all."""
    rng = random.Random(seed)
    cum, total = [], 0.0
    for i in range(docs):
        total += 1.0 / (i + 1) ** zipf_s
        cum.append(total)
    doc_sizes = [rng.randint(2, 12) * MIB for _ in range(docs)]
    chats: dict[int, int] = {}  # open chat -> its turn
    next_chat = scan = 0
    for _ in range(requests):
        r = rng.random()
        if r < 0.15:
            yield Access("system", 2 * MIB, True)
        elif r < 0.45:
            d = rng.choices(range(docs), cum_weights=cum)[0]
            yield Access(f"doc/{d}", doc_sizes[d], True)
        elif r < 0.80:
            if len(chats) < 64 and (not chats or rng.random() < 0.2):
                chats[next_chat] = 0
                next_chat += 1
            chat = rng.choice(list(chats))
            turn = chats[chat]
            if turn > 0:
                yield Access(f"chat/{chat}/{turn - 1}", (2 + turn) * MIB, True)
            yield Access(f"chat/{chat}/{turn}", (3 + turn) * MIB, False)
            chats[chat] = turn + 1
            if rng.random() < 0.2:  # the chat ends (5 turns on average)
                del chats[chat]
        else:
            scan += 1
            yield Access(f"scan/{scan}", rng.randint(1, 6) * MIB, True)


def working_set(accesses: list[Access]) -> int:
    """The bytes that are live, averaged over the trace: a key counts from its first use
    to its last, if it has more than one (what any cache could ever hit)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for i, a in enumerate(accesses):
        first.setdefault(a.key, i)
        last[a.key] = i
        sizes[a.key] = a.size
    live = sum(sizes[k] * (last[k] - first[k]) for k in sizes)
    return live // len(accesses)


@dataclass
class Replay:
    """One policy's tiers and what they did."""

    name: str
    dram: Lru | S3Fifo
    disk: Lru | S3Fifo
    admission: Admission | None  # None: every DRAM victim goes to disk
    #: a promotion leaves the disk copy in place (a later demotion of it writes nothing)
    keep: bool = False
    lookups: int = 0
    dram_hits: int = 0
    disk_hits: int = 0
    written: int = 0
    cost_ms: float = 0.0
    drops: Counter[str] = field(default_factory=Counter)

    def run(self, accesses: list[Access]) -> None:
        for a in accesses:
            if a.lookup:
                self.lookup(a.key, a.size)
            else:
                self.place(a.key, a.size)

    def lookup(self, key: str, size: int) -> None:
        self.lookups += 1
        if self.dram.hit(key):
            self.dram_hits += 1
            self.cost_ms += 0.1
            if self.admission is not None:
                self.admission.hit(key)
            return
        if self.disk.hit(key):
            if not self.keep:
                self.disk.remove(key)  # promoted: it leaves the disk
            self.disk_hits += 1
            self.cost_ms += 0.2 + size / 2.5e6
            self.place(key, size, used=True)
            return
        self.cost_ms += 300.0 * size / MIB  # recomputed, then put
        self.place(key, size)

    def place(self, key: Hashable, size: int, *, used: bool = False) -> None:
        if self.admission is not None and used:
            self.admission.hit(key)
        for victim in self.dram.insert(key, size):
            self.demote(victim)

    def demote(self, victim: Evicted) -> None:
        if victim.key in self.disk:  # its copy is there still: nothing to write
            if self.admission is not None:
                self.admission.evicted(victim.key)
            return
        if self.admission is not None and not self.admission.evicted(victim.key):
            self.drops["cold"] += 1
            return
        self.written += victim.size
        dropped = self.disk.insert(victim.key, victim.size)
        self.drops["disk_full"] += len(dropped)

    def report(self) -> str:
        hits = self.dram_hits + self.disk_hits
        per_hit = self.written / self.disk_hits / MIB if self.disk_hits else float("inf")
        return (
            f"{self.name:<8} hit {hits / self.lookups:6.1%}  "
            f"(DRAM {self.dram_hits / self.lookups:6.1%}, disk {self.disk_hits / self.lookups:6.1%})  "
            f"written {self.written / MIB / 1024:8.1f} GiB  {per_hit:6.2f} MiB/disk hit  "
            f"mean restore {self.cost_ms / self.lookups:7.1f} ms"
        )


def restore(size: int, repeat: int) -> None:
    """A disk-tier restore against a raw pread of the same bytes and a DRAM copy."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as where:
        disk = DiskDir(where)
        disk.open()
        data = os.urandom(size)
        sealed, blob = disk.seal("t", "k", memoryview(data))
        disk.write(sealed, blob)
        path = os.path.join(where, sealed.name)
        src = os.memfd_create("bench-src")
        dst = os.memfd_create("bench-dst")
        os.ftruncate(src, size)
        os.ftruncate(dst, size)
        with mmap.mmap(src, size) as a, mmap.mmap(dst, size) as b:
            a[:] = data
            out = memoryview(b)

            def uncached() -> None:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

            def tier() -> None:
                disk.read_into(sealed, out)

            def floor() -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.preadv(fd, [out], NONCE)
                finally:
                    os.close(fd)

            times: dict[str, list[float]] = {"tier": [], "floor": [], "dram": []}
            for _ in range(repeat):
                for name, fn in (("tier", tier), ("floor", floor)):
                    uncached()
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                b[:] = a
                times["dram"].append(time.perf_counter() - t0)
            assert bytes(out) == data
            out.release()
        os.close(src)
        os.close(dst)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"restore of {size / MIB:.2f} MiB (median of {repeat}): disk tier {ms['tier']:.2f} ms, "
        f"raw pread {ms['floor']:.2f} ms ({ms['tier'] / ms['floor']:.2f}x floor), "
        f"DRAM copy {ms['dram']:.2f} ms; recompute of the Gemma state 2000-7000 ms "
        f"(docs/performance.md): {2000 / ms['tier']:.0f}-{7000 / ms['tier']:.0f}x the disk tier"
    )


def gemma(repeat: int, threads: int) -> None:
    """Recompute vs a disk-tier restore vs its floor (pread + set_data), one run, Gemma."""
    import llama_cpp
    import numpy as np
    from timing import median_ms

    from llama_model import gemma_model
    from maasd.llama import LlamaSeqAdapter

    llm = llama_cpp.Llama(
        str(gemma_model()), n_ctx=1024, n_batch=1024, n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    text = " ".join(f"Section {i}: the daemon keeps prefixes in shared memory." for i in range(60))
    tokens = llm.tokenize(text.encode())[:600]
    seq = LlamaSeqAdapter(llm)

    def recompute() -> None:
        llm.reset()
        llm.eval(tokens)

    recompute_ms = median_ms(recompute, 3)
    size = seq.state_size(0)
    state = np.empty(size, np.uint8)
    seq.state_get(0, state, 0, size)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as where:
        disk = DiskDir(where)
        disk.open()
        sealed, blob = disk.seal("t", "k", memoryview(state.data))
        disk.write(sealed, blob)
        path = os.path.join(where, sealed.name)
        fd = os.memfd_create("bench-restore")
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:

            def restored() -> None:  # set_data straight from the mapping
                seq.state_set(0, np.frombuffer(m, np.uint8), 0, size)

            def uncached() -> None:
                f = os.open(path, os.O_RDONLY)
                os.posix_fadvise(f, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(f)

            def tier() -> None:
                uncached()
                disk.read_into(sealed, memoryview(m))
                restored()

            def floor() -> None:
                uncached()
                f = os.open(path, os.O_RDONLY)
                try:
                    os.preadv(f, [memoryview(m)], NONCE)
                finally:
                    os.close(f)
                restored()

            tier_ms, floor_ms = median_ms(tier, repeat), median_ms(floor, repeat)
        os.close(fd)
    print(
        f"gemma, {len(tokens)} tokens, state {size / MIB:.2f} MiB: recompute {recompute_ms:.0f} ms; "
        f"disk-tier restore (read + decrypt + set_data) {tier_ms:.2f} ms = "
        f"{recompute_ms / tier_ms:.0f}x faster than recompute; floor (pread + set_data) "
        f"{floor_ms:.2f} ms ({tier_ms / floor_ms:.2f}x floor)"
    )


def churn(lookups: int) -> None:
    """Tenant B's lookup latency alone, then under tenant A's churn through a disk tier."""
    import threading

    import numpy as np

    from conftest import Daemon
    from maasd.client import Worker

    def put(w: Worker, key: str, pool: str) -> None:
        m = w.put(key, MIB, pool=pool)
        m.array[:] = np.frombuffer(os.urandom(MIB), np.uint8)
        w.commit(m)

    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(Path(tmp) / "m", env={"MAASD_LOG_LEVEL": "warning"}).start()
        try:
            d.pool("churn", 16 * MIB, disk_dir=f"{tmp}/disk", disk_bytes=256 * MIB)
            d.pool("plain", 16 * MIB)  # the floor: the same churn, no disk tier
            d.pool("quiet", 8 * MIB)
            _, key_a = d.tenant("a", quota_bytes=64 * MIB)
            _, key_b = d.tenant("b", quota_bytes=64 * MIB)
            stop = threading.Event()

            def churner(pool: str) -> None:
                with Worker(d.socket_path, key_a) as wa:
                    i = 0
                    while not stop.is_set():
                        put(wa, f"{pool}{i}", pool)
                        hit = wa.lookup([f"{pool}{i}"])
                        if hit is not None:
                            hit.close()
                        i += 1

            def p(times: list[float], q: float) -> float:
                return sorted(times)[int(q * (len(times) - 1))] * 1e3

            with Worker(d.socket_path, key_b) as wb:
                put(wb, "mine", "quiet")
                runs: dict[str, list[float]] = {}
                for name in ("alone", "plain", "churn"):
                    if name != "alone":
                        stop.clear()
                        t = threading.Thread(target=churner, args=(name,))
                        t.start()
                        time.sleep(1.0)
                    times = []
                    for _ in range(lookups):
                        t0 = time.perf_counter()
                        hit = wb.lookup(["mine"])
                        times.append(time.perf_counter() - t0)
                        assert hit is not None
                        hit.close()
                    runs[name] = times
                    if name != "alone":
                        stop.set()
                        t.join()
            demoted = d.metric("maasd_disk_demotions_total", pool="churn")
            written = d.metric("maasd_disk_write_bytes_total", pool="churn")
        finally:
            d.close()
    a, f, c = runs["alone"], runs["plain"], runs["churn"]
    print(
        f"tenant B lookups ({lookups} each), p50/p99 ms: alone {p(a, 0.5):.3f}/{p(a, 0.99):.3f}; "
        f"A churning without a disk tier (floor) {p(f, 0.5):.3f}/{p(f, 0.99):.3f}; "
        f"A churning through a disk tier {p(c, 0.5):.3f}/{p(c, 0.99):.3f} "
        f"(p99 {p(c, 0.99) / p(f, 0.99):.2f}x the floor); A demoted {demoted:.0f} entries, "
        f"{written / MIB:.0f} MiB written"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--restore-mib", type=float, default=9.27)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--churn", action="store_true", help="measure with a real daemon")
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument("--gemma", action="store_true", help="restore vs recompute, Gemma")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.gemma:
        gemma(args.repeat, args.threads)
        return
    if args.churn:
        churn(args.lookups)
        return
    accesses = list(trace(args.requests, args.seed))
    ws = working_set(accesses)
    dram = disk = ws // 4  # working set = 4x DRAM = 2x (DRAM + disk)
    print(
        f"trace: {len(accesses)} accesses, {sum(a.lookup for a in accesses)} lookups; "
        f"reusable working set {ws / MIB / 1024:.1f} GiB; "
        f"DRAM {dram / MIB / 1024:.1f} GiB, disk {disk / MIB / 1024:.1f} GiB"
    )
    replays = [
        Replay("lru", Lru(dram), Lru(disk), None),
        Replay("lru+s3", Lru(dram), S3Fifo(disk), Admission()),
        Replay("s3+s3", S3Fifo(dram), S3Fifo(disk), Admission()),
        Replay("lru/k", Lru(dram), Lru(disk), None, keep=True),
        Replay("lru+s3/k", Lru(dram), S3Fifo(disk), None, keep=True),
        Replay("lru+s3/kA", Lru(dram), S3Fifo(disk), Admission(), keep=True),
    ]
    base = None
    for r in replays:
        r.run(accesses)
        print(r.report())
        ratio = (r.dram_hits + r.disk_hits) / r.lookups
        base = ratio if base is None else base
        print(f"{'':<8} hit ratio {ratio / base:.2f}x lru's; drops {dict(r.drops)}")
    restore(int(args.restore_mib * MIB), args.repeat)


if __name__ == "__main__":
    main()
