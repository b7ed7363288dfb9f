"""Which database errors mean "the ledger cannot serve now" (507) and which are bugs (500)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from maasd.errors import LedgerUnavailable
from maasd.store.base import ledger_errors, unavailable


@pytest.mark.parametrize(
    ("orig", "expected"),
    [
        ("database is locked", "busy"),
        ("database or disk is full", "disk is full"),
        ("connection failed: connection refused", "cannot be reached"),
        ("no such column: nope", None),  # a statement of ours: a bug, not an outage
    ],
)
def test_which_database_errors_are_an_outage(orig: str, expected: str | None) -> None:
    exc = sa.exc.OperationalError("SELECT 1", {}, Exception(orig))
    why = unavailable(exc)
    if expected is None:
        assert why is None
    else:
        assert why is not None
        assert expected in why


def test_a_constraint_is_never_an_outage() -> None:
    exc = sa.exc.IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed: connection"))
    assert unavailable(exc) is None


def test_ledger_errors_turns_an_outage_into_a_507_and_lets_the_rest_through() -> None:
    with pytest.raises(LedgerUnavailable, match="busy"), ledger_errors():
        raise sa.exc.OperationalError("BEGIN", {}, Exception("database is locked"))
    with pytest.raises(sa.exc.OperationalError), ledger_errors():
        raise sa.exc.OperationalError("SELECT", {}, Exception("no such table: x"))
    with pytest.raises(LedgerUnavailable, match="pool is exhausted"), ledger_errors():
        raise sa.exc.TimeoutError("QueuePool limit reached")


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "words"),
    [
        ("40P01", "rolled back"),  # deadlock detected: a retry, not a bug
        ("40001", "rolled back"),
        ("57014", "statement timeout"),
        ("53300", "out of resources"),
        ("08006", "cannot serve"),
    ],
)
def test_postgresql_states_that_mean_retry(sqlstate: str, words: str) -> None:
    exc = sa.exc.OperationalError("UPDATE", {}, _PgError(sqlstate))
    why = unavailable(exc)
    assert why is not None
    assert words in why
