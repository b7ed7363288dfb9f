"""The shared prefix tier on Redis or Valkey (docs/scale-out.md, "The L2 tier").

A layer below the core, beside the store and the allocator: it knows Redis, the value
format and the failure handling, and nothing of regions, ledgers or sockets.

=======================  ===========================================================
:mod:`.codec`            (pure) Redis key names per tenant; a value's header, its
                         checks (format, namespace, size, XXH3-128 checksum)
:mod:`.breaker`          (pure) the circuit breaker
:mod:`.queue`            the bounded write-behind queue (and its lane of deletes)
:mod:`.ends`             (pure) the values this daemon's entries wrote, and which of
                         them an entry's release deletes
:mod:`.client`           redis-py: a bounded connection pool, five Lua scripts
:mod:`.tier`             :class:`L2Tier`, what the core calls, and the writer thread
:mod:`.metrics`          the ``maasd_l2_*`` series
=======================  ===========================================================

Importing this package needs nothing beyond maasd's own dependencies; :func:`open_tier`
loads redis-py and xxhash (the ``l2`` extra) when a daemon is configured with an L2 URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maasd.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from maasd.l2.tier import L2Tier, Source
    from maasd.settings import Settings

__all__ = ["open_tier"]


def open_tier(settings: Settings, registry: CollectorRegistry, source: Source) -> L2Tier:
    """The L2 tier of ``settings.l2_url`` (not yet started); ConfigError without the extra."""
    try:
        from maasd.l2.tier import L2Tier
    except ImportError as exc:
        raise ConfigError(
            f"--l2-url needs the l2 extra (pip install 'maasd[l2]'): {exc.name} is missing"
        ) from None
    return L2Tier(settings, registry, source)
