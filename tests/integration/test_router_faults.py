"""``maasd router`` against what goes wrong, with real llama-server processes on the real
Gemma 3 270M and the module's real ``maasd serve``: hostile bodies, a backend killed
before its first byte, a client that goes away mid-stream, a shared prefix published
before an answer and restored elsewhere, a model file that differs only in its middle,
and a Python worker of another fingerprint.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.llama

pytest.importorskip("xxhash")


from llama_model import CAPITALS, GERMANY  # noqa: E402
from maasd.client import Client, Worker  # noqa: E402
from router_bad_bodies import BAD_BODIES, assert_error_4xx, send  # noqa: E402
from router_fleet import (  # noqa: E402
    CHUNK,
    RouterProc,
    attached_server,
    long_stream,
    text_of,
    tokens_of,
)

LONG = "A long one.\n" + GERMANY


def test_hostile_bodies_are_4xx_and_the_router_stays_healthy(routers: Any) -> None:
    r = routers(backends=1)
    for case, path, raw in BAD_BODIES:
        err = assert_error_4xx(send(r.http, path, raw))
        assert "Traceback" not in err["message"], case
    assert r.health()["status"] == "ok"
    assert " Berlin" in text_of(r.complete(GERMANY))
    assert r.metric("maasd_router_requests", outcome="ok") == 1
    assert "Traceback" not in r.log()


def test_a_backend_killed_before_its_first_byte_is_retried_on_another(routers: Any) -> None:
    r = routers(backends=2)
    out: list[httpx.Response] = []
    body = {"prompt": LONG, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(target=lambda: out.append(r.http.post("/v1/completions", json=body)))
    t.start()
    try:  # a whole answer (not a stream): nothing reaches the client before its end
        wait_for(lambda: any(b["busy"] for b in r.health()["backends"]), r, "busy", 60)
        time.sleep(0.3)  # in its prefill or generation: seconds on one thread
        bs = r.health()["backends"]
        victim = next(i for i, b in enumerate(bs) if b["busy"])
        os.kill(bs[victim]["pid"], signal.SIGKILL)
    finally:
        t.join(300)
    (resp,) = out
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-maasd-backend"] != str(victim)  # answered by the other one
    assert text_of(resp).startswith(" Berlin")
    assert r.metric("maasd_router_errors", kind="transport") == 1
    wait_for(lambda: r.health()["backends"][victim]["restarts"] == 1, r, "restarted")


def wait_for(cond: Any, r: RouterProc, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what}: {r.health()}\n{r.log()}")
        time.sleep(0.1)


def test_a_client_gone_mid_stream_frees_its_slot_and_a_restore_waits_for_the_server(
    routers: Any,
) -> None:
    r = routers(backends=1)
    prompt = "Gone.\n" + GERMANY
    cold = r.complete(prompt)
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    r.wait_idle()
    body = long_stream("Other.\n" + CAPITALS + "Once upon a time")
    with (
        httpx.Client(base_url=r.url, timeout=120) as c,
        c.stream("POST", "/v1/completions", json=body) as s,
    ):
        for i, _ in enumerate(s.iter_raw()):
            if i == 3:
                break  # and the connection closes: a client that went away
    r.wait_idle(timeout=30)  # the slot is given back …
    # … and the next request restores into it only once the server stopped generating
    warm = r.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) > 0
    assert text_of(warm) == text_of(cold)
    url = r.health()["backends"][0]["url"]
    assert not any(s["is_processing"] for s in httpx.get(f"{url}/slots").json())
    assert r.metric("maasd_router_requests", outcome="error") >= 1
    assert r.health()["status"] == "ok"


def test_a_shared_prefix_published_before_an_answer_is_restored_with_a_partial_prefill(
    routers: Any,
) -> None:
    """A prefix-only (lead) publish of a sliding-window model (Gemma 3) restores elsewhere:
    the other router's backend evaluates only what follows it."""
    a = routers(backends=1)
    for pad in range(2 * CHUNK):  # the shared prefix 8 tokens past a chunk boundary: the
        shared = "x " * pad + "Leads.\n" + CAPITALS  # questions below end in its chunk
        n_shared = len(tokens_of(a, shared))
        if n_shared % CHUNK == 8:
            break
    boundary = n_shared - 8
    tail = "Zebra " * 48  # the first prompt's own prefix ends chunks later
    a.complete(shared + tail + "The capital of Germany is")
    a.wait_idle()
    a.complete("Unrelated.\n" + "Zebra " * 20)  # the slot no longer holds the shared prefix
    a.wait_idle()
    second = a.complete(shared + "The capital of France is")  # shares it: leads its publish
    assert " Paris" in text_of(second)
    assert a.metric("maasd_router_prompt_tokens", kind="publish") > 0  # prefix-only prefill
    assert a.metric("maasd_router_entries", op="publish", outcome="ok") >= 2
    a.wait_idle()
    b = routers(backends=1)
    prompt = shared + "The capital of Italy is"  # shares only the lead's prefix
    warm = b.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) == boundary
    assert " Rome" in text_of(warm)
    n = len(tokens_of(b, prompt))
    evaluated = b.metric("maasd_router_prompt_tokens", kind="evaluated")
    assert 0 < evaluated <= n - boundary + 1  # partial: the window was restored whole


@pytest.fixture(scope="module")
def other_gemma(gemma_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma with one byte changed in the middle of its weights: the same size, metadata,
    first and last MiB and shapes — another model, as two fine-tunes are."""
    out = tmp_path_factory.mktemp("model") / "gemma-changed.gguf"
    shutil.copyfile(gemma_gguf, out)
    with open(out, "r+b") as f:
        f.seek(out.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    return out


def test_a_model_that_differs_only_in_its_middle_shares_nothing(
    routers: Any, gemma_gguf: Path, other_gemma: Path, daemon: Any, router_key: str
) -> None:
    changed, original = (routers(backends=1, model=m) for m in (other_gemma, gemma_gguf))
    with open(gemma_gguf, "rb") as f, open(other_gemma, "rb") as g:  # what edges could see
        assert f.read(1 << 20) == g.read(1 << 20)
        f.seek(-(1 << 20), os.SEEK_END)
        g.seek(-(1 << 20), os.SEEK_END)
        assert f.read() == g.read()
    assert changed.health()["fingerprint"] != original.health()["fingerprint"]
    prompt = "Middle.\n" + GERMANY
    changed.complete(prompt)
    changed.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    cold = original.complete(prompt)  # another fingerprint: other keys, a miss
    assert cold.headers["x-maasd-restored"] == "0"
    assert original.metric("maasd_router_entries", op="lookup", outcome="hit") == 0
    # the other model's real state of a prompt this fleet never saw, committed under
    # this fleet's key (a buggy or hostile writer of the tenant): refused, dropped
    forged = "Forged.\n" + GERMANY
    changed.complete(forged)
    changed.wait_metric("maasd_router_entries", 2, op="publish", outcome="ok")
    toks = tokens_of(original, forged)
    n = len(toks) - len(toks) % CHUNK
    entry = recommit(daemon, router_key, changed.health()["fingerprint"], original, toks[:n])
    original.wait_idle()
    warm = original.complete(forged)
    assert warm.headers["x-maasd-restored"] == "0"
    assert original.metric("maasd_router_entries", op="lookup", outcome="refused") == 1
    assert " Berlin" in text_of(warm)
    with Client(daemon.url, router_key) as c:
        assert entry not in {b.id for b in c.buffers()}


def recommit(daemon: Any, key: str, their_fp: str, ours: RouterProc, toks: list[int]) -> str:
    """Copy the entry another fleet published for ``toks`` under our fleet's key for them."""
    from maasd.llama.format import chunk_keys

    theirs = chunk_keys(their_fp, toks, CHUNK)[-1][1]
    mine = chunk_keys(ours.health()["fingerprint"], toks, CHUNK)[-1][1]
    with Worker(daemon.socket_path, key) as w:
        hit = w.lookup([theirs])
        assert hit is not None
        data = bytes(hit.array[: hit.size])
        hit.close()
        m = w.put(mine, len(data))
        m.array[: len(data)] = np.frombuffer(data, np.uint8)
        return w.commit(m).id


def test_a_python_worker_of_another_fingerprint_shares_nothing_either_way(
    routers: Any, daemon: Any, router_key: str, gemma_gguf: Path
) -> None:
    """A worker on the same model file but its own fingerprint (KVStore's default, not
    the fleet's): its entries are misses for the router and the router's for it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from maasd.llama import KVStore

    r = routers(backends=1)
    py = llama_cpp.Llama(str(gemma_gguf), n_ctx=512, n_threads=1, verbose=False)
    first = "Worker's own.\n" + GERMANY
    toks = tokens_of(r, first)
    n = len(toks) - len(toks) % CHUNK
    py.eval(toks[:n])
    with Worker(daemon.socket_path, router_key) as w:
        kv = KVStore(None, w, py, chunk=CHUNK)  # its own fingerprint
        assert kv.fingerprint != r.health()["fingerprint"]
        assert kv.save(0, toks[:n]) is not None
    out = r.complete(first)
    assert out.headers["x-maasd-restored"] == "0"
    assert " Berlin" in text_of(out)
    second = "Router's own.\n" + GERMANY
    r.complete(second)
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    with Worker(daemon.socket_path, router_key) as w:
        assert KVStore(None, w, py, chunk=CHUNK).restore(0, tokens_of(r, second)) == 0
    assert r.metric("maasd_router_entries", op="lookup", outcome="refused") == 0  # keys differ


def test_attached_backends_that_run_differently_are_refused_saying_what_differs(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """Two backends of one model, one with flash attention (V not transposed): what the
    router reads from each differs, so it does not start (one router, one fingerprint);
    and --cache-type-k must be what an attached backend runs."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    logs = tmp_path / "server.log"
    with (
        attached_server(llama_server, gemma_gguf, dirs[0], logs, slots=1) as a,
        attached_server(llama_server, gemma_gguf, dirs[1], logs, "-fa", "on", slots=1) as b,
    ):
        pairs = [
            ("--backend", a, "--slot-dir", str(dirs[0])),
            ("--backend", b, "--slot-dir", str(dirs[1])),
        ]
        with pytest.raises(RuntimeError, match="router exited") as e:
            routers(backends=0, router_args=pairs[0] + pairs[1])
        assert "differ: settings" in str(e.value)
        assert "flash attention" in str(e.value)
        with pytest.raises(RuntimeError, match="router exited") as e:
            routers(backends=0, router_args=(*pairs[0], "--cache-type-k", "q8_0"))
        assert "--cache-type-k/-v ('q8_0', 'f16'), but the backends run K f16" in str(e.value)
        fa = routers(backends=0, router_args=pairs[1])  # alone: it is what it is, read
        plain = routers(backends=0, router_args=pairs[0])
        assert fa.health()["fingerprint"] != plain.health()["fingerprint"]
