"""The daemon's own limits: open files and memory mappings, and what a buffer may take of them.

Every buffer costs the daemon one open file (its memfd) and one mapping (the
daemon's own, for scrubbing and placement checks) for as long as the region
exists — live, waiting to be reclaimed, or in a pool's warm stock. Quotas in
bytes do not bound those: a tenant of 4 KiB buffers reaches the open-files
limit long before its quota. Two bounds do:

* per tenant, ``max_buffers`` (:mod:`maasd.store.buffers` checks it in the
  reserve transaction, 409 ``buffer-count-exceeded``);
* daemon-wide, the **region budget** below (507 ``resource-limit``), so that
  the ledger, the REST and socket connections and the fds being handed out
  always find a free descriptor.

The budget, from the soft ``RLIMIT_NOFILE`` ``M`` (which ``maasd serve`` first
raises to the hard limit), ``vm.max_map_count`` ``P``, the worker socket's
``socket_max_connections`` ``S``, the REST server's connections ``R`` (its cap,
``http_max_connections`` lowered to ``M // 4`` as :mod:`maasd.api.server` does,
plus the eighth it still answers 507) and the ledger's connection pool
(``db_pool_size + db_max_overflow`` connections, 2 files each with SQLite, 1
with PostgreSQL: ``L`` files)::

    reserved      = 64 + L + R + 2 × S               the daemon's own files (listeners,
                                                     logs, pipes, libraries), the ledger,
                                                     the REST connections, and per socket
                                                     connection its socket and the fd of
                                                     the one reply held for it
    headroom      = max(reserved, M // 4)            fds for everything but regions
    region_budget = min(M - headroom,                regions held at once
                        P - max(1024, P // 8))

A socket connection has at most one fd in flight too (sent, not yet read by its
peer: :mod:`maasd.broker.inflight`), which the kernel counts against the same
``RLIMIT_NOFILE`` for the daemon's user: ``S`` of them at most
(:attr:`Limits.fds_in_flight`), inside the headroom whenever the budget is not 0.

With the defaults (``S = 1024``, ``R = 576``, SQLite, ``L = 160``) and
``M = 20000``: 15,000 regions. With ``M = 524288`` (systemd's default hard
limit) and ``P = 65530`` the mappings bind: 57,339. With ``M = 1024`` nothing is
left for buffers until ``socket_max_connections`` is lowered (to 64: 384
regions) — the daemon says so when it starts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from maasd.allocator.region import open_regions
from maasd.errors import BackingError, MaasdError, PoolExhausted, ResourceLimit

__all__ = [
    "Limits",
    "RegionBudget",
    "kernel_refusal",
    "raise_open_files",
    "read_limits",
    "rest_connections",
]

#: The daemon's own files besides the ledger and connections (listeners, logs, pipes,
#: libraries, fds being handed out); ~20 when idle.
OWN_FILES = 64
#: Fds a worker socket reply carries at most (attach, lookup, put: one).
FDS_PER_REPLY = 1
#: Fewer free files than this and /healthz says the daemon is out of files.
MIN_FREE_FILES = 16
#: Mappings never given to regions, at the least (the interpreter, libraries, thread stacks).
MIN_MAP_HEADROOM = 1024
#: The share of the open-files limit REST connections may hold (maasd.api.server's rule).
REST_FD_SHARE = 4

_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


@dataclass(frozen=True)
class Limits:
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

    @property
    def reserved(self) -> int:
        """Fds the daemon needs besides regions, at most."""
        sockets = self.socket_connections * (1 + FDS_PER_REPLY)
        return OWN_FILES + self.ledger_files + self.rest_connections + sockets

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
        """Regions this process may hold at once."""
        maps = self.map_budget
        return self.file_budget if maps is None else min(self.file_budget, maps)

    @property
    def binding(self) -> str:
        """Which limit the budget comes from, as an operator would name it."""
        maps = self.map_budget
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


def read_limits(
    *,
    socket_connections: int = 0,
    http_max_connections: int = 0,
    ledger_files: int = 0,
    open_files: int | None = None,
) -> Limits:
    """This process's limits now, with what the daemon's configuration takes of its files.

    ``open_files`` replaces the soft RLIMIT_NOFILE (``maasd doctor`` passes the hard
    limit, which ``maasd serve`` raises the soft one to).
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if open_files is None else open_files
    try:
        with open(_MAX_MAP_COUNT) as f:
            maps: int | None = int(f.read().strip())
    except (OSError, ValueError):
        maps = None
    if soft == resource.RLIM_INFINITY:  # pragma: no cover - Linux always has a finite limit
        soft = 1 << 20
    return Limits(
        open_files=int(soft),
        max_map_count=maps,
        socket_connections=socket_connections,
        rest_connections=rest_connections(http_max_connections, int(soft))
        if http_max_connections
        else 0,
        ledger_files=ledger_files,
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
    """Admits the creation of a region while the process holds fewer than its budget.

    ``held`` counts the regions that exist (by default every open
    :class:`~maasd.allocator.Region` of the process); regions being created are
    counted from :meth:`admit` on, so concurrent reserves cannot overshoot.
    """

    def __init__(self, limits: Limits, held: Callable[[], int] = open_regions) -> None:
        self.limits = limits
        self.budget = limits.region_budget
        self._held = held
        self._lock = threading.Lock()
        self._in_flight = 0

    def held(self) -> int:
        """Regions that exist or are being created now."""
        return self._held() + self._in_flight

    def room_for_stock(self) -> bool:
        """Whether a pool's warm stock may make one more region: only while a quarter of
        the budget stays free for reserves (of any pool: a stocked region serves only
        its own)."""
        return self.held() + 1 <= self.budget - max(1, self.budget // 4)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """One region may be created inside the block; :class:`ResourceLimit` at the budget."""
        with self._lock:
            held = self._held() + self._in_flight
            if held >= self.budget:
                raise ResourceLimit(self.describe(held))
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def describe(self, held: int | None = None) -> str:
        """What the budget is and how much of it is taken, for a 507's detail and /healthz."""
        held = self.held() if held is None else held
        lim = self.limits
        n = open_files()  # -1: not even the count could be read (no fd left for it)
        return (
            f"the daemon holds {n if n >= 0 else 'all'} of its {lim.open_files} open files, {held} of "
            f"them for buffers: its budget for buffers is {self.budget} (from {lim.binding}; "
            f"each buffer takes one open file and one memory mapping, and {lim.headroom} files "
            "are kept for the ledger and connections); release buffers, or raise the "
            "daemon's LimitNOFILE (or lower socket_max_connections)"
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
    says which: "4096 bytes on node 0").
    """
    if e.errno == errno.EMFILE:
        return ResourceLimit(f"the kernel refused a file ({e.detail}): {budget.describe()}")
    if e.errno == errno.ENFILE:
        return ResourceLimit(
            f"the system-wide open files limit (fs.file-max) is reached ({e.detail})"
        )
    if e.errno == errno.ENOMEM and e.detail.startswith("mmap") and not hugetlb:
        return ResourceLimit(
            f"the kernel refused a mapping ({e.detail}): vm.max_map_count "
            f"{budget.limits.max_map_count} or the address space is exhausted; "
            f"{budget.describe()}"
        )
    if e.errno in (errno.ENOMEM, errno.ENOSPC):
        return PoolExhausted(f"the kernel has no memory for {wanted} ({e.detail})")
    return None
