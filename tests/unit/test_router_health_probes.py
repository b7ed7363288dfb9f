"""An attached backend's ``/health`` probes, without llama-server: how a probe went (up,
hung: no answer in time, gone: refused, reset or not 200) and what the third miss in a
row is counted as — ``backend_hung`` or ``backend_gone`` — with the requests waiting
for the server ended as a 504 or a 502 (docs/llama-server.md, "What fails how")."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from maasd.router.backend import Backend, BackendGone, BackendHung, Health
from maasd.router.fleet import HUNG_PROBES, count_probe
from maasd.router.metrics import RouterMetrics


def _errors(m: RouterMetrics, kind: str) -> float:
    labels = {"backend": "0", "kind": kind}
    return m.registry.get_sample_value("maasd_router_errors_total", labels) or 0.0


def _closed_port() -> int:
    """A loopback port nothing listens on (connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _serve(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _answer(status: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    return handler


async def _never_answer(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
    await reader.read()  # until the client gives up


async def _reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.transport.abort()  # a server that dies with the request read


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (_answer(b"200 OK"), Health.UP),
        (_answer(b"503 Service Unavailable"), Health.GONE),  # loading: not what we sent to
        (_never_answer, Health.HUNG),  # takes the connection, answers nothing
        (_reset, Health.GONE),
        (None, Health.GONE),  # nothing listens: refused
    ],
    ids=["200", "503", "silent", "reset", "refused"],
)
def test_a_probe_tells_a_hung_server_from_a_gone_one(
    handler: Handler | None, expected: Health
) -> None:
    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if handler is None:
                url = f"http://127.0.0.1:{_closed_port()}"
            else:
                url = await stack.enter_async_context(_serve(handler))
            b = Backend(0, url, "/x")
            stack.push_async_callback(b.close)
            assert await b.health(timeout_s=0.5) is expected

    asyncio.run(main())


async def _waiting(b: Backend) -> asyncio.Task[None]:
    """A request's wait for ``b``'s answer, under way."""
    never = asyncio.Event()

    async def wait() -> None:
        async with b.until_hung():
            await never.wait()

    t = asyncio.create_task(wait())
    await asyncio.sleep(0.01)
    return t


@pytest.mark.parametrize(
    ("probes", "kind", "ended", "status"),
    [
        ((Health.HUNG,) * HUNG_PROBES, "backend_hung", BackendHung, 504),
        ((Health.GONE,) * HUNG_PROBES, "backend_gone", BackendGone, 502),
        # the third miss in a row says how it is now: killed after it hung, it is gone
        ((Health.HUNG, Health.HUNG, Health.GONE), "backend_gone", BackendGone, 502),
        ((Health.GONE, Health.GONE, Health.HUNG), "backend_hung", BackendHung, 504),
    ],
    ids=["hung", "gone", "hung-then-gone", "gone-then-hung"],
)
def test_the_third_miss_counts_a_hung_backend_apart_from_a_gone_one(
    probes: tuple[Health, ...], kind: str, ended: type[BackendHung], status: int
) -> None:
    """Refused or reset probes are ``backend_gone``, timed-out ones ``backend_hung``: one
    of the two, once, at the third miss in a row; a request still waiting is ended as a
    502 (gone) or a 504 (hung)."""
    other = "backend_gone" if kind == "backend_hung" else "backend_hung"

    async def main() -> None:
        m = RouterMetrics()
        b = Backend(0, "http://127.0.0.1:9", "/x")
        t = await _waiting(b)
        for i, health in enumerate(probes):
            assert _errors(m, kind) == 0, i
            assert count_probe(b, health, m) is False
        assert _errors(m, kind) == 1
        assert _errors(m, other) == 0
        with pytest.raises(ended) as exc:
            await t
        assert type(exc.value) is ended
        assert exc.value.status == status
        assert ("went away" if status == 502 else "stopped answering") in str(exc.value)
        count_probe(b, Health.GONE, m)  # still down: counted once, either way
        count_probe(b, Health.HUNG, m)
        assert (_errors(m, kind), _errors(m, other)) == (1, 0)
        await b.close()

    asyncio.run(main())


class _Probed(Backend):
    """A backend whose probes time out (after ``probe_s``) and are logged, as (what,
    index) with what "start" or "end", in the order they happen."""

    probe_s = 0.05
    log: list[tuple[str, int]]
    probing = 0  # its probes under way

    async def health(self, timeout_s: float = 5.0) -> Health:  # noqa: ARG002
        self.log.append(("start", self.index))
        self.probing += 1
        try:
            await asyncio.sleep(self.probe_s)
        finally:
            self.probing -= 1
            self.log.append(("end", self.index))
        return Health.HUNG


def test_attached_backends_are_probed_at_once_each_never_twice_at_once() -> None:
    """The watcher of attached backends: two hung ones are probed at once — each one's
    third probe begins before the other's ends, so both are judged in one judging
    period, not one after the other — while one backend's probes never overlap each
    other; closing the fleet in the middle of a probe ends every watcher."""
    from maasd.router.fleet import Fleet, FleetConfig

    async def main() -> None:
        m = RouterMetrics()
        fleet = Fleet(FleetConfig(), m)
        log: list[tuple[str, int]] = []
        backends = [_Probed(i, "http://127.0.0.1:9", f"/x{i}") for i in range(2)]
        for b in backends:
            b.log, b.alive = log, True
            fleet.backends.append(b)
            fleet._tasks.append(asyncio.create_task(fleet._watch_attached(b, every_s=0.001)))
        async with asyncio.timeout(30):
            while min(b.missed for b in backends) < HUNG_PROBES + 1:
                await asyncio.sleep(0.01)
        for b in backends:
            labels = {"backend": str(b.index), "kind": "backend_hung"}
            assert m.registry.get_sample_value("maasd_router_errors_total", labels) == 1
            assert not b.alive
        running = {0: 0, 1: 0}
        seen: dict[tuple[str, int], int] = {}
        third: dict[tuple[str, int], int] = {}  # where each one's third probe starts, ends
        for n, (what, i) in enumerate(log):
            running[i] += 1 if what == "start" else -1
            assert running[i] in (0, 1), f"backend {i} probed twice at once: {log}"
            seen[what, i] = seen.get((what, i), 0) + 1
            if seen[what, i] == HUNG_PROBES:
                third[what, i] = n
        for i, other in ((0, 1), (1, 0)):
            assert third["start", i] < third["end", other], f"one after the other: {log}"
        for b in backends:
            b.probe_s = 3600.0  # the next probes hang for good: closing must end them
        async with asyncio.timeout(30):
            while any(b.probing == 0 for b in backends):
                await asyncio.sleep(0.01)
            await fleet.close()
        assert all(t.done() for t in fleet._tasks)
        assert [b.probing for b in backends] == [0, 0]
        assert sorted(log[-2:]) == [("end", 0), ("end", 1)]

    asyncio.run(main())


class _BackWithBadProps(Backend):
    """A backend that answers ``/health`` again, but whose ``/props`` fails as an HTTP
    client error or an answer that is not JSON would (neither an OSError nor a timeout)."""

    probes = 0
    errors: tuple[Exception, ...] = ()

    async def health(self, timeout_s: float = 5.0) -> Health:  # noqa: ARG002
        self.probes += 1
        return Health.UP

    async def props(self) -> dict[str, object]:
        raise self.errors[self.probes % len(self.errors)]


def test_a_backend_that_comes_back_answering_badly_stays_watched() -> None:
    """Before, an ``httpx`` error or a ``ValueError`` from ``/props`` ended the backend's
    watcher task: it was never probed again, and closing the fleet raised that error."""
    import httpx

    from maasd.router.fleet import Fleet, FleetConfig

    async def main() -> None:
        fleet = Fleet(FleetConfig(), RouterMetrics())
        b = _BackWithBadProps(0, "http://127.0.0.1:9", "/x0")
        b.errors = (httpx.ReadError("reset"), ValueError("not JSON"))
        fleet.backends.append(b)
        task = asyncio.create_task(fleet._watch_attached(b, every_s=0.001))
        fleet._tasks.append(task)
        async with asyncio.timeout(30):
            while b.probes < 20:
                await asyncio.sleep(0.01)
        assert not task.done()
        assert not b.alive  # never admitted: nothing to say what it runs
        await fleet.close()
        assert task.cancelled()

    asyncio.run(main())
