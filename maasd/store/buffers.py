"""Buffers and their leases in the ledger, and the reserve transaction.

A buffer's life in the ledger::

    begin_reserve ─> reserving ─ set_state ─> live ─ mark_releasing/mark_expired ─> releasing
                └ (an entry) ─> staged ─ commit ──┘                     finish_release ─> (deleted)

An entry (``kind = 'entry'``, a socket ``put``) is ``staged`` while its writer fills
it: it counts like any buffer but no lookup sees it, until :meth:`BufferRepo.commit`
makes it ``live`` with its ``committed_at``. Its lease runs from the put: a DELETE or
the reaper may release it while staged (``staged ─> releasing``), and the commit, a
compare-and-set from ``staged``, then finds it gone.

Eviction marks its victims ``releasing`` inside the reserve transaction that
needs their bytes; the victims are chosen by :mod:`maasd.store.eviction`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    delete,
    exists,
    insert,
    or_,
    select,
    true,
    tuple_,
    update,
)

from maasd.errors import (
    BufferCountExceeded,
    DuplicateKey,
    InvalidRequest,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
    StateConflict,
    Unauthorized,
)
from maasd.models import BufferState, ReleaseReason
from maasd.sizes import check_fits, check_size
from maasd.store import schema
from maasd.store.base import Repository, violation
from maasd.store.events import EVENT_COLUMNS, buffer_event, ins_event
from maasd.store.eviction import Candidate, Victims, choose_victims
from maasd.store.fast import Hot
from maasd.store.records import BufferRow, Extension

__all__ = ["BufferRepo", "ReserveRepo"]

_B = schema.buffers

# ------------------------------------------------------------- reserve
_ins_buffer = insert(_B)
_T, _P = schema.tenants, schema.pools
# The reserve's two locks, each reading what it decides by from the row it locks: the
# running totals (maasd.store.totals) are columns of those rows, and every change to
# them is an UPDATE of them (the triggers on buffers), so each read is exact across
# hosts. Lock order is always tenant, then pool: no deadlock between reserves.
_lock_tenant_totals = (
    select(_T.c.quota_bytes, _T.c.max_buffers, _T.c.deleting_at, _T.c.used_bytes, _T.c.buffers)
    .where(_T.c.id == bindparam("p_tenant"))
    .with_for_update()
)
# The key check rides on the second lock: its snapshot is taken once the tenant's lock
# is held, so it sees every key the lock's previous holders committed.
_lock_pool_totals = (
    select(
        _P.c.capacity_bytes,
        _P.c.name,
        _P.c.deleting_at,
        _P.c.used_bytes,
        exists()
        .where(
            _B.c.tenant_id == bindparam("p_tenant"),
            _B.c.host == bindparam("p_host"),
            _B.c.key == bindparam("p_key"),
        )
        .label("dup"),
    )
    .where(_P.c.id == bindparam("p_pool"))
    .with_for_update(of=_P)
)
_evictable = and_(_B.c.evictable == true(), _B.c.state == "live")
_lru = (_B.c.last_used_at, _B.c.id)
_cand_cols = (_B.c.id, _B.c.tenant_id, _B.c.pool_id, _B.c.size_bytes, *_lru)
# A quota shortfall evicts only the tenant's buffers on the reserving host: only the
# daemon holding a buffer's memory can scrub it (docs/scale-out.md).
_tenant_here = and_(_B.c.tenant_id == bindparam("p_tenant"), _B.c.host == bindparam("p_host"))
# Candidates come a page at a time, after the last one seen in LRU order (keyset
# paging): a reserve reads as many as its victims need, not every evictable row.
_after = tuple_(*_lru) > tuple_(bindparam("after_t"), bindparam("after_id"))
_PAGE = 32


def _paged(where: Any) -> Any:
    return select(*_cand_cols).where(_evictable, where, _after).order_by(*_lru).limit(_PAGE)


_sel_cand_tenant = _paged(_tenant_here)
_sel_cand_pool = _paged(_B.c.pool_id == bindparam("p_pool"))
_sel_cand_both = _paged(or_(_tenant_here, _B.c.pool_id == bindparam("p_pool")))


def _candidates(conn: Connection, stmt: Any, params: dict[str, Any]) -> Iterator[Candidate]:
    """The evictable candidates of ``stmt``, least recently used first, read a page at
    a time as the caller takes them: O(taken), not O(candidates)."""
    after: tuple[float, str] = (float("-inf"), "")
    while True:
        page = conn.execute(stmt, {**params, "after_t": after[0], "after_id": after[1]}).all()
        for r in page:
            yield Candidate(r[0], r[1], r[2], r[3])
        if len(page) < _PAGE:
            return
        after = (page[-1][4], page[-1][5])


def _deferring(candidates: Iterable[Candidate], later: Collection[str]) -> Iterator[Candidate]:
    """``candidates`` in their order, but those in ``later`` after all the others (in
    their order too): a stable sort on "in ``later``" that reads no more than it must."""
    held = []
    for c in candidates:
        if c.id in later:
            held.append(c)
        else:
            yield c
    yield from held


# Releasing clears the key: it is unique among reserving/live buffers only, so a
# tenant may store the same key again while the old buffer is being scrubbed.
_mark_victims = (
    update(_B)
    .where(_B.c.id.in_(bindparam("ids", expanding=True)), _B.c.state == "live")
    .values(state="releasing", key=None)
    .returning(*_B.c)
)
_del_buffer = delete(_B).where(_B.c.id == bindparam("p_id")).returning(*_B.c)
# A live buffer's row (not an entry's) ended in one step (ReserveRepo.release_live).
_del_live_buffer = (
    delete(_B)
    .where(_B.c.id == bindparam("p_id"), _B.c.state == "live", _B.c.kind == "buffer")
    .returning(*_B.c)
)
_del_own_live_buffer = _del_live_buffer.where(_B.c.tenant_id == bindparam("p_tenant"))
_del_buffers = delete(_B).where(_B.c.id.in_(bindparam("ids", expanding=True))).returning(*_B.c)
#: Ids per statement when many rows go at once (SQLite allows 32766 variables).
_IDS_PER_STATEMENT = 10_000

# ------------------------------------------------------------- buffers
_sel_buffer = select(_B).where(_B.c.id == bindparam("p_id"))
_sel_own_buffer = _sel_buffer.where(_B.c.tenant_id == bindparam("p_tenant"))
_mark_releasing = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"))
    .values(state="releasing", key=None)
    .returning(*_B.c)
)
_mark_own_releasing = _mark_releasing.where(_B.c.tenant_id == bindparam("p_tenant"))
#: The states of a buffer that holds memory under a lease: a live buffer, and an entry
#: still staged (its writer has not committed it). Either may be released by a DELETE,
#: renewed, and released by the reaper when its lease ends.
_LEASED = ("live", "staged")
_is_leased = _B.c.state.in_(_LEASED)
_mark_leased_releasing = _mark_releasing.where(_is_leased)
_mark_own_leased_releasing = _mark_own_releasing.where(_is_leased)
_mark_own_staged_releasing = _mark_own_releasing.where(_B.c.state == "staged")
_mark_expired = _mark_releasing.where(_is_leased, _B.c.expires_at < bindparam("now"))
_set_state = update(_B).where(_B.c.id == bindparam("p_id")).values(state=bindparam("p_state"))
_advance = _set_state.where(_B.c.state == bindparam("p_from"))
_renew = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"), _is_leased, _B.c.expires_at > bindparam("p_alive"))
    .values(
        expires_at=bindparam("p_expires"),
        ttl_s=bindparam("p_ttl"),
        lease_set_at=bindparam("p_set"),
    )
    .returning(*_B.c)
)
_renew_own = _renew.where(_B.c.tenant_id == bindparam("p_tenant"))
_touch = update(_B).where(_B.c.id == bindparam("p_id")).values(last_used_at=bindparam("now"))
# A lease only ever grows here: a longer renew that landed meanwhile stays. And only by a
# hit since the last renew: one before it (taken to be written when the renew came) would
# undo a renew to a shorter lease; the renew's lease is the later word.
_extend = (
    update(_B)
    .where(
        _B.c.id == bindparam("p_id"),
        _B.c.expires_at < bindparam("p_expires"),
        or_(_B.c.lease_set_at.is_(None), _B.c.lease_set_at <= bindparam("p_hit")),
    )
    .values(expires_at=bindparam("p_expires"))
)
# Not past its lease: the reaper releases it at its next pass (the commit answers 409).
_commit = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"), _B.c.state == "staged", _B.c.expires_at > bindparam("now"))
    .values(state="live", committed_at=bindparam("now"))
    .returning(*_B.c)
)
_set_numa = update(_B).where(_B.c.id == bindparam("p_id")).values(numa_node=bindparam("node"))
_set_checkpoint = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"))
    .values(
        checkpoint_path=bindparam("path"),
        checksum=bindparam("p_checksum"),
        checkpointed_at=bindparam("now"),
    )
)
_on_host = _B.c.host == bindparam("host")
_sel_expired = (
    select(_B)
    .where(_is_leased, _B.c.expires_at < bindparam("now"), _on_host)
    .order_by(_B.c.expires_at)
)
_sel_on_host = select(_B).where(_on_host).order_by(_B.c.created_at, _B.c.id)
_sel_lookup = select(_B).where(
    _B.c.tenant_id == bindparam("p_tenant"),
    _B.c.state == "live",
    _B.c.key.in_(bindparam("keys", expanding=True)),
)
_sel_lookup_host = _sel_lookup.where(_on_host)
#: the one key per tenant and host (maasd.store.schema)
_KEY_CONSTRAINT = "uq_buffers_tenant_id_host_key"

# The statements of a REST reserve + release, on the DBAPI cursor (maasd.store.fast).
_hot_lock_tenant = Hot(_lock_tenant_totals)
_hot_lock_pool = Hot(_lock_pool_totals)
_hot_ins_buffer = Hot(_ins_buffer, columns=[c.name for c in _B.c])
_hot_ins_event = Hot(ins_event, columns=EVENT_COLUMNS)
_hot_del_buffer = Hot(_del_buffer)
_hot_advance = Hot(_advance)
_hot_del_live = {False: Hot(_del_live_buffer), True: Hot(_del_own_live_buffer)}
_hot_mark = {
    (mine, leased): Hot(stmt)
    for (mine, leased), stmt in {
        (False, False): _mark_releasing,
        (False, True): _mark_leased_releasing,
        (True, False): _mark_own_releasing,
        (True, True): _mark_own_leased_releasing,
    }.items()
}


def _check_state(state: str) -> None:
    if state not in schema.BUFFER_STATES:
        raise InvalidRequest(f"unknown buffer state {state!r}")


def _record_uses(
    conn: Connection, touches: list[dict[str, Any]], extends: list[dict[str, Any]]
) -> None:
    """Uses (the LRU order) and lease extensions, batched: one executemany each.

    In the order of the buffers' ids: two transactions writing uses of the same buffers
    (a reserve admitting the batch, the reaper flushing it) then lock their rows in one
    order, and cannot deadlock on PostgreSQL (they did, under a slow ledger). A lease
    extension is always about a buffer used too, so the touches lock every row first."""
    if touches:
        conn.execute(_touch, sorted(touches, key=_by_id))
    if extends:
        conn.execute(_extend, sorted(extends, key=_by_id))


def _by_id(params: Mapping[str, Any]) -> str:
    return str(params["p_id"])


def _extends(leases: Mapping[str, Extension] | None) -> list[dict[str, Any]]:
    """The parameters of ``_extend`` for lease extensions (``buffer_id → Extension``)."""
    return [
        {"p_id": b, "p_expires": e.expires_at, "p_hit": e.hit_at} for b, e in (leases or {}).items()
    ]


def _admitted_state(row: BufferRow) -> BufferState:
    """The state ``row`` is admitted in. An entry's put: ``staged`` straight away — a crash
    leaves a staged row as it would a reserving one (recovery releases both), and no lookup
    or eviction sees either: one ledger write less per save. A plain buffer (no key, not
    evictable) asked for ``live``: ``live`` — no key lookup or eviction sees it either, and
    recovery releases a live row whose memory is gone: one write less per REST reserve
    (maasd.core.reserve). Anything else: ``reserving``, until its region is held."""
    if row.kind == "entry":
        return "staged"
    if row.state == "live" and not row.evictable and row.key is None:
        return "live"
    return "reserving"


class ReserveRepo(Repository):
    """Admitting a buffer (quota, count, capacity, key, eviction: one transaction) and deleting it."""

    def begin_reserve(
        self,
        row: BufferRow,
        *,
        quota_check: bool = True,
        uses: Mapping[str, float] | None = None,
        leases: Mapping[str, Extension] | None = None,
        durable: bool = True,
        prefer_not: Collection[str] = (),
        default_cap: int | None = None,
    ) -> list[BufferRow]:
        """Admit ``row`` to the ledger (state ``reserving``), evicting if it must; atomically.

        First ``uses`` (``buffer_id → when``) and ``leases`` (``buffer_id →``
        :class:`Extension`) are recorded, as :meth:`BufferRepo.touch_many` does, since
        eviction orders by uses: on SQLite inside the transaction below, which saves
        them a commit of their own; on PostgreSQL in a transaction of their own just
        before, because row locks on those buffers held through the admission could
        deadlock with a concurrent reserve marking them as victims.

        An entry's put, and a plain buffer asked for ``live``, are admitted in their
        final state (:func:`_admitted_state`).

        In one write transaction: lock the tenant and pool rows; refuse a
        tenant being deleted (:class:`Unauthorized`: its keys are revoked) and a
        pool being deleted (:class:`StateConflict`); refuse a key the tenant
        already uses on this host (:class:`DuplicateKey`); read the tenant's and
        the pool's bytes and the tenant's buffer count (every state, entries
        too: :mod:`maasd.store.totals`, O(1)) from the rows it locked; if ``row`` does not fit the quota (unless ``quota_check`` is
        false), the tenant's ``max_buffers`` (NULL: ``default_cap``, the daemon's
        ``max_buffers_per_tenant``; ``None``: no cap)
        or the pool's capacity, choose victims
        (:func:`~maasd.store.eviction.choose_victims`): **evictable live**
        buffers, least recently used first — the tenant's own on ``row.host``
        for a quota or count shortfall, any tenant's in this pool for a capacity
        shortfall (a host can only scrub what it holds). If they cannot close the
        shortfalls, raise :class:`QuotaExceeded` (quota),
        :class:`BufferCountExceeded` (count) or :class:`PoolExhausted`
        (capacity) and change nothing. Otherwise mark the
        victims ``releasing``, insert ``row``, record one ``evict`` event per
        victim (naming this reserve) and the ``reserve`` event, and commit.

        Returns the victims (state ``releasing``): the caller scrubs each and
        calls :meth:`finish_release` with ``record=False`` (their event is
        written here). The caller checks that ``row`` is smaller than the pool
        (``TooLarge``); it is guarded here too. Unknown tenant or pool: :class:`NotFound`.

        ``durable=False`` (a volatile pool's buffer): without waiting for the disk, also with
        persistent victims (docs/operations.md, "Crash safety"). ``prefer_not``: ids evicted
        after every other candidate (:mod:`maasd.core.room`)."""
        state = _admitted_state(row)
        if row.state != state:
            row = msgspec.structs.replace(row, state=state)
        check_size(row.size_bytes, "size_bytes")  # a size ≤ 0 would let the sums undercount
        try:
            touches = [{"p_id": b, "now": t} for b, t in (uses or {}).items()]
            extends = _extends(leases)
            if (touches or extends) and self.is_postgres:
                with self._writing(durable=False) as conn:  # best effort: see touch_many
                    _record_uses(conn, touches, extends)
                touches, extends = [], []
            with self._writing(durable=durable) as conn:
                _record_uses(conn, touches, extends)
                victims = self._admit(conn, row, quota_check, prefer_not, default_cap)
                _insert(conn, row, victims)
        except sa.exc.IntegrityError as exc:
            v = violation(exc)
            if v.kind == "unique" and v.of(_KEY_CONSTRAINT, "buffers.key"):
                raise DuplicateKey(f"a buffer with key {row.key!r} already exists") from exc
            if v.kind == "foreign_key":
                raise NotFound("tenant or pool not found") from exc
            raise StateConflict(f"buffer {row.id} conflicts with the ledger: {v.message}") from exc
        return victims

    def _admit(
        self,
        conn: Connection,
        row: BufferRow,
        quota_check: bool,
        prefer_not: Collection[str],
        default_cap: int | None,
    ) -> list[BufferRow]:
        """Inside the reserve transaction: lock, check, and mark the victims if it must."""
        params = {
            "p_tenant": row.tenant_id,
            "p_pool": row.pool_id,
            "p_host": row.host,
            "p_key": row.key,
        }
        t: Any = _hot_lock_tenant.first(conn, params)
        if t is None:
            raise NotFound(f"tenant {row.tenant_id} not found")
        p: Any = _hot_lock_pool.first(conn, params)
        if p is None:
            raise NotFound(f"pool {row.pool_id} not found")
        quota, cap, tenant_deleting, tenant_used, count = t
        capacity, pool_name, pool_deleting, pool_used, dup = p
        if tenant_deleting is not None:
            raise Unauthorized("the tenant is being deleted; its keys are revoked")
        if pool_deleting is not None:
            raise StateConflict(f"pool {pool_name!r} is being deleted")
        if cap is None:
            cap = default_cap
        size = row.size_bytes
        check_fits(size, capacity, f"pool {pool_name!r}")
        if dup:
            raise DuplicateKey(f"a buffer with key {row.key!r} already exists")
        need_t = tenant_used + size - quota if quota_check else 0
        need_c = count + 1 - cap if cap is not None else 0
        need_p = pool_used + size - capacity
        if need_t <= 0 and need_p <= 0 and need_c <= 0:
            return []
        mine = need_t > 0 or need_c > 0
        if mine and need_p > 0:
            stmt = _sel_cand_both
        elif mine:
            stmt = _sel_cand_tenant
        else:
            stmt = _sel_cand_pool
        candidates = _candidates(conn, stmt, params)
        if prefer_not:  # least recently used first still, but held ones last
            candidates = _deferring(candidates, prefer_not)
        choice = choose_victims(
            candidates,
            tenant_id=row.tenant_id,
            pool_id=row.pool_id,
            quota_short=need_t,
            capacity_short=need_p,
            count_short=need_c,
        )
        if choice.unmet == "quota":
            raise QuotaExceeded(
                f"tenant {row.tenant_id} uses {tenant_used} of its {quota} bytes quota; "
                f"{size} more bytes do not fit" + _even_after(choice.freed_quota)
            )
        if choice.unmet == "count":
            raise BufferCountExceeded(
                f"tenant {row.tenant_id} holds {count} buffers, its max_buffers is {cap}; "
                "release some (evicting its evictable ones was not enough) or ask the "
                "admin to raise max_buffers"
            )
        if choice.unmet == "capacity":
            raise PoolExhausted(
                f"pool {pool_name!r} has {max(capacity - pool_used, 0)} of {capacity} bytes free; "
                f"{size} bytes requested" + _even_after(choice.freed_capacity)
            )
        return self._mark_victims(conn, choice)

    @staticmethod
    def _mark_victims(conn: Connection, choice: Victims) -> list[BufferRow]:
        order = {cid: i for i, cid in enumerate(choice.ids)}
        result: Any = conn.execute(_mark_victims, {"ids": list(choice.ids)})
        marked = [BufferRow(*r) for r in result]
        marked.sort(key=lambda v: order[v.id])
        return marked

    def finish_release(
        self,
        buffer_id: str,
        kind: ReleaseReason = "release",
        *,
        now: float | None = None,
        detail: str | None = None,
        record: bool = True,
        durable: bool = True,
    ) -> BufferRow | None:
        """Delete a buffer's row (its memory is scrubbed) and record a ``kind`` event.

        ``record=False`` records nothing: for a victim of an eviction, whose
        ``evict`` event the reserve that caused it wrote already. Returns the
        deleted row, or ``None`` if there was none (already finished).
        ``durable=False``: a volatile buffer's (see :mod:`maasd.store.base`).
        """
        with self._writing(durable=durable) as conn:
            r: Any = _hot_del_buffer.first(conn, {"p_id": buffer_id})
            if r is None:
                return None
            row = BufferRow(*r)
            if record:
                at = time.time() if now is None else now
                _hot_ins_event.run(conn, buffer_event(kind, at, row, detail))
        return row

    def release_live(
        self,
        buffer_id: str,
        tenant_id: str | None,
        scrub: Callable[[BufferRow], object],
        *,
        durable: bool = True,
    ) -> BufferRow | None:
        """Release a ``live`` buffer (not an entry) in one transaction: delete its row (only
        ``tenant_id``'s; ``None``: the admin), record its ``release`` event, and call
        ``scrub(row)`` — which makes its memory zero — before the commit.

        What :meth:`BufferRepo.mark_releasing` and :meth:`finish_release` do in two, for a
        buffer whose release nothing else can observe half done: its row is locked from
        the delete on (SQLite: the write lock; PostgreSQL: the row's), so a concurrent
        release, the reaper, a tenant delete or an eviction waits for the commit and then
        finds no row; a crash before the commit leaves the row ``live`` (recovery releases
        a volatile one; the caller passes only those); ``scrub`` raising rolls it back.
        Returns the row, or ``None`` when there is no such live buffer (nothing changed,
        ``scrub`` not called).
        """
        params = {"p_id": buffer_id}
        if tenant_id is not None:
            params["p_tenant"] = tenant_id
        with self._writing(durable=durable) as conn:
            r: Any = _hot_del_live[tenant_id is not None].first(conn, params)
            if r is None:
                return None
            row = BufferRow(*r)
            _hot_ins_event.run(conn, buffer_event("release", time.time(), row))
            scrub(row)
        return row

    def finish_release_many(
        self, buffer_ids: Sequence[str], kind: ReleaseReason, *, now: float | None = None
    ) -> int:
        """Delete many buffers' rows (their memory is scrubbed) with a ``kind`` event each,
        in one transaction — what shutdown does instead of a round trip per buffer.
        Ids without a row are skipped. Returns how many rows went."""
        at = time.time() if now is None else now
        gone = 0
        with self._writing() as conn:
            for i in range(0, len(buffer_ids), _IDS_PER_STATEMENT):
                chunk = list(buffer_ids[i : i + _IDS_PER_STATEMENT])
                rows = [BufferRow(*r) for r in conn.execute(_del_buffers, {"ids": chunk})]
                if rows:
                    conn.execute(ins_event, [buffer_event(kind, at, r) for r in rows])
                gone += len(rows)
        return gone


def _insert(conn: Connection, row: BufferRow, victims: list[BufferRow]) -> None:
    """Insert an admitted ``row``, its ``reserve`` event and an ``evict`` event per victim."""
    _hot_ins_buffer.run(conn, msgspec.structs.asdict(row))
    event = buffer_event("reserve", row.created_at, row)
    if not victims:
        _hot_ins_event.run(conn, event)
        return
    evicted = [buffer_event("evict", row.created_at, v, detail=f"for {row.id}") for v in victims]
    _hot_ins_event.many(conn, [*evicted, event])


def _even_after(freed: int) -> str:
    return f", even after evicting {freed} evictable bytes" if freed else ""


class BufferRepo(Repository):
    """Reading buffers, changing their state, lease, placement and checkpoint."""

    def set_state(self, buffer_id: str, state: BufferState, *, durable: bool = True) -> None:
        """Set a buffer's state (``releasing`` also clears its key). :class:`NotFound` if unknown."""
        _check_state(state)
        if state == "releasing":
            self.mark_releasing(buffer_id, None, durable=durable)
            return
        params = {"p_id": buffer_id, "p_state": state}
        if self._single_count(_set_state, params, durable=durable) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def advance(
        self,
        buffer_id: str,
        from_state: BufferState,
        to_state: BufferState,
        *,
        durable: bool = True,
    ) -> bool:
        """Compare-and-set a buffer's state: ``from_state`` → ``to_state``, only if it is
        still in ``from_state``. ``False`` when it is not (released meanwhile, or gone).

        A reserve goes ``reserving`` → ``live`` this way, so that a tenant delete or a
        pool drain that claimed the row meanwhile wins, and the reserve scrubs its own
        region instead of publishing it. ``durable=False``: a volatile buffer's (see
        :mod:`maasd.store.base`).
        """
        _check_state(from_state)
        _check_state(to_state)
        params = {"p_id": buffer_id, "p_from": from_state, "p_state": to_state}
        with self._single_statement(durable=durable) as conn:
            return _hot_advance.count(conn, params) == 1

    def mark_releasing(
        self,
        buffer_id: str,
        tenant_id: str | None,
        *,
        only_leased: bool = False,
        durable: bool = True,
    ) -> BufferRow:
        """Mark a buffer ``releasing`` (clearing its key) and return it.

        ``tenant_id=None`` acts as the admin. Unknown or foreign ids raise
        :class:`NotFound`. By default a buffer already releasing is returned
        again (idempotent, so the daemon's own clean-ups can finish another's
        work); ``only_leased=True`` — a caller's DELETE — claims only a ``live``
        buffer or a ``staged`` entry, so of two concurrent releases (or a release
        and an entry's commit) exactly one succeeds and the other finds it gone.
        """
        params = {"p_id": buffer_id}
        if tenant_id is not None:
            params["p_tenant"] = tenant_id
        with self._single_statement(durable=durable) as conn:
            row = _hot_mark[tenant_id is not None, only_leased].first(conn, params)
        if row is None:
            raise NotFound(f"buffer {buffer_id} not found")
        return BufferRow(*row)

    def mark_staged_releasing(
        self, buffer_id: str, tenant_id: str, *, durable: bool = True
    ) -> BufferRow | None:
        """Mark a ``staged`` entry of ``tenant_id`` ``releasing`` (an abort); ``None`` if it
        is not staged any more (committed, or released by someone else)."""
        params = {"p_id": buffer_id, "p_tenant": tenant_id}
        row = self._single_first(_mark_own_staged_releasing, params, durable=durable)
        return None if row is None else BufferRow(*row)

    def mark_expired(self, buffer_id: str, now: float, *, durable: bool = True) -> BufferRow | None:
        """Mark a buffer ``releasing`` only if it is live (or a staged entry) and its
        lease ended before ``now``.

        The reaper's compare-and-set: a lease renewed between :meth:`expired`
        and this call is left alone (``None``), as is a buffer someone else is
        already releasing. A staged entry's commit is the other side of the same
        compare-and-set (:meth:`commit` moves only a ``staged`` row): exactly one wins.
        """
        row = self._single_first(_mark_expired, {"p_id": buffer_id, "now": now}, durable=durable)
        return None if row is None else BufferRow(*row)

    def buffer(self, buffer_id: str, tenant_id: str | None = None) -> BufferRow | None:
        """A buffer by id; with ``tenant_id``, only if it is that tenant's (foreign → ``None``)."""
        if tenant_id is None:
            row = self._read_first(_sel_buffer, {"p_id": buffer_id})
        else:
            row = self._read_first(_sel_own_buffer, {"p_id": buffer_id, "p_tenant": tenant_id})
        return None if row is None else BufferRow(*row)

    def buffers(
        self,
        tenant_id: str | None = None,
        pool_id: str | None = None,
        states: Iterable[str] | None = ("live",),
        *,
        host: str | None = None,
    ) -> list[BufferRow]:
        """Buffers filtered by tenant, pool, states (``None`` = all) and host; oldest first."""
        stmt = select(_B)
        params: dict[str, Any] = {}
        if tenant_id is not None:
            stmt = stmt.where(_B.c.tenant_id == bindparam("p_tenant"))
            params["p_tenant"] = tenant_id
        if pool_id is not None:
            stmt = stmt.where(_B.c.pool_id == bindparam("p_pool"))
            params["p_pool"] = pool_id
        if states is not None:
            wanted = list(states)
            for s in wanted:
                _check_state(s)
            stmt = stmt.where(_B.c.state.in_(bindparam("states", expanding=True)))
            params["states"] = wanted
        if host is not None:
            stmt = stmt.where(_on_host)
            params["host"] = host
        stmt = stmt.order_by(_B.c.created_at, _B.c.id)
        return [BufferRow(*r) for r in self._read_rows(stmt, params)]

    def renew(
        self,
        buffer_id: str,
        tenant_id: str | None,
        expires_at: float,
        alive_after: float = 0.0,
        *,
        ttl_s: int | None = None,
        now: float | None = None,
    ) -> BufferRow:
        """Set a live buffer's (or staged entry's) lease end, and its length ``ttl_s``, by a
        renew at ``now`` (``None``: the clock's; ``ttl_s`` ``None``: from ``now`` to
        ``expires_at``). :class:`NotFound` if unknown, foreign, neither live nor staged, or
        its lease ended at ``alive_after`` or before."""
        at = time.time() if now is None else now
        ttl = max(1, round(expires_at - at)) if ttl_s is None else ttl_s
        params = {
            "p_id": buffer_id,
            "p_expires": expires_at,
            "p_alive": alive_after,
            "p_ttl": ttl,
            "p_set": at,
        }
        if tenant_id is None:
            row = self._single_first(_renew, params)
        else:
            row = self._single_first(_renew_own, {**params, "p_tenant": tenant_id})
        if row is None:
            raise NotFound(f"buffer {buffer_id} not found")
        return BufferRow(*row)

    def touch_many(
        self, uses: Mapping[str, float], leases: Mapping[str, Extension] | None = None
    ) -> None:
        """Record uses (attach, lookup hit; ``buffer_id → when``) and lease extensions (a
        lookup hit; ``buffer_id →`` :class:`Extension`, never shortening a lease, nor
        written over a renew after the hit) in one transaction.

        A use moves the buffer to the back of the LRU order that eviction follows.

        Committed without waiting for the disk, whichever buffers they are about: they
        were kept in memory until now, so a crash of the daemon loses the unwritten
        ones anyway — a power loss may lose these too, which changes no more than
        that (an LRU order a little older, a lease as its last renewal left it).
        """
        if not uses and not leases:
            return
        with self._writing(durable=False) as conn:
            _record_uses(conn, [{"p_id": b, "now": t} for b, t in uses.items()], _extends(leases))

    def commit(self, buffer_id: str, now: float, *, durable: bool = True) -> BufferRow | None:
        """Make a ``staged`` entry ``live``, committed at ``now``, in one statement.

        ``None`` when it is not staged (released meanwhile), or its lease ended at ``now``
        or before (the reaper's next pass releases it): nothing changes then.
        ``durable=False``: a volatile pool's entry (see :mod:`maasd.store.base`).
        """
        row = self._single_first(_commit, {"p_id": buffer_id, "now": now}, durable=durable)
        return None if row is None else BufferRow(*row)

    def set_numa_node(self, buffer_id: str, node: int) -> None:
        """Record the node a buffer's pages were pinned to. :class:`NotFound` if unknown."""
        if self._single_count(_set_numa, {"p_id": buffer_id, "node": node}) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def set_checkpoint(self, buffer_id: str, path: str, checksum: str, now: float) -> None:
        """Record a written checkpoint (file and checksum). :class:`NotFound` if unknown."""
        params = {"p_id": buffer_id, "path": path, "p_checksum": checksum, "now": now}
        if self._single_count(_set_checkpoint, params) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def set_checkpoints(self, written: Sequence[tuple[str, str, str]], now: float) -> set[str]:
        """Record many written checkpoints (``(buffer_id, path, checksum)``) in one
        transaction; returns the ids recorded (a buffer gone meanwhile is not)."""
        recorded: set[str] = set()
        with self._writing() as conn:
            for buffer_id, path, checksum in written:
                params = {"p_id": buffer_id, "path": path, "p_checksum": checksum, "now": now}
                if conn.execute(_set_checkpoint, params).rowcount == 1:
                    recorded.add(buffer_id)
        return recorded

    def expired(self, now: float, host: str) -> list[BufferRow]:
        """Live buffers and staged entries of ``host`` whose lease ended before ``now``,
        earliest first."""
        return [BufferRow(*r) for r in self._read_rows(_sel_expired, {"now": now, "host": host})]

    def lookup(
        self,
        tenant_id: str,
        keys: Sequence[str],
        *,
        host: str | None = None,
        alive: Callable[[BufferRow], bool] | None = None,
    ) -> tuple[str, BufferRow] | None:
        """The last key of ``keys`` (ordered short → long) with a live buffer of this tenant.

        One query for all keys. ``host`` restricts the hit to buffers held in
        that host's memory (a worker can only map local memory).
        """
        if not keys:
            return None
        params: dict[str, Any] = {"p_tenant": tenant_id, "keys": list(dict.fromkeys(keys))}
        stmt = _sel_lookup
        if host is not None:
            stmt = _sel_lookup_host
            params["host"] = host
        found = [BufferRow(*r) for r in self._read_rows(stmt, params)]
        if alive is not None:  # e.g. its lease not ended (the reaper not there yet)
            found = [b for b in found if alive(b)]
        if not found:
            return None
        rank = {k: i for i, k in enumerate(keys)}
        best = max(found, key=lambda b: rank[b.key or ""])
        assert best.key is not None
        return best.key, best

    def buffers_on_host(self, host: str) -> list[BufferRow]:
        """Every buffer (all states) held by ``host`` — the input of crash recovery."""
        return [BufferRow(*r) for r in self._read_rows(_sel_on_host, {"host": host})]
