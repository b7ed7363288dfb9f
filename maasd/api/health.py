"""``/healthz``: whether the daemon is healthy, component by component.

A component check is a plain ``() -> (ok, why)`` callable (the broker's
``healthy()``, say); :func:`of_checks` makes the one ``health`` callable that
:func:`maasd.api.app.create_app` takes out of named checks. ``/healthz`` answers
200 ``{"status": "ok"}`` when every component is healthy, else 503
``{"status": "unhealthy", "components": {...}}`` — the one 5xx the API gives
that is not about a request's input. The ``degraded`` checks are of components the
daemon serves without (the ledger, L2: docs/scale-out.md, "Failure modes"): when
one of those fails and nothing else does, the answer is 200 ``{"status":
"degraded", "components": {...}}`` — a supervisor must not restart a daemon for
them (its memory would be lost), an operator should know.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import anyio.to_thread
from litestar import Response

from maasd.api.schemas import Component, Status, Unhealthy

__all__ = ["ComponentCheck", "Healthz", "HealthCheck", "of_checks"]

logger = logging.getLogger(__name__)

#: One component's check: ``(True, "")`` when healthy, else ``(False, why)``.
ComponentCheck = Callable[[], tuple[bool, str]]

#: What ``create_app(health=...)`` takes: ``() -> {component: (ok, why)}``.
HealthCheck = Callable[[], Mapping[str, tuple[bool, str]]]


def _run(name: str, check: ComponentCheck) -> tuple[bool, str]:
    try:
        ok, why = check()
    except Exception as e:  # a check that fails says "unhealthy", it does not break /healthz
        logger.warning("health check %s failed", name, exc_info=e)
        return False, f"the check itself failed: {type(e).__name__}: {e}"
    return bool(ok), str(why)


def of_checks(checks: Mapping[str, ComponentCheck]) -> HealthCheck:
    """One ``health`` callable over named component checks; a check that raises counts as failing.

    >>> health = of_checks({"broker": lambda: (True, ""), "disk": lambda: (False, "full")})
    >>> health()
    {'broker': (True, ''), 'disk': (False, 'full')}
    """
    named = dict(checks)
    return lambda: {name: _run(name, check) for name, check in named.items()}


class Healthz:
    """The ``/healthz`` answer over an optional ``health`` callable (none: always ok)."""

    def __init__(
        self, check: HealthCheck | None = None, degraded: HealthCheck | None = None
    ) -> None:
        self.check = check
        self.degraded = degraded

    async def answer(self) -> Response[Status | Unhealthy]:
        # In a worker thread of its own, not on the service's limiter: a check may
        # block, and a daemon whose service threads are all scrubbing is still alive.
        vital, soft = await anyio.to_thread.run_sync(self.both)
        if not all(c.ok for c in vital.values()):
            return Response(
                Unhealthy(status="unhealthy", components={**vital, **soft}), status_code=503
            )
        if not all(c.ok for c in soft.values()):
            return Response(Unhealthy(status="degraded", components={**vital, **soft}))
        return Response(Status(status="ok"))

    def both(self) -> tuple[dict[str, Component], dict[str, Component]]:
        """The vital components' states and the degraded ones' (blocking)."""
        return _components(self.check), _components(self.degraded)

    def components(self) -> dict[str, Component]:
        """Every vital component's state (blocking)."""
        return _components(self.check)


def _components(check: HealthCheck | None) -> dict[str, Component]:
    if check is None:
        return {}
    try:
        states = dict(check())
    except Exception as e:
        logger.warning("health check failed", exc_info=e)
        states = {"health": (False, f"the check itself failed: {type(e).__name__}: {e}")}
    return {
        name: Component(ok=bool(ok), detail=str(why) or ("ok" if ok else "unhealthy"))
        for name, (ok, why) in states.items()
    }
