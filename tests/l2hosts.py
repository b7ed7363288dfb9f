"""Two real daemons on one PostgreSQL ledger and one real Redis: the L2 tests' setup.

A plugin of ``conftest.py`` (``pytest_plugins``), so its fixtures serve a test module by
name, without an import:

* ``redis_server``: a ``redis-server`` of the module's own (:mod:`redisdb`), skipping
  the module where there is none or the ``l2`` extra (redis-py) is missing;
* ``l2_ledger_url``: a fresh PostgreSQL database of the module's own, skipping where
  ``MAASD_TEST_PG_URL`` is not set.

:func:`two_hosts` starts the pair on them with the module's own names and settings;
:func:`commit` and :func:`in_l2` are what the tests do with it. Each test module keeps
its own ``hosts`` fixture: the settings (timeouts, L2 limits, pool sizes) are what a
module is about.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import Daemon
from maasd.client import Worker
from pgdb import PG_URL, fresh_pg_database
from redisdb import REDIS_SERVER, RedisServer

#: A small ledger connection pool for each daemon of a pair (the daemon's default is
#: 16 kept and 64 more under load), for the modules that size it down.
SMALL_DB_POOL = {"MAASD_DB_POOL_SIZE": "4", "MAASD_DB_MAX_OVERFLOW": "8"}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server or valkey-server on PATH (apt-get install redis-server)")
    pytest.importorskip("redis", reason="needs the l2 extra (redis-py)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def l2_ledger_url() -> Iterator[str]:
    if not PG_URL:
        pytest.skip("MAASD_TEST_PG_URL is not set (scripts/pg-test-server)")
    with fresh_pg_database() as url:
        yield url


@contextlib.contextmanager
def two_hosts(
    tmp_path_factory: pytest.TempPathFactory,
    names: tuple[str, str],
    ledger_url: str,
    redis_server: RedisServer,
    env: dict[str, str],
) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons of host ``names[0]`` and ``names[1]`` on the ledger and the L2, each with
    ``env`` on top, started in that order and stopped at the end whatever happened."""
    daemons = [
        Daemon(
            tmp_path_factory.mktemp(name),
            env={
                "MAASD_DB_URL": ledger_url,
                "MAASD_NODE_NAME": name,
                "MAASD_L2_URL": redis_server.url,
                **env,
            },
        )
        for name in names
    ]
    try:
        for d in daemons:
            d.start()
        yield daemons[0], daemons[1]
    finally:
        for d in daemons:
            d.close()


def l2_key(tenant_id: str, key: str) -> str:
    """The Redis key a daemon writes the tenant's entry ``key`` under."""
    from maasd.l2 import codec  # the l2 extra's xxhash: this module is loaded by every run

    return codec.Keys("maasd", tenant_id).entry(key)


def encoded(tenant_id: str, key: str, data: bytes) -> bytes:
    """``data`` as a daemon writes it to L2 for the tenant's entry ``key`` (header + bytes):
    what a test plants in Redis."""
    from maasd.l2 import codec

    buf = bytearray(codec.value_size(tenant_id, key, len(data)))
    buf[len(buf) - len(data) :] = data
    return bytes(codec.encode_into(buf, tenant_id, key))


def in_l2(redis_server: RedisServer, tenant_id: str, key: str) -> bool:
    return bool(redis_server.client().exists(l2_key(tenant_id, key)))


def commit(w: Worker, key: str, data: bytes, pool: str | None = None) -> str:
    """Put ``data`` under ``key`` (in ``pool``, else the default) and commit it: its id."""
    m = w.put(key, len(data), pool=pool)
    m.array[: len(data)] = np.frombuffer(data, np.uint8)
    return w.commit(m).id
