"""``maasd router`` in front of attached llama-server backends that hang, with real
llama-server processes on the real Gemma 3 270M and the module's real ``maasd serve``.

A hung backend is one SIGSTOPped: its process lives, its port takes connections, nothing
answers. The router started none of them, so it cannot kill one to end its requests (as
it does for those it starts: test_spec_tiers_round12.py): its watcher ends them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.llama

from llama_model import CAPITALS  # noqa: E402
from router_fleet import RouterProc, attached_process, long_stream, serve_on_each  # noqa: E402

#: far beyond the watcher's judgment (3 missed /health probes of 5 s, 1 s apart), on a
#: loaded machine: the point is that the client does not wait for ever
ENDED_WITHIN_S = 120.0


def _send(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """A completion read to its end (a stream's bytes as they come) into ``out``; a client
    timeout far past ENDED_WITHIN_S guards the test itself."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(ENDED_WITHIN_S * 2)) as c:
        try:
            if body.get("stream"):
                with c.stream("POST", "/v1/completions", json=body) as s:
                    out["status"] = s.status_code
                    out["body"] = b"".join(s.iter_raw())
            else:
                r = c.post("/v1/completions", json=body)
                out["status"], out["body"] = r.status_code, r.content
        except httpx.HTTPError as exc:
            out["client_error"] = repr(exc)


def _wait(cond: Any, r: RouterProc, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what}: {r.health()}\n{r.log()}")
        time.sleep(0.1)


def _processing(url: str) -> bool:
    return any(s["is_processing"] for s in httpx.get(f"{url}/slots", timeout=10).json())


@contextlib.contextmanager
def _attached_fleet(
    routers: Any, binary: str, model: Path, tmp_path: Path, n: int
) -> Iterator[tuple[RouterProc, list[subprocess.Popen[bytes]]]]:
    """``n`` attached backends of one slot each and a router in front of them → the
    router and each backend's process, in the router's order."""
    with contextlib.ExitStack() as stack:
        servers: list[subprocess.Popen[bytes]] = []
        args: list[str] = []
        for i in range(n):
            slot_dir = tmp_path / f"slots-{i}"
            slot_dir.mkdir()
            log = tmp_path / f"server-{i}.log"
            url, proc = stack.enter_context(attached_process(binary, model, slot_dir, log, slots=1))
            servers.append(proc)
            args += ["--backend", url, "--slot-dir", str(slot_dir)]
        yield routers(backends=0, router_args=tuple(args)), servers


def test_a_hung_attached_backend_ends_its_requests_and_serves_again_after(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """A stream under way and a whole answer being generated, each on an attached backend
    that is then SIGSTOPped: the stream ends with an error event (504, no ``[DONE]``), the
    whole answer is a 504 in the OpenAI error form — within the watcher's judgment, not
    never; their slots are given back, nothing of theirs is published, ``backend_hung``
    counts both; the third backend serves meanwhile; after SIGCONT both serve again."""
    with _attached_fleet(routers, llama_server, gemma_gguf, tmp_path, 3) as (r, servers):
        urls = [b["url"] for b in r.health()["backends"]]
        published = r.metric("maasd_router_entries", op="publish")
        stream: dict[str, Any] = {}
        whole: dict[str, Any] = {}
        ended = ("Story one.\n" + CAPITALS, "Story two.\n" + CAPITALS)  # publishable lengths
        long_whole = {**long_stream(ended[1], max_tokens=1000), "stream": False}
        threads = [
            threading.Thread(
                target=_send,
                args=(r.url, long_stream(ended[0], max_tokens=1000), stream),
                daemon=True,
            ),
            threading.Thread(target=_send, args=(r.url, long_whole, whole), daemon=True),
        ]
        threads[0].start()
        _wait(lambda: sum(b["busy"] for b in r.health()["backends"]) == 1, r, "streaming")
        threads[1].start()
        _wait(lambda: sum(b["busy"] for b in r.health()["backends"]) == 2, r, "both busy")
        victims = [i for i, b in enumerate(r.health()["backends"]) if b["busy"]]
        (spare,) = set(range(3)) - set(victims)
        _wait(lambda: all(_processing(urls[i]) for i in victims), r, "both generating")
        stopped = time.monotonic()
        try:
            for i in victims:
                os.kill(servers[i].pid, signal.SIGSTOP)
            for i in range(3):  # served meanwhile (short prompts: nothing to publish)
                res = r.http.post(
                    "/v1/completions",
                    json={"prompt": f"Hung {i}. Paris is in", "max_tokens": 4},
                    timeout=ENDED_WITHIN_S,
                )
                assert res.status_code == 200, res.text
                assert res.headers["x-maasd-backend"] == str(spare)
            for t in threads:
                t.join(max(stopped + ENDED_WITHIN_S - time.monotonic(), 0))
            assert not any(t.is_alive() for t in threads), "a request to a hung backend hangs"
            assert "client_error" not in stream, stream
            assert "client_error" not in whole, whole
            assert stream["status"] == 200  # it had begun: its end is an error event
            assert b"[DONE]" not in stream["body"]
            last = stream["body"].strip().split(b"\n")[-1]
            assert last.startswith(b"data: "), stream["body"][-500:]
            err = json.loads(last[6:])["error"]
            assert err["code"] == 504, err
            assert "hung" in err["message"], err
            assert whole["status"] == 504, whole
            err = json.loads(whole["body"])["error"]
            assert err["type"] == "server_error", err
            assert err["code"] == 504, err
            assert "stopped answering" in err["message"], err
            h = r.health()
            assert h["status"] == "ok"  # the spare serves
            for i in victims:
                assert not h["backends"][i]["alive"]
                assert h["backends"][i]["busy"] == 0, h  # the slots are given back
            assert r.metric("maasd_router_errors", kind="backend_hung") == 2
            assert r.metric("maasd_router_requests", outcome="error") == 2
        finally:
            for i in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(servers[i].pid, signal.SIGCONT)
        _wait(lambda: all(r.health()["backends"][i]["alive"] for i in victims), r, "back")
        serve_on_each(r, victims)
        r.wait_idle()
        assert r.metric("maasd_router_entries", op="publish") == published
        assert "Traceback" not in r.log()


def test_a_long_generation_on_an_attached_backend_that_answers_is_not_cut(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """The watcher ends only a hung backend's requests: a stream that generates for many
    of its probe periods, on a backend that answers /health meanwhile, runs to its end."""
    with _attached_fleet(routers, llama_server, gemma_gguf, tmp_path, 1) as (r, _servers):
        out: dict[str, Any] = {}
        _send(r.url, long_stream("Once upon a time", max_tokens=600), out)
        assert out.get("status") == 200, out
        assert b'"error"' not in out["body"], out["body"][-500:]
        assert b"[DONE]" in out["body"], out["body"][-500:]
        timings = [
            json.loads(line[6:])["timings"]
            for line in out["body"].split(b"\n")
            if line.startswith(b"data: {") and b'"timings"' in line
        ]
        assert timings[-1]["predicted_n"] == 600  # every token: nothing cut it short
        assert r.metric("maasd_router_errors", kind="backend_hung") == 0
        assert r.metric("maasd_router_requests", outcome="ok") == 1
