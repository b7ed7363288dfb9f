"""Admitting a reserve that must evict: only bytes that really come free make room.

The ledger admits a reserve in one transaction (:meth:`ReserveRepo.begin_reserve`):
quota, capacity and victims decided together, the victims marked ``releasing``. Their
memory is then released here — but a committed entry is sealed, so its pages cannot be
punched, and while some process holds its memfd (a worker's fd, mapping, child, a
re-open) they stay resident and its row stays ``releasing``, counted in its tenant's
quota and its pool (:mod:`maasd.core.holders`). Such a victim made no room::

    begin_reserve(row, prefer_not=attached)   victims: unattached ones first
    each victim released (scrubbed, closed by the daemon; the connections that hold
      it are told ``released`` and drop it)
    wait up to EVICT_WAIT_S for the entry victims' inodes to go
      all gone    → admitted
      some held   → the row was admitted on bytes that are not free: its admission is
                    undone (``reserve_failed``) and the ledger asked again; held victims
                    are counted and no candidates any more, so each round evicts others,
                    until the ledger refuses (409 quota-exceeded, 507) or it fits

An honest worker's own cache is the usual holder: the pushed ``released`` frame makes
it unmap at once (also while it waits for this very reserve's answer), so the wait is
short and the victim does free.
"""

from __future__ import annotations

import msgspec

from maasd.core.release import Releaser
from maasd.core.runtime import Runtime
from maasd.errors import PoolExhausted, QuotaExceeded
from maasd.store import BufferRow, Store, must_last
from maasd.tenancy import keys

__all__ = ["EVICT_ROUNDS", "EVICT_WAIT_S", "admit"]

#: How long a reserve waits for the holders of the entries it evicted to let go.
EVICT_WAIT_S = 0.5
#: Admissions tried before a reserve whose victims stay held gives up.
EVICT_ROUNDS = 4


def admit(
    store: Store,
    runtime: Runtime,
    releaser: Releaser,
    row: BufferRow,
    *,
    uses: dict[str, float],
    leases: dict[str, float],
) -> BufferRow:
    """Admit ``row`` (state ``reserving``/``staged``), its victims released and freed.

    Returns the row admitted (a new id if a round was undone). Raises what
    :meth:`~maasd.store.ReserveRepo.begin_reserve` raises; after :data:`EVICT_ROUNDS`
    rounds whose victims stayed held, :class:`QuotaExceeded` (a victim of the tenant's
    own) or :class:`PoolExhausted`. ``uses`` and ``leases`` are written by the first
    admitting transaction (the caller's dicts are emptied then).
    """
    held: list[BufferRow] = []
    for _ in range(EVICT_ROUNDS):
        try:
            victims = store.begin_reserve(
                row,
                uses=dict(uses),
                leases=dict(leases),
                durable=must_last(row.persistence),
                prefer_not=runtime.attached_ids(),
            )
        except (QuotaExceeded, PoolExhausted) as e:
            if not held:
                raise
            raise type(e)(f"{e.detail}; {_still_held(held)}") from e
        uses.clear()
        leases.clear()
        for victim in victims:
            releaser.evict(victim)
        entries = [v.id for v in victims if v.kind == "entry"]
        still = runtime.holders.wait_freed(entries, EVICT_WAIT_S) if entries else set()
        if not still:
            return row
        held = [v for v in victims if v.id in still]
        # Admitted on bytes still held: undone, and the ledger asked again.
        store.finish_release(row.id, kind="reserve_failed", durable=must_last(row.persistence))
        row = msgspec.structs.replace(row, id=keys.new_id())
    if any(v.tenant_id == row.tenant_id for v in held):
        raise QuotaExceeded(f"tenant {row.tenant_id}'s quota is full: {_still_held(held)}")
    raise PoolExhausted(f"the pool is full: {_still_held(held)}")


def _still_held(held: list[BufferRow]) -> str:
    return (
        f"{len(held)} evicted entries ({sum(v.size_bytes for v in held)} bytes) are still "
        "held open by workers and count until every fd and mapping of them is closed"
    )
