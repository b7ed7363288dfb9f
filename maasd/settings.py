"""One :class:`Settings` object, built once from flags, ``MAASD_*`` env and a TOML file.

Precedence, highest first: command-line flags, environment variables, the
config file (``--config`` / ``MAASD_CONFIG``), built-in defaults. The config
file may also hold ``[[pools]]`` tables (the fields of :class:`~maasd.models.PoolSpec`);
without any, the daemon makes one volatile memfd pool per NUMA node
(:func:`default_pools`).

Example ``maasd.toml``::

    host = "127.0.0.1"
    port = 7878
    max_ttl_s = 86400

    [[pools]]
    name = "fast"
    numa_node = 0
    capacity_bytes = "8GiB"
    latency_us = 1
    warm_bytes = "512MiB"       # keep this much prefaulted memory ready

    [[pools]]
    name = "kv-persist"
    numa_node = 0
    capacity_bytes = "2GiB"
    persistence = "persistent"
    spill_dir = "/var/lib/maasd/spill"

Sizes a person types — ``MAASD_DEFAULT_POOL_BYTES``, ``MAASD_DEFAULT_WARM_BYTES``,
``MAASD_WARM_MIN_AVAILABLE_BYTES``, the same keys in the file, and a pool's
``capacity_bytes`` and ``warm_bytes`` there — take units (``1GiB``, ``512MiB``, ``1.5GB``) or plain
bytes (:func:`maasd.units.parse_size`); a bad one is refused naming where it came from
(``MAASD_DEFAULT_POOL_BYTES: '1Gx' is not a size; …``). REST bodies stay integers.
"""

from __future__ import annotations

import math
import os
import socket as _socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from maasd import bounds
from maasd.bounds import DEFAULT_HOST, DEFAULT_PORT, MAX_BUFFERS, default_data_dir, worker_socket
from maasd.errors import ConfigError
from maasd.models import PoolSpec
from maasd.topology import Topology
from maasd.units import SizeError, parse_size

GiB = 1 << 30
#: A shorter metrics key would be guessable.
MIN_METRICS_KEY = 16
DEFAULT_POOL_CAP = 8 * GiB
#: The default pools' warm stock: 1/16 of the capacity, at most this.
DEFAULT_WARM_CAP = 256 << 20
#: Service calls of one caller running at once on the REST API unless told otherwise
#: (``Settings.http_tenant_threads``; ``maasd.api.create_app``'s ``caller_threads``).
DEFAULT_TENANT_THREADS = 16


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the daemon is configured with. Field names double as TOML keys."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    socket: str | None = None  # default: DATA_DIR/maasd.sock
    socket_group: str | None = None  # group (name or gid) given the socket, for workers
    data_dir: str = msgspec.field(default_factory=default_data_dir)
    db_url: str | None = None  # default: sqlite:///DATA_DIR/maasd.db
    config: str | None = None
    # The admin key: this, else the file admin_key_file, else $CREDENTIALS_DIRECTORY/admin-key
    # (systemd LoadCredential=), else DATA_DIR/admin.key (generated once).
    admin_key: str | None = None
    admin_key_file: str | None = None
    metrics_key: str | None = None  # a key good for GET /metrics only
    metrics_public: bool = False  # GET /metrics needs no key at all
    node_name: str = msgspec.field(default_factory=_socket.gethostname)
    default_pool_bytes: int | None = None
    # The default pools' warm stock; None: min(capacity / 16, 256 MiB); 0: none.
    default_warm_bytes: int | None = None
    # Below this much MemAvailable the memfd pools' warm stock is given back; None:
    # 1/16 of the host's memory, at least 512 MiB.
    warm_min_available_bytes: int | None = None
    max_ttl_s: int = 7 * 24 * 3600
    reaper_interval_s: float = 1.0  # also this host's heartbeat in a shared ledger
    host_timeout_s: float = 30.0  # a host silent this long may be forgotten (docs/scale-out.md)
    db_pool_size: int = 16  # ledger connections kept open (docs/scale-out.md: sizing)
    db_max_overflow: int = 64  # more, opened under load and closed after
    # Bounds of every ledger wait (PostgreSQL; docs/scale-out.md, "Failure modes"): a new
    # connection, and one statement (the server cancels it). Past either: 507.
    db_connect_timeout_s: float = 3.0
    db_statement_timeout_s: float = 10.0
    # A tenant's cap on buffers (entries included) when it has none of its own. Each buffer
    # holds one of the daemon's mappings (and an open file, but for idle entries where they
    # park): 4096 lets a prefix cache of MiB-sized entries fill tens of GiB, and keeps a
    # dozen tenants inside the ~57,000 regions that vm.max_map_count's default allows
    # (maasd.core.limits).
    max_buffers_per_tenant: int = 4096
    # The share of the daemon's region budget (its open files and mappings for buffers,
    # maasd.core.limits) one tenant may hold at once: a quarter, so that one tenant's
    # flood of small entries leaves the others theirs. 1.0 on a host of one tenant.
    tenant_region_share: float = 0.25
    # "auto": an idle committed entry keeps no open file, only the daemon's mapping,
    # where the kernel lets the daemon re-open its mappings (CAP_CHECKPOINT_RESTORE or
    # CAP_SYS_ADMIN; maasd.allocator.parking); "keep": each keeps its memfd open.
    entry_fds: Literal["auto", "keep"] = "auto"
    checkpoint_on_shutdown: bool = True
    log_level: str = "info"
    # Bounds of the worker socket (docs/operations.md, "Worker socket limits").
    socket_max_connections: int = 1024  # open at once, in total
    socket_max_unauthenticated: int = 64  # not yet past hello, in total
    socket_max_per_uid: int = 512  # of one peer uid
    socket_max_per_tenant: int = 128  # of one tenant, after hello
    socket_hello_timeout_s: float = 5.0  # hello must arrive this long after accept
    socket_send_timeout_s: float = 10.0  # a reply the peer leaves unread this long closes it
    socket_slow_workers: int = 4  # threads for operations that may block (renew, …)
    socket_slow_per_tenant: int = 2  # of those, running at once for one tenant
    # Bounds of the REST server (docs/operations.md, "REST limits"): the connections it
    # holds at once (lowered to a quarter of the open-files limit if that is less), and
    # the deadlines of a request's head (from its first byte), its body (from the end of
    # the head) and of a response the client leaves unread; and how long a connection
    # stays open idle between requests (longer than a client's pool keeps one: httpx's 5 s).
    http_max_connections: int = 512
    http_head_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_send_timeout_s: float = 30.0
    http_keepalive_s: float = 20.0
    # Service calls of one tenant (or of the admin) running at once, of the REST API's
    # 64 threads; its further calls wait for its own to end (docs/operations.md).
    http_tenant_threads: int = DEFAULT_TENANT_THREADS
    # The shared prefix tier (docs/scale-out.md, "The L2 tier"): a Redis or Valkey URL
    # (redis://, rediss://, unix://); needs the PostgreSQL ledger. Only the daemon uses it.
    l2_url: str | None = None
    l2_timeout_s: float = 0.1  # connect and each read/write of one L2 request
    l2_tenant_bytes: int = 1 << 30  # a tenant's bytes in L2 at most (oldest evicted there)
    l2_ttl_s: int = 24 * 3600  # an entry's life in L2 (renewed by each new write of it)
    l2_queue_entries: int = 64  # committed entries waiting to be written behind, at most
    l2_queue_bytes: int = 512 << 20  # … and their bytes; past either, a write is dropped
    # The largest value (entry and header) sent to L2; larger entries stay local, counted.
    l2_max_value_bytes: int = 256 << 20
    # A store's timeout is l2_timeout_s plus its value's bytes at this rate (a slow link).
    l2_min_bytes_per_s: int = 100 << 20
    l2_breaker_failures: int = 3  # consecutive L2 failures that open the circuit breaker
    l2_breaker_backoff_s: float = 2.0  # open this long, then one probe (half-open)
    l2_prefix: str = "maasd"  # of every Redis key: several fleets can share one Redis
    # The pools' disk tiers (docs/operations.md, "The disk tier"): a tenant may hold this
    # many times its quota_bytes on a pool's disk tier; the encrypted bytes waiting for
    # the demotion writer, at most (past it an eviction drops rather than waits).
    disk_quota_factor: int = 4
    disk_inflight_bytes: int = 64 << 20
    # The background latency probe (docs/allocator.md, "Latency classes"): None = on under
    # `maasd serve`, off for a Service embedded elsewhere; the child is killed past the timeout.
    latency_probe: bool | None = None
    latency_probe_timeout_s: float = 120.0
    pools: list[PoolSpec] = msgspec.field(default_factory=list)

    @property
    def socket_path(self) -> str:
        return self.socket or worker_socket(self.data_dir)

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{os.path.join(self.data_dir, 'maasd.db')}"

    @property
    def admin_key_path(self) -> str:
        return os.path.join(self.data_dir, "admin.key")


#: The worker socket's bounds: each must be > 0 and finite.
SOCKET_BOUNDS = tuple(
    name
    for name in Settings.__struct_fields__
    if name.startswith("socket_") and name != "socket_group"
)

#: Settings that are sizes (plain bytes or with units, in the environment and the file),
#: and the keys of a ``[[pools]]`` table that are: whether 0 is a valid value of each.
SIZES = {
    "default_pool_bytes": False,
    "default_warm_bytes": True,
    "warm_min_available_bytes": True,
    "l2_tenant_bytes": False,
    "l2_queue_bytes": False,
    "l2_max_value_bytes": False,
    "l2_min_bytes_per_s": False,
    "disk_inflight_bytes": False,
}
POOL_SIZES = {"capacity_bytes": False, "warm_bytes": True, "disk_bytes": True}

#: The REST server's bounds: each must be > 0 and finite.
HTTP_BOUNDS = tuple(name for name in Settings.__struct_fields__ if name.startswith("http_"))

#: The L2 tier's bounds: each must be > 0 and finite (its URL and key prefix are checked apart).
L2_BOUNDS = tuple(
    name
    for name in Settings.__struct_fields__
    if name.startswith("l2_") and name not in ("l2_url", "l2_prefix")
)
#: URL schemes redis-py connects with.
L2_SCHEMES = ("redis", "rediss", "unix")

#: environment variable → field
ENV = {
    "MAASD_HOST": "host",
    "MAASD_PORT": "port",
    "MAASD_SOCKET": "socket",
    "MAASD_SOCKET_GROUP": "socket_group",
    "MAASD_DATA_DIR": "data_dir",
    "MAASD_DB_URL": "db_url",
    "MAASD_CONFIG": "config",
    "MAASD_ADMIN_KEY": "admin_key",
    "MAASD_ADMIN_KEY_FILE": "admin_key_file",
    "MAASD_METRICS_KEY": "metrics_key",
    "MAASD_METRICS_PUBLIC": "metrics_public",
    "MAASD_NODE_NAME": "node_name",
    "MAASD_DEFAULT_POOL_BYTES": "default_pool_bytes",
    "MAASD_DEFAULT_WARM_BYTES": "default_warm_bytes",
    "MAASD_WARM_MIN_AVAILABLE_BYTES": "warm_min_available_bytes",
    "MAASD_MAX_TTL_S": "max_ttl_s",
    "MAASD_REAPER_INTERVAL_S": "reaper_interval_s",
    "MAASD_HOST_TIMEOUT_S": "host_timeout_s",
    "MAASD_DB_POOL_SIZE": "db_pool_size",
    "MAASD_DB_MAX_OVERFLOW": "db_max_overflow",
    "MAASD_DB_CONNECT_TIMEOUT_S": "db_connect_timeout_s",
    "MAASD_DB_STATEMENT_TIMEOUT_S": "db_statement_timeout_s",
    "MAASD_MAX_BUFFERS_PER_TENANT": "max_buffers_per_tenant",
    "MAASD_TENANT_REGION_SHARE": "tenant_region_share",
    "MAASD_ENTRY_FDS": "entry_fds",
    "MAASD_LOG_LEVEL": "log_level",
    **{f"MAASD_{name.upper()}": name for name in SOCKET_BOUNDS},
    **{f"MAASD_{name.upper()}": name for name in HTTP_BOUNDS},
    "MAASD_L2_URL": "l2_url",
    "MAASD_L2_PREFIX": "l2_prefix",
    **{f"MAASD_{name.upper()}": name for name in L2_BOUNDS},
    "MAASD_DISK_QUOTA_FACTOR": "disk_quota_factor",
    "MAASD_DISK_INFLIGHT_BYTES": "disk_inflight_bytes",
    "MAASD_LATENCY_PROBE": "latency_probe",
    "MAASD_LATENCY_PROBE_TIMEOUT_S": "latency_probe_timeout_s",
}


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from ``flags`` (None values ignored), ``env`` and the config file.

    Raises :class:`~maasd.errors.ConfigError` with a readable message for a bad value or file.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    from_env: dict[str, Any] = {field: env[var] for var, field in ENV.items() if env.get(var)}
    config_path = flags.get("config") or from_env.get("config")
    from_file = _read_config(config_path) if config_path else {}
    _parse_sizes(from_env, from_file, config_path)
    merged = {**from_file, **from_env, **flags}
    try:
        # strict=False lets env strings such as "7878" convert to int fields. Settings
        # and PoolSpec both forbid unknown fields: a typo in the file or in a [[pools]]
        # table (``scrubb = "punch"``) is refused instead of silently falling back to
        # a default.
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"settings: {bounds.explain(str(e))}") from e
    _check(settings)
    settings.data_dir = str(Path(settings.data_dir).expanduser())
    return settings


def _read_config(path: str) -> dict[str, Any]:
    """The TOML config file's table; :class:`ConfigError` for a bad path or file."""
    if "\0" in path:
        raise ConfigError(f"config file {path!r}: a path cannot hold a NUL byte")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from e


def _check(settings: Settings) -> None:
    """The rules no type says: ranges, relations between fields, names that must exist."""
    for field, value in msgspec.structs.asdict(settings).items():
        if isinstance(value, str) and "\0" in value:  # paths and names: the kernel refuses them
            raise ConfigError(f"settings: {field} cannot hold a NUL byte")
    if not 0 < settings.port < 65536:
        raise ConfigError(f"settings: port must be 1..65535, got {settings.port}")
    if settings.max_ttl_s < 1:
        raise ConfigError("settings: max_ttl_s must be ≥ 1")
    if not 1 <= settings.max_buffers_per_tenant <= MAX_BUFFERS:
        raise ConfigError(f"settings: max_buffers_per_tenant must be 1..{MAX_BUFFERS}")
    if not 0 < settings.tenant_region_share <= 1:
        raise ConfigError(
            f"settings: tenant_region_share must be in (0, 1], got {settings.tenant_region_share}"
        )
    for name in (
        *SOCKET_BOUNDS,
        *HTTP_BOUNDS,
        *L2_BOUNDS,
        "disk_quota_factor",
        "latency_probe_timeout_s",
    ):
        value = getattr(settings, name)
        # ``inf`` would turn a deadline or a bound off, quietly (nothing is ever closed)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"settings: {name} must be > 0 and finite, got {value}")
    if not settings.host_timeout_s >= 3 * settings.reaper_interval_s > 0:
        raise ConfigError(
            "settings: host_timeout_s must be at least 3 heartbeats (reaper_interval_s = "
            f"{settings.reaper_interval_s:g}), got {settings.host_timeout_s:g}"
        )
    _check_db(settings)
    for name in ("default_warm_bytes", "warm_min_available_bytes"):
        if (getattr(settings, name) or 0) < 0:
            raise ConfigError(f"settings: {name} must be ≥ 0")
    if settings.metrics_key is not None and len(settings.metrics_key) < MIN_METRICS_KEY:
        raise ConfigError(
            f"settings: metrics_key must be at least {MIN_METRICS_KEY} characters "
            "(e.g. `openssl rand -hex 24`)"
        )
    check_l2(settings)
    group_id(settings.socket_group)  # an unknown group fails here, before anything starts
    names = [p.name for p in settings.pools]
    if len(names) != len(set(names)):
        raise ConfigError(f"settings: duplicate pool names in config: {names}")


def _check_db(settings: Settings) -> None:
    """The ledger connection's rules: its pool and its timeouts."""
    if settings.db_pool_size < 1 or settings.db_max_overflow < 0:
        raise ConfigError("settings: db_pool_size must be ≥ 1 and db_max_overflow ≥ 0")
    if not (settings.db_connect_timeout_s > 0 and settings.db_statement_timeout_s > 0):
        raise ConfigError("settings: db_connect_timeout_s and db_statement_timeout_s must be > 0")


def _parse_sizes(from_env: dict[str, Any], from_file: dict[str, Any], path: str | None) -> None:
    """Turn the size strings of the environment and the config file into bytes, in place."""
    for key, zero in SIZES.items():
        _sizes(from_env, key, f"MAASD_{key.upper()}", zero)
        _sizes(from_file, key, f"{path}: {key}", zero)
    pools = from_file.get("pools")
    # Anything but an array of tables is refused afterwards, by the type (``pools = 3``).
    for i, pool in enumerate(pools if isinstance(pools, list) else []):
        if isinstance(pool, dict):
            for key, zero in POOL_SIZES.items():
                _sizes(pool, key, f"{path}: pools[{i}].{key}", zero)


def _sizes(values: dict[str, Any], key: str, origin: str, allow_zero: bool = False) -> None:
    """Parse ``values[key]`` in place when it is a size string (``"8GiB"``); ``origin`` names
    where it came from in the error."""
    raw = values.get(key)
    if isinstance(raw, str):
        try:
            values[key] = parse_size(raw, allow_zero=allow_zero)
        except SizeError as e:
            raise ConfigError(f"{origin}: {e}") from None


def check_l2(settings: Settings) -> None:
    """A ``ConfigError`` unless the L2 settings can work: a Redis URL, and the shared
    PostgreSQL ledger (tenant ids, which namespace L2, are global only there)."""
    if settings.l2_url is None:
        return
    scheme = settings.l2_url.partition("://")[0].lower()
    if "://" not in settings.l2_url or scheme not in L2_SCHEMES:
        raise ConfigError(
            f"settings: l2_url must be a redis://, rediss:// or unix:// URL (got a {scheme!r} URL)"
        )
    backend = settings.database_url.partition(":")[0].partition("+")[0].lower()
    if backend not in ("postgresql", "postgres"):
        raise ConfigError(
            "settings: --l2-url needs the shared PostgreSQL ledger (--db postgresql+psycopg://…): "
            "L2 keys are namespaced by tenant id, and tenant ids are global only there; this "
            f"daemon's ledger is {backend or 'not a URL'}"
        )
    if not settings.l2_prefix or any(c in settings.l2_prefix for c in "{}: \t\n"):
        raise ConfigError("settings: l2_prefix must be a non-empty word without {, }, : or spaces")


def group_id(group: str | None) -> int | None:
    """The gid of ``group`` (a name or a number), or None; :class:`ConfigError` if unknown."""
    if group is None:
        return None
    import grp

    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"settings: no group named {group!r} (socket_group)") from None


def default_pools(
    topology: Topology, pool_bytes: int | None = None, warm_bytes: int | None = None
) -> list[PoolSpec]:
    """The default without configured pools: one volatile memfd pool per node, ``node<N>``.

    Size: ``pool_bytes`` when given, else a quarter of the node's free memory,
    at most 8 GiB — rounded down to whole pages. Warm stock: ``warm_bytes`` when
    given (at most the capacity), else 1/16 of the capacity, at most 256 MiB.
    """
    page = topology.page_bytes
    pools = []
    for node in topology.nodes:
        size = (
            pool_bytes
            if pool_bytes is not None
            else min(node.mem_free_bytes // 4, DEFAULT_POOL_CAP)
        )
        size -= size % page
        if size <= 0:
            continue
        warm = min(size // 16, DEFAULT_WARM_CAP) if warm_bytes is None else min(warm_bytes, size)
        pools.append(
            PoolSpec(
                name=f"node{node.id}",
                numa_node=node.id,
                capacity_bytes=size,
                backing="memfd",
                persistence="volatile",
                latency_us=1,
                prefault=True,
                scrub="zero",
                warm_bytes=warm - warm % page,
            )
        )
    return pools
