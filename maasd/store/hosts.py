"""The daemon hosts sharing the ledger: claims, heartbeats, and forgetting a dead host.

Every time here is the database's clock (:class:`db_now`), never a host's: one
host's heartbeat is compared with another's "now", and hosts' clocks drift.

A host is **live** while it has not stopped cleanly and its last heartbeat is
younger than the caller's ``stale_s``. Claims and heartbeats name the
*incarnation* (a random id per daemon start), so a process whose claim was
taken — by an operator forgetting its host, or by a new daemon of the same
name after it stopped beating — learns it at its next heartbeat.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import Float, bindparam, delete, func, insert, select, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from maasd.errors import NotFound, StateConflict
from maasd.store import schema
from maasd.store.base import Repository, used
from maasd.store.events import buffer_event, event, ins_event
from maasd.store.records import BufferRow, HostRow

__all__ = ["HostRepo", "HostUsage", "db_now", "is_live"]

_H = schema.hosts
_P = schema.pools
_B = schema.buffers


class db_now(FunctionElement[float]):
    """The database server's current time, in epoch seconds (a ``Float``)."""

    type = Float()
    inherit_cache = True
    name = "db_now"


@compiles(db_now, "postgresql")
def _db_now_pg(_element: db_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    # clock_timestamp(), not now(): the time of this statement, not of its transaction.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "sqlite")
def _db_now_sqlite(_element: db_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


_sel_now = select(db_now())
_lock_host = select(_H, db_now()).where(_H.c.name == bindparam("p_name")).with_for_update()
_ins_host = insert(_H).values(
    name=bindparam("p_name"),
    incarnation=bindparam("p_inc"),
    started_at=db_now(),
    last_seen=db_now(),
    heartbeat_s=bindparam("p_hb"),
)
_take_host = (
    update(_H)
    .where(_H.c.name == bindparam("p_name"))
    .values(
        incarnation=bindparam("p_inc"),
        started_at=db_now(),
        last_seen=db_now(),
        heartbeat_s=bindparam("p_hb"),
        stopped_at=None,
    )
)
_beat = (
    update(_H)
    .where(
        _H.c.name == bindparam("p_name"),
        _H.c.incarnation == bindparam("p_inc"),
        _H.c.stopped_at.is_(None),
    )
    .values(last_seen=db_now())
)
_stop = (
    update(_H)
    .where(_H.c.name == bindparam("p_name"), _H.c.incarnation == bindparam("p_inc"))
    .values(stopped_at=db_now())
)
_sel_hosts = select(_H).order_by(_H.c.name)
_sel_pools_by_host = select(_P.c.host, func.count(_P.c.id), used(_P.c.capacity_bytes)).group_by(
    _P.c.host
)
_sel_buffers_by_host = select(_B.c.host, func.count(_B.c.id), used(_B.c.size_bytes)).group_by(
    _B.c.host
)
_lock_host_pools = select(_P.c.id).where(_P.c.host == bindparam("p_name")).with_for_update()
_del_host_buffers = delete(_B).where(_B.c.host == bindparam("p_name")).returning(*_B.c)
_del_host_pools = delete(_P).where(_P.c.host == bindparam("p_name"))
_del_host = delete(_H).where(_H.c.name == bindparam("p_name"))


class HostUsage(HostRow, frozen=True):
    """A host with what the ledger holds for it, and the database's time of the reading."""

    pools: int = 0
    capacity_bytes: int = 0
    buffers: int = 0
    used_bytes: int = 0
    now: float = 0.0


def is_live(row: HostRow, now: float, stale_s: float) -> bool:
    """Serving: not stopped cleanly, and a heartbeat younger than ``stale_s`` at ``now``."""
    return row.stopped_at is None and now - row.last_seen < stale_s


class HostRepo(Repository):
    """Claiming a host name for this process, beating, listing hosts, forgetting one."""

    def claim_host(
        self,
        name: str,
        incarnation: str,
        heartbeat_s: float,
        *,
        stale_s: float,
        take_over: HostRow | None = None,
    ) -> HostRow | None:
        """Make ``incarnation`` the process serving host ``name``; ``None`` when it is.

        Claimed when the host is new, stopped cleanly, or its heartbeat is older
        than ``stale_s`` — or it is still exactly ``take_over`` (the same
        incarnation and heartbeat a caller watched not move). Otherwise another
        process looks alive as this host: its row is returned, nothing changes.
        """
        params = {"p_name": name, "p_inc": incarnation, "p_hb": heartbeat_s}
        try:
            return self._claim(params, stale_s, take_over)
        except sa.exc.IntegrityError:
            # Two first claims of a new name raced to insert its row: the other one won,
            # and is seen (alive) by a second look.
            return self._claim(params, stale_s, take_over)

    def _claim(
        self, params: dict[str, Any], stale_s: float, take_over: HostRow | None
    ) -> HostRow | None:
        with self._writing() as conn:
            found = conn.execute(_lock_host, params).first()
            if found is None:
                conn.execute(_ins_host, params)
                return None
            row, now = HostRow(*found[:-1]), found[-1]
            unchanged = take_over is not None and (row.incarnation, row.last_seen) == (
                take_over.incarnation,
                take_over.last_seen,
            )
            if row.incarnation != params["p_inc"] and is_live(row, now, stale_s) and not unchanged:
                return row
            conn.execute(_take_host, params)
        return None

    def heartbeat(self, name: str, incarnation: str) -> bool:
        """Record that ``incarnation`` still serves ``name``; ``False`` if its claim is gone."""
        return self._single_count(_beat, {"p_name": name, "p_inc": incarnation}) == 1

    def stop_host(self, name: str, incarnation: str) -> None:
        """Record a clean shutdown of ``incarnation`` (nothing if it no longer holds the claim)."""
        self._single_count(_stop, {"p_name": name, "p_inc": incarnation})

    def hosts(self) -> list[HostUsage]:
        """Every host, by name, with its pools and buffers and the database's time."""
        with self._reading() as conn:
            now = conn.execute(_sel_now).scalar_one()
            rows = conn.execute(_sel_hosts).all()
            pools = {h: (n, cap) for h, n, cap in conn.execute(_sel_pools_by_host)}
            bufs = {h: (n, size) for h, n, size in conn.execute(_sel_buffers_by_host)}
        out = []
        for r in rows:
            n_pools, capacity = pools.get(r.name, (0, 0))
            n_bufs, size = bufs.get(r.name, (0, 0))
            out.append(
                HostUsage(
                    **r._asdict(),
                    pools=n_pools,
                    capacity_bytes=capacity,
                    buffers=n_bufs,
                    used_bytes=size,
                    now=now,
                )
            )
        return out

    def forget_host(self, name: str, *, stale_s: float) -> list[BufferRow]:
        """Forget a host that is not live: its buffers, its pools, its row; in one transaction.

        The buffers' memory died with the host (or is fenced off by it: see
        :meth:`heartbeat`), so their rows are deleted without a scrub, each with
        a ``host_forget`` event, and stop counting against quotas. Returns them.
        :class:`NotFound` for an unknown host; :class:`StateConflict` for a live one.
        """
        with self._writing() as conn:
            found = conn.execute(_lock_host, {"p_name": name}).first()
            if found is None:
                raise NotFound(f"no host {name!r} in the ledger")
            row, now = HostRow(*found[:-1]), found[-1]
            if is_live(row, now, stale_s):
                raise StateConflict(
                    f"host {name!r} is serving (heartbeat {now - row.last_seen:.1f} s ago; "
                    f"a host is forgotten after {stale_s:g} s without one)"
                )
            # Lock the pools first: a reserve into one of them waits, then finds it gone.
            conn.execute(_lock_host_pools, {"p_name": name}).all()
            gone = [BufferRow(*r) for r in conn.execute(_del_host_buffers, {"p_name": name})]
            events = [buffer_event("host_forget", now, b, detail=name) for b in gone]
            events.append(
                event(
                    "host_forget",
                    now,
                    nbytes=sum(b.size_bytes for b in gone),
                    detail=f"{name}: {len(gone)} buffer(s)",
                )
            )
            conn.execute(ins_event, events)
            conn.execute(_del_host_pools, {"p_name": name})
            conn.execute(_del_host, {"p_name": name})
        return gone
