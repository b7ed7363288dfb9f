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
    wait up to EVICT_WAIT_S for the entry victims' inodes to go — only if a victim
      still held was attached by a connection (told ``released``): one no connection
      holds (a kept fd after a detach, a child's, a re-open) will not let go when told,
      so waiting for it would only let its holder stall other tenants' reserves
      all gone    → admitted
      some held   → the row was admitted on bytes that are not free: its admission is
                    undone (``reserve_failed``) and the ledger asked again; held victims
                    are counted and no candidates any more, so each round evicts others,
                    until the ledger refuses (409 quota-exceeded, 507) or it fits

The waits of all rounds together are at most EVICT_WAIT_S (a peer told ``released``
that never lets go costs a reserve that moment once, not once per round). Rounds that
waited are at most EVICT_ROUNDS; rounds that did not (their held victims no connection
was told about, or the moment spent) at most EVICT_ROUNDS_UNTOLD more, each one a
ledger transaction and no wait. So a tenant that keeps cold entries of its own held in a shared
pool (counted in its quota, as they should be) cannot make another tenant's put fail
while that tenant's own evictable entries could make room, unless it holds more than
EVICT_ROUNDS_UNTOLD rounds' worth of victims (tests/integration/test_attacks_round3.py).

An honest worker's own cache is the usual holder: the pushed ``released`` frame makes
it unmap at once (also while it waits for this very reserve's answer), so the wait is
short and the victim does free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from maasd.core.attachments import Attachments
from maasd.core.holders import HeldAfterRelease, Holders
from maasd.core.release import Releaser
from maasd.errors import BufferCountExceeded, PoolExhausted, QuotaExceeded
from maasd.store import BufferRow, Extension, ReserveRepo, must_last
from maasd.tenancy import keys

__all__ = ["EVICT_ROUNDS", "EVICT_ROUNDS_UNTOLD", "EVICT_WAIT_S", "admit"]

#: How long a reserve waits, all rounds together, for the holders of the entries it
#: evicted to let go.
EVICT_WAIT_S = 0.5
#: Admissions tried before a reserve whose victims stay held gives up.
EVICT_ROUNDS = 4
#: Further admissions whose held victims no connection was told about (nothing waited).
EVICT_ROUNDS_UNTOLD = 64


def admit(
    store: ReserveRepo,
    attachments: Attachments,
    holders: Holders,
    releaser: Releaser,
    row: BufferRow,
    *,
    uses: dict[str, float],
    leases: dict[str, Extension],
    default_cap: int | None = None,
    renamed: Callable[[str], None] | None = None,
) -> BufferRow:
    """Admit ``row`` (state ``reserving``/``staged``), its victims released and freed.

    Returns the row admitted (a new id if a round was undone). Raises what
    :meth:`~maasd.store.ReserveRepo.begin_reserve` raises; after :data:`EVICT_ROUNDS`
    rounds whose victims stayed held, :class:`QuotaExceeded` (a victim of the tenant's
    own) or :class:`PoolExhausted`. ``uses`` and ``leases`` are written by the first
    admitting transaction (the caller's dicts are emptied then). ``renamed(new_id)`` is
    told the id of each admission asked again, before it is asked.
    """
    held: list[BufferRow] = []
    waited = untold = 0
    deadline = time.monotonic() + EVICT_WAIT_S  # all rounds' waits together
    attached = attachments.attached_ids()  # a view: asked only if a victim is chosen
    while waited < EVICT_ROUNDS and untold < EVICT_ROUNDS_UNTOLD:
        try:
            victims = store.begin_reserve(
                row,
                uses=dict(uses),
                leases=dict(leases),
                durable=must_last(row.persistence),
                prefer_not=attached,
                default_cap=default_cap,
            )
        except (QuotaExceeded, PoolExhausted, BufferCountExceeded) as e:
            if not held:
                of_pool = isinstance(e, PoolExhausted)
                note = _held_after_release(
                    holders.held_by(), row.pool_id if of_pool else row.tenant_id, of_pool
                )
                if note:
                    raise type(e)(f"{e.detail}; {note}") from e
                raise
            raise type(e)(f"{e.detail}; {_still_held(held)}") from e
        uses.clear()
        leases.clear()
        entries = [v.id for v in victims if v.kind == "entry"]
        told = {i for i in entries if i in attached}  # their eviction tells a connection
        for victim in victims:
            releaser.evict(victim)
        still = holders.wait_freed(entries, 0) if entries else set()
        left = deadline - time.monotonic()
        if still & told and left > 0:  # a connection was told to let go: a moment
            still = holders.wait_freed(still, left)
            waited += 1
        else:
            untold += 1
        if not still:
            return row
        held = [v for v in victims if v.id in still]
        # Admitted on bytes still held: undone, and the ledger asked again.
        store.finish_release(row.id, kind="reserve_failed", durable=must_last(row.persistence))
        row = msgspec.structs.replace(row, id=keys.new_id())
        if renamed is not None:  # the caller expects a release of the new id (inflight.py)
            renamed(row.id)
    if any(v.tenant_id == row.tenant_id for v in held):
        raise QuotaExceeded(f"tenant {row.tenant_id}'s quota is full: {_still_held(held)}")
    raise PoolExhausted(f"the pool is full: {_still_held(held)}")


def _still_held(held: list[BufferRow]) -> str:
    return (
        f"{len(held)} evicted entries ({sum(v.size_bytes for v in held)} bytes) are still "
        "held open by workers and count until every fd and mapping of them is closed"
    )


def _held_after_release(held: list[HeldAfterRelease], owner: str, pool: bool) -> str:
    """What a refusal should also say when part of what a tenant (or, ``pool``, a pool)
    ``owner`` is counted for is released entries workers still hold: its owner sees none
    of them."""
    mine = [h for h in held if (h.pool_id if pool else h.tenant_id) == owner]
    if not mine:
        return ""
    return (
        f"{len(mine)} of them ({sum(h.size_bytes for h in mine)} bytes) are released "
        "entries still held open by workers, counted until every fd and mapping of them "
        "is closed (the admin's `maasctl buffers list --held` names the processes)"
    )
