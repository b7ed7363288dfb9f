"""The Grafana dashboard's metric names, and the names a scrape exposes: the dashboard
tests prove every name it queries is exposed by a running daemon, worker or router."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "maasd.json"
ROUTER = "maasd_router_"


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's PromQL expressions use."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", []) if t.get("expr")]
    assert exprs, "a dashboard without queries"
    return {name for e in exprs for name in re.findall(r"\bmaasd_[a-zA-Z0-9_:]*", e)}


def exposed(text: str) -> set[str]:
    """Every sample name a scrape exposes, also of families without samples yet."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for f in text_string_to_metric_families(text):
        names.add(f.name)
        names.update(f.name + s for s in suffixes.get(f.type, ()))
        names.update(s.name for s in f.samples)
    return names
