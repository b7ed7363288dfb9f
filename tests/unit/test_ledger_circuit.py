"""The ledger's circuit, the keys taken through an outage, and the last-known answers.

Real SQLite ledgers; the outage is the circuit opened with a probe that fails (a
PostgreSQL one is in tests/integration/test_ledger_outage_dataplane.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from maasd.core.auth import Auth
from maasd.core.stale import LastKnown
from maasd.errors import LedgerUnavailable, Unauthorized
from maasd.settings import Settings
from maasd.store import Store
from maasd.store.base import ledger_errors
from maasd.store.circuit import LedgerCircuit
from maasd.tenancy import keys
from waiting import wait_until


class Probe:
    """A probe that fails until told to succeed; counts its calls."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if not self.up.is_set():
            raise sa.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))


def test_an_outage_opens_the_circuit_and_its_probe_closes_it() -> None:
    probe = Probe()
    circuit = LedgerCircuit(probe, max_backoff_s=0.2)
    ups: list[float | None] = []
    circuit.on_up(lambda: ups.append(circuit.down_since))
    try:
        circuit.check()  # closed: nothing raised
        with pytest.raises(LedgerUnavailable), ledger_errors(circuit):
            raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))
        assert circuit.down_since is not None
        with pytest.raises(LedgerUnavailable, match="cannot be reached"):
            circuit.check()  # at once, without the database
        wait_until(lambda: probe.calls >= 2, message="probed in the background")
        assert circuit.down_since is not None
        assert ups == []
        probe.up.set()
        wait_until(lambda: circuit.down_since is None, message="closed by the probe")
        assert ups == [None]  # told once, after it closed
        circuit.check()
        assert circuit.opened == 1
    finally:
        circuit.close()


@pytest.mark.parametrize("words", ["no such table: x", 'near "x": syntax error'])
def test_bugs_and_contention_leave_the_circuit_closed(words: str) -> None:
    circuit = LedgerCircuit(Probe())
    with pytest.raises(sa.exc.OperationalError), ledger_errors(circuit):
        raise sa.exc.OperationalError("BEGIN", {}, Exception(words))
    with pytest.raises(LedgerUnavailable), ledger_errors(circuit):
        raise sa.exc.TimeoutError("QueuePool limit reached")
    assert circuit.down_since is None


@pytest.mark.parametrize(
    "words",
    ["database is locked", "database or disk is full", "attempt to write a readonly database"],
)
def test_a_file_that_cannot_be_written_opens_the_circuit_for_writes_only(words: str) -> None:
    reads, writes = Probe(), Probe()
    circuit = LedgerCircuit(reads, write_probe=writes, max_backoff_s=0.2)
    try:
        with pytest.raises(LedgerUnavailable), ledger_errors(circuit):
            raise sa.exc.OperationalError("INSERT", {}, Exception(words))
        assert circuit.writes_only
        circuit.check(write=False)  # reads go on
        with pytest.raises(LedgerUnavailable):
            circuit.check()  # writes: at once
        wait_until(lambda: writes.calls >= 2, message="the write probe runs")
        assert reads.calls == 0
        # An outage of reads meanwhile widens it.
        with pytest.raises(LedgerUnavailable), ledger_errors(circuit):
            raise sa.exc.OperationalError("SELECT", {}, Exception("disk I/O error"))
        assert not circuit.writes_only
        with pytest.raises(LedgerUnavailable):
            circuit.check(write=False)
        reads.up.set()
        # Readable again, but the writes were never shown to work: back to writes only.
        wait_until(lambda: circuit.writes_only, message="narrowed by the read probe")
        circuit.check(write=False)
        with pytest.raises(LedgerUnavailable):
            circuit.check()
        calls = writes.calls
        wait_until(lambda: writes.calls > calls, message="the write probe runs again")
        assert circuit.down_since is not None
        writes.up.set()
        wait_until(lambda: circuit.down_since is None, message="closed by the write probe")
        circuit.check()
    finally:
        circuit.close()


def test_the_write_probe_of_a_real_file_fails_while_another_process_holds_its_lock(
    tmp_path: Path,
) -> None:
    import sqlite3

    s = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    s.upgrade()
    other = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    try:
        s.db.write_probe()
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            s.db.write_probe()  # within its short wait, not the pool's busy timeout
        other.execute("ROLLBACK")
        s.db.write_probe()
        assert [r[0] for r in other.execute("SELECT version_num FROM alembic_version")]
    finally:
        other.close()
        s.dispose()


@pytest.fixture
def store(tmp_path: Path):
    s = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    s.upgrade()
    yield s
    s.dispose()


def _down(store: Store) -> Probe:
    """Open the store's circuit with a probe that fails until the test says (a circuit
    of the test's own, told the same callbacks as the store's: its Auth's, say)."""
    probe = Probe()
    callbacks = list(store.circuit._on_up)
    store.db.circuit = LedgerCircuit(probe, max_backoff_s=0.2)
    for callback in callbacks:
        store.circuit.on_up(callback)
    store.circuit.trip("the database cannot be reached")
    return probe


def test_an_open_circuit_fails_every_ledger_call_at_once(store: Store) -> None:
    store.tenants.add_tenant(keys.new_id(), "t", 1 << 20, time.time())
    probe = _down(store)
    for call in (
        store.tenants.tenants,
        lambda: store.tenants.add_tenant(keys.new_id(), "u", 1, time.time()),
    ):
        with pytest.raises(LedgerUnavailable):
            call()
    probe.up.set()
    wait_until(lambda: store.circuit.down_since is None)
    assert [t.name for t in store.tenants.tenants()] == ["t"]  # nothing was written meanwhile


def test_keys_through_an_outage(store: Store, tmp_path: Path) -> None:
    tenant = keys.new_id()
    store.tenants.add_tenant(tenant, "t", 1 << 20, time.time())
    tokens = [keys.new_token() for _ in range(3)]
    for token in tokens:
        store.tenants.add_key(keys.new_id(), tenant, keys.digest(token), time.time())
    auth = Auth(Settings(data_dir=str(tmp_path)), store.tenants)
    checked = auth.authenticate(tokens[0])
    auth.authenticate(tokens[2])
    auth.forget_keys()  # a revocation heard of: what was checked before must be checked again
    auth.authenticate(tokens[2])
    auth._set_trusted(False)  # the listener lost (PostgreSQL): the cache no longer answers
    probe = _down(store)

    assert auth.authenticate(tokens[2]).tenant_id == tenant  # checked since: taken
    with pytest.raises(LedgerUnavailable):
        auth.authenticate(tokens[0])  # checked before the revocation: not without the ledger
    with pytest.raises(LedgerUnavailable):
        auth.authenticate(tokens[1])  # never checked here
    with pytest.raises(LedgerUnavailable):
        auth.authenticate("maasd_nope")  # unknown or revoked: only the ledger can say

    # Revoked during the outage, through another daemon on the ledger: this one cannot
    # hear of it until the ledger is back.
    other = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        revoked = other.tenants.key_by_digest(keys.digest(tokens[2]))
        assert revoked is not None
        assert other.tenants.revoke_key(tenant, revoked.id)
    finally:
        other.dispose()
    generation = auth.generation
    auth._set_trusted(True)  # the listener back before the pool: the circuit is still open
    assert auth.generation > generation  # every connection checks its key again
    assert auth.authenticate(tokens[2]).tenant_id == tenant  # still unreadable: taken

    generation = auth.generation
    probe.up.set()
    # the pool back (its circuit's callbacks run once it closed): a connection that took
    # the key from memory just now checks it again
    wait_until(lambda: auth.generation > generation)
    assert store.circuit.down_since is None
    with pytest.raises(Unauthorized):
        auth.authenticate(tokens[2])  # the ledger read again: revoked, and forgotten here
    probe.up.clear()
    store.circuit.trip("the database cannot be reached")
    with pytest.raises(LedgerUnavailable):
        auth.authenticate(tokens[2])  # not taken from memory after the ledger said no
    probe.up.set()
    wait_until(lambda: store.circuit.down_since is None)
    assert auth.authenticate(tokens[0]) == checked
    with pytest.raises(Unauthorized):
        auth.authenticate("maasd_nope")


def test_last_known_answers_while_the_ledger_is_down() -> None:
    now = [100.0]
    known: LastKnown[int] = LastKnown(clock=lambda: now[0])
    value = [1]

    def read() -> int:
        if value[0] < 0:
            raise LedgerUnavailable("down")
        return value[0]

    fresh = known.answer("q", read)
    assert (fresh.value, fresh.stale_since) == (1, None)
    value[0], now[0] = -1, 200.0
    stale = known.answer("q", read)
    assert (stale.value, stale.stale_since) == (1, 100.0)  # as of when it was read
    with pytest.raises(LedgerUnavailable):
        known.answer("never asked", read)


def test_the_stale_header_has_the_one_timestamp_format_of_the_api() -> None:
    """SPEC §4: timestamps are RFC 3339 in UTC "with a fixed format" — the ``as-of`` of a
    stale answer too (it was ``isoformat``'s ``…+00:00``, without fraction)."""
    from maasd.api.controllers import STALE_HEADER, _maybe_stale
    from maasd.core.stale import Maybe

    assert STALE_HEADER not in _maybe_stale(Maybe([1])).headers
    header = _maybe_stale(Maybe([1], stale_since=1_764_606_041.5)).headers[STALE_HEADER]
    assert header == "ledger-unavailable; as-of=2025-12-01T16:20:41.500000Z"
