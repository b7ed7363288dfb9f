"""``maasd router`` in front of real llama-server processes, on the real Gemma 3 270M.

Each router is a subprocess that starts its own backends (``scripts/llama-server``'s
build, one thread, one slot each) and talks to the module's real ``maasd serve``.
Prompts are the capitals texts of ``tests/llama_model.py``, whose greedy continuations
are confident enough that runs in other batch splits agree.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

pytest.importorskip("xxhash")

from llama_model import CAPITALS, GERMANY, SWEDEN  # noqa: E402
from maasd.client import Client, Worker  # noqa: E402
from maasd.llama.format import chunk_keys, header_len_for, pack_header, state_checksum  # noqa: E402
from router_fleet import CHUNK, attached_server, long_stream, text_of, tokens_of  # noqa: E402


def test_restore_from_maasd_equals_a_cold_run_on_another_router(routers: Any) -> None:
    a = routers(backends=1)
    cold = a.complete(GERMANY)
    assert cold.headers["x-maasd-restored"] == "0"
    a.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    b = routers(backends=1)  # another router, other backends: only maasd holds the prefix
    warm = b.complete(GERMANY)
    n = len(tokens_of(b, GERMANY))
    restored = int(warm.headers["x-maasd-restored"])
    assert restored == n - n % CHUNK
    assert text_of(warm) == text_of(cold)
    # a sliding-window model (Gemma 3) continued a prefix-only save: a partial prefill
    assert 0 < b.metric("maasd_router_prompt_tokens", kind="evaluated") <= n - restored + 1
    assert b.metric("maasd_router_prompt_tokens", kind="restored") > 0
    assert b.metric("maasd_router_restore_seconds_count") == 1
    # the slot now holds it: the next identical prompt needs no restore
    again = b.complete(GERMANY)
    assert again.headers["x-maasd-restored"] == "0"
    assert text_of(again) == text_of(cold)
    assert b.metric("maasd_router_prompt_tokens", kind="held") > 0


def test_real_slot_files_where_proc_links_cannot_be_used(routers: Any) -> None:
    copy = ("--slot-files", "copy")
    prompt = "Copies.\n" + SWEDEN
    a = routers(backends=1, router_args=copy)
    cold = a.complete(prompt)
    a.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    b = routers(backends=1, router_args=copy)
    warm = b.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) > 0
    assert text_of(warm) == text_of(cold)
    for r in (a, b):  # nothing left behind in the slot dirs
        for be in r.health()["backends"]:
            assert not list(Path(be["slot_dir"]).iterdir())


def test_a_prefix_from_backend_a_restores_on_backend_b_while_a_is_busy(routers: Any) -> None:
    r = routers(backends=2)
    prompt = "Fleet.\n" + SWEDEN  # a prefix of its own (the module's daemon holds others)
    first = r.complete(prompt)
    home = first.headers["x-maasd-backend"]
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    # keep the backend that holds the prefix busy with a long stream …
    done = threading.Event()

    def stream() -> None:
        body = long_stream("Fleet.\n" + CAPITALS + "Once upon a time")
        with r.http.stream("POST", "/v1/completions", json=body) as s:
            for _ in s.iter_raw():
                done.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert done.wait(120)
        busy = r.health()["backends"]
        if not busy[int(home)]["busy"]:
            pytest.skip("the long stream ended before the second request (a fast machine)")
        second = r.complete(prompt)
        # … the router never sends anything to a busy slot: the other backend restores
        assert second.headers["x-maasd-backend"] != home
        assert int(second.headers["x-maasd-restored"]) > 0
        assert text_of(second) == text_of(first)
    finally:
        t.join(300)


def forge(daemon: Any, key: str, fingerprint: str, toks: list[int], *, flip: str) -> str:
    """Commit, under the key of ``toks``, an entry a buggy or hostile writer of the tenant
    made: a bad state checksum, or another model's fingerprint with a valid checksum."""
    n = len(toks) - len(toks) % CHUNK
    the_key = chunk_keys(fingerprint, toks[:n], CHUNK)[-1][1]
    state = struct.pack("<Ii", 0xAF143CD8, 0) + os.urandom(64 << 10)
    crc = state_checksum(state)
    fp = "0" * 32 if flip == "fingerprint" else fingerprint
    head = pack_header(fp, toks[:n], len(state), crc ^ (1 if flip == "checksum" else 0), CHUNK)
    with Worker(daemon.socket_path, key) as w:
        m = w.put(the_key, header_len_for(n) + len(state))
        m.array[: len(head)] = np.frombuffer(head, np.uint8)
        m.array[len(head) : len(head) + len(state)] = np.frombuffer(state, np.uint8)
        return w.commit(m).id


@pytest.mark.parametrize("flip", ["checksum", "fingerprint"])
def test_a_corrupt_or_foreign_entry_is_a_miss_and_dropped(
    routers: Any, daemon: Any, router_key: str, flip: str
) -> None:
    r = routers(backends=1)
    prompt = f"Question {flip}.\n" + GERMANY
    fp = r.health()["fingerprint"]
    entry = forge(daemon, router_key, fp, tokens_of(r, prompt), flip=flip)
    cold = r.complete(prompt)
    assert cold.headers["x-maasd-restored"] == "0"
    assert r.metric("maasd_router_entries", op="lookup", outcome="refused") == 1
    assert " Berlin" in text_of(cold)  # the forged state never reached the server
    with Client(daemon.url, router_key) as c:  # dropped: nobody else trips on it
        assert entry not in {b.id for b in c.buffers()}
    assert r.health()["status"] == "ok"


def test_a_backend_killed_mid_stream_is_restarted(routers: Any) -> None:
    r = routers(backends=1)
    prompt = "Restarts.\n" + GERMANY
    cold = r.complete(prompt)
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    r.wait_idle()
    pid = r.health()["backends"][0]["pid"]
    body = long_stream(prompt, 300)
    chunks: list[bytes] = []
    with r.http.stream("POST", "/v1/completions", json=body) as s:
        for c in s.iter_raw():
            chunks.append(c)
            if len(chunks) == 3:
                os.kill(pid, signal.SIGKILL)
    tail = b"".join(chunks)[-2000:]
    assert b"[DONE]" not in tail  # cut short …
    assert b'"error"' in tail  # … with an error event, not a silent end
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = r.health()["backends"][0]
        if h["alive"] and h["restarts"] == 1:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"not restarted: {r.health()}\n{r.log()}")
    assert h["pid"] != pid
    # the new process holds nothing: the prefix survives in maasd and is restored
    warm = r.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) > 0
    assert text_of(warm) == text_of(cold)
    assert r.metric("maasd_router_backend_restarts") == 1
    assert r.metric("maasd_router_errors", kind="backend_died") == 1


def test_without_maasd_it_is_a_plain_balancer_and_says_so(routers: Any, tmp_path: Path) -> None:
    r = routers(backends=1, socket_path=str(tmp_path / "no-such.sock"))
    assert r.metric("maasd_router_sharing") == 0
    assert r.health()["sharing"] is False
    assert " Berlin" in text_of(r.complete(GERMANY))
    assert "PREFIX SHARING OFF" in r.log()


def test_chat_streams_and_models(routers: Any) -> None:
    r = routers(backends=1)
    body = {
        "messages": [{"role": "user", "content": GERMANY}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with r.http.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        raw = b"".join(s.iter_raw())
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert events
    assert events[0]["object"] == "chat.completion.chunk"
    models = r.http.get("/v1/models").json()
    assert models["data"]
    bad = r.http.post("/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400
    assert r.health()["status"] == "ok"


def test_attached_backends_with_two_slots(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    from maasd.router.files import PREFIX

    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    stale = slot_dir / f"{PREFIX}999999999-0-restore"  # a link a crashed router left
    stale.symlink_to("/proc/999999999/fd/3")
    with attached_server(llama_server, gemma_gguf, slot_dir, tmp_path / "attached.log") as url:
        r = routers(backends=0, router_args=("--backend", url, "--slot-dir", str(slot_dir)))
        assert not stale.is_symlink()  # swept at start
        assert r.health()["backends"][0]["slots"] == 2
        first = r.complete("Attached.\n" + GERMANY)
        r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
        # a second prompt sharing nothing goes to the other, empty slot
        other = r.complete("Zebra " * 20)
        assert other.headers["x-maasd-slot"] != first.headers["x-maasd-slot"]
        r.wait_idle()
        again = r.complete("Attached.\n" + GERMANY)
        assert again.headers["x-maasd-slot"] == first.headers["x-maasd-slot"]
        assert text_of(again) == text_of(first)
        assert not [p for p in slot_dir.iterdir()]  # no link left behind


def test_python_workers_and_llama_server_share_entries_both_ways(
    routers: Any, daemon: Any, router_key: str, gemma_gguf: Path
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from maasd.llama import KVStore, LlamaSeqAdapter
    from maasd.llama.fleet import model_fleet_fingerprint

    def load() -> Any:
        return llama_cpp.Llama(str(gemma_gguf), n_ctx=512, n_threads=1, verbose=False)

    r = routers(backends=1)
    py = load()
    fp = model_fleet_fingerprint(py)
    assert fp == r.health()["fingerprint"]  # one llama.cpp build, the same settings
    # a prefix a Python worker computed, restored by llama-server
    first = "Python first.\n" + GERMANY
    toks = tokens_of(r, first)
    n = len(toks) - len(toks) % CHUNK
    py.eval(toks[:n])
    with Worker(daemon.socket_path, router_key) as w:
        assert KVStore(None, w, py, chunk=CHUNK, fingerprint=fp).save(0, toks[:n]) is not None
    out = r.complete(first)
    assert int(out.headers["x-maasd-restored"]) == n
    assert " Berlin" in text_of(out)
    # and one llama-server computed, restored by a Python worker
    second = "Server first.\n" + GERMANY
    r.complete(second)
    r.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    toks2 = tokens_of(r, second)
    m = len(toks2) - len(toks2) % CHUNK
    b = load()
    with Worker(daemon.socket_path, router_key) as w:
        kv = KVStore(None, w, b, chunk=CHUNK, fingerprint=fp)
        # the entry holds the server's whole slot (the prompt and the answer) under the
        # key of its m-token prefix: a worker restores as much as its prompt shares, here
        # capped at m to compare logits in the batch split of the tolerance below
        assert kv.restore(0, toks2, max_tokens=m) == m
    b.eval(toks2[m:])
    c = load()  # cold, in the same batch split
    c.eval(toks2[:m])
    c.eval(toks2[m:])
    lb, lc = LlamaSeqAdapter(b).last_logits(), LlamaSeqAdapter(c).last_logits()
    assert int(np.argmax(lb)) == int(np.argmax(lc))
    np.testing.assert_allclose(lb, lc, rtol=0, atol=1.5)
