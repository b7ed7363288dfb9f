"""The ledger: SQLAlchemy Core tables, one repository per aggregate, Alembic plumbing.

>>> from maasd.store import Store, BufferRow          # doctest: +SKIP
>>> store = Store("sqlite:////var/lib/maasd/maasd.db")  # doctest: +SKIP
>>> store.upgrade()                                   # doctest: +SKIP
>>> store.buffers.buffer(buffer_id)                   # doctest: +SKIP

:class:`Store` holds the :class:`Database` and one repository per aggregate
(``store.tenants``, ``store.pools``, ``store.reserves`` and ``store.buffers``,
``store.events``, ``store.hosts``, ``store.totals``: :mod:`maasd.store.repository`);
each class is exported here too, for the modules typed with the one they are handed.

The schema is created and changed only by the Alembic migrations in the
top-level ``migrations/`` directory (:meth:`Store.upgrade`).
"""

from __future__ import annotations

from maasd.store.base import Repository, must_last
from maasd.store.buffers import BufferRepo, ReserveRepo
from maasd.store.database import Database
from maasd.store.engine import alembic_config, create_engine, migrations_dir, normalize_url
from maasd.store.events import EventRepo
from maasd.store.hosts import HostRepo, HostUsage, is_live
from maasd.store.notify import KEYS_CHANNEL
from maasd.store.pools import PoolRepo
from maasd.store.records import (
    BufferRow,
    EventRow,
    Extension,
    HostRow,
    KeyRow,
    PoolRow,
    TenantRow,
)
from maasd.store.repository import Store
from maasd.store.schema import ACCOUNTED_STATES, BUFFER_STATES, metadata
from maasd.store.tenants import TenantRepo
from maasd.store.totals import TotalsRepo

__all__ = [
    "ACCOUNTED_STATES",
    "BUFFER_STATES",
    "BufferRepo",
    "BufferRow",
    "Database",
    "KEYS_CHANNEL",
    "EventRepo",
    "EventRow",
    "Extension",
    "HostRepo",
    "HostRow",
    "HostUsage",
    "KeyRow",
    "PoolRepo",
    "PoolRow",
    "Repository",
    "ReserveRepo",
    "Store",
    "TenantRepo",
    "TenantRow",
    "TotalsRepo",
    "alembic_config",
    "create_engine",
    "is_live",
    "metadata",
    "migrations_dir",
    "must_last",
    "normalize_url",
]
