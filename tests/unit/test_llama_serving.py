"""The pure parts of prefix sharing for llama-cpp-python and of ``maasd worker``.

``Link`` (the lazily re-opened connection), which keys a ``MaasdCache`` save goes under,
the worker's command line, and its metrics (token accounting, time to first token, the
middleware) — none needs a daemon or a model.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from maasd.client import Worker
from maasd.client import errors as ce
from maasd.llama.link import FIRST_RETRY_S, Link


class FakeWorker:
    """A connection as far as ``Link`` uses one: ``closed`` and ``close``."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def fake_worker(*_: str) -> Worker:
    return cast(Worker, FakeWorker())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_link_opens_lazily_backs_off_and_reports_changes() -> None:
    clock, events, tries = Clock(), [], []
    failing = [ce.ConnectionFailed("refused")]

    def open_worker(path: str, key: str) -> Worker:
        tries.append((path, key))
        if failing:
            raise failing.pop()
        return fake_worker()

    link = Link(
        "/s", "k", open_worker=open_worker, on_change=lambda up, _w: events.append(up), clock=clock
    )
    assert tries == []  # nothing before the first use
    assert link.get() is None
    assert events == [False]
    assert link.get() is None  # within the back-off: not tried again
    assert len(tries) == 1
    clock.now += FIRST_RETRY_S
    w = link.get()
    assert isinstance(w, FakeWorker)
    assert events == [False, True]
    assert link.get() is w  # kept while it is open
    assert link.up

    link.failed(ce.DuplicateKey(409, "Duplicate key", "k"))  # a refusal: still up
    assert link.get() is w
    link.failed(ce.ConnectionFailed("gone"))  # broken: closed
    assert w.closed
    assert events == [False, True, False]
    assert link.get() is None
    clock.now += 2 * FIRST_RETRY_S
    assert link.get() is not None
    link.close()
    assert link.get() is None  # closed for good


def test_a_revoked_key_breaks_the_link() -> None:
    link = Link("/s", "k", open_worker=fake_worker)
    w = link.get()
    assert w is not None
    link.failed(ce.Unauthorized(401, "Unauthorized", "revoked"))
    assert w.closed
    assert not link.up


# ----------------------------------------------------------------------------- keys


cache = pytest.importorskip("maasd.llama.cache", reason="needs llama-cpp-python")
context = pytest.importorskip("maasd.llama.context")


@pytest.mark.parametrize(
    ("n", "last", "want"),
    [
        (700, None, [640]),  # no lookup (the model held the prompt): the end only
        # a miss: the end, then the three largest chunk × 2^k within the prompt
        (700, (context.Restore("miss"), 650), [640, 512, 256, 128]),
        (100, (context.Restore("miss"), 90), [64]),
        (40, (context.Restore("miss"), 30), [40]),  # shorter than a chunk: its length
        # a hit found under 512 sharing 600: the end and the fork point 576
        (700, (context.Restore("hit", matched=512, common=600), 650), [640, 576]),
        # found under its fork point: only the end
        (700, (context.Restore("hit", matched=576, common=600), 650), [640]),
        # the end is the key it was found under: nothing new
        (650, (context.Restore("hit", matched=640, common=645), 650), []),
        (700, (context.Restore("not_better", matched=64, common=300), 650), [640, 256]),
        (700, (context.Restore("down"), 650), [640]),
        (700, (context.Restore("refused", matched=128), 650), [640]),
    ],
)
def test_which_keys_a_save_goes_under(n: int, last: Any, want: list[int]) -> None:
    assert cache.save_lengths(n, 64, last) == want


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert context.common_prefix(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert context.common_prefix(a, a[:2]) == 2
    assert context.common_prefix(a, np.array([], dtype=np.int32)) == 0
    assert context.common_prefix(a, a.copy()) == 4


# ----------------------------------------------------------------------------- worker


def test_the_worker_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from maasd.llama.worker import parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(28))  # --model is looked at, not loaded
    monkeypatch.setenv("MAASD_KEY", "maasd_k")
    monkeypatch.setenv("MAASD_SOCKET", "/run/maasd.sock")
    cfg = parse_args(["--model", "m.gguf", "--processes", "2", "--n_ctx", "4096"])
    assert cfg.processes == 2
    assert cfg.key == "maasd_k"
    assert cfg.socket == "/run/maasd.sock"
    assert cfg.model["n_ctx"] == 4096
    # the defaults maasd worker changes
    assert cfg.host == "127.0.0.1"
    assert cfg.server["interrupt_requests"] is False
    assert cfg.model["logits_all"] is False
    assert cfg.model["verbose"] is False
    # … and what the command line says wins
    cfg = parse_args(["--model", "m.gguf", "--interrupt_requests", "true", "--cache", "true"])
    assert cfg.server["interrupt_requests"] is True
    assert cfg.model["cache"] is False  # maasd is the cache


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "--model is required"),
        (["--model", "m", "--processes", "0"], "at least 1"),
        (["--model", "m", "--processes", "100000"], "--processes must be at most "),
        (["--model", "m", "--n_ctx", "-1"], "--n_ctx"),
        (["--model", "m", "--logits_all", "maybe"], "logits_all"),
        (["--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: cannot read it"),
        (["--model", "/"], "--model /: is a directory"),
        (["--model", "/dev/null"], "--model /dev/null: not a regular file"),
        (["--model", "/proc/self/status"], "--model /proc/self/status: not a GGUF file"),
        (["--model", "/dev/null", "--port", "70000"], "--port must be 0-65535, not 70000"),
        (["--model", "m", "--maasd-url", "http://[::1"], "--maasd-url http://[::1: not a URL"),
        (["--model", "m", "--maasd-url", "localhost:7878"], "not an http:// or https:// URL"),
        (["--model", "m", "--maasd-url", "ftp://h"], "not an http:// or https:// URL"),
        (["--model", "m", "--graceful-timeout", "-1"], "--graceful-timeout must be 0 or more"),
    ],
)
def test_a_bad_worker_command_line_exits_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from maasd.llama.worker import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_processes_are_bounded_by_the_cpus_the_worker_may_run_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--processes`` at most 4 per CPU of the worker's affinity mask: 100000 tried to
    start that many llama.cpp processes."""
    from maasd.llama.worker import parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(28))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert parse_args(["--model", "m.gguf", "--processes", "8"]).processes == 8
    with pytest.raises(SystemExit) as info:
        parse_args(["--model", "m.gguf", "--processes", "9"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err == "maasd worker: error: --processes must be at most 8 (4 per CPU it may run on), not 9"
    )


def test_worker_metrics_count_tokens_by_source_and_time_the_first_token() -> None:
    from maasd.llama.worker_metrics import WorkerMetrics

    m = WorkerMetrics(pid=7)

    def value(name: str, **labels: str) -> float:
        got = m.registry.get_sample_value(name, {"pid": "7", **labels})
        return 0.0 if got is None else got

    m.looked_up(prompt=100, held=0, restored=90, outcome="hit")
    m.looked_up(prompt=50, held=49, restored=0, outcome="held")
    m.looked_up(prompt=30, held=0, restored=0, outcome="miss")
    assert value("maasd_worker_prompt_tokens_total", source="restored") == 90
    assert value("maasd_worker_prompt_tokens_total", source="held") == 49
    assert value("maasd_worker_prompt_tokens_total", source="evaluated") == 10 + 1 + 30
    assert value("maasd_worker_cache_lookups_total", outcome="hit") == 1

    class Model:
        def sample(self, *_a: Any, **_k: Any) -> int:
            return 5

    model = Model()
    m.hook_sampling(model)
    assert model.sample() == 5  # armed by the last looked_up: timed
    assert model.sample() == 5  # not the first token: not timed
    assert value("maasd_worker_ttft_seconds_count") == 1
    m.sharing(True)
    assert m.registry.get_sample_value("maasd_worker_sharing_enabled") == 1
    body, content_type = m.render()
    assert b"maasd_worker_ttft_seconds_bucket" in body
    assert content_type.startswith("text/plain")


@pytest.mark.parametrize("shared_dir", [False, True], ids=["one-process", "multiprocess"])
def test_worker_metrics_list_every_family_the_dashboard_reads_before_any_completion(
    shared_dir: bool, tmp_path: Path
) -> None:
    """A fresh process's save, restore and first-token series exist at zero, so a scrape
    lists them whichever process answers it (the multiprocess files included). In a
    process of its own: prometheus-client picks its value store once, at import."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if shared_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    code = (
        "import sys; from maasd.llama.worker_metrics import WorkerMetrics; "
        "sys.stdout.write(WorkerMetrics(pid=11).render()[0].decode())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    body = run.stdout
    for name in (
        "maasd_worker_cache_restore_seconds_bucket",
        "maasd_worker_cache_save_seconds_bucket",
        "maasd_worker_ttft_seconds_bucket",
        "maasd_worker_cache_saved_bytes_total",
        "maasd_worker_cache_restored_bytes_total",
    ):
        assert name + "{" in body, name
    assert 'maasd_worker_cache_restore_seconds_count{pid="11"} 0.0' in body
    if shared_dir:
        assert any(tmp_path.iterdir())  # the values went to the shared files


def test_the_middleware_names_the_process_and_stamps_completions() -> None:
    from maasd.llama import worker_metrics as wm

    m = wm.WorkerMetrics(pid=42)
    seen: dict[str, Any] = {}

    async def app(_scope: Any, _receive: Any, send: Any) -> None:
        seen["arrived"] = wm._ARRIVED.get(None)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request"}

    async def call(path: str) -> None:
        scope = {"type": "http", "path": path}
        await m.middleware(app)(scope, receive, send)

    asyncio.run(call("/v1/models"))
    assert seen["arrived"] is None
    assert (wm.PID_HEADER, b"42") in sent[0]["headers"]
    asyncio.run(call("/v1/chat/completions"))
    assert seen["arrived"] is not None
