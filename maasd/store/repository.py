"""The ledger's repository: every SQL statement maasd runs, behind one ``Store``.

SQLAlchemy Core on one synchronous engine (see :mod:`maasd.store.engine` for
why). Three kinds of connection, chosen per method:

* **reads** — one statement, no explicit transaction: on SQLite no ``BEGIN``
  is sent (a single ``SELECT`` is atomic by itself), on PostgreSQL the
  connection is in autocommit, so a read is one round trip;
* **single-statement writes** (``touch``, ``renew`` …) — ``BEGIN IMMEDIATE``
  on SQLite (take the write lock before reading anything), autocommit on
  PostgreSQL (the statement is its own transaction);
* **write transactions** (reserve, deletes, anything that reads then writes)
  — ``BEGIN IMMEDIATE`` on SQLite, which serialises all writers; on
  PostgreSQL (READ COMMITTED) the rows that guard the decision — the tenant,
  then the pool — are locked with ``SELECT … FOR UPDATE`` first, and usage is
  summed by a *later* statement, whose fresh snapshot therefore includes
  everything committed by the previous holder of those locks.

Usage is never stored: it is ``SUM(size_bytes)`` over a tenant's (or pool's)
buffers in every state — ``reserving`` and ``releasing`` memory is memory in
use — computed inside the transaction that decides.

Statements are built once at import time with bind parameters, so SQLAlchemy's
compiled cache serves each call; rows become records positionally
(``BufferRow(*row)``), the cheapest conversion msgspec offers.

Example::

    store = Store("sqlite:////var/lib/maasd/maasd.db")
    store.upgrade()
    store.add_tenant(new_id(), "acme", 8 << 30, time.time())
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy import (
    BigInteger,
    Connection,
    and_,
    bindparam,
    cast,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.engine import URL, Engine

from maasd.errors import (
    DuplicateKey,
    InvalidRequest,
    NotFound,
    PoolExhausted,
    QuotaExceeded,
    StateConflict,
    TooLarge,
)
from maasd.store import schema
from maasd.store.engine import alembic_config, create_engine, normalize_url
from maasd.store.records import BufferRow, EventRow, KeyRow, PoolRow, TenantRow

__all__ = ["Store"]

_P = schema.pools
_T = schema.tenants
_K = schema.api_keys
_B = schema.buffers
_E = schema.events

#: Arbitrary, fixed: the PostgreSQL advisory lock that serialises migrations.
_MIGRATION_LOCK_ID = 0x6D616173  # "maas"


def _used(column: Any) -> Any:
    """``SUM(column)`` as a BigInteger, 0 when there are no rows.

    (PostgreSQL's ``sum(bigint)`` is ``numeric``; the cast keeps it an ``int``.)
    """
    return cast(func.coalesce(func.sum(column), 0), BigInteger)


# ---------------------------------------------------------------- statements
# Pools
_sel_pools = select(_P).where(_P.c.host == bindparam("host")).order_by(_P.c.name)
_sel_pool = select(_P).where(
    _P.c.host == bindparam("host"),
    or_(_P.c.id == bindparam("ref"), _P.c.name == bindparam("ref")),
)
_sel_pool_usage = (
    select(_P.c.id, _used(_B.c.size_bytes), func.count(_B.c.id))
    .select_from(_P.outerjoin(_B, _B.c.pool_id == _P.c.id))
    .where(_P.c.host == bindparam("host"))
    .group_by(_P.c.id)
)
_lock_pool = (
    select(_P.c.capacity_bytes, _P.c.name).where(_P.c.id == bindparam("p_id")).with_for_update()
)
_del_pool = delete(_P).where(_P.c.id == bindparam("p_id"))
_count_pool_buffers = select(func.count()).select_from(_B).where(_B.c.pool_id == bindparam("p_id"))

# Tenants
_tenant_with_usage = select(_T, _used(_B.c.size_bytes), func.count(_B.c.id)).select_from(
    _T.outerjoin(_B, _B.c.tenant_id == _T.c.id)
)
_sel_tenant = _tenant_with_usage.where(
    or_(_T.c.id == bindparam("ref"), _T.c.name == bindparam("ref"))
).group_by(_T.c.id)
_sel_tenants = _tenant_with_usage.group_by(_T.c.id).order_by(_T.c.name)
_lock_tenant = select(_T.c.quota_bytes).where(_T.c.id == bindparam("p_id")).with_for_update()
_set_quota = update(_T).where(_T.c.id == bindparam("p_id")).values(quota_bytes=bindparam("quota"))
_del_tenant = delete(_T).where(_T.c.id == bindparam("p_id"))
_count_tenant_buffers = (
    select(func.count()).select_from(_B).where(_B.c.tenant_id == bindparam("p_id"))
)

# Keys
_sel_key_by_digest = (
    select(_K)
    .select_from(_K.join(_T, _T.c.id == _K.c.tenant_id))
    .where(_K.c.digest == bindparam("digest"), _K.c.revoked_at.is_(None))
)
_sel_keys = select(_K).where(_K.c.tenant_id == bindparam("p_tenant")).order_by(_K.c.created_at)
_revoke_key = (
    update(_K)
    .where(
        _K.c.id == bindparam("key_id"),
        _K.c.tenant_id == bindparam("p_tenant"),
        _K.c.revoked_at.is_(None),
    )
    .values(revoked_at=bindparam("now"))
)
_revoke_keys = (
    update(_K)
    .where(_K.c.tenant_id == bindparam("p_tenant"), _K.c.revoked_at.is_(None))
    .values(revoked_at=bindparam("now"))
)
_del_keys = delete(_K).where(_K.c.tenant_id == bindparam("p_id"))

# Buffers
_ins_buffer = insert(_B)
_ins_event = insert(_E)
_sel_buffer = select(_B).where(_B.c.id == bindparam("p_id"))
_sel_own_buffer = _sel_buffer.where(_B.c.tenant_id == bindparam("p_tenant"))
# Inside the reserve transaction, after the locks: both usages and the key check
# in one statement (one round trip).
_reserve_facts = select(
    select(_used(_B.c.size_bytes)).where(_B.c.tenant_id == bindparam("p_tenant")).scalar_subquery(),
    select(_used(_B.c.size_bytes)).where(_B.c.pool_id == bindparam("p_pool")).scalar_subquery(),
    exists().where(_B.c.tenant_id == bindparam("p_tenant"), _B.c.key == bindparam("p_key")),
)
_evictable = and_(_B.c.evictable == true(), _B.c.state == "live")
_lru = (_B.c.last_used_at, _B.c.id)
_cand_cols = (_B.c.id, _B.c.tenant_id, _B.c.pool_id, _B.c.size_bytes)
_sel_cand_tenant = (
    select(*_cand_cols).where(_evictable, _B.c.tenant_id == bindparam("p_tenant")).order_by(*_lru)
)
_sel_cand_pool = (
    select(*_cand_cols).where(_evictable, _B.c.pool_id == bindparam("p_pool")).order_by(*_lru)
)
_sel_cand_both = (
    select(*_cand_cols)
    .where(
        _evictable,
        or_(_B.c.tenant_id == bindparam("p_tenant"), _B.c.pool_id == bindparam("p_pool")),
    )
    .order_by(*_lru)
)
# Releasing clears the key: it is unique among reserving/live buffers only, so a
# tenant may store the same key again while the old buffer is being scrubbed.
_mark_victims = (
    update(_B)
    .where(_B.c.id.in_(bindparam("ids", expanding=True)), _B.c.state == "live")
    .values(state="releasing", key=None)
    .returning(*_B.c)
)
_mark_releasing = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"))
    .values(state="releasing", key=None)
    .returning(*_B.c)
)
_mark_own_releasing = _mark_releasing.where(_B.c.tenant_id == bindparam("p_tenant"))
_mark_live_releasing = _mark_releasing.where(_B.c.state == "live")
_mark_own_live_releasing = _mark_own_releasing.where(_B.c.state == "live")
_mark_expired = _mark_releasing.where(_B.c.state == "live", _B.c.expires_at < bindparam("now"))
_set_state = update(_B).where(_B.c.id == bindparam("p_id")).values(state=bindparam("p_state"))
_del_buffer = delete(_B).where(_B.c.id == bindparam("p_id")).returning(*_B.c)
_renew = (
    update(_B)
    .where(_B.c.id == bindparam("p_id"), _B.c.state == "live")
    .values(expires_at=bindparam("p_expires"))
    .returning(*_B.c)
)
_renew_own = _renew.where(_B.c.tenant_id == bindparam("p_tenant"))
_touch = update(_B).where(_B.c.id == bindparam("p_id")).values(last_used_at=bindparam("now"))
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
_on_host = _B.c.pool_id.in_(select(_P.c.id).where(_P.c.host == bindparam("host")).scalar_subquery())
_sel_expired = (
    select(_B)
    .where(_B.c.state == "live", _B.c.expires_at < bindparam("now"), _on_host)
    .order_by(_B.c.expires_at)
)
_sel_on_host = select(_B).where(_on_host).order_by(_B.c.created_at, _B.c.id)
_sel_lookup = select(_B).where(
    _B.c.tenant_id == bindparam("p_tenant"),
    _B.c.state == "live",
    _B.c.key.in_(bindparam("keys", expanding=True)),
)
_sel_lookup_host = _sel_lookup.where(_on_host)
_sel_events = select(_E).order_by(_E.c.id.desc()).limit(bindparam("limit"))

_truncate_order = (_E, _B, _K, _T, _P)


# ------------------------------------------------------------------ helpers
def _event(
    kind: str,
    at: float,
    *,
    tenant_id: str | None = None,
    buffer_id: str | None = None,
    pool_id: str | None = None,
    nbytes: int | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    return {
        "at": at,
        "kind": kind,
        "tenant_id": tenant_id,
        "buffer_id": buffer_id,
        "pool_id": pool_id,
        "bytes": nbytes,
        "detail": detail,
    }


def _buffer_event(
    kind: str, at: float, row: BufferRow, detail: str | None = None
) -> dict[str, Any]:
    return _event(
        kind,
        at,
        tenant_id=row.tenant_id,
        buffer_id=row.id,
        pool_id=row.pool_id,
        nbytes=row.size_bytes,
        detail=detail,
    )


def _violation(exc: sa.exc.IntegrityError) -> tuple[str, str]:
    """Classify an integrity error: ``("unique" | "foreign_key" | "other", what)``.

    ``what`` names the constraint on PostgreSQL (``uq_buffers_tenant_id_key``)
    and the columns on SQLite (``buffers.tenant_id, buffers.key``).
    """
    orig = exc.orig
    message = str(orig)
    sqlstate = getattr(orig, "sqlstate", None)  # psycopg
    diag = getattr(orig, "diag", None)
    what = (getattr(diag, "constraint_name", None) or message) if diag is not None else message
    if sqlstate == "23505" or "UNIQUE constraint failed" in message:
        return "unique", what
    if sqlstate == "23503" or "FOREIGN KEY constraint failed" in message:
        return "foreign_key", what
    return "other", what


def _is_key_clash(what: str) -> bool:
    return "uq_buffers_tenant_id_key" in what or "buffers.key" in what


def _check_state(state: str) -> None:
    if state not in schema.BUFFER_STATES:
        raise InvalidRequest(f"unknown buffer state {state!r}")


# -------------------------------------------------------------------- store
class Store:
    """The ledger: pools, tenants, keys, buffers and events in one database.

    Thread-safe; one instance per daemon. ``url`` is ``sqlite:///PATH`` (the
    embedded default) or a PostgreSQL URL (``postgresql://``,
    ``postgresql+psycopg://``, or ``postgresql+asyncpg://``, which is run
    through psycopg 3 because the store is synchronous). The schema is created
    only by :meth:`upgrade` (Alembic).

    >>> store = Store("sqlite:////tmp/maasd-doctest.db")  # doctest: +SKIP
    >>> store.upgrade()                                    # doctest: +SKIP
    """

    def __init__(
        self,
        url: str | URL,
        *,
        pool_size: int = 16,
        max_overflow: int = 64,
        echo: bool = False,
    ) -> None:
        self.url: URL = normalize_url(url)
        self.engine: Engine = create_engine(
            self.url, pool_size=pool_size, max_overflow=max_overflow, echo=echo
        )
        self.dialect: str = self.engine.dialect.name
        self.is_postgres: bool = self.dialect == "postgresql"
        if self.is_postgres:
            autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self._read: Engine = autocommit
            self._single: Engine = autocommit
        else:
            self._read = self.engine.execution_options(maasd_begin="none")
            self._single = self.engine  # BEGIN IMMEDIATE
        self._write: Engine = self.engine
        # SQLite has one writer at a time. Queueing this process's writers on a lock
        # hands the database over at once; leaving it to the busy timeout makes them
        # poll with growing sleeps (up to 100 ms), which is what made the reserve p99
        # long under load. Other processes (migrations, tools) still meet the timeout.
        self._wlock: AbstractContextManager[Any] = (
            nullcontext() if self.is_postgres else threading.RLock()
        )

    def __repr__(self) -> str:
        return f"Store({self.url.render_as_string(hide_password=True)!r})"

    # ---------------------------------------------------------- lifecycle
    def upgrade(self, revision: str = "head") -> None:
        """Migrate the database to ``revision`` (default: the newest) with Alembic.

        Runs inside one write transaction: ``BEGIN IMMEDIATE`` on SQLite, an
        advisory transaction lock on PostgreSQL, so that daemons starting
        together migrate one after the other (the second finds nothing to do).
        """
        from alembic import command

        with self._write.begin() as conn:
            if self.is_postgres:
                conn.execute(
                    sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID}
                )
            command.upgrade(alembic_config(connection=conn), revision)

    def downgrade(self, revision: str) -> None:
        """Migrate down to ``revision`` (``"base"`` drops everything). For tests and operators."""
        from alembic import command

        with self._write.begin() as conn:
            if self.is_postgres:
                conn.execute(
                    sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID}
                )
            command.downgrade(alembic_config(connection=conn), revision)

    def current_revision(self) -> str | None:
        """The database's Alembic revision, ``None`` for an empty database."""
        from alembic.runtime.migration import MigrationContext

        with self._read.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    @staticmethod
    def head_revision() -> str | None:
        """The newest revision the shipped migrations know."""
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(alembic_config()).get_current_head()

    def dispose(self) -> None:
        """Close every pooled connection. The store must not be used afterwards."""
        self.engine.dispose()

    def _truncate(self) -> None:
        """Delete every row of every table (tests only)."""
        with self._write.begin() as conn:
            for table in _truncate_order:
                conn.execute(delete(table))

    # --------------------------------------------------------- internals
    @contextlib.contextmanager
    def _writing(self) -> Iterator[Connection]:
        with self._wlock, self._write.begin() as conn:
            yield conn

    # Rows are typed Any: each becomes a record positionally, which mypy cannot check.
    def _read_rows(self, stmt: Any, params: dict[str, Any] | None = None) -> list[Any]:
        with self._read.connect() as conn:
            return list(conn.execute(stmt, params or {}).all())

    def _read_first(self, stmt: Any, params: dict[str, Any]) -> Any:
        with self._read.connect() as conn:
            return conn.execute(stmt, params).first()

    def _single_first(self, stmt: Any, params: dict[str, Any]) -> Any:
        with self._wlock, self._single.begin() as conn:
            return conn.execute(stmt, params).first()

    def _single_count(self, stmt: Any, params: dict[str, Any]) -> int:
        with self._wlock, self._single.begin() as conn:
            return conn.execute(stmt, params).rowcount

    # -------------------------------------------------------------- pools
    def add_pool(self, row: PoolRow) -> PoolRow:
        """Insert a pool. A taken ``(host, name)`` (or id) raises :class:`StateConflict`."""
        try:
            with self._writing() as conn:
                conn.execute(insert(_P), msgspec.structs.asdict(row))
                conn.execute(
                    _ins_event,
                    _event(
                        "pool_create",
                        row.created_at,
                        pool_id=row.id,
                        nbytes=row.capacity_bytes,
                        detail=row.name,
                    ),
                )
        except sa.exc.IntegrityError as exc:
            raise StateConflict(f"a pool named {row.name!r} already exists on {row.host}") from exc
        return row

    def pools(self, host: str) -> list[PoolRow]:
        """The pools of ``host``, by name."""
        return [PoolRow(*r) for r in self._read_rows(_sel_pools, {"host": host})]

    def pool(self, host: str, id_or_name: str) -> PoolRow | None:
        """The pool of ``host`` with this id (preferred) or name, else ``None``."""
        rows = self._read_rows(_sel_pool, {"host": host, "ref": id_or_name})
        if not rows:
            return None
        best = next((r for r in rows if r.id == id_or_name), rows[0])
        return PoolRow(*best)

    def usage_by_pool(self, host: str) -> dict[str, tuple[int, int]]:
        """``{pool_id: (used_bytes, buffers)}`` for every pool of ``host`` (all states count)."""
        return {r[0]: (r[1], r[2]) for r in self._read_rows(_sel_pool_usage, {"host": host})}

    def delete_pool(self, pool_id: str, *, now: float | None = None) -> None:
        """Delete an empty pool: :class:`NotFound` if unknown, :class:`StateConflict` if it holds buffers."""
        with self._writing() as conn:
            if conn.execute(_lock_pool, {"p_id": pool_id}).first() is None:
                raise NotFound(f"pool {pool_id} not found")
            n = conn.execute(_count_pool_buffers, {"p_id": pool_id}).scalar_one()
            if n:
                raise StateConflict(f"pool {pool_id} still holds {n} buffer(s)")
            conn.execute(_del_pool, {"p_id": pool_id})
            conn.execute(
                _ins_event,
                _event("pool_delete", time.time() if now is None else now, pool_id=pool_id),
            )

    # ------------------------------------------------------------ tenants
    def add_tenant(self, id: str, name: str, quota_bytes: int, now: float) -> TenantRow:
        """Insert a tenant. A taken name raises :class:`StateConflict`."""
        try:
            with self._writing() as conn:
                conn.execute(
                    insert(_T),
                    {"id": id, "name": name, "quota_bytes": quota_bytes, "created_at": now},
                )
                conn.execute(
                    _ins_event,
                    _event("tenant_create", now, tenant_id=id, nbytes=quota_bytes, detail=name),
                )
        except sa.exc.IntegrityError as exc:
            raise StateConflict(f"a tenant named {name!r} already exists") from exc
        return TenantRow(id, name, quota_bytes, now, 0, 0)

    def tenant(self, id_or_name: str) -> TenantRow | None:
        """The tenant with this id (preferred) or name, with its usage; else ``None``."""
        rows = self._read_rows(_sel_tenant, {"ref": id_or_name})
        if not rows:
            return None
        best = next((r for r in rows if r.id == id_or_name), rows[0])
        return TenantRow(*best)

    def tenants(self) -> list[TenantRow]:
        """Every tenant with its usage, by name."""
        return [TenantRow(*r) for r in self._read_rows(_sel_tenants)]

    def set_quota(self, tenant_id: str, quota_bytes: int) -> None:
        """Change a tenant's quota (lowering it below use is allowed). :class:`NotFound` if unknown."""
        if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes < 0:
            raise InvalidRequest(f"quota_bytes must be a non-negative integer, got {quota_bytes!r}")
        with self._writing() as conn:
            if conn.execute(_set_quota, {"p_id": tenant_id, "quota": quota_bytes}).rowcount == 0:
                raise NotFound(f"tenant {tenant_id} not found")
            conn.execute(
                _ins_event,
                _event("quota_set", time.time(), tenant_id=tenant_id, nbytes=quota_bytes),
            )

    def delete_tenant(self, tenant_id: str, *, now: float | None = None) -> None:
        """Delete a tenant and its keys.

        The caller releases (scrubs) its buffers first; if any remain this
        raises :class:`StateConflict` and changes nothing. :class:`NotFound` if unknown.
        """
        with self._writing() as conn:
            if conn.execute(_lock_tenant, {"p_id": tenant_id}).first() is None:
                raise NotFound(f"tenant {tenant_id} not found")
            n = conn.execute(_count_tenant_buffers, {"p_id": tenant_id}).scalar_one()
            if n:
                raise StateConflict(f"tenant {tenant_id} still holds {n} buffer(s)")
            conn.execute(_del_keys, {"p_id": tenant_id})
            conn.execute(_del_tenant, {"p_id": tenant_id})
            conn.execute(
                _ins_event,
                _event("tenant_delete", time.time() if now is None else now, tenant_id=tenant_id),
            )

    # --------------------------------------------------------------- keys
    def add_key(self, id: str, tenant_id: str, digest: bytes, now: float) -> KeyRow:
        """Store a key's digest for a tenant. :class:`NotFound` if the tenant is unknown."""
        try:
            with self._wlock, self._single.begin() as conn:
                conn.execute(
                    insert(_K),
                    {
                        "id": id,
                        "tenant_id": tenant_id,
                        "digest": digest,
                        "created_at": now,
                        "revoked_at": None,
                    },
                )
                conn.execute(_ins_event, _event("key_issue", now, tenant_id=tenant_id, detail=id))
        except sa.exc.IntegrityError as exc:
            kind, message = _violation(exc)
            if kind == "foreign_key":
                raise NotFound(f"tenant {tenant_id} not found") from exc
            raise StateConflict(f"key already exists: {message}") from exc
        return KeyRow(id, tenant_id, digest, now, None)

    def key_by_digest(self, digest: bytes) -> KeyRow | None:
        """The unrevoked key with this digest whose tenant exists, else ``None``."""
        row = self._read_first(_sel_key_by_digest, {"digest": digest})
        return None if row is None else KeyRow(*row)

    def keys(self, tenant_id: str) -> list[KeyRow]:
        """All keys of a tenant, revoked ones included, oldest first."""
        return [KeyRow(*r) for r in self._read_rows(_sel_keys, {"p_tenant": tenant_id})]

    def revoke_key(self, tenant_id: str, key_id: str, *, now: float | None = None) -> bool:
        """Revoke one key of this tenant. ``False`` if unknown, foreign or already revoked."""
        at = time.time() if now is None else now
        params = {"p_tenant": tenant_id, "key_id": key_id, "now": at}
        with self._writing() as conn:
            if conn.execute(_revoke_key, params).rowcount != 1:
                return False
            conn.execute(_ins_event, _event("key_revoke", at, tenant_id=tenant_id, detail=key_id))
        return True

    def revoke_keys(self, tenant_id: str, *, now: float | None = None) -> int:
        """Revoke every live key of a tenant; returns how many were revoked."""
        at = time.time() if now is None else now
        with self._writing() as conn:
            n = int(conn.execute(_revoke_keys, {"p_tenant": tenant_id, "now": at}).rowcount)
            if n:
                conn.execute(
                    _ins_event, _event("key_revoke", at, tenant_id=tenant_id, detail=f"all {n}")
                )
        return n

    # ------------------------------------------------------------ buffers
    def begin_reserve(self, row: BufferRow, *, quota_check: bool = True) -> list[BufferRow]:
        """Admit ``row`` to the ledger (state ``reserving``), evicting if it must; atomically.

        In one write transaction: lock the tenant and pool rows; refuse a key
        the tenant already uses (:class:`DuplicateKey`); sum the tenant's and
        the pool's usage; if ``row`` does not fit the quota (unless
        ``quota_check`` is false) or the pool's capacity, choose victims among
        **evictable live** buffers, least recently used first — the tenant's
        own for a quota shortfall, any tenant's in this pool for a capacity
        shortfall — taking in LRU order each candidate that helps a shortfall
        still open, until both close. If they cannot close, raise
        :class:`QuotaExceeded` (quota) or :class:`PoolExhausted` (capacity) and
        change nothing. Otherwise mark the victims ``releasing``, insert
        ``row``, record ``evict``/``reserve`` events and commit.

        Returns the victims (state ``releasing``): the caller scrubs each and
        calls :meth:`finish_release` with ``kind="evict"``. The caller checks
        that ``row`` is smaller than the pool (``TooLarge``); it is guarded here
        too. Unknown tenant or pool: :class:`NotFound`.
        """
        if row.state != "reserving":
            row = msgspec.structs.replace(row, state="reserving")
        size = row.size_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidRequest(f"size_bytes must be a positive integer, got {size!r}")
        try:
            with self._writing() as conn:
                # Lock order is always tenant, then pool: no deadlock between reserves.
                t = conn.execute(_lock_tenant, {"p_id": row.tenant_id}).first()
                if t is None:
                    raise NotFound(f"tenant {row.tenant_id} not found")
                p: Any = conn.execute(_lock_pool, {"p_id": row.pool_id}).first()
                if p is None:
                    raise NotFound(f"pool {row.pool_id} not found")
                quota, (capacity, pool_name) = t[0], p
                if size > capacity:
                    raise TooLarge(
                        f"{size} bytes exceed pool {pool_name!r}'s whole capacity of {capacity} bytes"
                    )
                tenant_used, pool_used, dup = conn.execute(
                    _reserve_facts,
                    {"p_tenant": row.tenant_id, "p_pool": row.pool_id, "p_key": row.key},
                ).one()
                if dup:
                    raise DuplicateKey(f"a buffer with key {row.key!r} already exists")
                need_t = tenant_used + size - quota if quota_check else 0
                need_p = pool_used + size - capacity
                victims: list[BufferRow] = []
                if need_t > 0 or need_p > 0:
                    victims = self._evict(
                        conn,
                        row,
                        need_t,
                        need_p,
                        quota=quota,
                        tenant_used=tenant_used,
                        capacity=capacity,
                        pool_used=pool_used,
                        pool_name=pool_name,
                    )
                conn.execute(_ins_buffer, msgspec.structs.asdict(row))
                events = [
                    _buffer_event("evict", row.created_at, v, detail=f"for {row.id}")
                    for v in victims
                ]
                events.append(_buffer_event("reserve", row.created_at, row))
                conn.execute(_ins_event, events)
        except sa.exc.IntegrityError as exc:
            kind, message = _violation(exc)
            if kind == "unique" and _is_key_clash(message):
                raise DuplicateKey(f"a buffer with key {row.key!r} already exists") from exc
            if kind == "foreign_key":
                raise NotFound("tenant or pool not found") from exc
            raise StateConflict(f"buffer {row.id} conflicts with the ledger: {message}") from exc
        return victims

    def _evict(
        self,
        conn: Connection,
        row: BufferRow,
        need_t: int,
        need_p: int,
        *,
        quota: int,
        tenant_used: int,
        capacity: int,
        pool_used: int,
        pool_name: str,
    ) -> list[BufferRow]:
        """Pick and mark the victims for :meth:`begin_reserve`, or raise if none suffice."""
        params = {"p_tenant": row.tenant_id, "p_pool": row.pool_id}
        if need_t > 0 and need_p > 0:
            stmt = _sel_cand_both
        elif need_t > 0:
            stmt = _sel_cand_tenant
        else:
            stmt = _sel_cand_pool
        chosen: list[str] = []
        freed_t = freed_p = 0
        for cid, ctenant, cpool, csize in conn.execute(stmt, params):
            helps_t = need_t > 0 and ctenant == row.tenant_id
            helps_p = need_p > 0 and cpool == row.pool_id
            if not (helps_t or helps_p):
                continue  # would free nothing that is short: leave it alone
            chosen.append(cid)
            if ctenant == row.tenant_id:
                need_t -= csize
                freed_t += csize
            if cpool == row.pool_id:
                need_p -= csize
                freed_p += csize
            if need_t <= 0 and need_p <= 0:
                break
        size = row.size_bytes
        if need_t > 0:
            raise QuotaExceeded(
                f"tenant {row.tenant_id} uses {tenant_used} of its {quota} bytes quota; "
                f"{size} more bytes do not fit"
                + (f", even after evicting {freed_t} evictable bytes" if freed_t else "")
            )
        if need_p > 0:
            raise PoolExhausted(
                f"pool {pool_name!r} has {max(capacity - pool_used, 0)} of {capacity} bytes free; "
                f"{size} bytes requested"
                + (f", even after evicting {freed_p} evictable bytes" if freed_p else "")
            )
        order = {cid: i for i, cid in enumerate(chosen)}
        result: Any = conn.execute(_mark_victims, {"ids": chosen})
        marked = [BufferRow(*r) for r in result]
        marked.sort(key=lambda v: order[v.id])
        return marked

    def set_state(self, buffer_id: str, state: str) -> None:
        """Set a buffer's state (``releasing`` also clears its key). :class:`NotFound` if unknown."""
        _check_state(state)
        if state == "releasing":
            self.mark_releasing(buffer_id, None)
            return
        if self._single_count(_set_state, {"p_id": buffer_id, "p_state": state}) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def mark_releasing(
        self, buffer_id: str, tenant_id: str | None, *, only_live: bool = False
    ) -> BufferRow:
        """Mark a buffer ``releasing`` (clearing its key) and return it.

        ``tenant_id=None`` acts as the admin. Unknown or foreign ids raise
        :class:`NotFound`. By default a buffer already releasing is returned
        again (idempotent, so the daemon's own clean-ups can finish another's
        work); ``only_live=True`` — a caller's DELETE — claims only a ``live``
        buffer, so of two concurrent releases exactly one succeeds and the
        other finds the buffer gone.
        """
        params = {"p_id": buffer_id}
        if tenant_id is None:
            stmt = _mark_live_releasing if only_live else _mark_releasing
        else:
            stmt = _mark_own_live_releasing if only_live else _mark_own_releasing
            params["p_tenant"] = tenant_id
        row = self._single_first(stmt, params)
        if row is None:
            raise NotFound(f"buffer {buffer_id} not found")
        return BufferRow(*row)

    def mark_expired(self, buffer_id: str, now: float) -> BufferRow | None:
        """Mark a buffer ``releasing`` only if it is live and its lease ended before ``now``.

        The reaper's compare-and-set: a lease renewed between :meth:`expired`
        and this call is left alone (``None``), as is a buffer someone else is
        already releasing.
        """
        row = self._single_first(_mark_expired, {"p_id": buffer_id, "now": now})
        return None if row is None else BufferRow(*row)

    def finish_release(
        self,
        buffer_id: str,
        kind: str = "release",
        *,
        now: float | None = None,
        detail: str | None = None,
    ) -> BufferRow | None:
        """Delete a buffer's row (its memory is scrubbed) and record a ``kind`` event.

        Returns the deleted row, or ``None`` if there was none (already finished).
        """
        with self._writing() as conn:
            r: Any = conn.execute(_del_buffer, {"p_id": buffer_id}).first()
            if r is None:
                return None
            row = BufferRow(*r)
            conn.execute(
                _ins_event, _buffer_event(kind, time.time() if now is None else now, row, detail)
            )
        return row

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
        """Buffers filtered by tenant, pool, states (``None`` = all) and pool host; oldest first."""
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

    def renew(self, buffer_id: str, tenant_id: str | None, expires_at: float) -> BufferRow:
        """Set a live buffer's lease end. :class:`NotFound` if unknown, foreign or not live."""
        if tenant_id is None:
            row = self._single_first(_renew, {"p_id": buffer_id, "p_expires": expires_at})
        else:
            row = self._single_first(
                _renew_own, {"p_id": buffer_id, "p_tenant": tenant_id, "p_expires": expires_at}
            )
        if row is None:
            raise NotFound(f"buffer {buffer_id} not found")
        return BufferRow(*row)

    def touch(self, buffer_id: str, now: float) -> bool:
        """Record a use (attach, lookup hit): moves the buffer to the back of the LRU order."""
        return self._single_count(_touch, {"p_id": buffer_id, "now": now}) == 1

    def touch_many(self, uses: dict[str, float]) -> None:
        """Record many uses (``buffer_id → when``) in one transaction."""
        if uses:
            with self._writing() as conn:
                conn.execute(_touch, [{"p_id": b, "now": t} for b, t in uses.items()])

    def set_numa_node(self, buffer_id: str, node: int) -> None:
        """Record the node a buffer's pages were pinned to. :class:`NotFound` if unknown."""
        if self._single_count(_set_numa, {"p_id": buffer_id, "node": node}) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def set_checkpoint(self, buffer_id: str, path: str, checksum: str, now: float) -> None:
        """Record a written checkpoint (file and checksum). :class:`NotFound` if unknown."""
        params = {"p_id": buffer_id, "path": path, "p_checksum": checksum, "now": now}
        if self._single_count(_set_checkpoint, params) == 0:
            raise NotFound(f"buffer {buffer_id} not found")

    def expired(self, now: float, host: str) -> list[BufferRow]:
        """Live buffers in ``host``'s pools whose lease ended before ``now``, earliest first."""
        return [BufferRow(*r) for r in self._read_rows(_sel_expired, {"now": now, "host": host})]

    def lookup(
        self, tenant_id: str, keys: Sequence[str], *, host: str | None = None
    ) -> tuple[str, BufferRow] | None:
        """The last key of ``keys`` (ordered short → long) with a live buffer of this tenant.

        One query for all keys. ``host`` restricts the hit to buffers in that
        host's pools (a worker can only map local memory).
        """
        if not keys:
            return None
        params: dict[str, Any] = {"p_tenant": tenant_id, "keys": list(dict.fromkeys(keys))}
        stmt = _sel_lookup
        if host is not None:
            stmt = _sel_lookup_host
            params["host"] = host
        rows = self._read_rows(stmt, params)
        if not rows:
            return None
        rank = {k: i for i, k in enumerate(keys)}
        best = max((BufferRow(*r) for r in rows), key=lambda b: rank[b.key or ""])
        assert best.key is not None
        return best.key, best

    def buffers_on_host(self, host: str) -> list[BufferRow]:
        """Every buffer (all states) in ``host``'s pools — the input of crash recovery."""
        return [BufferRow(*r) for r in self._read_rows(_sel_on_host, {"host": host})]

    # ------------------------------------------------------------- events
    def record_event(
        self,
        kind: str,
        *,
        at: float | None = None,
        tenant_id: str | None = None,
        buffer_id: str | None = None,
        pool_id: str | None = None,
        nbytes: int | None = None,
        detail: str | None = None,
    ) -> None:
        """Append one entry to the audit trail."""
        ev = _event(
            kind,
            time.time() if at is None else at,
            tenant_id=tenant_id,
            buffer_id=buffer_id,
            pool_id=pool_id,
            nbytes=nbytes,
            detail=detail,
        )
        with self._wlock, self._single.begin() as conn:
            conn.execute(_ins_event, ev)

    def events(
        self, limit: int = 100, *, tenant_id: str | None = None, before: int | None = None
    ) -> list[EventRow]:
        """The newest ``limit`` events, newest first; only ``tenant_id``'s when given, and
        only those older than event id ``before`` (to page back)."""
        stmt = _sel_events
        params: dict[str, Any] = {"limit": limit}
        if tenant_id is not None:
            stmt = stmt.where(_E.c.tenant_id == bindparam("p_tenant"))
            params["p_tenant"] = tenant_id
        if before is not None:
            stmt = stmt.where(_E.c.id < bindparam("before"))
            params["before"] = before
        return [EventRow(*r) for r in self._read_rows(stmt, params)]
