"""A REST reserve + release pair in process (ASGI, no sockets, no HTTP parser), beside the floor.

Not run by CI (nothing asserted). From the project root::

    .venv/bin/python tests/bench/profile_rest.py [--pairs 1500] [--profile]

Both apps are driven by one ``httpx.AsyncClient`` over ``httpx.ASGITransport`` on one
event loop: the floor is ``bench_reserve.py``'s bare litestar POST + DELETE, maasd's
app (:func:`maasd.api.app.create_app`) runs on a real :class:`~maasd.core.Service`
(SQLite ledger in a temp dir, a pool without prefault: ``bench_reserve.py --prefault
off``). It prints, per pair, the wall time and the CPU time of the event loop's
thread — the client's share included, the same in both — so the difference is what
the daemon's loop adds (routing, auth, the hand-over of each call to a service thread
and back, the response); the wall beyond the loop's CPU is the service threads' work
(in process: ``profile_service.py``) and the waits for them. ``--profile``: cProfile of
the loop's thread for maasd, by cumulative time (maasd, litestar, the hand-over).
What ``uvicorn``'s h11 parser costs, the same for both, is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
import types
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_reserve
import profile_service

from maasd.api.app import create_app


def floor_app() -> Any:
    """``bench_reserve.py``'s floor app (one definition of it)."""
    module = types.ModuleType("bench_floor")  # litestar reads its handlers' module
    sys.modules[module.__name__] = module
    exec(bench_reserve.FLOOR_APP, module.__dict__)  # the bench's own source
    return module.app


WARM_UP = 100


async def pairs(
    app: Any,
    key: str,
    reserve_url: str,
    release_url: str,
    body: dict[str, int],
    n: int,
    prof: cProfile.Profile | None = None,
) -> tuple[float, float]:
    """``n`` reserve + release pairs: (wall, loop thread CPU) per pair, in ms."""
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://bench",
        headers={"Authorization": f"Bearer {key}"},
    ) as c:

        async def pair() -> None:
            r = await c.post(reserve_url, json=body)
            assert r.status_code == 201, r.text
            r = await c.delete(f"{release_url}/{r.json()['id']}")
            assert r.status_code == 204, r.text

        for _ in range(WARM_UP):
            await pair()
        if prof is not None:
            prof.enable()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            await pair()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if prof is not None:
            prof.disable()
        return wall / n * 1e3, cpu / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1500)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    svc = profile_service.service(prefault=False, warm=0)
    try:
        key = svc.tenants.create("t", 1 << 40).api_key
        maasd_app = create_app(svc)
        mib = profile_service.MiB

        def maasd(prof: cProfile.Profile | None = None) -> tuple[float, float]:
            body = {"size_bytes": mib, "ttl_s": 600}
            reserve, release = "/v1/pools/node0/reserve", "/v1/buffers"
            return asyncio.run(pairs(maasd_app, key, reserve, release, body, args.pairs, prof))

        floor = pairs(floor_app(), key, "/floor", "/floor", {"size_bytes": mib}, args.pairs)
        rows = {"floor": asyncio.run(floor), "maasd": maasd()}
        print(f"{'per pair':<8} {'wall ms':>9} {'loop cpu ms':>12}")
        for name, (wall, cpu) in rows.items():
            print(f"{name:<8} {wall:>9.3f} {cpu:>12.3f}")
        if args.profile:
            prof = cProfile.Profile()
            maasd(prof)
            stats = pstats.Stats(prof).sort_stats("cumulative")
            stats.print_stats("maasd|litestar|concurrent/futures|asyncio/(base_events|events)", 40)
    finally:
        svc.close()


if __name__ == "__main__":
    main()
