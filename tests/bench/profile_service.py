"""A REST-style reserve + release and an entry's put + commit, in process (no sockets, no HTTP).

Not run by CI (nothing asserted). From the project root::

    .venv/bin/python tests/bench/profile_service.py [--pairs 600] [--entries 60]

A real :class:`~maasd.core.Service` (SQLite ledger in a temp dir): first ``--pairs``
``reserve`` + ``release`` of 1 MiB buffers in a pool without prefault (what
``bench_reserve.py --prefault off`` asks over REST), then ``--entries`` ``put_entry`` +
``commit_entry`` + ``release`` of 9.27 MiB entries in a pool with a warm stock of 128 MiB
(``bench_kv.py``'s save, 50 ms apart so that the warmer refills), then as many
``publish``-es of a 9.27 MiB memfd (the save's one round trip since). It prints the medians
of each call's wall time and of its thread's CPU time (``time.thread_time``: what
other load on a shared machine disturbs least). Run it against an older tree with
``PYTHONPATH=<export of it>`` from outside the checkout to compare.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from maasd.core import Service
from maasd.models import PoolSpec, ReserveSpec
from maasd.settings import Settings

MiB = 1 << 20
ENTRY = 9_720_000
WARM_UP = 10


def service(prefault: bool, warm: int, persistence: str = "volatile", **settings: Any) -> Service:
    """A started Service: one pool ``node0`` of 1 GiB (``persistence``: a spill dir of its
    own when persistent), ``settings`` over the rest."""
    spill = (
        {"spill_dir": tempfile.mkdtemp(prefix="maasd-spill-")}
        if persistence == "persistent"
        else {}
    )
    svc = Service(
        Settings(
            data_dir=tempfile.mkdtemp(prefix="maasd-profile-"),
            admin_key="profile-admin-key-0123456789abcdef",
            pools=[
                PoolSpec(
                    name="node0",
                    numa_node=0,
                    capacity_bytes=1 << 30,
                    prefault=prefault,
                    warm_bytes=warm,
                    persistence=persistence,  # type: ignore[arg-type]
                    **spill,  # type: ignore[arg-type]
                )
            ],
            node_name="profile",
            **settings,
        )
    )
    svc.start(reaper=False)
    return svc


def timed(out: dict[str, list[float]], name: str, fn: Callable[[], Any]) -> Any:
    w, c = time.perf_counter(), time.thread_time()
    result = fn()
    out.setdefault(f"{name} wall", []).append(time.perf_counter() - w)
    out.setdefault(f"{name} cpu", []).append(time.thread_time() - c)
    return result


def cycles(
    n: int, cycle: Callable[[int, dict[str, list[float]]], None], gap: float = 0.0
) -> dict[str, list[float]]:
    """``cycle(i, out)`` ``WARM_UP + n`` times, ``gap`` s apart; the warm-up's samples dropped."""
    out: dict[str, list[float]] = {}
    for i in range(WARM_UP + n):
        cycle(i, out)
        if i == WARM_UP - 1:
            out.clear()
        time.sleep(gap)
    return out


def pairs(n: int) -> dict[str, list[float]]:
    svc = service(prefault=False, warm=0)
    try:
        who = svc.auth.authenticate(svc.tenants.create("t", 1 << 40).api_key)
        spec = ReserveSpec(size_bytes=MiB, pool="node0", ttl_s=600)

        def pair(_i: int, out: dict[str, list[float]]) -> None:
            info = timed(out, "reserve", lambda: svc.reserves.reserve(who, spec))
            timed(out, "release", lambda: svc.buffers.release(who, info.id))

        return cycles(n, pair)
    finally:
        svc.close()


def entries(n: int) -> dict[str, list[float]]:
    svc = service(prefault=True, warm=128 * MiB)
    try:
        who = svc.auth.authenticate(svc.tenants.create("t", 1 << 40).api_key)
        time.sleep(1.5)  # the first stock

        def put_commit(i: int, out: dict[str, list[float]]) -> None:
            h = timed(out, "put_entry", lambda: svc.entries.put(who, f"k{i}", ENTRY))
            m = mmap.mmap(h.fd, h.size_bytes)
            m[:4096] = b"\x07" * 4096
            m.close()
            os.close(h.fd)
            timed(out, "commit_entry", lambda: svc.entries.commit(who, h.buffer_id, owned=True))
            svc.buffers.release(who, h.buffer_id)

        return cycles(n, put_commit, gap=0.05)
    finally:
        svc.close()


def publishes(n: int) -> dict[str, list[float]]:
    """``n`` publishes of a 9.27 MiB memfd (``KVStore.save``'s one round trip), each released."""
    svc = service(prefault=True, warm=128 * MiB)
    fd = os.memfd_create("profile-scratch", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, ENTRY)
        os.pwrite(fd, b"\x07" * ENTRY, 0)
        who = svc.auth.authenticate(svc.tenants.create("t", 1 << 40).api_key)
        time.sleep(1.5)  # the first stock

        def publish(i: int, out: dict[str, list[float]]) -> None:
            made = svc.publishes.publish
            info = timed(out, "publish_entry", lambda: made(who, f"k{i}", fd, ENTRY))
            svc.buffers.release(who, info.id)

        return cycles(n, publish, gap=0.05)
    finally:
        os.close(fd)
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=600)
    ap.add_argument("--entries", type=int, default=60)
    args = ap.parse_args()
    results = pairs(args.pairs)
    if args.entries:
        results.update(entries(args.entries))
        results.update(publishes(args.entries))
    print(f"{'call':<20} {'wall p50':>9} {'cpu p50':>9}  (ms)")
    for call in ("reserve", "release", "put_entry", "commit_entry", "publish_entry"):
        if f"{call} wall" not in results:  # --entries 0
            continue
        wall = statistics.median(results[f"{call} wall"]) * 1e3
        cpu = statistics.median(results[f"{call} cpu"]) * 1e3
        print(f"{call:<20} {wall:>9.3f} {cpu:>9.3f}")


if __name__ == "__main__":
    main()
