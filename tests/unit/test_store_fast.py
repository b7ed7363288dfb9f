"""The ledger's hot statements on the DBAPI cursor (maasd.store.fast): what SQLAlchemy would
send, what it would answer, and the errors it would raise, on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from ledger import buf, make_pool, make_tenant, reserve_live, snapshot
from maasd.errors import LedgerUnavailable
from maasd.store import Store, buffers, events
from maasd.store.base import ledger_errors, unavailable, violation
from maasd.store.circuit import LedgerCircuit
from maasd.store.fast import Hot
from maasd.tenancy.keys import new_id

pytest_plugins = ("ledger",)

#: Every statement the store runs hot, with the parameters it passes.
HOT: dict[str, tuple[Hot, dict[str, Any]]] = {
    "lock tenant": (buffers._hot_lock_tenant, {"p_tenant": "t", "p_pool": "p", "p_host": "h"}),
    "lock pool": (
        buffers._hot_lock_pool,
        {"p_tenant": "t", "p_pool": "p", "p_host": "h", "p_key": None},
    ),
    "insert buffer": (
        buffers._hot_ins_buffer,
        {c.name: None for c in buffers._B.c}
        | {"evictable": True, "size_bytes": 5, "created_at": 2},
    ),
    "insert event": (
        buffers._hot_ins_event,
        dict.fromkeys(events.EVENT_COLUMNS, "x") | {"at": 1.5, "bytes": 5},
    ),
    "delete buffer": (buffers._hot_del_buffer, {"p_id": "b"}),
    "advance": (buffers._hot_advance, {"p_id": "b", "p_from": "reserving", "p_state": "live"}),
    **{
        f"mark {k}": (hot, {"p_id": "b", "p_tenant": "t"} if k[0] else {"p_id": "b"})
        for k, hot in buffers._hot_mark.items()
    },
}


def sent(store: Store, run: Any) -> tuple[str, Any]:
    """What ``run(conn)`` hands the driver (statement and parameters), in a transaction
    rolled back (a statement that fails on these values fails after it was sent)."""
    seen: list[tuple[str, Any]] = []

    def before(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not statement.startswith(("BEGIN", "PRAGMA")):
            seen.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", before)
    try:
        with store.engine.connect() as conn, contextlib.suppress(sa.exc.DBAPIError):
            conn.begin()
            run(conn)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", before)
    (found,) = seen
    return found


@pytest.mark.parametrize("name", sorted(HOT))
def test_a_hot_statement_sends_what_sqlalchemy_sends(store: Store, name: str) -> None:
    """The same SQL text, and the same values in the same order (literal values such as
    ``state = 'releasing'`` and a literal ``IN`` list's included), through the same bind
    processors: what ``conn.execute`` hands the driver, on this backend."""
    hot, given = HOT[name]
    assert sent(
        store,
        lambda c: (
            hot.first(c, given)
            if "RETURNING" in hot.plan(c.dialect).sql
            or hot.plan(c.dialect).sql.startswith("SELECT")
            else hot.run(c, given)
        ),
    ) == sent(store, lambda c: c.execute(hot.stmt, given))


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.psycopg.dialect()])
def test_every_hot_statement_compiles_for_both_dialects(dialect: Any) -> None:
    for hot, given in HOT.values():
        plan = hot.plan(dialect)
        assert plan.params(given)  # every required bind is given
        assert "POSTCOMPILE" not in plan.sql


def test_a_statement_with_an_in_list_is_refused() -> None:
    with pytest.raises(ValueError, match="computed at execution"):
        Hot(buffers._mark_victims).plan(sqlite.dialect())


def test_rows_and_counts_are_what_conn_execute_answers(store: Store) -> None:
    """RETURNING rows through the result processors (SQLite's 0/1 becomes a bool), a
    SELECT's first row, an UPDATE's count, and nothing for a row that is not there."""
    t, p = make_tenant(store, quota=1 << 20), make_pool(store, capacity=1 << 20)
    live = reserve_live(store, buf(t, p, 100, evictable=True, key="k"))
    params = {"p_id": live.id, "p_tenant": t.id}
    with store.db.writing() as conn:
        slow = conn.execute(buffers._sel_own_buffer, params).first()
        fast = buffers._hot_lock_tenant.first(conn, {"p_tenant": t.id})
        assert fast == tuple(conn.execute(buffers._lock_tenant_totals, {"p_tenant": t.id}).one())
        marked = buffers._hot_mark[True, True].first(conn, params)
        assert buffers._hot_mark[True, True].first(conn, params) is None  # releasing now
        assert (
            buffers._hot_advance.count(conn, {"p_id": live.id, "p_from": "live", "p_state": "x"})
            == 0
        )
    assert slow is not None
    assert marked is not None
    row = buffers.BufferRow(*marked)
    assert type(row.evictable) is bool
    assert row.evictable is True
    assert msgspec.structs.replace(row, state="live", key="k") == buffers.BufferRow(*slow)
    assert store.buffers.buffer(live.id) == row  # committed with the transaction
    gone = store.reserves.finish_release(live.id)
    assert gone == row
    assert store.reserves.finish_release(live.id) is None
    assert [e.kind for e in store.events.events(1)] == ["release"]
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.used_bytes == 0


def test_cursor_events_see_the_hot_statements(store: Store) -> None:
    t, p = make_tenant(store), make_pool(store)
    seen: list[tuple[str, str]] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(("b", a[2])))
    sa.event.listen(store.engine, "after_cursor_execute", lambda *a: seen.append(("a", a[2])))
    row = reserve_live(store, buf(t, p, 10))
    sqls = [s for _, s in seen if s.split()[0] in ("SELECT", "INSERT", "UPDATE", "DELETE")]
    assert any(s.startswith("INSERT INTO buffers") for s in sqls)
    assert [w for w, s in seen if s.startswith("INSERT INTO events")] == ["b", "a"]
    assert store.buffers.buffer(row.id) is not None


def test_a_unique_violation_is_the_integrity_error_sqlalchemy_raises(store: Store) -> None:
    """A duplicate id, and a duplicate key on one host: the IntegrityError that
    ``violation`` classifies, so the reserve's conflict mapping holds."""
    t, p = make_tenant(store), make_pool(store)
    first = reserve_live(store, buf(t, p, 10, key="k"))
    again = msgspec.structs.replace(first, key=None)  # the same id
    other = msgspec.structs.replace(first, id=new_id(), state="live")
    for row, constraint, column in (
        (again, "pk_buffers", "buffers.id"),
        (other, "uq_buffers_tenant_id_host_key", "buffers.key"),
    ):
        with pytest.raises(sa.exc.IntegrityError) as caught, store.db.writing() as conn:
            buffers._hot_ins_buffer.run(conn, msgspec.structs.asdict(row))
        v = violation(caught.value)
        assert v.kind == "unique"
        assert v.of(constraint, column), v
        assert unavailable(caught.value) is None  # a conflict, never an outage
    assert [b.id for b in store.buffers.buffers(states=None)] == [first.id]


def test_a_foreign_key_violation_is_classified_as_such(store: Store) -> None:
    t, p = make_tenant(store), make_pool(store)
    orphan = msgspec.structs.replace(buf(t, p, 10), tenant_id=new_id())
    with pytest.raises(sa.exc.IntegrityError) as caught, store.db.writing() as conn:
        buffers._hot_ins_buffer.run(conn, msgspec.structs.asdict(orphan))
    assert violation(caught.value).kind == "foreign_key"


def test_a_locked_sqlite_file_is_the_error_the_circuit_counts(tmp_path: Any) -> None:
    """Another process holding the write lock past the busy timeout: the statement fails
    with SQLAlchemy's OperationalError ("database is locked"), which ledger_errors turns
    into a 507 and which opens the circuit for writes."""
    s = Store(f"sqlite:///{tmp_path / 'l.db'}")
    s.upgrade()
    other = sqlite3.connect(tmp_path / "l.db", isolation_level=None)
    circuit = LedgerCircuit(lambda: None)
    try:
        t, p = make_tenant(s), make_pool(s)
        row = reserve_live(s, buf(t, p, 10))
        other.execute("BEGIN IMMEDIATE")
        with s.db.read.connect() as conn:  # no BEGIN: the statement meets the lock itself
            conn.connection.dbapi_connection.execute("PRAGMA busy_timeout=50")  # type: ignore[union-attr]
            with pytest.raises(sa.exc.OperationalError, match="locked") as caught:
                buffers._hot_mark[False, True].first(conn, {"p_id": row.id})
            conn.connection.dbapi_connection.execute("PRAGMA busy_timeout=10000")  # type: ignore[union-attr]
        assert unavailable(caught.value) == "busy: the database stayed locked past the busy timeout"
        assert not caught.value.connection_invalidated
        with pytest.raises(LedgerUnavailable, match="busy"), ledger_errors(circuit):
            raise caught.value
        assert circuit.writes_only
    finally:
        circuit.close()
        other.close()
        s.dispose()


def test_a_lost_postgresql_connection_is_invalidated_as_sqlalchemy_does(store: Store) -> None:
    """The server ends the connection under a transaction: the hot statement raises the
    DBAPIError SQLAlchemy raises for a disconnect (``connection_invalidated``), which is
    the circuit's outage (507, the circuit opens); once the probe finds the server, the
    pool hands out a working connection."""
    if not store.is_postgres:
        pytest.skip("PostgreSQL only")
    t, p = make_tenant(store), make_pool(store)
    row = reserve_live(store, buf(t, p, 10))

    def lose_the_connection() -> None:
        with store.db.writing() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with store.engine.connect() as killer:
                killer.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
                killer.commit()
            buffers._hot_mark[False, True].first(conn, {"p_id": row.id})

    with pytest.raises(LedgerUnavailable, match="lost") as caught:
        lose_the_connection()
    cause = caught.value.__cause__
    assert isinstance(cause, sa.exc.DBAPIError)
    assert cause.connection_invalidated
    assert store.circuit.down_since is not None
    deadline = time.monotonic() + 10
    while store.circuit.down_since is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.buffers.buffer(row.id) is not None  # a new connection serves


def test_concurrent_first_use_compiles_once() -> None:
    hot = Hot(buffers._sel_buffer)
    plans: list[Any] = []
    dialect = sqlite.dialect()
    threads = [threading.Thread(target=lambda: plans.append(hot.plan(dialect))) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(p is plans[0] for p in plans)


def test_release_live_ends_a_live_buffer_and_nothing_else(store: Store) -> None:
    """One transaction: the row deleted (only the tenant's, only live, only a buffer), its
    event, and the scrub called before the commit; anything else is left as it was."""
    t, other, p = make_tenant(store), make_tenant(store, "other"), make_pool(store)
    live = reserve_live(store, buf(t, p, 10))
    reserving = buf(t, p, 20)
    store.reserves.begin_reserve(reserving)
    entry = msgspec.structs.replace(buf(t, p, 30, key="e"), kind="entry")
    store.reserves.begin_reserve(entry)  # admitted staged
    scrubbed: list[Any] = []
    before = snapshot(store)
    for bid, tenant_id in (
        (live.id, other.id),  # another tenant's
        (reserving.id, t.id),
        (entry.id, t.id),
        (new_id(), None),
    ):
        assert store.reserves.release_live(bid, tenant_id, scrubbed.append) is None
    assert scrubbed == []
    assert snapshot(store) == before
    gone = store.reserves.release_live(
        live.id, t.id, lambda r: scrubbed.append((r, store.buffers.buffer(r.id)))
    )
    ((row, seen_then),) = scrubbed
    assert row == gone == msgspec.structs.replace(live, state="live")
    assert seen_then is not None  # (another connection) not committed while it scrubs
    assert store.buffers.buffer(live.id) is None
    assert [e.kind for e in store.events.events(1)] == ["release"]
    tenant = store.tenants.tenant(t.id)
    assert tenant is not None
    assert tenant.used_bytes == 20 + 30
    assert store.reserves.release_live(live.id, None, scrubbed.append) is None
