"""The REST API in-process: litestar's TestClient over a real :class:`Service`.

A real SQLite ledger in a temp dir and a real memfd pool (``node0``, 32 MiB): no
daemon process, no sockets, so the API tests in ``tests/unit/test_api_*.py`` run
in seconds. Import as ``from inprocess_api import …`` (``tests/`` is on pytest's
``pythonpath``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from maasd.api.app import create_app
from maasd.core import Service
from maasd.models import PoolSpec, Principal
from maasd.settings import Settings

MiB = 1 << 20
ADMIN_KEY = "maasd_admin_key_for_the_api_tests"
ADMIN = Principal(is_admin=True)

#: The use-case objects the app's handlers are given (maasd.api.dependencies); the keys
#: (authentication, the role checks) are the /v1 hook's and the guards' own, not counted.
HANDED_TO_HANDLERS = ("pools", "tenants", "reserves", "buffers", "hosts", "last_known")


def service(data_dir: Path) -> Service:
    """A started Service (no reaper thread) with one volatile pool, ``node0``."""
    svc = Service(
        Settings(
            data_dir=str(data_dir),
            admin_key=ADMIN_KEY,
            pools=[PoolSpec(name="node0", numa_node=0, capacity_bytes=32 * MiB)],
            node_name="api-unit",
        )
    )
    svc.start(reaper=False)
    return svc


@contextmanager
def client(svc: Service, **app_options: Any) -> Iterator[TestClient[Litestar]]:
    """A TestClient on ``create_app(svc, **app_options)``."""
    with TestClient(create_app(svc, **app_options)) as c:
        yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def snapshot(svc: Service) -> tuple[Any, ...]:
    """Everything a refused request must leave unchanged: pools, tenants, every buffer."""
    return svc.pools.infos(), svc.tenants.infos(), svc.buffers.buffers(ADMIN)


class ServiceCalls:
    """Counts the calls of every public method of the use-case objects the handlers are
    given (``"reserves.reserve"``), wrapping the real ones on the instances.

    The app is given those very objects (handlers receive them by dependency
    injection), so a handler that runs shows up here; a hook or guard that refuses
    before the handler leaves :attr:`counts` empty.
    """

    def __init__(self, svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        for noun in HANDED_TO_HANDLERS:
            obj = getattr(svc, noun)
            for name in dir(type(obj)):
                if not name.startswith("_") and callable(getattr(type(obj), name)):
                    counted = self._counting(f"{noun}.{name}", getattr(obj, name))
                    monkeypatch.setattr(obj, name, counted)

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted
