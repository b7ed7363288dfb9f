"""An integrity error is classified by the driver's codes (maasd.store.base.violation),
not by its message: real SQLite errors here, PostgreSQL's with MAASD_TEST_PG_URL."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from maasd.store.base import violation

_META = sa.MetaData()
_PARENT = sa.Table("parent", _META, sa.Column("id", sa.Integer, primary_key=True))
_CHILD = sa.Table(
    "child",
    _META,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("parent_id", sa.ForeignKey("parent.id"), nullable=False),
    sa.Column("key", sa.String, nullable=True),
    sa.UniqueConstraint("parent_id", "key", name="uq_child_parent_id_key"),
)


def _engines() -> list[str]:
    urls = ["sqlite://"]
    if os.environ.get("MAASD_TEST_PG_URL"):
        urls.append(os.environ["MAASD_TEST_PG_URL"])
    return urls


@pytest.fixture(params=_engines())
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    eng = sa.create_engine(request.param)
    if eng.dialect.name == "sqlite":
        sa.event.listen(eng, "connect", lambda c, _: c.execute("PRAGMA foreign_keys=ON"))
    _META.drop_all(eng)
    _META.create_all(eng)
    with eng.begin() as conn:
        conn.execute(_PARENT.insert(), [{"id": 1}])
        conn.execute(_CHILD.insert(), [{"id": 1, "parent_id": 1, "key": "k"}])
    yield eng
    _META.drop_all(eng)
    eng.dispose()


def _refused(engine: sa.Engine, row: dict[str, object]) -> sa.exc.IntegrityError:
    with pytest.raises(sa.exc.IntegrityError) as info, engine.begin() as conn:
        conn.execute(_CHILD.insert(), [row])
    return info.value


def test_a_unique_clash_names_its_constraint_or_columns(engine: sa.Engine) -> None:
    v = violation(_refused(engine, {"id": 2, "parent_id": 1, "key": "k"}))
    assert v.kind == "unique"
    assert v.of("uq_child_parent_id_key", "child.key")
    assert not v.of("uq_other", "child.other")


def test_a_missing_parent_is_a_foreign_key_violation(engine: sa.Engine) -> None:
    v = violation(_refused(engine, {"id": 3, "parent_id": 99, "key": "x"}))
    assert v.kind == "foreign_key"
    assert not v.of("uq_child_parent_id_key", "child.key")


def test_a_primary_key_clash_is_unique_but_not_the_key_constraint(engine: sa.Engine) -> None:
    v = violation(_refused(engine, {"id": 1, "parent_id": 1, "key": "other"}))
    assert v.kind == "unique"
    assert not v.of("uq_child_parent_id_key", "child.key")
