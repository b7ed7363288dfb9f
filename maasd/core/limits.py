"""The daemon's own limits: open files and memory mappings, and what a buffer may take of them.

What a region costs the daemon, in every state, is one mapping (the daemon's
writable one: ``F_SEAL_FUTURE_WRITE`` forbids every later writable mapping, and
the scrub at release writes through it) and one open file (its memfd): staged or
committed, live, released and waiting to be reclaimed, in a pool's warm stock, or
filled from the L2 tier — except an idle committed entry where the daemon may
re-open its mappings' files: it *parks*, closing its fd (:mod:`maasd.allocator.parking`;
``parks_entries``). So two budgets: of regions (mappings), and of regions holding an
fd. A committed entry keeps no second fd (a lookup re-opens its memfd read-only
for the reply: :mod:`maasd.core.regions`);
the fd a reply carries, a checkpoint file being written or read, the fresh copy
of a commit are transient, bounded by the connections and threads, and kept in
the headroom below, as are the read-only fds kept for the hottest entries
(:mod:`maasd.core.rofds`). Quotas in bytes do not bound regions — a tenant of 4 KiB
buffers reaches the open-files limit long before its quota — so three bounds do:

* per tenant, ``max_buffers`` (:mod:`maasd.store.buffers` checks it in the
  reserve transaction; at it the tenant's own evictable buffers are evicted,
  else 409 ``buffer-count-exceeded``);
* per tenant, its **fair share** of the region budget (``tenant_region_share``
  of it, a quarter by default: 507 ``resource-limit``), so that no tenant takes
  the regions others need;
* daemon-wide, the **region budget** below (507 ``resource-limit``), so that
  the ledger, the REST and socket connections and the fds being handed out
  always find a free descriptor: no request meets ``EMFILE``.

The budget, from the soft ``RLIMIT_NOFILE`` ``M`` (which ``maasd serve`` first
raises to the hard limit), ``vm.max_map_count`` ``P``, the worker socket's
connections ``S`` (``socket_max_connections`` lowered to ``M // 12``, never below
16, as the broker caps it), the REST server's connections ``R`` (its cap,
``http_max_connections`` lowered to ``M // 4`` as :mod:`maasd.api.server` does,
plus the eighth it still answers 507), the ledger's connection pool
(``db_pool_size + db_max_overflow`` connections, 2 files each with SQLite, 1
with PostgreSQL: ``L`` files) and the threads ``T`` that may hold a transient
file (the REST API's 64 service threads and ``socket_slow_workers``)::

    reserved      = 96 + L + R + 3 × S + 2 × T   the daemon's own files (listeners,
                                                 logs, pipes, libraries; the read-only
                                                 fds of the 32 hottest entries), the ledger,
                                                 the REST connections, per socket
                                                 connection its socket, the fd of the
                                                 one reply held for it and the one fd a
                                                 peer's unfinished frame brought, per
                                                 thread a checkpoint file and a commit's
                                                 copy
    headroom      = max(reserved, M // 4)        fds for everything but regions
    file_budget   = M - headroom                 regions holding an fd at once
    region_budget = P - max(1024, P // 8)        regions held at once, entries parking
                  = min(file_budget, P - max(1024, P // 8))     else
    tenant share  = max(1, region_budget × tenant_region_share), and of file_budget

A socket connection has at most one fd in flight too (sent, not yet read by its
peer: :mod:`maasd.broker.inflight`), which the kernel counts against the same
``RLIMIT_NOFILE`` for the daemon's user: ``S`` of them at most
(:attr:`ProcessLimits.fds_in_flight`), inside the headroom whenever the budget is not 0.

With the defaults (``S = 1024``, ``R = 576``, SQLite, ``L = 160``, ``T = 68``) and
``M = 20000``: 15,000 regions holding an fd, 3,750 per tenant; where entries park,
57,339 regions in all (``P = 65530``), 14,334 per tenant. With ``M = 524288`` (systemd's
default hard limit) and ``P = 65530`` the mappings bind: 57,339. With ``M =
1024``: ``S = 85``, 89 regions. Below :data:`MIN_USEFUL_REGIONS` the daemon
refuses to start, naming the ``LimitNOFILE`` it needs (:func:`open_files_needed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import resource
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maasd.allocator.parking import can_park
from maasd.allocator.region import open_region_fds, open_regions
from maasd.core.rofds import HOT_READ_ONLY_FDS

if TYPE_CHECKING:
    from maasd.settings import Settings
from maasd.errors import BackingError, MaasdError, PoolExhausted, ResourceLimit

__all__ = [
    "BASE_TASKS",
    "FILES_PER_CONNECTION",
    "MIN_USEFUL_REGIONS",
    "ProcessLimits",
    "RegionBudget",
    "kernel_refusal",
    "open_files_needed",
    "parks_entries",
    "raise_open_files",
    "maps_needed",
    "read_limits",
    "rest_connections",
    "settings_limits",
    "regions_wanted",
    "socket_connections",
    "tasks_needed",
    "tenant_caps",
    "too_few_regions",
]

#: The daemon's own files besides the ledger and connections (listeners, logs, pipes,
#: libraries, fds being handed out); ~20 when idle.
OWN_FILES = 64
#: Fds a worker socket reply carries at most (attach, lookup, put: one).
FDS_PER_REPLY = 1
#: Files one socket connection may hold in the daemon at once: its socket, the fd of the
#: one reply held for it (its peer has not read the one before), and the one fd its peer
#: sent with a frame not yet whole (a publish's memfd: :mod:`maasd.broker.inbound`) —
#: both at once when the two frames came in one read.
FILES_PER_CONNECTION = 1 + FDS_PER_REPLY + 1
#: Fewer free files than this and /healthz says the daemon is out of files.
MIN_FREE_FILES = 16
#: Mappings never given to regions, at the least (the interpreter, libraries, thread stacks).
MIN_MAP_HEADROOM = 1024
#: The share of the open-files limit REST connections may hold (maasd.api.server's rule).
REST_FD_SHARE = 4
#: Worker socket connections may hold a twelfth of the open-files limit (each: up to
#: :data:`FILES_PER_CONNECTION` files, so a quarter of the files in all).
SOCKET_FD_SHARE = 12
#: Socket connections allowed whatever the limit (a daemon below it refuses to start).
MIN_SOCKET_CONNECTIONS = 16
#: Transient files a service thread may hold at once (a checkpoint file, a commit's copy).
FILES_PER_THREAD = 2
#: The REST API's service threads (maasd.api.app's ``threads``).
REST_THREADS = 64
#: Fewer regions than this and the daemon is of no use: ``maasd serve`` refuses to start.
MIN_USEFUL_REGIONS = 64
#: The daemon's own threads, outside its pools (about: one more per pool with a warm
#: stock): idle under SQLite, ``maasd serve`` runs 8 — its event loop (the main thread),
#: the socket's loop, reaper, reclaimer, warm-stock refill, holders' reader, disk-tier
#: writer, latency probe — and PostgreSQL, L2 and systemd add the ledger's listener,
#: watchdog and probe, the L2 writer and the systemd watchdog. ``OPENBLAS_NUM_THREADS=1``
#: (the unit's): numpy would otherwise start a thread per CPU that the daemon never uses.
BASE_TASKS = 12

_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


@dataclass(frozen=True)
class ProcessLimits:
    """The process limits the budget derives from (see the module docstring)."""

    #: The soft RLIMIT_NOFILE.
    open_files: int
    #: ``vm.max_map_count``; ``None`` when unknown (then only files bind).
    max_map_count: int | None = None
    #: The worker socket's cap on connections (``socket_max_connections``).
    socket_connections: int = 0
    #: REST connections held or still answered at once.
    rest_connections: int = 0
    #: Files the ledger's connection pool may hold at most.
    ledger_files: int = 0
    #: Threads that may each hold :data:`FILES_PER_THREAD` transient files.
    threads: int = 0
    #: The share of the region budget one tenant may hold (``tenant_region_share``).
    tenant_share: float = 1.0
    #: The settings the connection counts were scaled from (0: taken as they are).
    socket_setting: int = 0
    http_setting: int = 0
    #: Idle committed entries keep no fd (:mod:`maasd.allocator.parking`): then only
    #: the mappings bound regions, and the files bound those that hold one.
    parks_entries: bool = False

    @property
    def reserved(self) -> int:
        """Fds the daemon needs besides regions, at most."""
        sockets = self.socket_connections * FILES_PER_CONNECTION
        transient = self.threads * FILES_PER_THREAD
        own = OWN_FILES + HOT_READ_ONLY_FDS
        return own + self.ledger_files + self.rest_connections + sockets + transient

    @property
    def fds_in_flight(self) -> int:
        """Fds the worker socket may have sent and its peers not read yet, at most."""
        return self.socket_connections * FDS_PER_REPLY

    @property
    def headroom(self) -> int:
        """Fds kept for everything that is not a region."""
        return max(self.reserved, self.open_files // 4)

    @property
    def file_budget(self) -> int:
        return max(0, self.open_files - self.headroom)

    @property
    def map_budget(self) -> int | None:
        if self.max_map_count is None:
            return None
        return max(0, self.max_map_count - max(MIN_MAP_HEADROOM, self.max_map_count // 8))

    @property
    def region_budget(self) -> int:
        """Regions this process may hold at once (each one mapping; all but parked
        entries one fd too, within :attr:`file_budget`)."""
        maps = self.map_budget
        if maps is None:
            return self.file_budget
        return max(maps, 0) if self.parks_entries else min(self.file_budget, maps)

    @property
    def tenant_budget(self) -> int:
        """Regions one tenant may hold at once: its fair share of :attr:`region_budget`."""
        return max(1, int(self.region_budget * self.tenant_share))

    @property
    def tenant_file_budget(self) -> int:
        """Regions holding an fd one tenant may hold at once: its share of :attr:`file_budget`."""
        return max(1, int(min(self.file_budget, self.region_budget) * self.tenant_share))

    @property
    def binding(self) -> str:
        """Which limit the budget comes from, as an operator would name it."""
        maps = self.map_budget
        if maps is not None and self.parks_entries:
            return (
                f"vm.max_map_count {self.max_map_count} for regions, "
                f"RLIMIT_NOFILE {self.open_files} for those with an open file"
            )
        if maps is not None and maps < self.file_budget:
            return f"vm.max_map_count {self.max_map_count}"
        return f"RLIMIT_NOFILE {self.open_files}"


def open_files() -> int:
    """How many files this process has open now (one directory read: not for hot paths)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the directory's own fd
    except OSError:
        return -1


def rest_connections(http_max_connections: int, open_files: int) -> int:
    """REST connections the server may hold at once: ``http_max_connections`` lowered to
    a quarter of the open files (as :class:`maasd.api.server.HttpLimits` caps it), plus
    the eighth beyond the cap it still answers 507 before it closes them unanswered."""
    cap = min(http_max_connections, max(8, open_files // REST_FD_SHARE))
    return cap + max(4, cap // 8)


def socket_connections(socket_max_connections: int, open_files: int) -> int:
    """Worker socket connections the broker may hold at once: ``socket_max_connections``
    lowered to a twelfth of the open files (never below 16), so that a small
    ``RLIMIT_NOFILE`` still leaves files for buffers (``maasd.broker.Limits`` caps it so)."""
    return min(socket_max_connections, max(MIN_SOCKET_CONNECTIONS, open_files // SOCKET_FD_SHARE))


def max_map_count() -> int | None:
    """``vm.max_map_count``, or ``None`` when it cannot be read."""
    try:
        with open(_MAX_MAP_COUNT) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def limits_for(
    open_files: int,
    max_map_count: int | None,
    *,
    socket_max_connections: int = 0,
    http_max_connections: int = 0,
    ledger_files: int = 0,
    threads: int = 0,
    tenant_share: float = 1.0,
    parks_entries: bool = False,
) -> ProcessLimits:
    """The limits of a daemon with these settings under these process limits (the
    connection caps lowered to their shares of ``open_files``)."""
    return ProcessLimits(
        open_files=open_files,
        max_map_count=max_map_count,
        socket_connections=socket_connections(socket_max_connections, open_files)
        if socket_max_connections
        else 0,
        rest_connections=rest_connections(http_max_connections, open_files)
        if http_max_connections
        else 0,
        ledger_files=ledger_files,
        threads=threads,
        tenant_share=tenant_share,
        socket_setting=socket_max_connections,
        http_setting=http_max_connections,
        parks_entries=parks_entries,
    )


def open_files_needed(lim: ProcessLimits, regions: int = MIN_USEFUL_REGIONS) -> int | None:
    """The smallest ``RLIMIT_NOFILE`` that gives ``regions`` regions with ``lim``'s other
    settings (the connection caps scaled as :func:`limits_for` does), or ``None`` when
    ``vm.max_map_count`` alone holds fewer."""
    maps = dataclasses.replace(lim, open_files=1 << 30).map_budget
    if maps is not None and maps < regions:
        return None

    def budget(m: int) -> int:
        at_m = dataclasses.replace(lim, open_files=m)
        if lim.socket_setting:
            at_m = dataclasses.replace(
                at_m, socket_connections=socket_connections(lim.socket_setting, m)
            )
        if lim.http_setting:
            at_m = dataclasses.replace(at_m, rest_connections=rest_connections(lim.http_setting, m))
        return at_m.file_budget

    lo, hi = 1, 1 << 30  # the budget grows with M: each file adds under one to the headroom
    while lo < hi:
        mid = (lo + hi) // 2
        if budget(mid) >= regions:
            hi = mid
        else:
            lo = mid + 1
    return lo


def too_few_regions(lim: ProcessLimits) -> str:
    """Why a daemon under ``lim`` refuses to start, and the limit it needs."""
    need = open_files_needed(lim)
    fix = (
        f"raise LimitNOFILE (ulimit -Hn) to at least {need}"
        if need is not None
        else f"raise vm.max_map_count (now {lim.max_map_count})"
    )
    return (
        f"RLIMIT_NOFILE {lim.open_files} leaves {lim.file_budget} open files for buffers "
        f"once the ledger, connections and threads have theirs ({lim.headroom}); the daemon "
        f"needs room for {MIN_USEFUL_REGIONS} at least: {fix}, or lower "
        "socket_max_connections, http_max_connections or db_max_overflow"
    )


def settings_limits(
    settings: Settings, open_files: int, max_map_count: int | None, *, postgres: bool
) -> ProcessLimits:
    """The limits of a daemon with ``settings`` under these process limits: what ``maasd
    serve`` budgets (:func:`read_limits` with the same settings) and ``maasd doctor`` sizes."""
    pooled = settings.db_pool_size + settings.db_max_overflow
    return limits_for(
        open_files,
        max_map_count,
        socket_max_connections=settings.socket_max_connections,
        http_max_connections=settings.http_max_connections,
        ledger_files=pooled * (1 if postgres else 2),
        threads=REST_THREADS + settings.socket_slow_workers,
        tenant_share=settings.tenant_region_share,
        parks_entries=parks_entries(settings),
    )


def tasks_needed(settings: Settings, default_pool: int) -> int:
    """The tasks (threads) a daemon with ``settings`` runs at its caps: the REST service
    threads (:data:`REST_THREADS`), anyio's default pool (``default_pool`` threads: the
    daemon leaves it at anyio's default), the socket's slow-op workers and its own
    (:data:`BASE_TASKS`). ``TasksMax`` in the unit is sized from this sum."""
    return REST_THREADS + default_pool + settings.socket_slow_workers + BASE_TASKS


def tenant_caps(max_per_tenant: int, caps: list[int | None] | None) -> list[int]:
    """Each tenant's cap on its buffers (``None``: the daemon's ``max_buffers_per_tenant``,
    ``max_per_tenant``); with no tenants known (no ledger yet), one tenant at that default."""
    return [max_per_tenant if c is None else c for c in (caps or [None])]


def regions_wanted(caps: list[int], share: float, pool_regions: int | None = None) -> int:
    """Regions a budget must hold for every tenant to reach its cap (``caps``, from
    :func:`tenant_caps`): their sum, and at least the largest cap over the tenants'
    ``share`` (``tenant_region_share``: a tenant meets its share of the budget before its
    cap otherwise) — neither beyond ``pool_regions``, what the pools' pages can hold."""
    total, biggest = sum(caps), max(caps)
    if pool_regions is not None:
        total, biggest = min(total, pool_regions), min(biggest, pool_regions)
    return max(total, math.ceil(biggest / share))


def parks_entries(settings: Settings) -> bool:
    """Whether idle committed entries let their fd go in this process: ``entry_fds``
    ``auto`` and the kernel lets it re-open its mappings' files (:func:`can_park`)."""
    return settings.entry_fds == "auto" and can_park()


def maps_needed(regions: int) -> int:
    """The smallest ``vm.max_map_count`` whose mapping budget holds ``regions``."""
    lo, hi = 1, 1 << 34
    while lo < hi:
        mid = (lo + hi) // 2
        if (ProcessLimits(open_files=0, max_map_count=mid).map_budget or 0) >= regions:
            hi = mid
        else:
            lo = mid + 1
    return lo


def read_limits(
    *,
    socket_connections: int = 0,
    http_max_connections: int = 0,
    ledger_files: int = 0,
    threads: int = 0,
    tenant_share: float = 1.0,
    open_files: int | None = None,
) -> ProcessLimits:
    """This process's limits now, with what the daemon's configuration takes of its files
    (``socket_connections``: the ``socket_max_connections`` setting, lowered here).

    ``open_files`` replaces the soft RLIMIT_NOFILE (``maasd doctor`` passes the hard
    limit, which ``maasd serve`` raises the soft one to).
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if open_files is None else open_files
    if soft == resource.RLIM_INFINITY:  # pragma: no cover - Linux always has a finite limit
        soft = 1 << 20
    return limits_for(
        int(soft),
        max_map_count(),
        socket_max_connections=socket_connections,
        http_max_connections=http_max_connections,
        ledger_files=ledger_files,
        threads=threads,
        tenant_share=tenant_share,
    )


def raise_open_files() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns ``(before, after)``.

    The soft limit many shells and units start with (1024) is for ``select(2)``
    users; the daemon uses epoll and may hold one memfd per buffer.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return int(soft), int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


class RegionBudget:
    """Admits the creation of a region while the process holds fewer than its budget,
    and the tenant fewer than its share.

    ``held`` counts the regions that exist (by default every open
    :class:`~maasd.allocator.Region` of the process); regions being created are
    counted from :meth:`admit` on (in all, and per tenant), so concurrent reserves
    cannot overshoot.
    """

    def __init__(
        self,
        limits: ProcessLimits,
        held: Callable[[], int] = open_regions,
        held_fds: Callable[[], int] = open_region_fds,
    ) -> None:
        self.limits = limits
        self.budget = limits.region_budget
        self.tenant_budget = limits.tenant_budget
        #: of the regions, those that hold an fd (all but parked entries)
        self.file_budget = min(limits.file_budget, self.budget)
        self.tenant_file_budget = limits.tenant_file_budget
        self._held = held
        self._held_fds = held_fds
        self._lock = threading.Lock()
        self._in_flight = 0
        self._tenant_in_flight: Counter[str] = Counter()

    def held(self) -> int:
        """Regions that exist or are being created now."""
        return self._held() + self._in_flight

    def held_fds(self) -> int:
        """Of :meth:`held`, the regions that hold an fd (a region is made with one)."""
        return self._held_fds() + self._in_flight

    def room_for_stock(self) -> bool:
        """Whether a pool's warm stock may make one more region: only while a quarter of
        the budget (of regions, and of their fds) stays free for reserves (of any pool:
        a stocked region serves only its own)."""
        regions, fds = self.budget, self.file_budget
        return self.held() + 1 <= regions - max(1, regions // 4) and (
            self.held_fds() + 1 <= fds - max(1, fds // 4)
        )

    @contextlib.contextmanager
    def admit(
        self, tenant_id: str | None = None, tenant_held: int = 0, tenant_fds: int | None = None
    ) -> Iterator[None]:
        """One region may be created inside the block; :class:`ResourceLimit` at the budget
        (of regions, or of those holding an fd), or when ``tenant_id``, holding
        ``tenant_held`` regions (``tenant_fds`` of them with an fd), is at its share."""
        with self._lock:
            held = self._held() + self._in_flight
            if held >= self.budget:
                raise ResourceLimit(self.describe(held))
            if self._held_fds() + self._in_flight >= self.file_budget:
                raise ResourceLimit(self.describe(held))
            if tenant_id is not None:
                mine = tenant_held + self._tenant_in_flight[tenant_id]
                if mine >= self.tenant_budget:
                    raise ResourceLimit(self.describe_share(tenant_id, mine))
                fds = (tenant_held if tenant_fds is None else tenant_fds) + (
                    self._tenant_in_flight[tenant_id]
                )
                if fds >= self.tenant_file_budget:
                    raise ResourceLimit(self.describe_share(tenant_id, fds, files=True))
                self._tenant_in_flight[tenant_id] += 1
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if tenant_id is not None:
                    self._tenant_in_flight[tenant_id] -= 1
                    if self._tenant_in_flight[tenant_id] <= 0:
                        del self._tenant_in_flight[tenant_id]

    def describe_share(self, tenant_id: str, mine: int, *, files: bool = False) -> str:
        """The detail of a 507 at a tenant's share of the budget (``files``: of the regions
        that hold an open file: buffers and entries being written)."""
        what, budget, share = (
            ("buffer regions holding an open file", self.file_budget, self.tenant_file_budget)
            if files
            else ("buffer regions", self.budget, self.tenant_budget)
        )
        return (
            f"tenant {tenant_id} holds {mine} {what}, its share of the daemon's budget of "
            f"{budget} (tenant_region_share {self.limits.tenant_share:g}: {share}; "
            f"{self._cost()}); release buffers or entries, or ask the operator to raise "
            "tenant_region_share or LimitNOFILE"
        )

    def _cost(self) -> str:
        if self.limits.parks_entries:
            return (
                "each buffer or entry takes one memory mapping, and each buffer or entry "
                "being written one open file"
            )
        return "each buffer or entry takes one open file and one memory mapping"

    def describe(self, held: int | None = None) -> str:
        """What the budget is and how much of it is taken, for a 507's detail and /healthz."""
        held = self.held() if held is None else held
        lim = self.limits
        n = open_files()  # -1: not even the count could be read (no fd left for it)
        return (
            f"the daemon holds {n if n >= 0 else 'all'} of its {lim.open_files} open files and "
            f"{held} buffer regions ({self.held_fds()} of them with an open file): its budget "
            f"for buffers is {self.budget} regions, {self.file_budget} of them with an open file "
            f"(from {lim.binding}; {self._cost()}, and {lim.headroom} files are kept for the "
            "ledger and connections); release buffers, or raise the daemon's LimitNOFILE "
            f"{'and vm.max_map_count ' if lim.parks_entries else ''}(or lower "
            "socket_max_connections)"
        )

    def health(self) -> tuple[bool, str]:
        """``/healthz``: has the daemon files to spare? (Being at the region budget is not
        unhealthy: reserves answer 507, everything else works. Being out of files is:
        the ledger, connections and handles need them.)"""
        n = open_files()
        if n < 0 or n > self.limits.open_files - MIN_FREE_FILES:
            return False, f"out of open files: {self.describe()}"
        return (
            True,
            f"{n} of {self.limits.open_files} open files, {self.held()} of {self.budget} buffer regions",
        )


def kernel_refusal(
    e: BackingError, budget: RegionBudget, wanted: str, *, hugetlb: bool = False
) -> MaasdError | None:
    """The 507 a kernel refusal on the reserve path stands for, naming the limit; ``None``
    for a refusal that is no limit (a bug or a hostile input: the caller re-raises it).

    EMFILE/ENFILE: out of open files (the process's, or the whole system's); ENOMEM
    from ``mmap``: out of mappings or address space — but for ``hugetlb`` memory
    it is the kernel reserving the huge pages at ``mmap`` and finding none free;
    ENOMEM/ENOSPC otherwise: the kernel has no memory for the pages (``wanted``
    says which: "4096 bytes on node 0"); for ``hugetlb`` memory also EFAULT from the
    populate (``madvise``): the region's node has too few free huge pages of its own
    (huge pages are reserved at ``mmap`` host-wide, but a bound region takes only its
    node's — docs/allocator.md, "Placement").
    """
    if e.errno == errno.EMFILE:
        return ResourceLimit(f"the kernel refused a file ({e.detail}): {budget.describe()}")
    if e.errno == errno.ENFILE:
        return ResourceLimit(
            f"the system-wide open files limit (fs.file-max) is reached ({e.detail})"
        )
    if e.errno == errno.ENOMEM and e.op == "mmap" and not hugetlb:
        return ResourceLimit(
            f"the kernel refused a mapping ({e.detail}): vm.max_map_count "
            f"{budget.limits.max_map_count} or the address space is exhausted; "
            f"{budget.describe()}"
        )
    if e.errno in (errno.ENOMEM, errno.ENOSPC):
        return PoolExhausted(f"the kernel has no memory for {wanted} ({e.detail})")
    if hugetlb and e.errno == errno.EFAULT and e.op == "madvise":
        return PoolExhausted(
            f"too few free huge pages for {wanted}: a hugetlb buffer takes its own "
            f"node's, never another's ({e.detail})"
        )
    return None
