"""A body sent to a route that takes none counts in its caller's busy share.

The ``/v1`` hook reads the body of a route that takes none (a ``DELETE``, a ``GET``)
when one is announced, to refuse it unless it is nothing, ``{}`` or ``null``. A tenant
announcing a long body and trickling it held a connection busy there, and the busy
share did not count it: the body was read before the request was counted. Now it is
counted first: beyond its share, the tenant's requests are refused (507) unread.

A daemon with a cap of 16 (a share of 4), raw sockets; nothing timed.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from test_attacks_rest_gate_round15 import (
    BODY_S,
    CAP,
    HEAD_S,
    KEEPALIVE_S,
    NEVER_S,
    SEND_S,
    SHARE,
    answered,
    close_all,
    gauge_settles,
    refused_and_closed,
)

from budgets import http_limits_env
from conftest import Daemon, small_rest_daemon
from rawhttp import request
from waiting import wait_until


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with small_rest_daemon(
        tmp_path_factory.mktemp("gate-bodiless"),
        http_limits_env(CAP, HEAD_S, BODY_S, SEND_S, KEEPALIVE_S),
    ) as daemon:
        yield daemon


def trickled_delete(d: Daemon, key: str, buffer_id: str) -> socket.socket:
    """A ``DELETE`` whose head is whole and whose announced body has only begun."""
    s = socket.create_connection(("127.0.0.1", d.port), timeout=NEVER_S)
    extra = "Content-Type: application/json\r\nContent-Length: 60000\r\n"
    s.sendall(request("DELETE", f"/v1/buffers/{buffer_id}", key, extra=extra) + b"{")
    return s


def test_a_trickled_body_of_a_bodiless_route_counts_in_the_busy_share(d: Daemon) -> None:
    _, key = d.tenant("bodiless-trickle", 64 << 20)
    with d.client(key) as c:
        held = c.post("/v1/reserve", json={"size_bytes": 4096}).json()["id"]
    n = SHARE + 3
    conns = [trickled_delete(d, key, held) for _ in range(n)]
    try:
        wait_until(lambda: sum(map(answered, conns)) >= n - SHARE, NEVER_S, message="507s")
        refused = [s for s in conns if answered(s)]
        assert len(refused) == n - SHARE
        assert sum(refused_and_closed(s) for s in refused) >= n - SHARE - 1  # one may be shed
        with d.client(key) as c:  # the tenant's share is taken: its next request waits
            assert c.get(f"/v1/buffers/{held}").status_code == 507
    finally:
        close_all(conns)
    gauge_settles(d)
    with d.client(key) as c:
        wait_until(
            lambda: c.get(f"/v1/buffers/{held}").status_code == 200,
            NEVER_S,
            message="the share is free again, and no DELETE was carried out",
        )
        assert c.delete(f"/v1/buffers/{held}").status_code == 204
