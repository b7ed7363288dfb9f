"""The region budget of a daemon on its default settings, for tests that size a run by it
(``maasd.core.limits``): one definition of those defaults, which the unit tests pin."""

from __future__ import annotations

from maasd.core.limits import ProcessLimits, limits_for


def default_limits(
    open_files: int,
    max_map_count: int | None = None,
    *,
    tenant_share: float = 0.25,
    parks_entries: bool = False,
) -> ProcessLimits:
    """The limits ``maasd serve`` derives on its defaults — SQLite (16 + 64 connections,
    2 files each), 64 REST threads + 4 slow workers, socket_max_connections 1024,
    http_max_connections 512 — under these process limits."""
    return limits_for(
        open_files,
        max_map_count,
        socket_max_connections=1024,
        http_max_connections=512,
        ledger_files=160,
        threads=68,
        tenant_share=tenant_share,
        parks_entries=parks_entries,
    )
