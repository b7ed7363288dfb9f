"""What a test checks after a daemon restart: the ledger against the live buffers, and a
buffer's bytes read and written through a worker mapping.

Import as ``from recovered import ledger_totals, read_buffer`` (``tests/`` is on the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from maasd.client import Worker

if TYPE_CHECKING:
    from conftest import Daemon


#: A config of two pools on node 0, ``vol`` (volatile) and ``pers`` (persistent):
#: ``POOLS.format(vol=…, pers=…)``.
POOLS = """
[[pools]]
name = "vol"
numa_node = 0
capacity_bytes = {vol}
persistence = "volatile"

[[pools]]
name = "pers"
numa_node = 0
capacity_bytes = {pers}
persistence = "persistent"
"""


def ledger_totals(d: Daemon) -> int:
    """Check ledger = live buffers on every view the API gives; return the bytes in use."""
    buffers = d.admin.get("/v1/buffers")
    assert buffers.status_code == 200, buffers.text
    in_buffers = sum(b["size_bytes"] for b in buffers.json())
    tenants = d.admin.get("/v1/tenants").json()
    in_tenants = sum(t["used_bytes"] for t in tenants)
    pools = d.admin.get("/v1/pools").json()
    in_pools = sum(p["used_bytes"] for p in pools)
    for p in pools:
        assert p["used_bytes"] + p["free_bytes"] == p["capacity_bytes"], p
        assert 0 <= p["used_bytes"] <= p["capacity_bytes"], p
    assert in_buffers == in_tenants == in_pools, (in_buffers, in_tenants, in_pools)
    assert (
        len(buffers.json())
        == sum(t["buffers"] for t in tenants)
        == sum(p["buffers"] for p in pools)
    )
    return in_buffers


def read_buffer(d: Daemon, key: str, buffer_id: str) -> bytes:
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buffer_id)
        data = m.array.tobytes()
        m.close()
    return data


def write_buffer(d: Daemon, key: str, buffer_id: str, data: bytes) -> None:
    with Worker(d.socket_path, key, renew_interval_s=0) as w:
        m = w.attach(buffer_id)
        m.array[:] = np.frombuffer(data, dtype=np.uint8)
        m.close()


def spill_ids(spill: Path) -> list[str]:
    """The buffer ids of a spill dir's files (every file, whatever its name), sorted."""
    return sorted(p.name.split(".")[0] for p in spill.iterdir()) if spill.exists() else []
