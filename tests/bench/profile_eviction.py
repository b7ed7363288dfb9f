"""A put that evicts 16 entries, in process, as the entries held grow: O(victims), not O(entries).

Not run by CI (nothing asserted). From the project root::

    .venv/bin/python tests/bench/profile_eviction.py [--steps 1000,10000,40000] [--puts 15]
                                                    [--persistence persistent|volatile]

A real :class:`~maasd.core.Service` (SQLite ledger in a temp dir, no sockets) with one
pool of ``--persistence`` and one tenant allowed the whole region budget; it fills the
pool with committed 4 KiB entries up to each step, then times ``--puts`` puts of 64 KiB
with the tenant's quota lowered to its use, so that each evicts its 16 least recently
used entries (``bench_scale.py`` measures the same through a running daemon, where the
machine's load drifts between steps). It prints, per step, the fill time and the
median wall and thread CPU time of such a put. Steps above ~57,000 entries need
``vm.max_map_count`` raised (docs/operations.md, "Sizing a host").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from maasd.core import Service
from maasd.models import Principal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_service

KiB = 1024
SIZE = 4 * KiB
VICTIMS = 16


def fill(svc: Service, who: Principal, start: int, n: int) -> None:
    for i in range(start, start + n):
        h = svc.entries.put(who, f"k{i}", SIZE)
        os.close(h.fd)
        svc.entries.commit(who, h.buffer_id, owned=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1000,10000,40000")
    ap.add_argument("--puts", type=int, default=15)
    ap.add_argument("--persistence", choices=("persistent", "volatile"), default="persistent")
    args = ap.parse_args()
    svc = profile_service.service(
        True, 0, args.persistence, max_buffers_per_tenant=1_000_000, tenant_region_share=1.0
    )
    try:
        tenant = svc.tenants.create("t", 1 << 40)
        who = svc.auth.authenticate(tenant.api_key)
        held = key = 0  # entries held; the next key's number
        print(f"{'entries':>8} {'fill s':>8} {'put p50 ms':>11} {'cpu p50 ms':>11}")
        for step in (int(s) for s in args.steps.split(",")):
            t0 = time.perf_counter()
            fill(svc, who, key, step - held)
            key += step - held
            held, filled = step, time.perf_counter() - t0
            wall: list[float] = []
            cpu: list[float] = []
            for r in range(args.puts):
                svc.tenants.set_quota(tenant.id, svc.tenants.usage(who).used_bytes)
                w, c = time.perf_counter(), time.thread_time()
                h = svc.entries.put(who, f"big{step}-{r}", VICTIMS * SIZE)
                wall.append(time.perf_counter() - w)
                cpu.append(time.thread_time() - c)
                os.close(h.fd)
                svc.buffers.release(who, h.buffer_id)
                svc.tenants.set_quota(tenant.id, 1 << 40)
                fill(svc, who, key, VICTIMS)  # back to the step's count
                key += VICTIMS
            print(
                f"{step:>8} {filled:>8.1f} {statistics.median(wall) * 1e3:>11.2f} "
                f"{statistics.median(cpu) * 1e3:>11.2f}"
            )
    finally:
        svc.close()


if __name__ == "__main__":
    main()
