"""The broker's bounds (from :class:`maasd.settings.Settings`) and the counts they apply to.

Pure bookkeeping, no sockets, so every cap is tested without a connection::

    >>> counts = ConnectionCounts(Limits(max_per_uid=1))
    >>> counts.admit_peer(1000) is None
    True
    >>> counts.admit_peer(1000)
    'peer uid 1000 has 1 connections open (socket_max_per_uid = 1)'

A connection is counted for its peer uid and, until it says ``hello``, as
unauthenticated; after ``hello`` it moves to its tenant. Every admitted count is
given back exactly once (``leave``), whatever way the connection ends.
"""

from __future__ import annotations

import collections
import resource
from typing import TYPE_CHECKING, TypeVar

import msgspec

from maasd.core.limits import socket_connections

if TYPE_CHECKING:
    from maasd.settings import Settings

__all__ = ["ConnectionCounts", "Limits", "tenant_connections"]

K = TypeVar("K")


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Every bound of the socket, with the defaults ``maasd serve`` uses.

    Each field is the ``Settings`` field ``socket_<name>`` (see docs/operations.md).
    """

    #: Connections open at once, in total.
    max_connections: int = 1024
    #: Connections that have not completed ``hello`` yet, in total; one peer uid may
    #: hold at most half of them. At either cap a new connection sheds the oldest one
    #: still waiting (of its uid; of the uid holding most), so idle connects lock nobody out.
    max_unauthenticated: int = 64
    #: Connections of one peer uid (SO_PEERCRED), before and after ``hello``.
    max_per_uid: int = 512
    #: Connections of one tenant (the admin key counts as tenant "admin"), after ``hello``.
    max_per_tenant: int = 128
    #: A connection must complete ``hello`` this many seconds after it was accepted.
    hello_timeout_s: float = 5.0
    #: A reply the peer has not taken off the socket within this many seconds closes it.
    send_timeout_s: float = 10.0
    #: Threads that run slow operations (renew now; reserve, commit, abort later).
    slow_workers: int = 4
    #: Slow operations of one tenant running at once (the rest wait their turn).
    slow_per_tenant: int = 2
    #: Why ``max_per_tenant`` is below its setting (``""``: it is not), for refusals.
    lowered: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """The limits configured in ``settings`` (fields ``socket_max_connections``, …),
        ``max_connections`` lowered to a twelfth of the open-files limit as the region
        budget counts it (:func:`maasd.core.limits.socket_connections`), and
        ``max_per_tenant`` to a tenant's share of that (:func:`tenant_connections`)."""
        fields = (name for name in cls.__struct_fields__ if name != "lowered")
        got = cls(**{name: getattr(settings, "socket_" + name) for name in fields})
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            cap = socket_connections(got.max_connections, int(soft))
            got = msgspec.structs.replace(got, max_connections=cap)
        per_tenant = tenant_connections(
            got.max_per_tenant, got.max_connections, settings.tenant_region_share
        )
        if per_tenant == got.max_per_tenant:
            return got
        why = (
            f", lowered from {got.max_per_tenant} to tenant_region_share "
            f"{settings.tenant_region_share:g} of the {got.max_connections} connections "
            "the open-files limit allows"
        )
        return msgspec.structs.replace(got, max_per_tenant=per_tenant, lowered=why)


def tenant_connections(max_per_tenant: int, max_connections: int, share: float) -> int:
    """Connections one tenant may hold: ``socket_max_per_tenant``, lowered to its
    ``share`` (``tenant_region_share``, as of the region budget) of the daemon's
    connections, so that no tenant takes the connections every other one needs — at a
    small open-files limit the total shrinks (:func:`maasd.core.limits.socket_connections`)
    and a fixed 128 would be all of them.

    >>> tenant_connections(128, 1024, 0.25), tenant_connections(128, 85, 0.25)
    (128, 21)
    >>> tenant_connections(128, 16, 0.25), tenant_connections(128, 16, 1.0)
    (4, 16)
    """
    return max(1, min(max_per_tenant, int(max_connections * share)))


class ConnectionCounts:
    """Open connections by peer uid, by tenant, unauthenticated and in total.

    ``admit_*`` answers ``None`` when the connection may stay (and counts it), or
    a sentence naming the cap it would exceed (and counts nothing).
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = 0
        self.unauthenticated = 0
        self.by_uid: collections.Counter[int] = collections.Counter()
        self.unauthenticated_by_uid: collections.Counter[int] = collections.Counter()
        self.by_tenant: collections.Counter[str] = collections.Counter()

    def admit_peer(self, uid: int) -> str | None:
        """A connection was accepted from ``uid``: count it, or say which cap refuses it."""
        lim = self.limits
        if self.total >= lim.max_connections:
            return (
                f"the daemon has {self.total} connections open "
                f"(socket_max_connections = {lim.max_connections})"
            )
        if self.unauthenticated >= lim.max_unauthenticated:
            return (
                f"{self.unauthenticated} connections are waiting for hello "
                f"(socket_max_unauthenticated = {lim.max_unauthenticated})"
            )
        uid_share = max(1, lim.max_unauthenticated // 2)
        if self.unauthenticated_by_uid[uid] >= uid_share:
            return (
                f"peer uid {uid} has {self.unauthenticated_by_uid[uid]} connections waiting "
                f"for hello, half of socket_max_unauthenticated = {lim.max_unauthenticated}"
            )
        if self.by_uid[uid] >= lim.max_per_uid:
            return (
                f"peer uid {uid} has {self.by_uid[uid]} connections open "
                f"(socket_max_per_uid = {lim.max_per_uid})"
            )
        self.total += 1
        self.unauthenticated += 1
        self.unauthenticated_by_uid[uid] += 1
        self.by_uid[uid] += 1
        return None

    def shed_for(self, uid: int) -> int | None:
        """Before ``admit_peer(uid)``: the uid whose oldest connection waiting for hello to
        close to make room, or None. At the per-uid share that is ``uid`` itself, at the
        total, the uid holding most; never when another cap would refuse ``uid`` anyway.
        """
        lim = self.limits
        if self.total >= lim.max_connections or self.by_uid[uid] >= lim.max_per_uid:
            return None
        waiting = self.unauthenticated_by_uid
        if waiting[uid] >= max(1, lim.max_unauthenticated // 2):
            return uid
        if self.unauthenticated >= lim.max_unauthenticated and waiting:
            return max(waiting, key=waiting.__getitem__)
        return None

    def admit_tenant(self, uid: int, tenant: str) -> str | None:
        """An admitted connection of ``uid`` said ``hello`` as ``tenant``: move it, or refuse."""
        if self.by_tenant[tenant] >= self.limits.max_per_tenant:
            return (
                f"tenant {tenant} has {self.by_tenant[tenant]} connections open "
                f"(socket_max_per_tenant = {self.limits.max_per_tenant}{self.limits.lowered})"
            )
        self.unauthenticated -= 1
        _decrement(self.unauthenticated_by_uid, uid)
        self.by_tenant[tenant] += 1
        return None

    def leave(self, uid: int, tenant: str | None) -> None:
        """An admitted connection closed; ``tenant`` is None if it never completed hello."""
        self.total -= 1
        _decrement(self.by_uid, uid)
        if tenant is None:
            self.unauthenticated -= 1
            _decrement(self.unauthenticated_by_uid, uid)
        else:
            _decrement(self.by_tenant, tenant)


def _decrement(counter: collections.Counter[K], key: K) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
