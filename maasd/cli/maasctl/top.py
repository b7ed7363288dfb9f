"""The machinery of ``maasctl top``: a refreshing full-screen view built from ``GET /metrics``.

Each frame scrapes the Prometheus text (admin or metrics key, unless the daemon runs
with --metrics-public), keeps the previous
scrape to turn the ``maasd_reserve_total`` / ``maasd_release_total`` counters
into rates, and — when the key may list pools and tenants — adds names and
quotas from the REST API. Keys are read from the terminal in cbreak mode with
``select`` so the view never blocks on input; ``q`` or Ctrl-C leave it and the
terminal is restored on every way out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import select
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from maasd.cli.maasctl.errors import from_client_error
from maasd.cli.maasctl.formatting import add_row, note, table, text, usage_bar
from maasd.cli.maasctl.units import format_size
from maasd.client import Client, Forbidden, MaasdClientError, Pool, Tenant, Unauthorized

__all__ = ["KeyReader", "Snapshot", "TopView", "parse_metrics", "rates", "run_top", "sparkline"]


@dataclass
class Snapshot:
    """What one scrape of ``/metrics`` says, keyed by the metric labels."""

    at: float
    pool_capacity: dict[str, float] = field(default_factory=dict)
    pool_used: dict[str, float] = field(default_factory=dict)
    pool_buffers: dict[str, float] = field(default_factory=dict)
    tenant_used: dict[str, float] = field(default_factory=dict)
    tenant_quota: dict[str, float] = field(default_factory=dict)
    #: tenant label (an id) → the ``name`` label the daemon adds, when it does
    tenant_names: dict[str, str] = field(default_factory=dict)
    attached: dict[str, float] = field(default_factory=dict)
    reserves: dict[str, float] = field(default_factory=dict)
    releases: dict[str, float] = field(default_factory=dict)


_GAUGES = {
    "maasd_pool_capacity_bytes": ("pool_capacity", "pool"),
    "maasd_pool_used_bytes": ("pool_used", "pool"),
    "maasd_pool_buffers": ("pool_buffers", "pool"),
    "maasd_tenant_used_bytes": ("tenant_used", "tenant"),
    "maasd_tenant_quota_bytes": ("tenant_quota", "tenant"),
    "maasd_attached_handles": ("attached", "tenant"),
    "maasd_reserve_total": ("reserves", "outcome"),
    "maasd_release_total": ("releases", "reason"),
}


def parse_metrics(text: str, at: float | None = None) -> Snapshot:
    """Parse Prometheus exposition text into a :class:`Snapshot`.

    Unknown families are ignored; a sample without the expected label is
    counted under ``""`` (the daemon's aggregate).
    """
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot(at=time.monotonic() if at is None else at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # Counters are exposed as "<family>_total"; older clients strip the suffix.
            target = _GAUGES.get(sample.name) or _GAUGES.get(family.name)
            if target is None or sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            attr, label = target
            bucket: dict[str, float] = getattr(snap, attr)
            key = sample.labels.get(label, "")
            bucket[key] = bucket.get(key, 0.0) + float(sample.value)
            if label == "tenant" and sample.labels.get("name"):
                snap.tenant_names[key] = sample.labels["name"]
    return snap


def rates(prev: Snapshot | None, cur: Snapshot, attr: str) -> dict[str, float]:
    """Per-second increase of a counter family between two scrapes (restarts clamp at 0)."""
    if prev is None or cur.at <= prev.at:
        return {k: 0.0 for k in getattr(cur, attr)}
    before: dict[str, float] = getattr(prev, attr)
    now: dict[str, float] = getattr(cur, attr)
    span = cur.at - prev.at
    return {k: max(0.0, v - before.get(k, 0.0)) / span for k, v in now.items()}


_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 30) -> str:
    """The last ``width`` values as block characters scaled to their maximum."""
    vals = values[-width:]
    top = max(vals, default=0.0)
    if top <= 0:
        return _SPARKS[0] * len(vals)
    return "".join(_SPARKS[min(7, int(v / top * 7.999))] for v in vals)


class TopView:
    """Holds the scrape history and renders one frame."""

    def __init__(
        self, client: Client, interval: float, *, use_api: bool, ascii_only: bool = False
    ) -> None:
        self.client = client
        self.interval = interval
        self.ascii_only = ascii_only
        self.prev: Snapshot | None = None
        self.cur: Snapshot | None = None
        self.reserve_hist: deque[float] = deque(maxlen=60)
        self.release_hist: deque[float] = deque(maxlen=60)
        self.error: str | None = None
        self.use_api = use_api
        self.pools: list[Pool] = []
        self.tenants: list[Tenant] | None = None
        self.frames = 0

    def scrape(self) -> None:
        """Fetch metrics (and names/quotas when allowed); failures show in the frame."""
        try:
            snap = parse_metrics(self.client.metrics())
        except MaasdClientError as exc:
            self.error = from_client_error(exc, self.client.base_url).line()
            return
        except ValueError as exc:  # prometheus parser: not exposition text
            self.error = f"cannot parse /metrics: {exc}"
            return
        self.error = None
        self.prev, self.cur = self.cur, snap
        self.reserve_hist.append(sum(rates(self.prev, snap, "reserves").values()))
        self.release_hist.append(sum(rates(self.prev, snap, "releases").values()))
        if self.use_api:
            try:
                self.pools = self.client.pools()
                self.tenants = self.client.tenants()
            except (Unauthorized, Forbidden):
                self.use_api = False  # a tenant key: metrics alone are still useful
                self.tenants = None
            except MaasdClientError:
                pass  # shown by the next failed scrape, if it lasts

    # -- rendering -----------------------------------------------------------

    def render(self) -> RenderableType:
        self.frames += 1
        now = dt.datetime.now().strftime("%H:%M:%S")
        head = Text()
        head.append("maasctl top", style="bold")
        head.append(f"  {self.client.base_url}  {now}  every {self.interval:g}s  ", style="dim")
        head.append("q", style="bold")
        head.append(" or Ctrl-C to quit", style="dim")
        parts: list[RenderableType] = [head]
        if self.error:
            parts.append(text(f"! {self.error}", "bold red"))
        if self.cur is None:
            parts.append(note("waiting for the first scrape…"))
            return Group(*parts)
        parts += [
            Text(""),
            self._pools(self.cur),
            Text(""),
            self._tenants(self.cur),
            Text(""),
            self._rates(),
        ]
        return Group(*parts)

    def _pools(self, snap: Snapshot) -> Table:
        t = table("Pools")
        t.add_column("POOL", style="bold", no_wrap=True)
        t.add_column("USE", no_wrap=True)
        t.add_column("USED", justify="right")
        t.add_column("CAPACITY", justify="right")
        t.add_column("BUFFERS", justify="right")
        names = {p.id: p.name for p in self.pools}
        labels = sorted(
            set(snap.pool_capacity) | set(snap.pool_used), key=lambda k: names.get(k, k)
        )
        for label in labels:
            cap = int(snap.pool_capacity.get(label, 0))
            used = int(snap.pool_used.get(label, 0))
            add_row(
                t,
                names.get(label, label) or "(all)",
                usage_bar(used, cap, ascii_only=self.ascii_only),
                format_size(used),
                format_size(cap),
                str(int(snap.pool_buffers[label])) if label in snap.pool_buffers else "-",
            )
        if not labels:
            add_row(t, "(none)", *[Text()] * 4)
        return t

    def _tenants(self, snap: Snapshot) -> Table:
        t = table("Tenants")
        t.add_column("TENANT", style="bold", no_wrap=True)
        t.add_column("USE", no_wrap=True)
        t.add_column("USED", justify="right")
        t.add_column("QUOTA", justify="right")
        t.add_column("HANDLES", justify="right")
        info: dict[str, Tenant] = {}
        for tenant in self.tenants or []:
            info[tenant.id] = tenant
            info.setdefault(tenant.name, tenant)
        labels = sorted(set(snap.tenant_used) | set(snap.tenant_quota) | set(snap.attached))
        labels.sort(key=lambda k: -snap.tenant_used.get(k, 0))
        for label in labels:
            x = info.get(label)
            used = int(snap.tenant_used.get(label, 0))
            quota = x.quota_bytes if x is not None else None
            if quota is None and label in snap.tenant_quota:
                quota = int(snap.tenant_quota[label])
            name = (x.name if x else None) or snap.tenant_names.get(label) or label or "(all)"
            add_row(
                t,
                name,
                usage_bar(used, quota, 12, ascii_only=self.ascii_only)
                if quota is not None
                else Text(),
                format_size(used),
                format_size(quota) if quota is not None else "-",
                str(int(snap.attached.get(label, 0))),
            )
        if not labels:
            add_row(t, "(none)", *[Text()] * 4)
        return t

    def _rates(self) -> Table:
        assert self.cur is not None
        t = table("Rates (per second)")
        t.add_column("WHAT", style="bold", no_wrap=True)
        t.add_column("RATE", justify="right")
        t.add_column("TOTAL", justify="right")
        t.add_column("HISTORY", no_wrap=True)
        res = rates(self.prev, self.cur, "reserves")
        rel = rates(self.prev, self.cur, "releases")
        add_row(
            t,
            "reserve",
            f"{sum(res.values()):.1f}",
            f"{int(sum(self.cur.reserves.values()))}",
            Text(sparkline(list(self.reserve_hist)), style="cyan"),
        )
        for k in sorted(res):
            add_row(t, f"  {k or '-'}", f"{res[k]:.1f}", f"{int(self.cur.reserves[k])}", Text())
        add_row(
            t,
            "release",
            f"{sum(rel.values()):.1f}",
            f"{int(sum(self.cur.releases.values()))}",
            Text(sparkline(list(self.release_hist)), style="magenta"),
        )
        for k in sorted(rel):
            add_row(t, f"  {k or '-'}", f"{rel[k]:.1f}", f"{int(self.cur.releases[k])}", Text())
        return t


class KeyReader:
    """Non-blocking single keys from a terminal (cbreak mode, select on stdin).

    Outside a terminal it only sleeps. The previous terminal mode is restored
    on exit, whatever ended the loop.
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.fd: int | None = None
        self._saved: Any = None

    def __enter__(self) -> KeyReader:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return self
        if not os.isatty(fd):
            return self
        import termios
        import tty

        try:
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
        except termios.error:
            self._saved = None
            return self
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self._saved is not None:
            import termios

            with contextlib.suppress(termios.error):
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
        self.fd = None

    def wait(self, timeout: float) -> str:
        """Wait up to ``timeout`` seconds; return the keys typed meanwhile (maybe ``""``)."""
        if self.fd is None:
            time.sleep(max(0.0, timeout))
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return ""
        try:
            data = os.read(self.fd, 64)
        except OSError:
            return ""
        if not data:  # EOF on the terminal: nothing more will ever be typed
            time.sleep(max(0.0, timeout))
            return ""
        return data.decode(errors="replace")


def _ticks(interval: float) -> Iterator[float]:
    """Deadlines every ``interval`` seconds that do not drift with render time."""
    nxt = time.monotonic()
    while True:
        nxt += interval
        now = time.monotonic()
        if nxt < now:  # fell behind (slow daemon): start again from now
            nxt = now + interval
        yield nxt


def run_top(
    client: Client, console: Console, interval: float, *, use_api: bool, once: bool = False
) -> None:
    """Run the view until ``q``/Ctrl-C (or print one frame when ``once``)."""
    ascii_only = not (console.encoding or "").lower().startswith("utf")
    view = TopView(client, interval, use_api=use_api, ascii_only=ascii_only)
    # Fail fast, with the usual one-line error, when the daemon is not there at all.
    client.metrics()
    view.scrape()
    if once:
        console.print(view.render())
        return
    with (
        KeyReader() as keys,
        Live(
            view.render(), console=console, screen=True, auto_refresh=False, transient=True
        ) as live,
    ):
        try:
            for deadline in _ticks(interval):
                quit_now = False
                while (left := deadline - time.monotonic()) > 0:
                    typed = keys.wait(left)
                    if "q" in typed.lower() or "\x03" in typed:
                        quit_now = True
                        break
                if quit_now:
                    break
                view.scrape()
                live.update(view.render(), refresh=True)
        except KeyboardInterrupt:
            pass
