"""Attacks on the REST gate's busy connections and on what a revocation leaves kept
(``maasd.api.server``: ``begin``, ``anonymous_share``, ``Gate.revoked``).

A tenant whose requests' bodies never finish holds each connection busy until the body
deadline, and opens the next as soon as one closes: without a bound of its own it
filled the whole cap (``http_max_connections``), and everyone else — other tenants, the
admin, ``/healthz`` — got 507 for as long as it went on. Now a caller has at most its
share of requests in progress (a quarter of the cap here, as for kept connections); its
request beyond it is answered 507 ``resource-limit`` unread and its connection closed.

Clients without a key did the same outside ``/v1``, where no key check counts a
request: asking the API page (large) on every connection and never reading it. Such
requests now count as one caller's, "anonymous", in the same share.

A daemon with a cap of 16 (a share of 4), raw sockets. No test asserts how fast
anything happened; deadlines are only waited for, with generous bounds.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from budgets import http_limits_env
from conftest import Daemon, small_rest_daemon
from rawhttp import answer, closed_by_peer, request
from rawhttp import survivors as rawhttp_survivors
from waiting import wait_until

MiB = 1 << 20
CAP = 16
SHARE = CAP // 4
#: Long enough that a flood's busy connections outlast what the tests ask meanwhile.
HEAD_S, BODY_S, SEND_S = 2.0, 10.0, 2.0
KEEPALIVE_S = 20.0
#: Far beyond any deadline here.
NEVER_S = 40.0
#: A reserve's body announced (under the 64 KiB limit) and never sent whole.
LENGTH = 60_000
RESERVE = b'{"size_bytes": 1048576}'


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with small_rest_daemon(
        tmp_path_factory.mktemp("gate-busy"),
        http_limits_env(CAP, HEAD_S, BODY_S, SEND_S, KEEPALIVE_S),
    ) as daemon:
        yield daemon


def connect(d: Daemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.port), timeout=NEVER_S)


def trickling(d: Daemon, key: str, length: int = LENGTH) -> socket.socket:
    """A connection whose reserve's head is whole and whose body has only begun."""
    s = connect(d)
    head = request("POST", "/v1/reserve", key, extra="Content-Type: application/json\r\n")
    s.sendall(head.replace(b"Content-Length: 0", f"Content-Length: {length}".encode()) + b"{")
    return s


def answered(s: socket.socket) -> bool:
    return bool(select.select([s], [], [], 0)[0])


def refused_and_closed(s: socket.socket) -> bool:
    """Whether ``s`` got the 507 ``resource-limit`` with ``Connection: close`` and was closed
    then; ``False`` if it was reset before any answer (shed at the cap: its head had not
    been read yet when a newer connection came, as for any anonymous idle connection)."""
    got = b""
    try:
        while chunk := s.recv(65536):  # to the end: the daemon closes it after the answer
            got += chunk
    except ConnectionResetError:
        if not got:
            return False
        raise
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 507 "), got
    assert b"\r\nconnection: close" in head.lower(), got
    assert b"/resource-limit" in body, got
    return True


def flood(d: Daemon, key: str, n: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """``n`` trickling connections of ``key``: the busy ones (unanswered) and the refused
    ones (answered 507, closed), once all but its share have been answered. The admin
    client's pooled connection may take a place meanwhile: at the cap, one of the
    flood's newest connections (its head not read yet) may be shed for it instead."""
    conns = [trickling(d, key) for _ in range(n)]
    wait_until(lambda: sum(map(answered, conns)) >= n - SHARE, NEVER_S, message="507s")
    refused = [s for s in conns if answered(s)]
    busy = [s for s in conns if s not in refused]
    shed = [s for s in refused if not refused_and_closed(s)]
    assert len(shed) <= max(0, n + 2 - CAP), len(shed)
    return busy, refused


def close_all(conns: list[socket.socket]) -> None:
    for s in conns:
        with contextlib.suppress(OSError):
            s.close()


def gauge_settles(d: Daemon) -> None:
    """Everything of the tests closed: the daemon holds at most the admin client's one."""
    wait_until(
        lambda: d.metric("maasd_http_connections") <= 2, NEVER_S, message="connections counted out"
    )


def share_free(d: Daemon, key: str) -> None:
    """The caller of ``key`` may have exactly its share of requests in progress again: no
    request gone is left counted in it."""
    busy, refused = flood(d, key, SHARE + 1)
    close_all(busy)
    assert (len(busy), len(refused)) == (SHARE, 1)


def others_served(d: Daemon, other: str) -> None:
    """Another tenant's reserve, the admin's list of tenants, an anonymous /healthz."""
    with d.client(other) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB})
        assert r.status_code == 201, r.text
        assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code in (200, 204)
    r = d.admin.get("/v1/tenants")
    assert r.status_code == 200, r.text
    assert httpx.get(f"{d.url}/healthz", timeout=10).status_code == 200


def test_a_tenant_trickling_the_whole_cap_holds_only_its_share_busy(d: Daemon) -> None:
    flooder = d.tenant("trickler", 256 * MiB)[1]
    other = d.tenant("bystander", 256 * MiB)[1]
    before = d.metric("maasd_http_connections_closed_total", reason="body_timeout")
    busy, refused = flood(d, flooder, CAP)
    try:
        assert (len(busy), len(refused)) == (SHARE, CAP - SHARE)
        s = connect(d)  # any other /v1 request of the flooder meanwhile
        s.sendall(request("GET", "/v1/usage", flooder))
        assert refused_and_closed(s)
        others_served(d, other)
        # ... while the flood's busy connections were still held (not at their deadline)
        assert not any(closed_by_peer(s) for s in busy)
        assert d.metric("maasd_http_connections_closed_total", reason="body_timeout") == before
    finally:
        close_all(busy)
    gauge_settles(d)
    share_free(d, flooder)  # the connections closed by their client were counted out
    gauge_settles(d)


def test_requests_ended_at_the_body_deadline_or_answered_leave_no_count(d: Daemon) -> None:
    key = d.tenant("ending", 256 * MiB)[1]
    busy, _ = flood(d, key, SHARE + 2)
    try:
        wait_until(lambda: all(closed_by_peer(s) for s in busy), NEVER_S, message="deadline")
    finally:
        close_all(busy)
    share_free(d, key)
    # requests answered: their connections stay open, idle, and hold no request
    body = RESERVE.ljust(200)
    conns = [trickling(d, key, len(body)) for _ in range(SHARE)]
    try:
        wait_until(lambda: not any(map(answered, conns)), NEVER_S)
        for s in conns:
            s.sendall(body[1:])
            status, text = answer(s)
            assert status == 201, text
        share_free(d, key)
        assert not any(closed_by_peer(s) for s in conns)  # kept alive all along
    finally:
        close_all(conns)
    gauge_settles(d)


def test_a_tenant_renewing_its_flood_at_once_locks_no_one_out(d: Daemon) -> None:
    """The flooder opens a new trickling connection as soon as one of its own is closed
    (refused, or at the body deadline), from as many threads as the cap. Everyone else
    is served meanwhile. (A new connection is anonymous until its head is read: in such
    a storm of connections it may be shed, or refused, before that — and a retry gets
    through. Before, every request was refused until the flooder stopped.)"""
    flooder = d.tenant("renewer", 256 * MiB)[1]
    other = d.tenant("neighbour", 256 * MiB)[1]
    stop = threading.Event()
    opened = [0]

    def renew() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                s = trickling(d, flooder)
                opened[0] += 1
                try:
                    while not stop.is_set() and not closed_by_peer(s, 0.2):
                        pass
                finally:
                    s.close()

    def reserve() -> int:
        with d.client(other) as c:
            return c.post("/v1/reserve", json={"size_bytes": MiB}).status_code

    asks: dict[str, tuple[Callable[[], int], int]] = {
        "a tenant's reserve": (reserve, 201),
        "the admin's list of tenants": (lambda: d.admin.get("/v1/tenants").status_code, 200),
        "/healthz": (lambda: httpx.get(f"{d.url}/healthz", timeout=10).status_code, 200),
    }
    seen: dict[str, list[int | str]] = {name: [] for name in asks}
    threads = [threading.Thread(target=renew, daemon=True) for _ in range(CAP)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: opened[0] >= 2 * CAP, NEVER_S, message="the flood renews itself")
        for _ in range(3):
            for name, (ask_once, ok) in asks.items():
                for _ in range(20):
                    try:
                        got: int | str = ask_once()
                    except httpx.TransportError as e:  # shed before its head was read
                        got = type(e).__name__
                    seen[name].append(got)
                    if got == ok:
                        break
                    assert got == 507 or isinstance(got, str), seen
                    time.sleep(0.1)
                else:
                    raise AssertionError(f"{name} locked out: {seen}")
    finally:
        stop.set()
        for t in threads:
            t.join(NEVER_S)
    gauge_settles(d)
    share_free(d, flooder)
    gauge_settles(d)


def ask(d: Daemon, method: str, path: str, key: str | None = None) -> socket.socket:
    """A new connection that sent one request and had it answered (left open, idle)."""
    s = connect(d)
    s.sendall(request(method, path, key))
    status, text = answer(s, head_only=method == "HEAD")
    assert status == 200, text
    return s


def survivors(d: Daemon, conns: list[socket.socket]) -> list[bool]:
    """:func:`rawhttp.survivors` on this module's daemon and limits."""
    return rawhttp_survivors(d.port, conns, CAP, SHARE, NEVER_S)


def test_connections_kept_with_a_key_revoked_since_are_shed_though_only_healthz_follows(
    d: Daemon,
) -> None:
    """The revoked key is never sent again (its client only asks /healthz): the revocation
    itself makes its connections anonymous. The other callers' connections are anonymous
    too until their next ``/v1`` request, which keeps them again."""
    tenant_id = d.tenant("revoked-quietly", 64 * MiB)[0]
    issued = d.admin.post(f"/v1/tenants/{tenant_id}/keys").json()
    bystander = d.tenant("kept-on", 64 * MiB)[1]
    gauge_settles(d)
    revoked = [ask(d, "GET", "/v1/usage", issued["api_key"]) for _ in range(SHARE)]
    other = [ask(d, "GET", "/v1/usage", bystander) for _ in range(SHARE)]
    try:
        r = d.admin.delete(f"/v1/tenants/{tenant_id}/keys/{issued['id']}")
        assert r.status_code == 204
        for s in revoked:
            s.sendall(request("GET", "/healthz"))
            assert answer(s)[0] == 200
        for s in other:
            s.sendall(request("GET", "/v1/usage", bystander))
            assert answer(s)[0] == 200
        assert survivors(d, revoked + other) == [False] * SHARE + [True] * SHARE
    finally:
        close_all(revoked + other)
    gauge_settles(d)


# -- requests outside /v1: the anonymous share ------------------------------------------

#: Pipelined on each hog's connection: far more answer than the socket buffers hold.
PIPELINED = 400
#: The send deadline of the anonymous-share daemon: longer than its tests take, so that
#: the connections held busy stay so meanwhile (nothing is timed against it).
LONG_SEND_S = 60.0


@pytest.fixture(scope="module")
def slow_send(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with small_rest_daemon(
        tmp_path_factory.mktemp("gate-anonymous"),
        http_limits_env(CAP, HEAD_S, BODY_S, LONG_SEND_S, KEEPALIVE_S),
    ) as daemon:
        yield daemon


def hog(d: Daemon) -> socket.socket:
    """An anonymous connection asking the API page (large) over and over, reading nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(NEVER_S)
    s.connect(("127.0.0.1", d.port))
    s.sendall(request("GET", "/schema/openapi.json") * PIPELINED)
    return s


def sockets(d: Daemon) -> int:
    """The daemon's open sockets (its REST connections among them)."""
    assert d.proc is not None
    fd = f"/proc/{d.proc.pid}/fd"
    count = 0
    for n in os.listdir(fd):
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            count += os.readlink(f"{fd}/{n}").startswith("socket:")
    return count


def docs_status(d: Daemon) -> tuple[int, str]:
    """``GET /docs`` (a small answer, outside /v1) on a new connection: status and detail."""
    try:
        r = httpx.get(f"{d.url}/docs", timeout=10)
    except httpx.TransportError as e:  # shed before its head was read
        return 0, type(e).__name__
    detail = r.json().get("detail", "") if r.status_code == 507 else ""
    return r.status_code, detail


def share_full(d: Daemon) -> bool:
    """Whether a request outside /v1 gets the 507 of the anonymous share (not the cap's)."""
    status, detail = docs_status(d)
    return status == 507 and "outside /v1" in detail


def test_the_api_page_is_large_enough_to_hold_a_connection_busy(slow_send: Daemon) -> None:
    """What the next test counts on: the pipelined answers are more than the daemon's
    send buffer can ever hold (``tcp_wmem``'s most) and the writer's high-water mark."""
    r = httpx.get(f"{slow_send.url}/schema/openapi.json", timeout=10)
    assert r.status_code == 200
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        most = int(f.read().split()[2])
    assert len(r.content) * PIPELINED > 2 * (most + 64 * 1024), len(r.content)


def test_anonymous_clients_not_reading_large_answers_hold_only_their_share_busy(
    slow_send: Daemon,
) -> None:
    """Anonymous clients ask ``/schema/openapi.json`` on every connection of the cap and
    never read the answers: at most the share of them stay busy, the others are refused
    (507, or closed at once when answers before the refused request lie unsent) and the
    daemon closes them. Meanwhile another anonymous request beyond the share gets the
    507, and a tenant's reserve, the admin's list of tenants and ``/healthz`` are served
    without one (a retry when a new connection was shed before its head was read, as
    any anonymous one). Before, the cap stayed busy and every newcomer got 507. Then the
    share's count is exact again: its size in hogs fills it, one fewer does not."""
    d = slow_send
    other = d.tenant("beside-the-hogs", 256 * MiB)[1]
    time.sleep(1.5)  # the admin client's pooled connection is closed (its 1 s expiry)
    base = sockets(d)
    hogs = [hog(d) for _ in range(CAP)]
    seen: dict[str, list[int | str]] = {}
    try:
        wait_until(lambda: share_full(d), NEVER_S, message="the anonymous share is full")
        for _ in range(3):
            for name, ask_once, ok in [
                ("reserve", lambda: reserve_status(d, other), 201),
                ("admin", lambda: d.admin.get("/v1/tenants").status_code, 200),
                ("/healthz", lambda: httpx.get(f"{d.url}/healthz", timeout=10).status_code, 200),
            ]:
                got = retried(ask_once, ok, seen.setdefault(name, []))
                assert got == ok, f"{name} locked out: {seen}"
        # Nothing was refused for the cap: beyond the share the hogs' connections are
        # closed, or idle and shed for newcomers. (Before, the cap stayed busy: 507s,
        # until a kept connection was shed for a newcomer after a grace of refusals.)
        assert all(got != 507 for got in sum(seen.values(), [])), seen
        assert share_full(d)  # the hogs' share still busy all along
        # the hogs beyond it were closed by the daemon (or shed since, idle, for newcomers)
        wait_until(lambda: sockets(d) <= base + SHARE + 3, NEVER_S, message="the rest closed")
    finally:
        close_all(hogs)
    wait_until(lambda: sockets(d) <= base, NEVER_S, message="connections closed")
    # nothing is left counted: the share's places are all free again, and no more
    hogs = [hog(d) for _ in range(SHARE)]
    try:
        wait_until(lambda: share_full(d), NEVER_S, message="the share full again")
        close_all(hogs[:1])
        wait_until(lambda: docs_status(d)[0] == 200, NEVER_S, message="a place given back")
    finally:
        close_all(hogs)
    wait_until(lambda: sockets(d) <= base, NEVER_S, message="connections closed")


def reserve_status(d: Daemon, key: str) -> int:
    with d.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": MiB})
        if r.status_code == 201:
            assert c.delete(f"/v1/buffers/{r.json()['id']}").status_code in (200, 204)
        return r.status_code


def retried(ask_once: Callable[[], int], ok: int, seen: list[int | str]) -> int | str:
    """``ask_once`` until it answers ``ok`` (20 times at most); a 507 or a reset between."""
    got: int | str = "never asked"
    for _ in range(20):
        try:
            got = ask_once()
        except httpx.TransportError as e:  # shed before its head was read
            got = type(e).__name__
        seen.append(got)
        if got == ok:
            break
        assert got == 507 or isinstance(got, str), seen
        time.sleep(0.1)
    return got
