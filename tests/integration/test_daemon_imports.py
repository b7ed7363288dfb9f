"""A serving daemon loads neither numpy nor pydantic, even after a reserve, a placement
count and a pin: numpy's OpenBLAS starts threads at import (a daemon at its
``RLIMIT_NPROC`` cannot), and either costs every start its import
(tests/unit/test_daemon_start_cost.py: what ``maasd serve`` imports)."""

from __future__ import annotations

from pathlib import Path

from conftest import Daemon

MiB = 1 << 20


def _loaded(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name for name in ("numpy", "openblas", "pydantic_core") if name in maps}


def test_a_serving_daemon_loads_no_numpy_or_pydantic(daemon: Daemon) -> None:
    assert daemon.proc is not None
    _, key = daemon.tenant("imports", 64 * MiB)
    with daemon.client(key) as c:
        r = c.post("/v1/reserve", json={"size_bytes": 4 * MiB})
        assert r.status_code == 201, r.text
        buffer_id = r.json()["id"]
        shown = c.get(f"/v1/buffers/{buffer_id}")  # the pages per node, counted now
        assert shown.status_code == 200, shown.text
        assert shown.json()["placement"], shown.text
        pinned = c.patch(f"/v1/buffers/{buffer_id}/pin", json={"numa_node": 0})
        assert pinned.status_code == 200, pinned.text
        assert c.delete(f"/v1/buffers/{buffer_id}").status_code == 204
    assert daemon.admin.get("/docs").status_code == 200
    assert daemon.admin.get("/schema/openapi.json").status_code == 200
    assert _loaded(daemon.proc.pid) == set()
