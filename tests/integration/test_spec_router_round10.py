"""SPEC §11 (llama-server fleets: ``maasd router``), checked word for word.

Through the real entry points only: the ``maasd router`` command line (a subprocess),
its HTTP API, real llama-server backends (``scripts/llama-server``'s build) on the real
Gemma 3 270M, and a real ``maasd serve``. Fixtures and helpers are those of
``tests/router_fleet.py`` (``routers``, ``router_key``, ``llama_server``, ``gemma_gguf``).
"""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

pytest.importorskip("xxhash")

from conftest import Daemon, free_port  # noqa: E402
from llama_model import GERMANY  # noqa: E402
from maasd.client import Client, Worker  # noqa: E402
from maasd.llama.format import chunk_keys, pack_header, state_checksum  # noqa: E402
from processes import running  # noqa: E402
from router_fleet import CHUNK, RouterProc, router_cli, text_of, tokens_of  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


# -- the command line ---------------------------------------------------------------------


def test_help_names_every_flag_of_the_synopsis_with_its_defaults() -> None:
    """§11: ``maasd router [--host 127.0.0.1] [--port 8080] [--maasd-url URL] [--socket
    PATH] [--key KEY | MAASD_KEY] [--pool NAME] (--backends N --llama-server PATH --model
    PATH.gguf [llama-server flags…] | --backend URL --slot-dir DIR …)``."""
    rc, out = router_cli("--help")
    assert rc == 0, out
    flat = " ".join(out.split())
    for flag in ("--host", "--port", "--maasd-url", "--socket", "--key", "--pool",
                 "--backends", "--llama-server", "--model", "--backend", "--slot-dir"):  # fmt: skip
        assert flag in out, flag
    assert "127.0.0.1" in flat
    assert "8080" in flat
    assert "MAASD_KEY" in flat


def test_backends_and_backend_are_alternatives(
    llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """§11: ``(--backends N --llama-server PATH --model PATH.gguf … | --backend URL
    --slot-dir DIR …)``: one or the other; both at once is a usage error (exit 2) before
    anything starts."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    rc, out = router_cli(
        "--port", str(free_port()), "--backends", "1", "--llama-server", llama_server,
        "--model", str(gemma_gguf), "--backend", "http://127.0.0.1:9", "--slot-dir",
        str(slot_dir), timeout=40,
    )  # fmt: skip
    import re
    import signal

    left = [int(x) for x in re.findall(r"started llama-server pid (\d+)", out)]
    left = [pid for pid in left if running(pid)]
    for pid in left:  # started by the router we ran, left behind by it
        os.kill(pid, signal.SIGKILL)
    assert rc == 2, f"rc={rc}: both --backends and --backend were accepted:\n{out[-3000:]}"
    assert not left, f"the router exited, its llama-server {left} still ran"


@pytest.mark.parametrize("n", ["-1", "0"])
def test_backends_n_below_one_is_a_usage_error(llama_server: str, gemma_gguf: Path, n: str) -> None:
    """§11 ``--backends N`` (N processes it starts): a count below 1 with nothing to attach
    is refused as a usage error (click's exit 2, saying what is wrong), not a traceback."""
    rc, out = router_cli(
        "--port", str(free_port()), "--backends", n, "--llama-server", llama_server,
        "--model", str(gemma_gguf), timeout=45,
    )  # fmt: skip
    assert rc == 2, f"rc={rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]


def test_the_key_flag_turns_sharing_on(routers: Any, router_key: str) -> None:
    """§11: ``[--key KEY | MAASD_KEY]``: the flag as well as the variable."""
    r = routers(backends=1, key=None, router_args=("--key", router_key))
    assert r.health()["sharing"] is True
    assert r.metric("maasd_router_sharing") == 1


def test_an_unknown_key_is_a_plain_balancer_that_says_so(routers: Any) -> None:
    """§11: "Without a reachable maasd the router still serves, as a plain balancer, and
    says so in its log and /metrics" — a maasd that refuses the key shares nothing."""
    r = routers(backends=1, key="maasd_" + secrets.token_hex(16))
    assert " Berlin" in text_of(r.complete("Bad key.\n" + GERMANY))
    assert r.metric("maasd_router_sharing") == 0
    assert r.health()["sharing"] is False
    assert "PREFIX SHARING OFF" in r.log()


# -- maasd going away while the router runs ------------------------------------------------


def test_maasd_going_away_leaves_a_plain_balancer_that_says_so(
    fresh_daemon: Daemon, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """§11: "Without a reachable maasd the router still serves, as a plain balancer, and
    says so in its log and /metrics" — also when maasd stops while the router runs."""
    d = fresh_daemon.start()
    _, key = d.tenant("router", 256 << 20)
    r = RouterProc(
        llama_server, gemma_gguf, tmp_path / "logs", backends=1, key=key,
        socket_path=d.socket_path, maasd_url=d.url, chunk=CHUNK,
    ).start()  # fmt: skip
    try:
        assert r.metric("maasd_router_sharing") == 1
        r.complete("Going away.\n" + GERMANY)
        r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
        r.wait_idle()
        d.stop()
        for i in range(3):  # it keeps serving, whatever it tries with maasd
            out = r.complete(f"Gone {i}.\n" + GERMANY)
            assert " Berlin" in text_of(out)
        deadline = time.monotonic() + 30
        while r.metric("maasd_router_sharing") != 0 and time.monotonic() < deadline:
            r.complete("Still gone.\n" + GERMANY)
            time.sleep(0.5)
        assert r.metric("maasd_router_sharing") == 0
        assert r.health()["sharing"] is False
        assert "PREFIX SHARING OFF" in r.log()
        assert r.health()["status"] == "ok"
    finally:
        r.stop()


# -- entries that must never reach a backend ------------------------------------------------


def _forge(daemon: Any, key: str, fp: str, toks: list[int], kind: str) -> str:
    """Commit under the key of ``toks`` an entry a buggy or hostile writer of the tenant
    made, of the router's own fingerprint: ``truncated`` (a valid header and checksum, the
    state cut short) or ``garbage`` (valid header and checksum of a state that is no
    KV cache at all)."""
    n = len(toks) - len(toks) % CHUNK
    the_key = chunk_keys(fp, toks[:n], CHUNK)[-1][1]
    state = struct.pack("<Ii", 0xAF143CD8, 0) + os.urandom(64 << 10)
    head = pack_header(fp, toks[:n], len(state), state_checksum(state), CHUNK)
    body = head + state
    if kind == "truncated":
        body = body[: len(head) + len(state) // 2]
    with Worker(daemon.socket_path, key) as w:
        m = w.put(the_key, len(body))
        m.array[: len(body)] = np.frombuffer(body, np.uint8)
        return w.commit(m).id


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_a_truncated_or_malformed_entry_is_a_miss_dropped_and_never_reaches_a_backend(
    routers: Any, daemon: Any, router_key: str, kind: str
) -> None:
    """§11: "a corrupt, truncated or foreign entry is a miss, is dropped, and never
    reaches a backend"."""
    r = routers(backends=1)
    prompt = f"Forged {kind}.\n" + GERMANY
    entry = _forge(daemon, router_key, r.health()["fingerprint"], tokens_of(r, prompt), kind)
    pid = r.health()["backends"][0]["pid"]
    out = r.complete(prompt)
    assert out.headers["x-maasd-restored"] == "0"
    assert " Berlin" in text_of(out)
    assert r.metric("maasd_router_entries", op="lookup", outcome="refused") == 1
    with Client(daemon.url, router_key) as c:
        assert entry not in {b.id for b in c.buffers()}
    h = r.health()
    assert h["status"] == "ok"
    assert h["backends"][0]["pid"] == pid  # the backend never crashed
    assert h["backends"][0]["restarts"] == 0


def test_published_entries_go_to_the_pool_named_by_pool(
    routers: Any, daemon: Any, router_key: str
) -> None:
    """§11: ``[--pool NAME]``: the pool the router's published entries go to."""
    name = f"routerpool{secrets.token_hex(3)}"
    info = daemon.pool(name, 128 << 20)
    r = routers(backends=1, router_args=("--pool", name))
    with Client(daemon.url, router_key) as c:
        before = {b.id for b in c.buffers()}
    r.complete("Pooled.\n" + GERMANY)
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    with Client(daemon.url, router_key) as c:
        new = [b for b in c.buffers() if b.id not in before]
    assert new, "nothing published"
    assert {b.pool_id for b in new} == {info["id"]}
    assert all(b.evictable and b.key for b in new)


def test_a_router_stopped_while_it_starts_leaves_no_backend_behind(
    llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """§11: the backends are llama-server processes "which it starts (and restarts)
    itself": a router stopped with SIGTERM (or Ctrl-C) while its backends are still
    loading must not leave them running, orphaned, after it exits."""
    import re
    import signal

    log = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MAASD_KEY", "MAASD_SOCKET")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, "-m", "maasd.cli.daemon", "router", "--port", str(free_port())]
    argv += ["--backends", "2", "--llama-server", llama_server, "--model", str(gemma_gguf)]
    with open(log, "wb") as out:
        p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pids and time.monotonic() < deadline and p.poll() is None:
            pids = [int(x) for x in re.findall(r"started llama-server pid (\d+)", log.read_text())]
            time.sleep(0.01)
        assert pids, log.read_text()[-3000:]
        p.send_signal(signal.SIGTERM)  # while the backends load
        p.wait(60)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in pids if running(pid)]
            time.sleep(0.2)
        assert not alive, f"llama-server {alive} outlived its router:\n{log.read_text()[-3000:]}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        for pid in pids:  # what the router left behind (ours: we made the router start it)
            if running(pid):
                os.kill(pid, signal.SIGKILL)
