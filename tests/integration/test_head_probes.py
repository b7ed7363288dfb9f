"""HEAD on a real daemon and a real router (docs/api.md, "HEAD"): the status GET has, no
body — ``/healthz`` healthy and degraded — and the same authentication as GET.

Load balancers and probes use HEAD (HAProxy's ``option httpchk HEAD``); it was 405 on
every route, so a balancer probing with it took every daemon and router out.
"""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from maasd.store.engine import BUSY_TIMEOUT_MS
from waiting import wait_until

if TYPE_CHECKING:
    from conftest import Daemon

MiB = 1 << 20


def _head_is_get_without_the_body(url: str, headers: dict[str, str] | None = None) -> int:
    got = httpx.get(url, headers=headers, timeout=30)
    head = httpx.head(url, headers=headers, timeout=30)
    assert head.status_code == got.status_code, (url, head.status_code, got.text)
    assert head.content == b""
    assert head.headers.get("content-type") == got.headers.get("content-type"), url
    return head.status_code


def test_head_on_a_daemon_answers_as_get_healthy_and_degraded(fresh_daemon: Daemon) -> None:
    d = fresh_daemon.start()
    _, key = d.tenant("head", 8 * MiB)
    tenant = {"Authorization": f"Bearer {key}"}
    admin = {"Authorization": f"Bearer {d.admin_key}"}
    assert _head_is_get_without_the_body(f"{d.url}/healthz") == 200
    assert _head_is_get_without_the_body(f"{d.url}/v1/usage") == 401
    assert _head_is_get_without_the_body(f"{d.url}/v1/usage", tenant) == 200
    assert _head_is_get_without_the_body(f"{d.url}/v1/tenants", tenant) == 403
    assert _head_is_get_without_the_body(f"{d.url}/metrics") == 401
    assert _head_is_get_without_the_body(f"{d.url}/metrics", admin) == 200

    # Degraded: the ledger cannot be written (another process holds SQLite's write lock);
    # the first write waits out the busy timeout and opens the circuit.
    other = sqlite3.connect(d.data_dir / "maasd.db", isolation_level=None, timeout=30)
    try:
        other.execute("BEGIN EXCLUSIVE")
        r = d.client(key).post(
            "/v1/reserve", json={"size_bytes": MiB}, timeout=BUSY_TIMEOUT_MS / 1000 * 3
        )
        assert r.status_code == 507, r.text
        wait_until(
            lambda: d.admin.get("/healthz").json()["status"] == "degraded",
            timeout=30,
            message="/healthz degraded",
        )
        assert _head_is_get_without_the_body(f"{d.url}/healthz") == 200
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(300)
def test_head_healthz_on_a_router(tmp_path: Path, llama_server: str, gemma_gguf: Path) -> None:
    from processes import signal_and_wait
    from router_fleet import RouterProc

    r = RouterProc(llama_server, gemma_gguf, tmp_path / "router", backends=1).start()
    try:
        assert _head_is_get_without_the_body(f"{r.url}/healthz") == 200
        assert _head_is_get_without_the_body(f"{r.url}/v1/models") == 200
        head = httpx.head(f"{r.url}/v1/completions", timeout=30)  # a POST route
        assert (head.status_code, head.content) == (405, b"")
    finally:
        r.http.close()
        assert r.proc is not None
        assert signal_and_wait(r.proc, signal.SIGTERM, 60) == 0, r.log()
