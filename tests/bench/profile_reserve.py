"""Where a REST reserve's time goes, part by part, in-process (not run by CI).

    .venv/bin/python tests/bench/profile_reserve.py [--requests 2000] [--size 1048576]

Builds the real app over a real :class:`~maasd.core.Service` (SQLite ledger in a
temp dir, one pool of 1 GiB, prefault off, then on) and drives ``POST
/v1/pools/node0/reserve`` + ``DELETE /v1/buffers/{id}`` through the ASGI
interface, without sockets. Each part of a reserve is timed by a wrapper around
the function that does it, and the ledger's commits and statements are counted
by SQLAlchemy events. The service calls run inline in this first pass (so that
the parts add up on one thread); the thread hop is timed on its own, with the
app's real runner. What the HTTP server (uvicorn, h11) adds is not in here:
``bench_reserve.py`` prints the daemon's and a bare litestar server's CPU per
request, which includes it.

Times are CPU microseconds of the one thread per reserve (``time.thread_time``,
mean over the run), so that other processes on a shared machine disturb them
little; a commit's wait for the disk is not in them. The thread hop is the
event loop's CPU for one round trip to a worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import litestar.response.base
from sqlalchemy import event

import maasd.api.strict
from maasd.api import auth as api_auth
from maasd.api.app import create_app
from maasd.core import Service
from maasd.models import PoolSpec
from maasd.settings import Settings

ADMIN = "profile-admin-key-0123456789abcdef"


class Clock:
    """Wall time per part, summed over the run."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.active = False

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - started

        return timed

    def wrap_async(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return await fn(*args, **kwargs)
            started = time.thread_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.spent[part] += time.thread_time() - started

        return timed


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


async def inline(_run: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``Run._in_thread`` for profiling: the service call on the event loop's own thread
    (every call of the app, the callers' shared ones too, goes through it)."""
    return fn(*args)


def build(data_dir: Path, prefault: bool) -> tuple[Service, str]:
    svc = Service(
        Settings(
            data_dir=str(data_dir),
            admin_key=ADMIN,
            pools=[PoolSpec(name="node0", numa_node=0, capacity_bytes=1 << 30, prefault=prefault)],
            node_name="profile",
        )
    )
    svc.start(reaper=False)
    return svc, svc.tenants.create("profile", 1 << 40).api_key


async def request(
    app: Any, method: str, path: str, key: str, body: bytes = b""
) -> tuple[int, bytes]:
    sent: list[Any] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Any:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [
        (b"host", b"maasd"),
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def instrument(svc: Service, clock: Clock) -> list[Any]:
    """Wrap the parts of a reserve; returns the patches to enter."""
    store = svc.store
    reserves = svc.reserves
    pool = svc.live.find("node0").pool
    return [
        patched(reserves, "reserve", clock.wrap("service", reserves.reserve)),
        patched(
            api_auth.ApiContext,
            "principal",
            clock.wrap_async("auth", api_auth.ApiContext.principal),
        ),
        patched(maasd.api.strict, "decode", clock.wrap("decode", maasd.api.strict.decode)),
        # on the repositories the core holds (maasd.core.app hands them out, not the store)
        patched(
            store.reserves,
            "begin_reserve",
            clock.wrap("ledger: admit (reserving)", store.reserves.begin_reserve),
        ),
        patched(store.buffers, "advance", clock.wrap("ledger: go live", store.buffers.advance)),
        patched(pool, "reserve", clock.wrap("region: create (+ prefault)", pool.reserve)),
        patched(
            reserves,
            "_check_placement",
            clock.wrap("region: placement check", reserves._check_placement),
        ),
        patched(
            litestar.response.base.Response,
            "render",
            clock.wrap("response encode", litestar.response.base.Response.render),
        ),
    ]


def count_ledger(svc: Service) -> dict[str, int]:
    counts = {"commits": 0, "statements": 0}
    engines = {id(e): e for e in (svc.store.db.write, svc.store.db.single, svc.store.db.read)}

    def on_commit(_conn: Any) -> None:
        counts["commits"] += 1

    def on_execute(*_args: Any) -> None:
        counts["statements"] += 1

    for engine in engines.values():
        event.listen(engine, "commit", on_commit)
        event.listen(engine, "after_cursor_execute", on_execute)
    return counts


async def profile(prefault: bool, n: int, size: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="maasd-profile-"))
    svc, key = build(tmp, prefault)
    app = create_app(svc)
    ctx = app.state[api_auth.STATE_KEY]
    real_run = ctx.run
    body = json.dumps({"size_bytes": size}).encode()
    clock = Clock()
    counts = count_ledger(svc)

    async def pair() -> None:
        clock.active = True
        started = time.thread_time()
        status, raw = await request(app, "POST", "/v1/pools/node0/reserve", key, body)
        clock.spent["total"] += time.thread_time() - started
        clock.active = False
        assert status == 201, raw
        status, raw = await request(app, "DELETE", f"/v1/buffers/{json.loads(raw)['id']}", key)
        assert status == 204, raw

    out: dict[str, float] = {}
    try:
        for _ in range(50):
            await pair()
        with _entered(instrument(svc, clock)), patched(api_auth.Run, "_in_thread", inline):
            for _ in range(n):
                await pair()
        out = {part: spent / n * 1e6 for part, spent in clock.spent.items()}
        out["commits per reserve+release"] = counts["commits"] / (n + 50)
        out["statements per reserve+release"] = counts["statements"] / (n + 50)
        hops = []
        for _ in range(n):
            started = time.thread_time()
            await real_run(lambda: None)
            hops.append(time.thread_time() - started)
        out["thread hop"] = statistics.median(hops) * 1e6
    finally:
        svc.close()
    return out


@contextmanager
def _entered(managers: list[Any]) -> Iterator[None]:
    if not managers:
        yield
        return
    with managers[0], _entered(managers[1:]):
        yield


def reserve_counts(prefault: bool, size: int) -> tuple[int, int]:
    """Commits and statements of one reserve alone (and of its release)."""
    tmp = Path(tempfile.mkdtemp(prefix="maasd-profile-"))
    svc, key = build(tmp, prefault)
    app = create_app(svc)
    counts = count_ledger(svc)
    try:

        async def one() -> tuple[int, int, int, int]:
            await request(app, "POST", "/v1/pools/node0/reserve", key, b'{"size_bytes": 4096}')
            c0, s0 = counts["commits"], counts["statements"]
            status, raw = await request(
                app,
                "POST",
                "/v1/pools/node0/reserve",
                key,
                json.dumps({"size_bytes": size}).encode(),
            )
            c1, s1 = counts["commits"], counts["statements"]
            await request(app, "DELETE", f"/v1/buffers/{json.loads(raw)['id']}", key)
            return c1 - c0, s1 - s0, counts["commits"] - c1, counts["statements"] - s1

        rc, rs, lc, ls = asyncio.run(one())
    finally:
        svc.close()
    return rc, rs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--size", type=int, default=1 << 20)
    args = ap.parse_args()
    results = {pf: asyncio.run(profile(pf, args.requests, args.size)) for pf in (False, True)}
    commits, statements = reserve_counts(False, args.size)
    service_parts = [
        "ledger: admit (reserving)",
        "region: create (+ prefault)",
        "region: placement check",
        "ledger: go live",
    ]
    edge_parts = ["auth", "decode", "response encode"]
    derived: dict[str, Callable[[dict[str, float]], float]] = {
        "service: the rest": lambda r: r["service"] - sum(r.get(p, 0.0) for p in service_parts),
        "framework: routing, hook, DI, response": lambda r: (
            r["total"] - r["service"] - sum(r.get(p, 0.0) for p in edge_parts)
        ),
        "total (app, service inline)": lambda r: r["total"],
    }
    print(f"one REST reserve of {args.size} B: CPU µs (in-process, {args.requests} requests)")
    print(f"{'part':<40} {'prefault off':>12} {'prefault on':>12}")
    rows = [*edge_parts[:2], *service_parts, *list(derived)[:1], edge_parts[2], *list(derived)[1:]]
    for part in rows:
        row = [
            derived[part](results[pf]) if part in derived else results[pf].get(part, 0.0)
            for pf in (False, True)
        ]
        print(f"{part:<40} {row[0]:>12.0f} {row[1]:>12.0f}")
    hops = [results[pf]["thread hop"] for pf in (False, True)]
    print(f"{'thread hop (event loop side)':<40} {hops[0]:>12.0f} {hops[1]:>12.0f}")
    print(f"ledger per reserve: {commits} commits, {statements} statements")
    for pf in (False, True):
        r = results[pf]
        print(
            f"prefault {'on ' if pf else 'off'}: {r['commits per reserve+release']:.2f} commits and "
            f"{r['statements per reserve+release']:.1f} statements per reserve+release"
        )


if __name__ == "__main__":
    main()
