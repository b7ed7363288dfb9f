"""Attacks on the REST connection gate's kept connections (``maasd.api.server``, ``trust``).

At the cap (``http_max_connections``) the gate sheds the oldest idle connection; a
connection that carried a ``/v1`` request with a valid key is its caller's ("kept", up
to a quarter of the cap per caller) and is shed only after every anonymous idle one,
once callers keep more than half the cap. These tests attack that through a real
daemon (cap 16: a share of 4 per caller, half the cap 8) with raw sockets.

Whether a connection is kept is observed, not read: a flood of anonymous idle
connections (twice the cap) sheds every idle connection that is not kept, oldest first,
and leaves the kept ones open (:func:`survivors`). No test asserts how fast anything
happened; deadlines are only waited for, with generous bounds.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from budgets import http_limits_env
from conftest import Daemon
from rawhttp import answer, closed_by_peer, request
from rawhttp import survivors as rawhttp_survivors
from waiting import wait_until

MiB = 1 << 20
CAP = 16
SHARE = CAP // 4
HEAD_S, BODY_S, SEND_S = 2.0, 3.0, 2.0
KEEPALIVE_S = 20.0
#: Far beyond any deadline here.
NEVER_S = 40.0
METRICS_KEY = "metrics-key-for-the-gate-attacks-0123456789"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(
        tmp_path_factory.mktemp("gate-attacks"),
        env={
            **http_limits_env(CAP, HEAD_S, BODY_S, SEND_S, KEEPALIVE_S),
            "MAASD_METRICS_KEY": METRICS_KEY,
        },
    )
    daemon.start()
    yield daemon
    daemon.close()


# -- raw HTTP ---------------------------------------------------------------------------


def connect(d: Daemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.port), timeout=NEVER_S)


def ask(
    d: Daemon, method: str, path: str, key: str | None = None, body: bytes = b""
) -> tuple[socket.socket, int]:
    """A new connection that sent one request and read its answer (left open, idle)."""
    s = connect(d)
    s.sendall(request(method, path, key, body))
    status, _ = answer(s, head_only=method == "HEAD")
    return s, status


def survivors(d: Daemon, conns: list[socket.socket]) -> list[bool]:
    """:func:`rawhttp.survivors` on this module's daemon and limits."""
    return rawhttp_survivors(d.port, conns, CAP, SHARE, NEVER_S)


def closed(d: Daemon, reason: str) -> float:
    return d.metric("maasd_http_connections_closed_total", reason=reason)


def closed_now(d: Daemon, reason: str) -> float:
    """:func:`closed`, or -1 while ``/metrics`` is refused: it is outside ``/v1``, counted
    in the anonymous share, which answers left unread on the API page may fill."""
    try:
        return closed(d, reason)
    except (httpx.TransportError, ValueError):  # (a 507 problem is no metrics text)
        return -1.0


def close_all(conns: list[socket.socket]) -> None:
    for s in conns:
        with contextlib.suppress(OSError):
            s.close()


def healthz(d: Daemon) -> int:
    return httpx.get(f"{d.url}/healthz", timeout=10).status_code


@pytest.fixture(scope="module")
def tenant(d: Daemon) -> tuple[str, str]:
    return d.tenant("gate", 256 * MiB)


def test_probe_a_valid_key_keeps_its_share(d: Daemon, tenant: tuple[str, str]) -> None:
    key = tenant[1]
    conns = [ask(d, "GET", "/v1/buffers", key)[0] for _ in range(SHARE + 2)]
    try:
        alive = survivors(d, conns)
    finally:
        close_all(conns)
    assert alive == [True] * SHARE + [False] * 2


def revoked_key(d: Daemon, tenant_id: str) -> str:
    r = d.admin.post(f"/v1/tenants/{tenant_id}/keys")
    assert r.status_code == 201, r.text
    info = r.json()
    assert d.admin.delete(f"/v1/tenants/{tenant_id}/keys/{info['id']}").status_code == 204
    return str(info["api_key"])


#: Requests that carry no valid key for their route: (method, path, whose key, status).
NOT_A_VALID_KEY = [
    ("GET", "/v1/buffers", "unknown", 401),
    ("GET", "/v1/buffers", "revoked", 401),
    ("GET", "/v1/buffers", None, 401),
    ("GET", "/v1/buffers", "metrics", 403),
    ("GET", "/metrics", "metrics", 200),
    ("GET", "/metrics", "admin", 200),
    ("GET", "/v1/tenants", "tenant", 403),
    ("GET", "/v1/usage", "admin", 403),
    ("GET", "/v1/buffers?bogus=1", "tenant", 400),
    ("GET", "/healthz", "tenant", 200),
    ("HEAD", "/healthz", "tenant", 200),
    ("GET", "/schema/openapi.json", "tenant", 200),
    ("GET", "/v1/no-such-route", "tenant", 404),
    ("DELETE", "/v1/usage", "tenant", 405),
    ("OPTIONS", "/v1/buffers", "unknown", 401),
]


@pytest.mark.parametrize(("method", "path", "whose", "status"), NOT_A_VALID_KEY)
def test_a_connection_is_not_kept_without_a_valid_key_for_its_route(
    d: Daemon, tenant: tuple[str, str], method: str, path: str, whose: str | None, status: int
) -> None:
    key = {
        "unknown": "maasd_" + "x" * 40,
        "revoked": revoked_key(d, tenant[0]) if whose == "revoked" else None,
        "metrics": METRICS_KEY,
        "admin": d.admin_key,
        "tenant": tenant[1],
        None: None,
    }[whose]
    conns = []
    try:
        for _ in range(SHARE):
            s, got = ask(d, method, path, key)
            assert got == status
            conns.append(s)
        assert survivors(d, conns) == [False] * SHARE
    finally:
        close_all(conns)


def share_intact(d: Daemon, key: str) -> None:
    """The caller of ``key`` keeps exactly its share of connections again (no count of
    a connection gone is left taking a place in it)."""
    conns = [ask(d, "GET", "/v1/usage", key)[0] for _ in range(SHARE + 1)]
    try:
        assert survivors(d, conns) == [True] * SHARE + [False]
    finally:
        close_all(conns)


def gauge_settles(d: Daemon) -> None:
    """Everything of the tests closed: the daemon holds at most the admin client's one."""
    wait_until(
        lambda: d.metric("maasd_http_connections") <= 2, NEVER_S, message="connections counted out"
    )


def rst(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def test_connections_closed_while_their_key_is_checked_leave_no_count(
    d: Daemon, tenant: tuple[str, str]
) -> None:
    """Unknown keys (each checked against the ledger, in a thread) and the tenant's own key
    after the cache was emptied by a revocation, on connections reset at once or a few
    milliseconds later (while the checks wait for their threads, or just after)."""
    rng = random.Random(13)
    for n in range(12):
        revoked_key(d, tenant[0])  # every key is checked against the ledger again
        conns = []
        for i in range(12):
            key = tenant[1] if i % 4 == 0 else f"maasd_unknown_{n}_{i}_" + "y" * 30
            s = connect(d)
            s.sendall(request("GET", "/v1/usage", key))
            conns.append(s)
        time.sleep(rng.uniform(0, 0.02))
        for s in conns:
            rst(s)
    gauge_settles(d)
    share_intact(d, tenant[1])


def test_kept_connections_closed_at_the_body_deadline_leave_no_count(
    d: Daemon, tenant: tuple[str, str]
) -> None:
    before = closed(d, "body_timeout")
    conns = []
    try:
        for _ in range(SHARE):  # (a caller's requests beyond it are refused at once: 507)
            s = connect(d)
            s.sendall(
                request("POST", "/v1/reserve", tenant[1], extra="Content-Length: 4096\r\n").replace(
                    b"Content-Length: 0\r\n", b""
                )
                + b'{"size_bytes": '
            )
            conns.append(s)
        wait_until(lambda: all(closed_by_peer(s) for s in conns), NEVER_S, message="closed")
    finally:
        close_all(conns)
    assert closed(d, "body_timeout") >= before + SHARE
    gauge_settles(d)
    share_intact(d, tenant[1])


def test_kept_connections_closed_at_the_head_deadline_leave_no_count(
    d: Daemon, tenant: tuple[str, str]
) -> None:
    before = closed(d, "head_timeout")
    conns = []
    try:
        for _ in range(SHARE):
            s, status = ask(d, "GET", "/v1/usage", tenant[1])
            assert status == 200
            s.sendall(b"GET /v1/usage HTTP/1.1\r\nHost: ma")  # and never the rest
            conns.append(s)
        wait_until(lambda: all(closed_by_peer(s) for s in conns), NEVER_S, message="closed")
    finally:
        close_all(conns)
    assert closed(d, "head_timeout") >= before + SHARE
    gauge_settles(d)
    share_intact(d, tenant[1])


def test_kept_connections_closed_at_the_send_deadline_leave_no_count(
    d: Daemon, tenant: tuple[str, str]
) -> None:
    before = closed(d, "send_timeout")
    conns = []
    try:
        for _ in range(SHARE):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", d.port))
            s.sendall(request("GET", "/v1/usage", tenant[1]))
            answer(s)
            s.sendall(request("GET", "/schema/openapi.json") * 400)  # pipelined, never read
            conns.append(s)
        wait_until(
            lambda: closed_now(d, "send_timeout") >= before + SHARE,
            NEVER_S,
            message="send deadline",
        )
    finally:
        close_all(conns)
    gauge_settles(d)
    share_intact(d, tenant[1])


def test_kept_connections_shed_over_half_the_cap_leave_no_count(d: Daemon) -> None:
    """Four callers keep the whole cap: each newcomer sheds the oldest of their idle
    connections, then carries the key of the caller whose connection it shed (kept again,
    in the place the shed one left in its share)."""
    keys = [d.tenant(f"over-half-{n}", 64 * MiB)[1] for n in range(CAP // SHARE)]
    gauge_settles(d)
    time.sleep(1.5)  # the admin client's pooled connection is closed (its 1 s expiry)
    conns = [ask(d, "GET", "/v1/usage", key)[0] for key in keys for _ in range(SHARE)]
    newcomers = []
    try:
        for n in range(CAP // 2):
            s, status = ask(d, "GET", "/v1/usage", keys[n // SHARE])
            assert status == 200
            newcomers.append(s)
            assert closed_by_peer(conns[n], NEVER_S)  # the oldest kept one, shed for it
        assert not any(closed_by_peer(s) for s in conns[CAP // 2 :] + newcomers)
    finally:
        close_all(conns + newcomers)
    gauge_settles(d)
    for key in keys:
        share_intact(d, key)


@pytest.mark.parametrize("how", ["revoke the key", "delete the tenant"])
def test_a_connection_kept_with_a_key_revoked_since_is_kept_no_more(d: Daemon, how: str) -> None:
    """A key revoked (or its tenant deleted) is refused at once: the connections it kept
    are not kept for it any longer, however long their client goes on sending requests
    on them (each answered 401)."""
    tenant_id = d.tenant("revoked-since", 64 * MiB)[0]
    issued = d.admin.post(f"/v1/tenants/{tenant_id}/keys").json()
    key = issued["api_key"]
    conns = [ask(d, "GET", "/v1/usage", key)[0] for _ in range(SHARE)]
    try:
        if how == "revoke the key":
            r = d.admin.delete(f"/v1/tenants/{tenant_id}/keys/{issued['id']}")
            assert r.status_code == 204
        else:
            assert d.admin.delete(f"/v1/tenants/{tenant_id}").status_code == 204
        for s in conns:
            s.sendall(request("GET", "/v1/usage", key))
            assert answer(s)[0] == 401
        assert survivors(d, conns) == [False] * SHARE
    finally:
        close_all(conns)


def gone(s: socket.socket) -> bool:
    """Whether the peer closed ``s``, without reading what it sent (left unread)."""
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def served(d: Daemon, key: str) -> None:
    """Another tenant's request and an anonymous /healthz, each on a fresh connection."""
    with d.client(key) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
    assert healthz(d) == 200


def test_one_tenant_keeping_twice_the_cap_idle_locks_no_one_out(d: Daemon) -> None:
    """A tenant's keep-alive connections beyond its share are anonymous: shed for others."""
    greedy = d.tenant("greedy", 64 * MiB)[1]
    other = d.tenant("other", 64 * MiB)[1]
    conns: list[socket.socket] = []
    try:
        for _ in range(CAP * 2):
            s, status = ask(d, "GET", "/v1/usage", greedy)
            assert status == 200
            conns.append(s)
        served(d, other)
        alive = [not closed_by_peer(s, 0.2) for s in conns]
        assert alive.count(True) <= CAP - 2, alive  # the greedy one's oldest were shed
    finally:
        close_all(conns)


def test_two_callers_keeping_half_the_cap_refuse_a_newcomer_only_while_the_rest_is_busy(
    d: Daemon,
) -> None:
    """Two tenants keep their shares idle (half the cap, not over); the other half is busy
    with their bodies that never finish (each tenant its share of requests in progress, on
    connections beyond its share of kept ones: anonymous). A newcomer,
    who has nothing idle and anonymous to shed, gets the 507 ``resource-limit`` (it asks
    once: within the grace of refusals, the kept ones are not shed for it) — until the
    body deadline frees the busy ones: it is served then, without waiting for the
    keep-alive timeout of the kept ones."""
    keys = [d.tenant(f"half-{n}", 64 * MiB)[1] for n in range(2)]
    newcomer = d.tenant("newcomer", 64 * MiB)[1]
    gauge_settles(d)
    time.sleep(1.5)  # the admin client's pooled connection is closed (its 1 s expiry)
    kept = [ask(d, "GET", "/v1/usage", key)[0] for key in keys for _ in range(SHARE)]
    busy = []
    try:
        for n in range(CAP - len(kept)):
            s = connect(d)
            key = keys[n % 2]
            s.sendall(
                f"POST /v1/reserve HTTP/1.1\r\nHost: maasd\r\nAuthorization: Bearer {key}"
                "\r\nContent-Type: application/json\r\nContent-Length: 4096"
                "\r\nExpect: 100-continue\r\n\r\n".encode()
            )
            busy.append(s)
            assert s.recv(100).startswith(b"HTTP/1.1 100")  # the daemon reads its body: busy
            s.sendall(b"{")
        s, status = ask(d, "GET", "/v1/usage", newcomer)
        s.close()
        assert status == 507
        wait_until(lambda: all(closed_by_peer(s) for s in busy), NEVER_S, message="body deadline")
        served(d, newcomer)
        assert not any(closed_by_peer(s) for s in kept)  # the kept ones were never shed
    finally:
        close_all(kept + busy)


def trickle_reserve(d: Daemon, key: str) -> socket.socket:
    """A reserve of ``key`` whose body the daemon has begun to read (``100 Continue``) and
    that never finishes: busy until the body deadline."""
    s = connect(d)
    s.sendall(
        f"POST /v1/reserve HTTP/1.1\r\nHost: maasd\r\nAuthorization: Bearer {key}"
        "\r\nContent-Type: application/json\r\nContent-Length: 4096"
        "\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    assert s.recv(100).startswith(b"HTTP/1.1 100")
    s.sendall(b"{")
    return s


def test_two_tenants_renewing_kept_and_busy_connections_lock_no_one_else_out(d: Daemon) -> None:
    """Invariant 9: at the cap the caller gets a 507, others keep working. Tenants A and B
    keep their shares of connections (half the cap) by sending a request on each every
    second — far within the keep-alive timeout, which therefore never closes them — and
    the other half is held busy, renewed as its deadlines close it: by anonymous clients
    that never read their (large) answers, their share (requests outside ``/v1`` count as
    one caller's), and by A's and B's bodies that never finish, on connections beyond
    their kept shares (anonymous for shedding), within their shares of requests in
    progress (three of A's, one of B's, each leaving room for the renewals of its kept
    ones, made one at a time). Nothing is over half, nothing anonymous is idle: every
    newcomer was refused, for as long as they went on (a lock-out that before kept
    connections took the whole cap busy). Another tenant (and the admin, who would
    revoke A's key) gets through: after a grace of refusals, an idle kept connection is
    shed."""
    a, b = (d.tenant(f"lock-{n}", 64 * MiB)[1] for n in range(2))
    newcomer = d.tenant("locked-out", 64 * MiB)[1]
    gauge_settles(d)
    time.sleep(1.5)  # the admin client's pooled connection is closed (its 1 s expiry)
    kept = [ask(d, "GET", "/v1/usage", key)[0] for key in (a, b) for _ in range(SHARE)]
    stop = threading.Event()

    def renew_kept() -> None:
        while not stop.wait(1.0):
            for s, key in zip(kept, [a] * SHARE + [b] * SHARE, strict=True):
                with contextlib.suppress(OSError, AssertionError):
                    s.sendall(request("GET", "/v1/usage", key))
                    answer(s)

    def hold_busy(open_one: Callable[[], socket.socket]) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, AssertionError), open_one() as s:
                while not stop.wait(0.2) and not gone(s):
                    pass

    def hog() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", d.port))
        s.sendall(request("GET", "/schema/openapi.json") * 400)  # pipelined, never read
        return s

    holders: list[Callable[[], socket.socket]] = [hog] * SHARE
    holders += [lambda: trickle_reserve(d, a)] * (SHARE - 1) + [lambda: trickle_reserve(d, b)]
    assert len(kept) + len(holders) == CAP
    attackers = [threading.Thread(target=renew_kept, daemon=True)] + [
        threading.Thread(target=hold_busy, args=(h,), daemon=True) for h in holders
    ]
    statuses: list[int | str] = []
    try:
        for t in attackers:
            t.start()
        time.sleep(1.0)
        deadline = time.monotonic() + 6 * SEND_S  # the busy ones are closed six times over
        while time.monotonic() < deadline and 200 not in statuses:
            try:
                with d.client(newcomer) as c:
                    statuses.append(c.get("/v1/usage").status_code)
            except httpx.TransportError as e:
                statuses.append(type(e).__name__)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in attackers:
            t.join(NEVER_S)
        close_all(kept)
    assert 200 in statuses, f"the newcomer was never served: {statuses}"


def rss_kib(d: Daemon) -> int:
    assert d.proc is not None
    for line in open(f"/proc/{d.proc.pid}/status"):  # noqa: SIM115 - read at once
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_long_churn_of_kept_connections_does_not_grow_the_daemon(d: Daemon) -> None:
    """Each connection keeps itself in its requests' state (the way back from the key
    check to the gate) until it is closed: thousands of kept connections opened and
    closed leave neither them nor their counts behind."""
    keys = [d.tenant(f"churn-{n}", 64 * MiB)[1] for n in range(3)]

    def churn(n: int) -> None:
        for i in range(n):
            with connect(d) as s:
                s.sendall(request("GET", "/v1/usage", keys[i % len(keys)]))
                assert answer(s)[0] == 200

    churn(1000)  # the allocator's pools warm up
    before = rss_kib(d)
    churn(5000)
    grown = rss_kib(d) - before
    assert grown < 8 * 1024, f"the daemon grew by {grown} KiB over 5000 connections"
    gauge_settles(d)
    for key in keys:
        share_intact(d, key)


def test_upgrade_requests_by_the_thousand_do_not_flood_the_log(d: Daemon) -> None:
    """uvicorn warns twice of every request with an ``Upgrade: websocket`` header it will
    not take (the server has no WebSocket): any client, without a key, on one keep-alive
    connection, made the daemon write ~300 bytes of log a request, as fast as it liked.
    The request is answered as plain HTTP; the warnings come at most once a minute."""
    before = d.log_path.stat().st_size
    with connect(d) as s:
        for _ in range(500):
            s.sendall(
                request("GET", "/healthz", extra="Connection: upgrade\r\nUpgrade: websocket\r\n")
            )
            assert answer(s)[0] == 200
    time.sleep(0.5)  # the log written
    grown = d.log_path.read_bytes()[before:].decode(errors="replace")
    assert grown.count("upgrade request") <= 2, grown[-2000:]
    assert len(grown) < 4096, grown[-2000:]


def test_after_the_attacks_anonymous_connections_shed_one_another_again(d: Daemon) -> None:
    gauge_settles(d)
    shed, refused = closed(d, "shed"), closed(d, "refused")
    conns = []
    try:
        for _ in range(CAP * 2):
            conns.append(connect(d))
            time.sleep(0.005)
        wait_until(lambda: sum(closed_by_peer(s) for s in conns) >= CAP, NEVER_S)
    finally:
        close_all(conns)
    assert closed(d, "refused") == refused
    assert closed(d, "shed") >= shed + CAP - 2
    assert healthz(d) == 200
    assert "Traceback" not in d.log_path.read_text(errors="replace")
