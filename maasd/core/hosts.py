"""The daemon hosts sharing one ledger: this host's claim and heartbeat, and forgetting a dead one.

Each daemon serves as one host (``settings.node_name``). At start it *claims*
the host's row in the ledger with a fresh incarnation id: only one process may
serve a host at a time, because a start's recovery releases every ledger row
of its host. The reaper then beats every ``reaper_interval_s``
(``hosts.last_seen``, on the database's clock); a clean close marks the row
stopped.

A claim that finds another incarnation still beating (stopped neither cleanly
nor for ``host_timeout_s``) takes it over at once if it is the one this data
dir's previous run wrote (``DATA_DIR/host.incarnation``: that run is dead, we
hold the data-dir lock). Any other it watches for three of its heartbeat
intervals and a second: a beat means another daemon serves under this name — a
configuration error, refused — and none means a run that died (SIGKILL,
power) elsewhere, taken over without waiting ``host_timeout_s``.

A host that never comes back is *forgotten* by the admin (``DELETE
/v1/hosts/{name}``): refused while it beats; otherwise its buffers leave the
ledger (their memory died with it) and stop counting against quotas, and its
pools go. A host forgotten while it was only cut off from the database (no
heartbeat for ``host_timeout_s``, yet alive) learns it at its next heartbeat:
its claim is gone, so it *fences* itself — scrubs and drops every region it
holds (a worker's old mapping reads zeros), drops its pools — and joins again
as a fresh host.
"""

from __future__ import annotations

import logging
import os
import time

from maasd.core.regions import Regions
from maasd.errors import ConfigError, StateConflict
from maasd.models import HostInfo, rfc3339
from maasd.settings import Settings
from maasd.store import HostRepo, HostRow, HostUsage, is_live
from maasd.tenancy import keys

__all__ = ["Hosts"]

logger = logging.getLogger(__name__)


def host_info(h: HostUsage, local: str, stale_s: float) -> HostInfo:
    """The API record of a host (``local``: the name of the answering daemon's host)."""
    return HostInfo(
        name=h.name,
        live=is_live(h, h.now, stale_s),
        local=h.name == local,
        started_at=rfc3339(h.started_at),
        last_seen=rfc3339(h.last_seen),
        last_seen_age_s=round(max(h.now - h.last_seen, 0.0), 3),
        heartbeat_s=h.heartbeat_s,
        stopped_at=None if h.stopped_at is None else rfc3339(h.stopped_at),
        pools=h.pools,
        capacity_bytes=h.capacity_bytes,
        buffers=h.buffers,
        used_bytes=h.used_bytes,
    )


class Hosts:
    """This daemon's claim on its host name, its heartbeat, and the admin's host use-cases."""

    def __init__(self, settings: Settings, store: HostRepo, regions: Regions) -> None:
        self._settings = settings
        self._host_rows = store
        self._regions = regions
        self.name = settings.node_name
        #: This process's claim: a new one per start (and per rejoin after a fence).
        self.incarnation = keys.new_id()

    @property
    def _stale_s(self) -> float:
        return self._settings.host_timeout_s

    def claim(self, *, wait: bool = True) -> None:
        """Serve as this host: :class:`ConfigError` if another daemon does (see the module)."""
        hb = self._settings.reaper_interval_s
        other = self._host_rows.claim_host(self.name, self.incarnation, hb, stale_s=self._stale_s)
        if other is not None and other.incarnation == self._previous():
            # This data dir's previous run (dead: we hold the data-dir lock). No wait.
            other = self._host_rows.claim_host(
                self.name, self.incarnation, hb, stale_s=self._stale_s, take_over=other
            )
        if other is not None and wait:
            watch = 3 * other.heartbeat_s + 1.0  # a few beats, and slack for a busy host
            logger.info(
                "host %s was last claimed by a run that has not stopped; watching it %.1f s",
                self.name,
                watch,
            )
            time.sleep(watch)
            other = self._host_rows.claim_host(
                self.name, self.incarnation, hb, stale_s=self._stale_s, take_over=other
            )
        if other is not None:
            raise ConfigError(_twin(self.name, other))
        self._remember()

    @property
    def _incarnation_path(self) -> str:
        return os.path.join(self._settings.data_dir, "host.incarnation")

    def _previous(self) -> str | None:
        """The incarnation this data dir's last run claimed, if it wrote one."""
        try:
            with open(self._incarnation_path) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _remember(self) -> None:
        """Write this run's incarnation into the data dir (replaced atomically)."""
        tmp = self._incarnation_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.incarnation + "\n")
        os.replace(tmp, self._incarnation_path)

    def heartbeat(self) -> bool:
        """Beat; ``False`` when this process's claim is gone (forgotten, or taken over)."""
        return self._host_rows.heartbeat(self.name, self.incarnation)

    def stopped(self) -> None:
        """Record a clean stop: an admin may forget this host at once from now on."""
        self._host_rows.stop_host(self.name, self.incarnation)

    def fence(self) -> int:
        """Scrub and drop every region this process holds; returns how many (its pools are
        dropped by their owner: :meth:`maasd.core.pools.Pools.unload`).

        For a process whose claim is gone: the ledger no longer has (or no longer
        gives this process) the rows of what it holds.
        """
        dropped = 0
        for buffer_id in self._regions.buffer_ids():
            region = self._regions.take_region(buffer_id)
            if region is not None:
                # punch: zeroes every mapping of the file without writing through the
                # daemon's own (which a worker's holes in hugetlb memory could fault)
                region.scrub("punch")
                region.close()
                dropped += 1
        self._regions.puts.forsake()  # puts in flight: their rows went too
        self.incarnation = keys.new_id()
        return dropped

    # -- the admin's use-cases ----------------------------------------------------------------

    def infos(self) -> list[HostInfo]:
        """Every host sharing the ledger, by name."""
        return [host_info(h, self.name, self._stale_s) for h in self._host_rows.hosts()]

    def forget(self, name: str) -> int:
        """Forget a host that is not serving; returns how many buffers left the ledger."""
        if name == self.name:
            raise StateConflict(f"host {name!r} is the daemon answering this request")
        gone = self._host_rows.forget_host(name, stale_s=self._stale_s)
        logger.warning(
            "host %s forgotten: %d buffer(s), %d bytes released from the ledger",
            name,
            len(gone),
            sum(b.size_bytes for b in gone),
        )
        return len(gone)


def _twin(name: str, other: HostRow) -> str:
    return (
        f"another daemon is serving as host {name!r} (incarnation {other.incarnation[:8]}, "
        f"beating every {other.heartbeat_s:g} s): give each daemon its own MAASD_NODE_NAME"
    )
