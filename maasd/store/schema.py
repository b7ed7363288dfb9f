"""The ledger's tables, as SQLAlchemy Core ``Table`` objects.

This module is the *declaration* the code queries against; the database itself
is only ever created and changed by the Alembic migrations in the top-level
``migrations/`` directory. ``tests/integration/test_migrations.py`` checks that
the two agree.

Conventions: ids are random 32-character hex strings (``String(32)``); times are
epoch seconds (``Float``); sizes are bytes (``BigInteger``). Usage is a running
total on the tenant's and the pool's row (``used_bytes``, ``buffers``: the sum of
the sizes and the count of its buffers in every state), kept by the database
itself: triggers on ``buffers`` (migration 0007, :mod:`maasd.store.totals`) change
it in the statement, and so the transaction, that inserts or deletes a row. A
reserve reads it from the row it locks: O(1), not O(buffers).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

__all__ = [
    "ACCOUNTED_STATES",
    "TOTALS",
    "BUFFER_KINDS",
    "BUFFER_STATES",
    "NAMING_CONVENTION",
    "api_keys",
    "buffers",
    "events",
    "hosts",
    "metadata",
    "pools",
    "tenants",
]

#: Deterministic constraint names, so migrations (and SQLite batch mode) can
#: refer to constraints by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: A buffer is ``reserving`` between the ledger insert and the memfd being ready,
#: ``staged`` while a put entry is being written (after its reserve, before its
#: commit: invisible to lookups), ``live`` while a tenant may use it, ``releasing``
#: while it is being scrubbed.
BUFFER_STATES = ("reserving", "staged", "live", "releasing")
#: States whose sizes count against quota and capacity: all of them — memory
#: being set up, written or scrubbed is still memory in use.
ACCOUNTED_STATES = BUFFER_STATES
#: What a buffer row is: ``buffer`` (a REST reserve) or ``entry`` (a socket
#: put/commit).
BUFFER_KINDS = ("buffer", "entry")
#: The running totals on ``tenants`` and ``pools`` (their last two columns): bytes and
#: count of the buffers in :data:`ACCOUNTED_STATES`. A pool's are not in its
#: :class:`~maasd.store.records.PoolRow` (a pool's record is its fixed properties).
TOTALS = ("used_bytes", "buffers")


def _totals() -> tuple[Column[int], Column[int]]:
    """The two total columns, kept by the triggers on ``buffers`` (never written by code)."""
    return (
        Column("used_bytes", BigInteger, nullable=False, server_default="0"),
        Column("buffers", BigInteger, nullable=False, server_default="0"),
    )


metadata = MetaData(naming_convention=NAMING_CONVENTION)

# Column order matters: each table's columns are in the field order of its row
# record in maasd.store.records, so a result row converts positionally.

pools = Table(
    "pools",
    metadata,
    Column("id", String(32), primary_key=True),
    # Several daemons may share one PostgreSQL: each owns the pools of its host.
    Column("host", String(255), nullable=False),
    Column("name", String(128), nullable=False),
    Column("numa_node", Integer, nullable=False),
    Column("backing", String(16), nullable=False),
    Column("persistence", String(16), nullable=False),
    Column("latency_us", Integer, nullable=False),
    Column("capacity_bytes", BigInteger, nullable=False),
    Column("page_bytes", BigInteger, nullable=False),
    Column("prefault", Boolean, nullable=False),
    Column("scrub", String(16), nullable=False),
    Column("spill_dir", Text, nullable=True),
    Column("created_at", Float, nullable=False),
    # Bytes of fresh, prefaulted regions the daemon keeps ready ahead of demand
    # (its warm stock); 0 = none. Counted inside capacity_bytes, not on top of it.
    Column("warm_bytes", BigInteger, nullable=False, server_default="0"),
    # Set when a delete of the pool starts: from then on no reserve lands in it,
    # while its buffers are drained. NULL = not being deleted.
    Column("deleting_at", Float, nullable=True),
    # The pool's disk tier (docs/operations.md, "The disk tier"): the directory its
    # evicted entries are demoted to, encrypted, and the bytes it may hold there.
    # NULL / 0 = none. What is on disk is not in the ledger (its keys are in memory only).
    Column("disk_dir", Text, nullable=True),
    Column("disk_bytes", BigInteger, nullable=False, server_default="0"),
    # Its buffers' bytes and count, every state (TOTALS; migration 0007).
    *_totals(),
    UniqueConstraint("host", "name"),
)

tenants = Table(
    "tenants",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("quota_bytes", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    # How many buffers the tenant may hold at once (max_buffers), counted
    # over the accounted states like its bytes; NULL = the daemon's default cap.
    Column("max_buffers", BigInteger, nullable=True),
    # Set when a delete of the tenant starts: from then on its new reserves are
    # refused, while its buffers (also those whose reserve was in flight) are
    # released. NULL = not being deleted.
    Column("deleting_at", Float, nullable=True),
    # The bytes it may hold on this host's disk tiers (docs/operations.md, "The disk
    # tier"); NULL = the default, disk_quota_factor × quota_bytes.
    Column("disk_quota_bytes", BigInteger, nullable=True),
    # Its buffers' bytes and count, every state, on every host (TOTALS; migration 0007).
    *_totals(),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant_id", String(32), ForeignKey("tenants.id"), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
    Index(None, "digest", unique=True),
    Index(None, "tenant_id"),
)

buffers = Table(
    "buffers",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant_id", String(32), ForeignKey("tenants.id"), nullable=False),
    Column("pool_id", String(32), ForeignKey("pools.id"), nullable=False),
    # The host whose memory holds the buffer (its pool's host, copied so that a
    # host's buffers and its key index need no join). Several hosts sharing one
    # PostgreSQL each hold their own buffers.
    Column("host", String(255), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("numa_node", Integer, nullable=False),
    Column("persistence", String(16), nullable=False),
    Column("label", String(128), nullable=True),
    Column("key", String(512), nullable=True),
    Column("evictable", Boolean, nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("last_used_at", Float, nullable=False),
    # One of BUFFER_KINDS: "buffer" (REST reserve) or "entry" (socket put/commit).
    Column("kind", String(16), nullable=False, server_default="buffer"),
    # When an entry was committed; from then on no process but the daemon can change its bytes.
    # NULL for buffers and for entries not yet committed.
    Column("committed_at", Float, nullable=True),
    Column("checkpoint_path", Text, nullable=True),
    Column("checksum", String(128), nullable=True),
    Column("checkpointed_at", Float, nullable=True),
    # The lease's length as its tenant last gave it (the reserve's or put's ttl_s, then
    # each renew's): what a lookup hit extends it by, also after a restart. NULL: a row
    # from before migration 0008, whose length is then taken as reserved (expires_at −
    # created_at). BigInteger: a ttl_s may be 2^31 (maasd.bounds.TtlS).
    Column("ttl_s", BigInteger, nullable=True),
    # When a renew last set the lease (the renewing daemon's clock); NULL: never renewed.
    # A lookup hit's batched extension is written only if the hit came after it: one
    # taken to be written before a renew to a shorter lease must not undo it (migration 0008).
    Column("lease_set_at", Float, nullable=True),
    # Equality columns, then the eviction order (least recently used first), then the
    # size: an eviction scan reads victims in order from the index (migration 0004).
    Index(None, "tenant_id", "state", "last_used_at", "id", "size_bytes"),
    Index(None, "pool_id", "state", "last_used_at", "id", "size_bytes"),
    Index(None, "expires_at"),
)
# A key is unique among one tenant's buffers on one host; NULL keys do not take
# part. (Keys are cleared when a buffer starts releasing, so this is "among its
# buffers not being released".) Per host, because several hosts sharing one
# PostgreSQL each keep their own copy of a prefix (docs/scale-out.md).
Index(
    "uq_buffers_tenant_id_host_key",
    buffers.c.tenant_id,
    buffers.c.host,
    buffers.c.key,
    unique=True,
    sqlite_where=buffers.c.key.is_not(None),
    postgresql_where=buffers.c.key.is_not(None),
)

# The daemons sharing this ledger, one row per host (MAASD_NODE_NAME). Times here are
# the *database's* clock (maasd.store.hosts.db_now), so that comparing one host's
# heartbeat with another's "now" is free of clock skew between hosts.
hosts = Table(
    "hosts",
    metadata,
    Column("name", String(255), primary_key=True),
    # Random id of the daemon process serving as this host; a new one per start. A
    # heartbeat only counts for the incarnation that claimed the row, so a process
    # that lost its claim (its host forgotten, or taken over) finds out at once.
    Column("incarnation", String(32), nullable=False),
    Column("started_at", Float, nullable=False),
    # Written by the reaper every heartbeat_s seconds: the host is serving.
    Column("last_seen", Float, nullable=False),
    Column("heartbeat_s", Float, nullable=False),
    # Set by a clean shutdown; NULL while serving (or after a crash).
    Column("stopped_at", Float, nullable=True),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("kind", String(32), nullable=False),
    # No foreign keys: the audit trail outlives the tenants, pools and buffers it names.
    Column("tenant_id", String(32), nullable=True),
    Column("buffer_id", String(32), nullable=True),
    Column("pool_id", String(32), nullable=True),
    Column("bytes", BigInteger, nullable=True),
    Column("detail", Text, nullable=True),
)
