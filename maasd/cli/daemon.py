"""``maasd``: run the daemon (``serve``), migrate its ledger (``migrate``), or look (``info``).

Lifecycle of ``maasd serve`` (cf. uvicorn's ``server.py``)::

    SIGHUP    logged and ignored from the first line on (maasd.serving.keep_on_hangup):
              the settings are read once, a restart applies a change
    harden    not dumpable (PR_SET_DUMPABLE 0: /proc/PID/fd, mem and environ are
              root's only), soft RLIMIT_NOFILE raised to the hard limit
    settings  flags > MAASD_* env > --config TOML > defaults; the admin and
              metrics keys, the database and L2 URLs then leave os.environ
    lock      DATA_DIR/maasd.lock (flock): one daemon per data dir
    service   migrate to head, recover(), finish deletes, provision pools, reaper
              (a SIGTERM/SIGINT from here on is honoured once the server listens:
              StopAsked)
    broker    the Unix socket for worker handles
    serve     uvicorn in-process until SIGTERM/SIGINT (maasd.serving's
              HANDLED_SIGNALS; maasd.api.server: REST connections capped, request
              deadlines)
    shutdown  stop accepting, finish in-flight requests (10 s grace),
              close the socket, checkpoint persistent buffers, scrub volatile
              ones (their rows go in one statement), close the database, exit 0
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click

from maasd import __version__
from maasd.errors import ConfigError, MaasdError

if TYPE_CHECKING:
    import asyncio

    from maasd.api.health import HealthCheck
    from maasd.broker import Broker
    from maasd.core import Service
    from maasd.notify import Systemd
    from maasd.settings import Settings

logger = logging.getLogger("maasd")

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


class LogfmtFormatter(logging.Formatter):
    """One line per event: ``ts=… level=… logger=… msg="…" key=value …`` (structured, greppable)."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields.update({k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS})
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def data_dir_lock(data_dir: str) -> Generator[None, None, None]:
    """Hold ``DATA_DIR/maasd.lock`` for the daemon's life; a second daemon fails at once."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    path = os.path.join(data_dir, "maasd.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise click.ClickException(
                f"another maasd (pid {holder}) is already serving data dir {data_dir}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _settings(**flags: Any) -> Settings:
    from maasd.settings import load

    try:
        return load(flags)
    except ConfigError as e:
        raise click.ClickException(e.detail) from e


#: Environment variables holding secrets (a database or L2 URL may carry a password): dropped
#: from ``os.environ`` once read, so that nothing the daemon starts inherits them. (The
#: copy the kernel keeps in /proc/PID/environ stays; the daemon being non-dumpable makes
#: that root's only.)
SECRET_ENV = ("MAASD_ADMIN_KEY", "MAASD_METRICS_KEY", "MAASD_DB_URL", "MAASD_L2_URL")

_PR_SET_DUMPABLE = 4


def harden() -> tuple[int, int]:
    """Make this process non-dumpable and raise its soft open-files limit to the hard one.

    Non-dumpable: /proc/PID/fd, /proc/PID/mem and /proc/PID/environ belong to root,
    so another process of the daemon's uid can neither open a tenant's memfd through
    /proc/PID/fd/N nor read the admin key from the environment, and no core dump
    (which would hold tenants' memory) is written. Returns the open-files limit
    ``(before, after)``.
    """
    from maasd.core.limits import raise_open_files

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise click.ClickException(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(err)}")
    before, after = raise_open_files()
    if after != before:
        logger.info("open files limit raised", extra={"before": before, "after": after})
    return before, after


class LazyGroup(click.Group):
    """A group whose named subcommands are imported only when asked for: ``maasd serve``
    then does not import what ``doctor``, ``router`` and ``worker`` need (numpy, httpx,
    the client: ~0.4 s of CPU at every daemon start)."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})  # name -> "module:attribute"

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            import importlib

            module, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy[cmd_name]} is not a click command")
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=LazyGroup,
    lazy={
        "doctor": "maasd.cli.doctor:doctor",
        "router": "maasd.cli.router:router",
        "worker": "maasd.cli.worker:worker",
    },
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="maasd")
def cli() -> None:
    """maasd — memory-as-a-service daemon for LLM inference hosts."""


_common = [
    click.option("--data-dir", help="State directory [env MAASD_DATA_DIR]."),
    click.option(
        "--db",
        "db_url",
        help="Ledger URL: sqlite:///… or postgresql+psycopg://… [env MAASD_DB_URL].",
    ),
    click.option(
        "--config", type=click.Path(dir_okay=False), help="TOML config file [env MAASD_CONFIG]."
    ),
]


_F = TypeVar("_F", bound=Callable[..., Any])


def common(fn: _F) -> _F:
    for opt in reversed(_common):
        fn = opt(fn)
    return fn


@cli.command()
@click.option("--host", help="REST listen address [env MAASD_HOST, default 127.0.0.1].")
@click.option("--port", type=int, help="REST port [env MAASD_PORT, default 7878].")
@click.option(
    "--socket", "socket", help="Worker socket path [env MAASD_SOCKET, default DATA_DIR/maasd.sock]."
)
@click.option(
    "--socket-group",
    help="Group (name or gid) that owns the socket, so workers "
    "of that group can connect [env MAASD_SOCKET_GROUP].",
)
@click.option(
    "--admin-key-file",
    type=click.Path(dir_okay=False),
    help="File holding the admin key, mode 0600 [env MAASD_ADMIN_KEY_FILE]; "
    "$CREDENTIALS_DIRECTORY/admin-key (systemd LoadCredential=admin-key:…) is read too.",
)
@click.option(
    "--metrics-public",
    is_flag=True,
    default=None,
    help="Serve GET /metrics to anyone, without a key [env MAASD_METRICS_PUBLIC=1]. "
    "Otherwise it needs the admin key or the metrics key [env MAASD_METRICS_KEY].",
)
@click.option(
    "--l2-url",
    help="Redis or Valkey URL of the shared prefix tier (redis://[:PASSWORD@]HOST:PORT/DB); "
    "needs a PostgreSQL ledger. Prefer the environment for a URL with a password "
    "[env MAASD_L2_URL].",
)
@click.option(
    "--release-lost-checkpoints",
    is_flag=True,
    help="Release the persistent buffers of a spill directory whose filesystem is gone "
    "(not mounted, or a disk really lost) instead of refusing to start. For one start: "
    "without it such a start stops, releasing nothing (docs/operations.md).",
)
@common
def serve(release_lost_checkpoints: bool, **flags: Any) -> None:
    """Run the daemon: REST control plane + worker socket.

    \b
    Example:
      maasd serve --data-dir /var/lib/maasd --port 7878
    """
    from maasd.serving import handling, keep_on_hangup

    keep_on_hangup("maasd serve")  # first: a hang-up kills nothing from here on
    settings = _settings(**flags)
    if settings.latency_probe is None:  # on under serve (docs/allocator.md, "Latency classes")
        settings.latency_probe = True
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    setup_logging(settings.log_level)
    harden()
    stop = StopAsked()
    with handling(stop), data_dir_lock(settings.data_dir):
        _serve(settings, stop, release_lost_checkpoints=release_lost_checkpoints)


class StopAsked:
    """Answers SIGTERM/SIGINT while the REST server is not taking them: during the startup
    (migrations, recovery of persistent buffers: seconds) and the shutdown (checkpoints).

    Left at their defaults, a SIGTERM then killed the daemon (exit 143, nothing closed)
    and a SIGINT aborted it. Now the first is remembered: :meth:`replay` hands it to the
    server once it listens, which stops as at any other time (finish, checkpoint, exit 0);
    during the shutdown it changes nothing. A second one aborts at once (exit 1, "Aborted!"),
    for a start that hangs: the process exits where it stands, as a SIGKILL would end it,
    which the ledger and the checkpoints are made to survive (SPEC invariant 6). It used to
    raise ``KeyboardInterrupt`` there, which SQLAlchemy, caught inside a commit, turned
    into an ``AssertionError`` and a traceback.
    """

    def __init__(self) -> None:
        self.signals: list[int] = []

    def __call__(self, sig: int, _frame: object) -> None:
        if self.signals:
            logger.warning("%s again: aborting at once", signal.Signals(sig).name)
            os.write(2, b"Aborted!\n")
            os._exit(1)
        self.signals.append(sig)
        logger.info(
            "%s while starting or stopping: the daemon stops gracefully (send it again to abort)",
            signal.Signals(sig).name,
        )

    def replay(self) -> None:
        """Deliver a remembered signal again, to whoever handles it now (the server)."""
        if self.signals:
            signal.raise_signal(self.signals[0])


class _Running:
    """What ``maasd serve`` runs between its startup and its shutdown."""

    def __init__(
        self, service: Service, broker: Broker, health: HealthCheck, systemd: Systemd
    ) -> None:
        self.service = service
        self.broker = broker
        self.health = health  # /healthz's checks: the service's and the broker's
        self.systemd = systemd


def _serve(settings: Settings, stop: StopAsked, *, release_lost_checkpoints: bool = False) -> None:
    """Startup, serve until a signal of ``HANDLED_SIGNALS``, shutdown (as uvicorn's server)."""
    from maasd.api.app import create_app
    from maasd.api.health import of_checks
    from maasd.api.server import http_config
    from maasd.serving import make_server

    running = _startup(settings, release_lost_checkpoints=release_lost_checkpoints)
    service, systemd = running.service, running.systemd
    app = create_app(
        service,
        health=running.health,
        degraded=of_checks(service.degraded_checks()),
        metrics_key=settings.metrics_key,
        metrics_public=settings.metrics_public,
        caller_threads=settings.http_tenant_threads,
    )
    server = make_server(
        http_config(app, settings, service.metrics, service.auth),
        ready=lambda loop: _ready(settings, systemd, loop, stop),
        stopping=systemd.stopping,
    )
    _log_serving(settings, service)
    try:
        server.run()
    finally:
        _shutdown(running)
    if not server.started:
        raise click.ClickException(f"could not listen on {settings.host}:{settings.port}")


def _startup(settings: Settings, *, release_lost_checkpoints: bool = False) -> _Running:
    """The service (ledger migrated, state recovered, pools, reaper), then the worker socket;
    a failure of either is one line and an exit 1, with nothing left open."""
    from maasd.allocator.parking import keep_capabilities_to_self
    from maasd.api.health import of_checks
    from maasd.broker import Broker, Limits
    from maasd.core import Service
    from maasd.notify import Systemd
    from maasd.settings import group_id

    keep_capabilities_to_self()  # the unit's ambient capability: not for our children
    # The start's first line (signals are handled from here on): from it to ``serving``
    # is what a start took (the ledger, recovery, the pools).
    logger.info(
        "starting",
        extra={"pid": os.getpid(), "version": __version__, "data_dir": settings.data_dir},
    )
    try:
        service = Service(settings)
        service.start(release_lost_checkpoints=release_lost_checkpoints)
    except MaasdError as e:  # a ConfigError (database URL, admin key file) above all
        raise click.ClickException(f"cannot start: {e.detail}") from e
    _log_limits(service, settings)
    if service.auth.admin_key_generated:
        # Printed once, on first start; afterwards it is only in DATA_DIR/admin.key (0600).
        click.echo(
            f"admin key (saved to {settings.admin_key_path}, mode 0600): "
            f"{service.auth.admin_key_generated}",
            err=True,
        )
    try:
        broker = Broker(
            service.socket_use_cases(),
            settings.socket_path,
            group=group_id(settings.socket_group),
            limits=Limits.from_settings(settings),
            events=service.metrics.socket_event,
        )
        broker.start()
    except (MaasdError, OSError) as e:
        service.close()
        raise click.ClickException(
            f"cannot open the worker socket {settings.socket_path}: "
            f"{getattr(e, 'detail', None) or e}"
        ) from e
    health = of_checks({**service.health_checks(), **_broker_checks(broker)})
    # READY=1, WATCHDOG=1, STOPPING=1 (maasd.notify)
    return _Running(service, broker, health, Systemd.from_env(health))


def _shutdown(running: _Running) -> None:
    """Stop telling systemd, close the socket, then the service (checkpoints, scrubs, the
    ledger): the order in which nothing new can arrive at what is being closed."""
    stopping = time.monotonic()
    running.systemd.close()
    running.broker.stop()
    running.service.close()
    logger.info("stopped", extra={"close_s": round(time.monotonic() - stopping, 3)})


def _log_serving(settings: Settings, service: Service) -> None:
    logger.info(
        "serving",
        extra={
            "url": f"http://{settings.host}:{settings.port}",
            "socket": settings.socket_path,
            "db": _redact(settings.database_url),
            "pools": ",".join(p.name for p in service.pools.infos()),
            # the L2 address stays out of info lines: whoever reads the log gets no route
            "l2": "on" if settings.l2_url else "off",
        },
    )
    if settings.l2_url:
        from maasd.l2.client import redact

        logger.debug("L2 tier", extra={"l2_url": redact(settings.l2_url)})


def _log_limits(service: Any, settings: Settings) -> None:
    """Say what the daemon may hold: its region budget and one tenant's share of it.

    (A budget too small to be of use stopped the daemon already: maasd.core.limits.)
    """
    budget = service.budget
    logger.info(
        "limits",
        extra={
            "open_files": budget.limits.open_files,
            "max_map_count": budget.limits.max_map_count,
            "region_budget": budget.budget,
            "tenant_region_budget": budget.tenant_budget,
            "rest_connections": budget.limits.rest_connections,
            "socket_connections": budget.limits.socket_connections,
            "max_buffers_per_tenant": settings.max_buffers_per_tenant,
        },
    )


def _ready(
    settings: Settings, systemd: Systemd, loop: asyncio.AbstractEventLoop, stop: StopAsked
) -> None:
    """REST listens and the socket is open: tell systemd (READY=1) and the person watching;
    then a stop asked for during the startup is handed to the server."""
    url = f"http://{settings.host}:{settings.port}"
    systemd.ready(loop, status=f"serving on {url}")
    if settings.admin_key:
        key = "set by MAASD_ADMIN_KEY or the config file"
    elif settings.admin_key_file:
        key = f"in {settings.admin_key_file}"
    elif (creds := os.environ.get("CREDENTIALS_DIRECTORY")) and os.path.exists(
        cred := os.path.join(creds, "admin-key")
    ):
        key = f"in {cred} (the admin-key credential)"
    else:
        key = f"in {settings.admin_key_path}"
    click.echo(
        f"maasd ready: REST {url}, worker socket {settings.socket_path}, admin key {key}",
        err=True,
    )
    stop.replay()


class SelfChecking(Protocol):
    """A part that says whether it can serve (the broker: :meth:`Broker.healthy`)."""

    def healthy(self) -> tuple[bool, str]: ...


def _broker_checks(broker: SelfChecking) -> dict[str, Callable[[], tuple[bool, str]]]:
    """The data plane's health for /healthz: the broker's own ``healthy()`` (is its
    accept thread alive?)."""
    return {"broker": broker.healthy}


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@cli.command()
@common
def migrate(**flags: Any) -> None:
    """Upgrade the ledger database to the newest schema, then exit.

    \b
    Example:
      maasd migrate --db postgresql+psycopg://maasd@db/maasd
    """
    settings = _settings(**flags)
    setup_logging(settings.log_level)
    from maasd.store import Store

    os.makedirs(settings.data_dir, mode=0o700, exist_ok=True)
    try:
        store = Store(settings.database_url)
    except ConfigError as e:
        raise click.ClickException(e.detail) from e
    try:
        store.upgrade()
    except MaasdError as e:  # a ledger a newer maasd migrated, or none reachable
        raise click.ClickException(e.detail) from e
    finally:
        store.dispose()
    click.echo(f"ledger at {_redact(settings.database_url)} is at the newest schema")


@cli.command()
@common
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option(
    "--probe",
    is_flag=True,
    help="Also measure load-to-use latency and copy bandwidth per CPU node × memory node "
    "(a pointer chase over 4 × the last-level cache, 64 MiB copies: seconds).",
)
def info(as_json: bool, probe: bool, **flags: Any) -> None:
    """Print the NUMA topology this host shows and the pools the daemon would create.

    \b
    Example:
      maasd info --json
      maasd info --probe
    """
    import msgspec

    from maasd.probe import Probe, probe_bandwidth, probe_latency
    from maasd.settings import default_pools
    from maasd.topology import discover, libnuma_view

    settings = _settings(**flags)
    topo = discover()
    pools = settings.pools or default_pools(
        topo, settings.default_pool_bytes, settings.default_warm_bytes
    )
    measured = (
        Probe(latency=probe_latency(topo), bandwidth=probe_bandwidth(topo)) if probe else None
    )
    if as_json:
        view: dict[str, Any] = {"topology": topo, "libnuma": libnuma_view(), "pools": pools}
        if measured is not None:
            view["latency"], view["bandwidth"] = measured.latency, measured.bandwidth
            view["measured"] = _pool_classes(topo, measured, pools)
        click.echo(msgspec.json.encode(view).decode())
        return
    click.echo(
        f"page size {topo.page_bytes} B, huge page {topo.hugepage_bytes >> 20} MiB, "
        f"{topo.hugepages_free} huge pages free"
    )
    for n in topo.nodes:
        click.echo(
            f"node {n.id}: cpus {_ranges(n.cpus)}, {n.mem_total_bytes / 2**30:.1f} GiB total, "
            f"{n.mem_free_bytes / 2**30:.1f} GiB free, distances {n.distances}, "
            f"huge pages {n.hugepages_free}/{n.hugepages_total} free"
        )
    numa = libnuma_view()
    click.echo(f"libnuma: {numa if numa is not None else 'not available'}")
    click.echo("pools to create:" if pools else "no pools to create")
    for p in pools:
        click.echo(
            f"  {p.name}: node {p.numa_node}, {p.capacity_bytes / 2**30:.2f} GiB, {p.backing}, "
            f"{p.persistence}, latency_us={p.latency_us}, prefault={p.prefault}, scrub={p.scrub}, "
            f"warm {p.warm_bytes / 2**20:.0f} MiB"
        )
    if measured is not None:
        _print_probe(topo, measured, pools)


def _pool_classes(topo: Any, measured: Any, pools: list[Any]) -> dict[str, Any]:
    """Each pool's measured class (``None``: its node not measured), by pool name."""
    from maasd.core.latency import node_classes

    classes = node_classes(topo, measured, time.time())
    return {p.name: classes.get(p.numa_node) for p in pools}


def _print_probe(topo: Any, measured: Any, pools: list[Any]) -> None:
    """The latency and bandwidth matrices, then each pool's declared class beside the
    measured one (from the nearest CPU node) and the farthest other node's figures."""
    click.echo("load-to-use latency, ns (CPU node → memory node):")
    for x in measured.latency:
        click.echo(f"  cpu {x.cpu_node} → mem {x.mem_node}: {x.ns:.0f}")
    click.echo("copy bandwidth, GiB/s (CPU node → memory node):")
    for b in measured.bandwidth:
        click.echo(f"  cpu {b.cpu_node} → mem {b.mem_node}: {b.gib_per_s:.2f}")
    for name, m in _pool_classes(topo, measured, pools).items():
        declared = next(p.latency_us for p in pools if p.name == name)
        if m is None:
            click.echo(f"  {name}: declared latency_us={declared}; not measured")
            continue
        remote = [f for f in m.by_cpu_node if f.cpu_node != m.cpu_node]
        far = max(remote, key=lambda f: f.latency_us or 0.0, default=None)
        click.echo(
            f"  {name}: declared latency_us={declared}; measured {m.latency_us:.3f} µs"
            + (f", {m.gib_per_s:.2f} GiB/s" if m.gib_per_s is not None else "")
            + f" from cpu node {m.cpu_node}"
            + (
                f"; {far.latency_us or 0:.3f} µs, {far.gib_per_s or 0:.2f} GiB/s "
                f"from cpu node {far.cpu_node}"
                if far is not None
                else ""
            )
        )


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
