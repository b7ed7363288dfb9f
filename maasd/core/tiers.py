"""The order a lookup goes through the tiers: DRAM → local disk → L2 → miss — the one place.

    DRAM   the index of committed entries (Entries.lookup), answered from memory; a hit
           is a use of its key for the disk tier's admission filter
    disk   a miss that names a key on this pool's disk tier (or L2 is ready) must wait:
           the disk tier promotes it into a fresh sealed memfd (Promotions.promote)
    L2     then the shared tier, if configured and its breaker lets calls in (Shared.fill)
    miss   counted once, by whichever step answered it; ``None``, a value, not an error

Both edges call :meth:`Tiers.find`: the broker first on its event loop with
``may_wait=False`` — a miss that a later tier is to be asked about answers
:data:`LATER`, and the broker asks again on its slow pool with ``may_wait=True``
— and any caller that may wait (tests, a thread) once, with ``may_wait=True``.

A DRAM hit on a shorter key is answered at once, even if a longer one is on disk or in
L2: the event loop never waits, and the worker asks again for what it computes next.
A hit on one of ``attached`` (entries the caller holds already) is not counted as a new
attachment, in whichever tier it was found.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from typing import Final, Literal

from maasd.core.auth import require_tenant
from maasd.core.disktier import DiskTiers
from maasd.core.entries import Entries, EntryHandle
from maasd.core.promotion import Promotions
from maasd.core.shared import Shared
from maasd.models import Principal

__all__ = ["LATER", "Later", "Tiers"]


class Later(enum.Enum):
    """A local miss that a slower tier is to be asked about: ask again where it may wait."""

    LATER = "later"


#: :meth:`Tiers.find`'s answer for a miss that must wait for the disk or L2.
LATER: Final = Later.LATER


class Tiers:
    """The lookup order through the tiers (see the module docstring)."""

    def __init__(
        self, entries: Entries, disk: DiskTiers, promotions: Promotions, shared: Shared
    ) -> None:
        self._entries = entries
        self._disk = disk
        self._promotions = promotions
        self._shared = shared

    def find(
        self,
        who: Principal,
        keys: list[str],
        attached: Container[str] = (),
        *,
        may_wait: bool = True,
    ) -> EntryHandle | Literal[Later.LATER] | None:
        """The committed entry of the longest of ``keys`` held here, from whichever tier has
        it (see the module docstring); ``None``: a miss. Without ``may_wait``, a DRAM miss
        that the disk tier or L2 is to be asked about answers :data:`LATER` (uncounted)."""
        tenant_id = require_tenant(who)
        l2 = self._shared.ready()
        ready = l2 or self._disk.fill_ready(tenant_id, keys)
        found = self._entries.lookup(who, keys, count_miss=not ready, attached=attached)
        if found is not None:
            self._disk.hit(tenant_id, found.key)
            return found
        if not l2:
            self._shared.skipped()
        if not ready:
            return None
        if not may_wait:
            return LATER
        return self._fill(who, tenant_id, keys, attached)

    def _fill(
        self, who: Principal, tenant_id: str, keys: list[str], attached: Container[str]
    ) -> EntryHandle | None:
        """A DRAM miss asked of the disk tiers, then of L2; may wait for either (never on
        an event loop)."""
        found = self._promotions.promote(who, tenant_id, keys, attached)
        if found is not None:
            return found
        if self._shared.ready():
            return self._shared.fill(who, keys, attached)
        return self._entries.lookup(who, keys, attached=attached)  # the miss, counted
