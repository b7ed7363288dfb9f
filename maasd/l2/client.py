"""The daemon's Redis/Valkey client for L2 (redis-py): store, fetch and forget.

* ``store``  — write one value, account its bytes to the tenant, evict the tenant's
  oldest values while its total passes its cap (atomic: the SET and a Lua script of
  the accounting in one MULTI/EXEC);
* ``fetch``  — of a lookup's keys (short → long), the value of the longest that exists,
  its last use moved to now — or its length only, when it passes the caller's bound
  (a script finds it; the longest key's value is read in the same round trip);
* ``forget`` — drop a value the daemon refused, with its accounting;
* ``delete`` — drop the value of a key if it is still the one this daemon wrote (or
  restored an entry from): its entry was released, not evicted. Compared by the
  value's checksum (:func:`maasd.l2.codec.digest`), read in the script — 16 bytes,
  the value itself never passes through Lua — so that a newer value of the key, stored
  by another host meanwhile, stays;
* ``drop_tenant`` — drop all of a deleted tenant's values and its accounting, and mark
  it gone, so that a store still in flight from any host (tenant ids are never
  reused) is undone in its own atomic step rather than left with accounting that
  has no TTL.

Connections come from a bounded pool; every call has the settings' connect and socket
timeouts — a ``store`` of a large value the longer timeout its caller gives it
(:meth:`RedisL2.store`'s ``timeout_s``: sending 64 MiB takes longer than a lookup's
round trip, and is no sign of a failing server) — and no retry (the circuit breaker of :mod:`maasd.l2.tier` decides when to try
again). Errors are redis-py's (:class:`redis.RedisError`) or ``OSError``; the tier counts
them. The URL, with its credentials, stays inside this object: :func:`redact` is what logs
may show.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from maasd.l2.codec import HEADER, SUM_AT, Keys

__all__ = ["RedisL2", "redact"]

#: KEYS: entry, lru, sizes, total, gone; ARGV: size, cap. → evicted count, or
#: -2 = :data:`~maasd.l2.codec.GONE` (the tenant was deleted: the value just set is deleted, nothing
#: accounted). Run in the same MULTI/EXEC as the SET of the value, after it: the value
#: itself never passes through Lua (turning 64 MiB into a Lua string and back held
#: Redis' one thread for every client, on every host, for tens of milliseconds; a plain
#: SET of a large argument takes the received buffer as it is).
_ACCOUNT = """
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('DEL', KEYS[1])
  return -2
end
local size = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then redis.call('DECRBY', KEYS[4], old) end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], t[1] + t[2] / 1000000, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[4], size)
local evicted = 0
while total > cap do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  local n = tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('HDEL', KEYS[3], oldest[1])
  redis.call('DEL', oldest[1])
  total = redis.call('DECRBY', KEYS[4], n)
  evicted = evicted + 1
end
return evicted
"""

#: KEYS: lru, then the entry keys short → long. → {index into the entry keys (1-based),
#: length of its value} of the longest that has one (its last use moved to now), or false.
#: A key that holds another type than a string (a hash, a list … put there by something
#: else than a daemon) is found too, with the length -1: the caller refuses and drops it,
#: as it does any value that fails its checks — an error here would fail every lookup
#: naming that key, and count against its tenant's breaker, for as long as it stays.
_FIND = """
for i = #KEYS, 2, -1 do
  local n = redis.pcall('STRLEN', KEYS[i])
  if type(n) == 'table' then return {i - 1, -1} end
  if n > 0 then
    local t = redis.call('TIME')
    redis.pcall('ZADD', KEYS[1], 'XX', t[1] + t[2] / 1000000, KEYS[i])
    return {i - 1, n}
  end
end
return false
"""

#: KEYS: entry, lru, sizes, total.
_FORGET = """
local n = redis.call('HGET', KEYS[3], KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
redis.call('DEL', KEYS[1])
if n then redis.call('DECRBY', KEYS[4], n) end
return 1
"""

#: KEYS: entry, lru, sizes, total; ARGV: a digest, its first and last offset in the value.
#: → 1 if the entry's value had that digest and is deleted (with its accounting), else 0
#: (none, another value, another type). Nothing here is refused when Redis is at
#: maxmemory (only the accounting's DECRBY is, ignored then): a delete frees memory.
_DELETE = """
local sum = redis.pcall('GETRANGE', KEYS[1], ARGV[2], ARGV[3])
if type(sum) ~= 'string' or sum ~= ARGV[1] then return 0 end
local n = redis.pcall('HGET', KEYS[3], KEYS[1])
redis.pcall('ZREM', KEYS[2], KEYS[1])
redis.pcall('HDEL', KEYS[3], KEYS[1])
redis.call('DEL', KEYS[1])
if type(n) == 'string' then redis.pcall('DECRBY', KEYS[4], n) end
return 1
"""

#: KEYS: lru, sizes, total; ARGV: a batch size. Up to that many of the values the tenant's
#: accounting knows of (all that a daemon stored and has not dropped) deleted, with their
#: accounting → how many; -1 once none is left, the accounting itself deleted then. In
#: batches: one script over a tenant's 10^5 small values held Redis for a second, every
#: daemon's L2 call with it, and passed the caller's timeout.
_DROP_TENANT = """
local names = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
local cursor = '0'
while #names == 0 do  -- sizes names none lru does not, but for one edited by hand
  local scan = redis.call('HSCAN', KEYS[2], cursor, 'COUNT', ARGV[1])
  for i = 1, #scan[2], 2 do table.insert(names, scan[2][i]) end
  cursor = scan[1]
  if cursor == '0' then break end
end
if #names == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  return -1
end
redis.call('ZREM', KEYS[1], unpack(names))
redis.call('HDEL', KEYS[2], unpack(names))
return redis.call('DEL', unpack(names))
"""
#: The values one call of :data:`_DROP_TENANT` deletes at most (about a millisecond).
DROP_BATCH = 512
#: A deleted tenant's mark lasts at least this long (ms), and at least the values' TTL.
GONE_MIN_MS = 3_600_000


#: The socket timeout of the calls the current thread makes now (None: the base one).
_call = threading.local()


class _ScaledTimeouts:
    """A mixin of redis-py's connection classes: each command is sent (and its reply
    read) with the timeout its thread set (:func:`_timeout`), else the base one. Python
    bounds a whole ``sendall`` by the socket timeout, so a value that takes longer to
    send than the base timeout needs a longer one."""

    socket_timeout: float | None
    _sock: Any

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect_check_health(check_health=False)  # type: ignore[attr-defined]
        t = getattr(_call, "timeout_s", None)
        self._sock.settimeout(self.socket_timeout if t is None else t)
        super().send_packed_command(command, check_health)  # type: ignore[misc]


@contextlib.contextmanager
def _timeout(seconds: float | None) -> Iterator[None]:
    _call.timeout_s = seconds
    try:
        yield
    finally:
        _call.timeout_s = None


def redact(url: str) -> str:
    """``url`` with its password (and user) replaced by ``***``: what a log may show."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


class RedisL2:
    """One daemon's connection pool to L2 and its scripts."""

    #: what a failed call raises (redis-py's errors; the socket's, to be sure)
    errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)

    def __init__(self, url: str, *, timeout_s: float, connections: int, prefix: str) -> None:
        self.prefix = prefix
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=connections,
            timeout=timeout_s,  # waiting for a free connection counts as slow too
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_keepalive=True,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        base = pool.connection_class
        pool.connection_class = type(f"Scaled{base.__name__}", (_ScaledTimeouts, base), {})
        self._redis = redis.Redis(connection_pool=pool)
        self._account = self._redis.register_script(_ACCOUNT)
        self._forget = self._redis.register_script(_FORGET)
        self._delete = self._redis.register_script(_DELETE)
        self._drop_tenant = self._redis.register_script(_DROP_TENANT)

    def keys(self, tenant_id: str) -> Keys:
        return Keys(self.prefix, tenant_id)

    def store(
        self,
        tenant_id: str,
        key: str,
        value: memoryview,
        *,
        cap: int,
        ttl_ms: int,
        timeout_s: float | None = None,
    ) -> int:
        """Write ``value`` under the tenant's ``key``; how many older values were evicted
        (-1: the value alone is larger than the tenant's ``cap``; ``GONE``: the tenant
        was deleted — either way nothing is left). ``timeout_s``: this call's socket
        timeout (default: the base one)."""
        if len(value) > cap:
            return -1
        k = self.keys(tenant_id)
        entry = k.entry(key)
        with _timeout(timeout_s):
            pipe = self._redis.pipeline(transaction=True)  # MULTI … EXEC: one atomic step
            pipe.set(entry, value, px=ttl_ms)
            self._account(
                keys=[entry, k.lru, k.sizes, k.bytes, k.gone], args=[len(value), cap], client=pipe
            )
            _, evicted = pipe.execute()
        return int(evicted)

    def fetch(
        self, tenant_id: str, keys: list[str], *, max_bytes: int
    ) -> tuple[str, bytes | int | None] | None:
        """Of ``keys`` (short → long), the longest with a value: ``(key, value)``, or
        ``(key, length)`` if the value is longer than ``max_bytes`` (not read), or
        ``(key, None)`` if that key holds another type than a string; ``None`` if none
        has one.

        One round trip when the longest key is the hit: the script that finds the hit
        and the read of the longest key's value (at most ``max_bytes`` of it) go in one
        pipeline. A shorter hit costs a second read. (A script cannot return the value
        itself cheaply: turning 10 MiB into a Lua string and back costs 4× a GET.)
        """
        k = self.keys(tenant_id)
        names = [k.entry(x) for x in keys]
        pipe = self._redis.pipeline(transaction=False)
        pipe.eval(_FIND, 1 + len(names), k.lru, *names)
        pipe.getrange(names[-1], 0, max_bytes - 1)
        # the read fails (WRONGTYPE) when the longest key is not a string: the script
        # says so; any other failure is raised
        found, longest = pipe.execute(raise_on_error=False)
        if isinstance(found, Exception):
            raise found
        if not found:
            return None
        index, length = int(found[0]), int(found[1])
        if length < 0:
            return keys[index - 1], None
        if length > max_bytes:
            return keys[index - 1], length
        if index == len(names):
            if isinstance(longest, Exception):
                raise longest
            return keys[-1], longest
        shorter = self._redis.getrange(names[index - 1], 0, max_bytes - 1)
        return keys[index - 1], cast(bytes, shorter)

    def forget(self, tenant_id: str, key: str) -> None:
        k = self.keys(tenant_id)
        self._forget(keys=[k.entry(key), k.lru, k.sizes, k.bytes])

    def delete(self, tenant_id: str, key: str, digest: bytes) -> bool:
        """Drop the tenant's value of ``key`` if its checksum is ``digest`` (the value this
        daemon wrote); whether it did (False: none, or another value, is there)."""
        k = self.keys(tenant_id)
        return bool(
            self._delete(
                keys=[k.entry(key), k.lru, k.sizes, k.bytes], args=[digest, SUM_AT, HEADER - 1]
            )
        )

    def drop_tenant(self, tenant_id: str, *, ttl_ms: int = 0) -> int:
        """Delete every value of the tenant and its accounting (it was deleted): how many
        values went. In batches of :data:`DROP_BATCH`, each call within the timeout. First
        the tenant is marked gone for ``ttl_ms`` (the values' TTL), at least
        :data:`GONE_MIN_MS`: a store that lands later, from this host or another, is
        undone (:data:`_ACCOUNT`)."""
        k = self.keys(tenant_id)
        self._redis.set(k.gone, b"1", px=max(ttl_ms, GONE_MIN_MS))
        dropped = 0
        while (n := int(self._drop_tenant(keys=[k.lru, k.sizes, k.bytes], args=[DROP_BATCH]))) >= 0:
            dropped += n
        return dropped

    def ping(self, timeout_s: float | None = None) -> None:
        with _timeout(timeout_s):
            self._redis.ping()

    def close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()
