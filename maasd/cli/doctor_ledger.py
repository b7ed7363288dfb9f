"""``maasd doctor``'s ledger check, and what the other checks read from the ledger.

The ledger is read through the daemon's own store (:class:`maasd.store.Store`, or the
one repository a check reads over a :class:`maasd.store.Database`: its URL rules, its
engine, its queries) and the schema's heads through the daemon's own Alembic
configuration, as the daemon's upgrade reads them (:meth:`maasd.store.Store.schema_state`). Nothing is created or
migrated: a SQLite file that does not exist yet is left so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from maasd.cli.doctor_check import Check
from maasd.errors import ConfigError, MaasdError
from maasd.settings import Settings

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = ["check_ledger", "ledger_tenant_caps"]


def ledger_tenant_caps(url: URL) -> list[int | None] | None:
    """The ``max_buffers`` of every tenant in the ledger not being deleted (``None``: the
    daemon's default), as :meth:`maasd.store.TenantRepo.tenants` reads them for ``GET
    /v1/tenants``; ``None`` when there is no ledger to read (not created, unreachable, not
    migrated yet)."""
    import sqlalchemy as sa

    from maasd.store import Database, TenantRepo

    if url.get_backend_name() == "sqlite" and (not url.database or not Path(url.database).exists()):
        return None
    db = Database(url, pool_size=1, max_overflow=0, connect_timeout_s=5.0)
    try:
        rows = TenantRepo(db).tenants()  # the one aggregate it reads: no whole store
    except (sa.exc.SQLAlchemyError, MaasdError):
        return None
    finally:
        db.dispose()
    return [t.max_buffers for t in rows if t.deleting_at is None]


def check_ledger(settings: Settings) -> Check:
    import sqlalchemy as sa

    from maasd.store import Store
    from maasd.store.engine import normalize_url

    name = "ledger"
    try:
        url = normalize_url(settings.database_url)
    except ConfigError as e:
        return Check(name, "fail", e.detail, "fix MAASD_DB_URL / --db")
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        return Check(name, "ok", f"{shown}: not created yet; maasd serve creates and migrates it")
    store = Store(url, pool_size=1, max_overflow=0, connect_timeout_s=5.0)
    try:
        schema = store.schema_state()  # what maasd serve's upgrade reads too
    except sa.exc.SQLAlchemyError as e:
        cause = getattr(e, "orig", None) or e  # the driver's own error, when there is one
        return Check(
            name,
            "fail",
            f"{shown}: {type(cause).__name__}: {(str(cause).strip() or '?').splitlines()[0]}",
            "check the URL, that the server runs and that this host may connect",
        )
    finally:
        store.dispose()
    at = ",".join(sorted(schema.current)) or "empty"
    if schema.at_head:
        return Check(name, "ok", f"{shown}: at the newest schema ({at})")
    if schema.unknown:
        return Check(
            name,
            "fail",
            f"{shown}: at {at}, which this maasd does not know (head {','.join(schema.heads)})",
            "a newer maasd migrated it: run that version, or restore a backup",
        )
    return Check(
        name,
        "warn",
        f"{shown}: at {at}, head is {','.join(sorted(schema.heads))}",
        "maasd serve migrates it on start; or run maasd migrate now",
    )
