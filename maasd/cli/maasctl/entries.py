"""``maasctl entries``: what a tenant's entries hold, decoded from their bytes.

The REST API lists the tenant's keyed buffers (``GET /v1/buffers``); their bytes are
only reachable through the worker socket, so each entry is attached there as the
tenant (a read-only handle of a committed entry: it counts as no use, its lease and
LRU place are left alone) and its state is viewed in place
(:mod:`maasd.llama.views`, zero-copy): fingerprint, tokens, caches, layers, K/V types
and bytes per layer. An entry that holds something else says "not a llama state".
The daemon itself never parses an entry: this is the tenant's tool, on the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import click
from rich.console import Group
from rich.table import Table
from rich.text import Text

from maasd.bounds import worker_socket
from maasd.cli.maasctl.context import Ctx, pass_ctx, raw
from maasd.cli.maasctl.errors import Unreachable
from maasd.cli.maasctl.formatting import add_row, ident, kv_table, note, short, size, table, text
from maasd.cli.maasctl.units import format_size
from maasd.client import Buffer, ConnectionFailed, MaasdClientError, Worker
from maasd.llama.views import StateError, StateView, view_state

__all__ = ["decode", "entries"]


def decode(array: Any, size_bytes: int, key: str | None) -> dict[str, Any]:
    """What the bytes of an entry hold, JSON-able: ``{"llama": True, …summary}`` or
    ``{"llama": False, "why": …}``. Nothing of the mapping is kept (no view outlives it)."""
    try:
        v = view_state(array, size_bytes)
    except StateError as exc:
        return {"llama": False, "why": str(exc)}
    try:
        return {"llama": True, **_summary(v, key)}
    finally:
        del v


def _summary(v: StateView, key: str | None) -> dict[str, Any]:
    out = v.summary()
    out["bytes"] = sum(x.nbytes for x in v.layers)
    out["n_layers"] = len(v.layers)
    out["k_types"] = sorted({x.k_type_name for x in v.layers})
    out["v_types"] = sorted({t for x in v.layers if (t := x.v_type_name)})
    fp = v.fingerprint
    # The key of a router's or KVStore's entry is "<fingerprint>:<hash>".
    out["key_fingerprint"] = key.split(":", 1)[0] if key and ":" in key else None
    out["fingerprint_matches_key"] = fp is not None and out["key_fingerprint"] == fp
    return out


def _socket_path(given: str | None) -> str:
    return given or worker_socket()


@contextlib.contextmanager
def _worker(c: Ctx, socket_path: str | None) -> Iterator[Worker]:
    path = _socket_path(socket_path)
    try:
        w = Worker(path, c.key_for("tenant") or "", renew_interval_s=0, timeout=c.timeout)
    except ConnectionFailed as exc:
        raise Unreachable(
            f"cannot reach maasd's worker socket {path}",
            exc.detail,
            hint="set --socket or MAASD_SOCKET; entries show needs the host's socket",
        ) from None
    try:
        yield w
    finally:
        w.close()


def _read(w: Worker, b: Buffer) -> dict[str, Any]:
    """The decoded state of ``b``, attached through ``w`` (an error: ``readable`` false)."""
    try:
        m = w.attach(b.id)
    except MaasdClientError as exc:
        return {"llama": False, "readable": False, "why": f"{exc.title}: {exc.detail}"}
    try:
        return {"readable": True, **decode(m.array, m.size, b.key)}
    finally:
        with contextlib.suppress(MaasdClientError):
            w.detach(b.id)


def _what(s: dict[str, Any]) -> str:
    if not s.get("readable", True):
        return f"unreadable: {s['why']}"
    if not s["llama"]:
        return "not a llama state"
    caches = " + ".join(str(c["n_layers"]) for c in s["caches"])
    kv = "/".join(s["k_types"]) + " · " + "/".join(s["v_types"] or ["no V"])
    return f"{caches} layers, {kv}, {format_size(s['bytes'])} of K/V"


def _short_fp(s: dict[str, Any]) -> str:
    fp = s.get("fingerprint") if s.get("llama") else None
    return fp[:12] + "…" if fp else "-"


def entries_table(rows: list[tuple[Buffer, dict[str, Any]]]) -> Table:
    t = table()
    for col, kw in (
        ("ID", {"overflow": "fold"}),
        ("KEY", {}),
        ("SIZE", {"justify": "right"}),
        ("FINGERPRINT", {"no_wrap": True}),
        ("TOKENS", {"justify": "right"}),
        ("CELLS", {"justify": "right"}),
        ("HOLDS", {}),
    ):
        t.add_column(col, **kw)
    for b, s in rows:
        llama = s.get("llama", False)
        cells = "/".join(str(c["n_cells"]) for c in s["caches"]) if llama else "-"
        add_row(
            t,
            ident(b.id),
            short(b.key),
            size(b.size_bytes),
            _short_fp(s),
            s.get("n_tokens") if llama else "-",
            cells,
            _what(s),
        )
    return t


def layers_table(s: dict[str, Any]) -> Table:
    t = table("layers")
    for col in ("CACHE", "LAYER", "CELLS", "K TYPE", "K ROW", "V TYPE", "V ROW", "V", "BYTES"):
        t.add_column(col, justify="left" if "TYPE" in col or col == "V" else "right")
    for c in s["caches"]:
        for x in c["layers"]:
            add_row(
                t,
                c["index"],
                x["layer"],
                x["n_cells"],
                x["k_type"],
                x["k_row_bytes"],
                x["v_type"] or "-",
                x["v_row_bytes"] or "-",
                "transposed" if x["v_trans"] else "rows",
                size(x["bytes"]),
            )
    return t


def entry_detail(b: Buffer, s: dict[str, Any]) -> Group | Table:
    t = kv_table()
    add_row(t, "id", ident(b.id))
    add_row(t, "key", text(b.key, overflow="fold"))
    add_row(t, "size", f"{format_size(b.size_bytes)} ({b.size_bytes} bytes)")
    add_row(t, "state", b.state)
    if not s.get("llama"):
        add_row(t, "holds", _what(s))
        if s.get("readable", True):
            add_row(t, "why", s["why"])
        return t
    add_row(t, "form", s["form"])
    add_row(t, "fingerprint", s["fingerprint"] or "-")
    if s["fingerprint"] is not None:
        add_row(t, "key's fingerprint", "matches" if s["fingerprint_matches_key"] else "DIFFERS")
    add_row(t, "tokens", s["n_tokens"])
    caches = ", ".join(f"{c['n_layers']} layers × {c['n_cells']} cells" for c in s["caches"])
    add_row(t, "caches", caches)
    add_row(t, "K / V types", f"{'/'.join(s['k_types'])} / {'/'.join(s['v_types']) or '-'}")
    add_row(t, "K/V bytes", f"{format_size(s['bytes'])} of {format_size(s['memory_bytes'])} state")
    return Group(t, Text(""), layers_table(s))


def _socket_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--socket",
        "socket_path",
        envvar="MAASD_SOCKET",
        metavar="PATH",
        help="maasd's worker socket on this host [env MAASD_SOCKET, default DATA_DIR/maasd.sock].",
    )(f)


@click.group()
def entries() -> None:
    """What the tenant's entries hold (MAASD_KEY, on the daemon's host).

    \b
    Example:
      MAASD_KEY=… maasctl entries list
      MAASD_KEY=… maasctl entries show 9b2f0c4e…
    """


@entries.command("list")
@_socket_option
@pass_ctx
def entries_list(c: Ctx, socket_path: str | None) -> None:
    """The tenant's entries, each decoded: fingerprint, tokens, cells, layers, K/V types.

    \b
    Example:
      maasctl entries list
      maasctl --json entries list | jq '.[] | {key: .buffer.key, tokens: .state.n_tokens}'
    """
    with c.client("tenant") as client:
        with client.responses() as seen:
            # committed ones: a staged entry (put, being written) is not readable yet
            items = [b for b in client.buffers() if b.key is not None and b.state == "live"]
        answer = raw(seen) or []
    with _worker(c, socket_path) as w:
        rows = [(b, _read(w, b)) for b in items]
    by_id = {x["id"]: x for x in answer if isinstance(x, dict)}
    c.emit(
        [{"buffer": by_id.get(b.id), "state": _compact(s)} for b, s in rows],
        lambda: entries_table(rows) if rows else note("No entries."),
    )


def _compact(s: dict[str, Any]) -> dict[str, Any]:
    if not s.get("llama"):
        return s
    caches = [{k: v for k, v in c.items() if k != "layers"} for c in s["caches"]]
    return {**s, "caches": caches}


@entries.command("show")
@click.argument("buffer_id", metavar="ID")
@_socket_option
@pass_ctx
def entries_show(c: Ctx, buffer_id: str, socket_path: str | None) -> None:
    """One entry decoded, layer by layer: cells, K/V types, row sizes, V layout, bytes.

    \b
    Example:
      maasctl entries show 9b2f0c4e…
    """
    with c.client("tenant") as client, client.responses() as seen:
        b = client.buffer(buffer_id)
    with _worker(c, socket_path) as w:
        s = _read(w, b)
    c.emit({"buffer": raw(seen), "state": s}, lambda: entry_detail(b, s))
