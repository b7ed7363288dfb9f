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


def http_limits_env(
    cap: int, head_s: float, body_s: float, send_s: float, keepalive_s: float
) -> dict[str, str]:
    """The environment of a daemon with small REST limits (``http_*``), so that attacks on
    its connection cap and deadlines are quick to perform."""
    return {
        "MAASD_HTTP_MAX_CONNECTIONS": str(cap),
        "MAASD_HTTP_HEAD_TIMEOUT_S": str(head_s),
        "MAASD_HTTP_BODY_TIMEOUT_S": str(body_s),
        "MAASD_HTTP_SEND_TIMEOUT_S": str(send_s),
        "MAASD_HTTP_KEEPALIVE_S": str(keepalive_s),
    }
