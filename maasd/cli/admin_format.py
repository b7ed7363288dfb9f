"""Human output of ``maasctl``: rich tables and panels, built from API dicts.

Every function takes the JSON the daemon returned (plain dicts/lists) and
returns a rich renderable; nothing here does I/O, so the same renderables
serve one-shot commands and the refreshing ``top`` view. Sizes are shown in
binary units and right-aligned; bars and colours come from
:mod:`maasd.cli.admin_units` (rich drops the colours when the output is not a
terminal).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from maasd.cli.admin_units import bar, format_percent, format_size, usage_fraction

__all__ = [
    "buffer_detail",
    "buffers_table",
    "format_cpus",
    "format_time",
    "key_issued",
    "pools_table",
    "status_view",
    "tenant_created",
    "tenant_detail",
    "tenants_table",
    "topology_view",
    "usage_bar",
    "usage_view",
]

Json = Mapping[str, Any]


def _style_for(fraction: float) -> str:
    if fraction >= 0.9:
        return "red"
    if fraction >= 0.7:
        return "yellow"
    return "green"


def usage_bar(
    used: int | None, total: int | None, width: int = 24, *, ascii_only: bool = False
) -> Text:
    """``████░░░░  42.5%`` coloured by fill level (green, yellow ≥ 70 %, red ≥ 90 %)."""
    f = usage_fraction(used, total)
    text = Text(bar(f, width, ascii_only=ascii_only), style=_style_for(f))
    if used and (not total or total <= 0):
        text.append("   over", style="bold red")  # a zero quota with use: no percentage
    else:
        text.append(f" {format_percent(f):>6}", style="bold red" if f > 1 else "")
    return text


def _size(n: Any) -> Text:
    return Text(format_size(n) if isinstance(n, int | float) else "-", justify="right")


def _id(value: Any) -> Text:
    return Text(str(value) if value is not None else "-", style="cyan", overflow="fold")


def _opt(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _ago(delta_s: float) -> str:
    s = int(abs(delta_s))
    if s < 60:
        out = f"{s}s"
    elif s < 3600:
        out = f"{s // 60}m{s % 60:02d}s"
    elif s < 86400:
        out = f"{s // 3600}h{(s % 3600) // 60:02d}m"
    else:
        out = f"{s // 86400}d{(s % 86400) // 3600:02d}h"
    return f"in {out}" if delta_s > 0 else f"{out} ago"


def format_time(value: Any, *, relative: bool = False, now: dt.datetime | None = None) -> str:
    """``2025-01-02T03:04:05.123456Z`` → ``2025-01-02 03:04:05Z`` (``(in 9m58s)`` if relative)."""
    t = _parse_time(value)
    if t is None:
        return _opt(value)
    out = t.strftime("%Y-%m-%d %H:%M:%SZ")
    if relative:
        now = now or dt.datetime.now(dt.UTC)
        out += f" ({_ago((t - now).total_seconds())})"
    return out


def format_cpus(cpus: Any) -> str:
    """``[0, 1, 2, 3, 8, 10]`` → ``0-3,8,10``."""
    if not isinstance(cpus, list) or not all(isinstance(c, int) for c in cpus):
        return _opt(cpus)
    if not cpus:
        return "-"
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = ordered[0]
    for c in ordered[1:]:
        if c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _table(title: str | None = None, **kw: Any) -> Table:
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        header_style="bold",
        pad_edge=False,
        **kw,
    )


# -- pools --------------------------------------------------------------------


def pools_table(pools: Iterable[Json], *, title: str | None = None) -> Table:
    t = _table(title)
    t.add_column("NAME", style="bold", no_wrap=True)
    t.add_column("ID", overflow="fold")
    t.add_column("NODE", justify="right")
    t.add_column("BACKING")
    t.add_column("PERSISTENCE")
    t.add_column("LAT µs", justify="right")
    t.add_column("CAPACITY", justify="right")
    t.add_column("USED", justify="right")
    t.add_column("FREE", justify="right")
    t.add_column("PAGE", justify="right")
    t.add_column("BUFFERS", justify="right")
    t.add_column("SCRUB")
    for p in pools:
        t.add_row(
            _opt(p.get("name")),
            _id(p.get("id")),
            _opt(p.get("numa_node")),
            _opt(p.get("backing")),
            _opt(p.get("persistence")),
            _opt(p.get("latency_us")),
            _size(p.get("capacity_bytes")),
            _size(p.get("used_bytes")),
            _size(p.get("free_bytes")),
            _size(p.get("page_bytes")),
            _opt(p.get("buffers")),
            _opt(p.get("scrub")),
        )
    return t


# -- tenants --------------------------------------------------------------------


def tenants_table(tenants: Iterable[Json], *, ascii_only: bool = False) -> Table:
    t = _table()
    t.add_column("NAME", style="bold", no_wrap=True)
    t.add_column("ID", overflow="fold")
    t.add_column("QUOTA", justify="right")
    t.add_column("USED", justify="right")
    t.add_column("USE", no_wrap=True)
    t.add_column("BUFFERS", justify="right")
    t.add_column("CREATED", no_wrap=True)
    for x in tenants:
        t.add_row(
            _opt(x.get("name")),
            _id(x.get("id")),
            _size(x.get("quota_bytes")),
            _size(x.get("used_bytes")),
            usage_bar(x.get("used_bytes"), x.get("quota_bytes"), 12, ascii_only=ascii_only),
            _opt(x.get("buffers")),
            format_time(x.get("created_at")),
        )
    return t


def _kv_table() -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    return t


def tenant_detail(x: Json, *, ascii_only: bool = False) -> Table:
    t = _kv_table()
    t.add_row("name", _opt(x.get("name")))
    t.add_row("id", _id(x.get("id")))
    t.add_row("quota", format_size(x.get("quota_bytes")))
    t.add_row("used", format_size(x.get("used_bytes")))
    t.add_row("use", usage_bar(x.get("used_bytes"), x.get("quota_bytes"), ascii_only=ascii_only))
    t.add_row("buffers", _opt(x.get("buffers")))
    if "created_at" in x:
        t.add_row("created", format_time(x.get("created_at")))
    return t


def tenant_created(x: Json) -> Group:
    t = _kv_table()
    t.add_row("name", _opt(x.get("name")))
    t.add_row("id", _id(x.get("id")))
    t.add_row("quota", format_size(x.get("quota_bytes")))
    if "key_id" in x:
        t.add_row("key id", _id(x.get("key_id")))
    t.add_row("api key", Text(_opt(x.get("api_key")), style="bold yellow", overflow="fold"))
    return Group(
        Text("Tenant created.", style="bold green"),
        t,
        Text("The API key is shown only this once: store it now (MAASD_KEY).", style="dim"),
    )


def key_issued(tenant: Json, key: Json) -> Group:
    t = _kv_table()
    t.add_row("tenant", f"{_opt(tenant.get('name'))} ({_opt(tenant.get('id'))})")
    t.add_row("key id", _id(key.get("id")))
    t.add_row("api key", Text(_opt(key.get("api_key")), style="bold yellow", overflow="fold"))
    t.add_row("created", format_time(key.get("created_at")))
    return Group(
        Text("Key issued.", style="bold green"),
        t,
        Text("The API key is shown only this once: store it now (MAASD_KEY).", style="dim"),
    )


# -- buffers --------------------------------------------------------------------


def _short(value: Any, n: int = 24) -> str:
    s = _opt(value)
    return s if len(s) <= n else s[: n - 1] + "…"


def buffers_table(
    buffers: Iterable[Json],
    *,
    tenant_names: Mapping[str, str] | None = None,
    pool_names: Mapping[str, str] | None = None,
) -> Table:
    tenant_names = tenant_names or {}
    pool_names = pool_names or {}
    t = _table()
    t.add_column("ID", overflow="fold")
    t.add_column("TENANT", no_wrap=True)
    t.add_column("POOL", no_wrap=True)
    t.add_column("SIZE", justify="right")
    t.add_column("NODE", justify="right")
    t.add_column("PERSISTENCE")
    t.add_column("STATE")
    t.add_column("EVICT")
    t.add_column("LABEL")
    t.add_column("KEY")
    t.add_column("EXPIRES", no_wrap=True)
    now = dt.datetime.now(dt.UTC)
    for b in buffers:
        tid = str(b.get("tenant_id"))
        pid = str(b.get("pool_id"))
        t.add_row(
            _id(b.get("id")),
            tenant_names.get(tid, tid),
            pool_names.get(pid, pid),
            _size(b.get("size_bytes")),
            _opt(b.get("numa_node")),
            _opt(b.get("persistence")),
            _opt(b.get("state")),
            _opt(b.get("evictable")),
            _short(b.get("label")),
            _short(b.get("key")),
            _relative_only(b.get("expires_at"), now),
        )
    return t


def events_table(
    events: Iterable[Json],
    *,
    tenant_names: Mapping[str, str] | None = None,
    pool_names: Mapping[str, str] | None = None,
) -> Table:
    tenant_names = tenant_names or {}
    pool_names = pool_names or {}
    t = _table()
    t.add_column("#", justify="right")
    t.add_column("AT", no_wrap=True)
    t.add_column("EVENT", no_wrap=True)
    t.add_column("TENANT", no_wrap=True)
    t.add_column("POOL", no_wrap=True)
    t.add_column("BUFFER", overflow="fold")
    t.add_column("BYTES", justify="right")
    t.add_column("DETAIL")
    for e in events:
        tid, pid = e.get("tenant_id"), e.get("pool_id")
        t.add_row(
            _opt(e.get("id")),
            format_time(e.get("at")),
            _opt(e.get("kind")),
            tenant_names.get(str(tid), _opt(tid)),
            pool_names.get(str(pid), _opt(pid)),
            _id(e.get("buffer_id")) if e.get("buffer_id") else Text("-"),
            _size(e.get("bytes")) if e.get("bytes") is not None else Text("-"),
            _short(e.get("detail"), 40),
        )
    return t


def _relative_only(value: Any, now: dt.datetime) -> str:
    t = _parse_time(value)
    return _ago((t - now).total_seconds()) if t else _opt(value)


def buffer_detail(
    b: Json, *, tenant_name: str | None = None, pool_name: str | None = None
) -> Table:
    t = _kv_table()
    t.add_row("id", _id(b.get("id")))
    tenant = _opt(b.get("tenant_id"))
    t.add_row("tenant", f"{tenant_name} ({tenant})" if tenant_name else tenant)
    pool = _opt(b.get("pool_id"))
    t.add_row("pool", f"{pool_name} ({pool})" if pool_name else pool)
    size = b.get("size_bytes")
    t.add_row("size", f"{format_size(size)} ({size} bytes)" if isinstance(size, int) else "-")
    t.add_row("numa node", _opt(b.get("numa_node")))
    placement = b.get("placement")
    if isinstance(placement, dict) and placement:
        t.add_row("placement", ", ".join(f"node {k}: {v} pages" for k, v in placement.items()))
    t.add_row("persistence", _opt(b.get("persistence")))
    t.add_row("state", _opt(b.get("state")))
    t.add_row("evictable", _opt(b.get("evictable")))
    t.add_row("label", Text(_opt(b.get("label")), overflow="fold"))
    t.add_row("key", Text(_opt(b.get("key")), overflow="fold"))
    if b.get("checksum"):
        t.add_row("checksum", _opt(b.get("checksum")))
    t.add_row("created", format_time(b.get("created_at")))
    t.add_row("expires", format_time(b.get("expires_at"), relative=True))
    return t


# -- usage, topology, status ----------------------------------------------------------


def usage_view(u: Json, *, ascii_only: bool = False) -> Table:
    t = _kv_table()
    t.add_row("tenant", _id(u.get("tenant_id")))
    t.add_row("quota", format_size(u.get("quota_bytes")))
    t.add_row("used", format_size(u.get("used_bytes")))
    quota, used = u.get("quota_bytes"), u.get("used_bytes")
    if isinstance(quota, int) and isinstance(used, int):
        t.add_row("free", format_size(max(0, quota - used)))
    t.add_row("use", usage_bar(used, quota, ascii_only=ascii_only))
    t.add_row("buffers", _opt(u.get("buffers")))
    return t


def topology_view(topo: Json) -> Group:
    t = _table("NUMA nodes")
    t.add_column("NODE", justify="right")
    t.add_column("CPUS")
    t.add_column("MEM TOTAL", justify="right")
    t.add_column("MEM FREE", justify="right")
    t.add_column("DISTANCES")
    for n in topo.get("nodes") or []:
        d = n.get("distances")
        dist = " ".join(str(x) for x in d) if isinstance(d, list) else _opt(d)
        t.add_row(
            _opt(n.get("id")),
            format_cpus(n.get("cpus")),
            _size(n.get("mem_total_bytes")),
            _size(n.get("mem_free_bytes")),
            dist,
        )
    hp = _kv_table()
    hp.add_row("huge page size", format_size(topo.get("hugepage_bytes")))
    hp.add_row("huge pages free", _opt(topo.get("hugepages_free")))
    return Group(t, hp)


def _sum(items: Iterable[Json], field: str) -> int:
    return sum(v for x in items if isinstance(v := x.get(field), int))


def status_view(
    pools: list[Json], tenants: list[Json] | None, *, ascii_only: bool = False
) -> Group:
    """Pools with usage bars, tenants with quota bars, and totals (``maasctl status``)."""
    pt = _table("Pools")
    pt.add_column("NAME", style="bold", no_wrap=True)
    pt.add_column("NODE", justify="right")
    pt.add_column("KIND", no_wrap=True)
    pt.add_column("USE", no_wrap=True)
    pt.add_column("USED", justify="right")
    pt.add_column("CAPACITY", justify="right")
    pt.add_column("BUFFERS", justify="right")
    for p in pools:
        kind = f"{_opt(p.get('backing'))}/{_opt(p.get('persistence'))}"
        pt.add_row(
            _opt(p.get("name")),
            _opt(p.get("numa_node")),
            kind,
            usage_bar(p.get("used_bytes"), p.get("capacity_bytes"), ascii_only=ascii_only),
            _size(p.get("used_bytes")),
            _size(p.get("capacity_bytes")),
            _opt(p.get("buffers")),
        )
    if not pools:
        pt.add_row("(no pools)", "", "", "", "", "", "")
    parts: list[RenderableType] = [pt]

    if tenants is not None:
        tt = _table("Tenants")
        tt.add_column("NAME", style="bold", no_wrap=True)
        tt.add_column("USE", no_wrap=True)
        tt.add_column("USED", justify="right")
        tt.add_column("QUOTA", justify="right")
        tt.add_column("BUFFERS", justify="right")
        for x in tenants:
            tt.add_row(
                _opt(x.get("name")),
                usage_bar(x.get("used_bytes"), x.get("quota_bytes"), ascii_only=ascii_only),
                _size(x.get("used_bytes")),
                _size(x.get("quota_bytes")),
                _opt(x.get("buffers")),
            )
        if not tenants:
            tt.add_row("(no tenants)", "", "", "", "")
        parts += [Text(""), tt]

    cap, used = _sum(pools, "capacity_bytes"), _sum(pools, "used_bytes")
    tot = _kv_table()
    tot.add_row("capacity", f"{format_size(cap)} in {len(pools)} pool(s)")
    tot.add_row(
        "used", usage_bar(used, cap, ascii_only=ascii_only).append(f"  {format_size(used)}")
    )
    tot.add_row("free", format_size(max(0, cap - used)))
    tot.add_row("buffers", str(_sum(pools, "buffers")))
    if tenants is not None:
        quota = _sum(tenants, "quota_bytes")
        ratio = f" ({quota / cap:.2f}x capacity)" if cap else ""
        tot.add_row("tenants", str(len(tenants)))
        tot.add_row("quotas", f"{format_size(quota)}{ratio}")
    parts += [Text(""), Text("Totals", style="bold")]
    parts.append(tot)
    return Group(*parts)
