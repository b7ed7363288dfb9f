"""``Client``: the REST control plane of SPEC §4 over a synchronous ``httpx.Client``.

Example::

    from maasd.client import Client, QuotaExceeded

    with Client("http://127.0.0.1:7878", api_key) as c:
        buf = c.reserve(size_bytes=64 << 20, pool="node0", ttl_s=600, key="model:abc")
        c.renew(buf.id, ttl_s=1200)
        hit = c.lookup(["model:a", "model:abc"])     # Buffer | None
        c.release(buf.id)

Every method returns frozen msgspec Structs from :mod:`maasd.client.types`
and raises the typed exceptions of :mod:`maasd.client.errors`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from maasd.client.errors import ConnectionFailed, NotFound, ProtocolError, error_from_problem
from maasd.client.types import (
    Buffer,
    Checkpoint,
    Health,
    KeyInfo,
    LookupHit,
    NewTenant,
    Pool,
    Tenant,
    Topology,
    Usage,
)

__all__ = ["Client"]

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()


def _seg(value: str) -> str:
    """One URL path segment: an id can never reach another route."""
    return quote(str(value), safe="")


class Client:
    """Synchronous REST client; one instance per key, usable from several threads.

    ``base_url`` is the daemon's REST address, ``api_key`` a tenant key or the
    admin key. Transport failures raise :class:`~maasd.client.errors.ConnectionFailed`;
    error answers raise the typed exception of their status and problem ``type``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )
        self._pool_lock = threading.Lock()
        self._pool_ids: dict[str, str] | None = None  # id or name -> id

    # --- plumbing --------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request; return the response if its status is < 400, else raise.

        ``json`` is encoded with msgspec; ``content`` sends raw bytes (as JSON
        unless ``headers`` says otherwise) — handy for testing malformed bodies.
        """
        hdrs = dict(headers or {})
        if json is not None:
            content = _json_encoder.encode(json)
        if content is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            resp = self._http.request(method, path, content=content, params=params, headers=hdrs)
        except httpx.TimeoutException as exc:
            raise ConnectionFailed(f"{method} {path}: timed out ({exc})") from exc
        except (httpx.TransportError, OSError) as exc:
            raise ConnectionFailed(f"{method} {path}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                problem = msgspec.json.decode(resp.content) if resp.content else {}
            except msgspec.DecodeError:
                problem = {"detail": resp.text[:500]}
            raise error_from_problem(resp.status_code, problem)
        return resp

    def _call(self, method: str, path: str, type: type[T], **kw: Any) -> T:
        resp = self.request(method, path, **kw)
        try:
            return msgspec.json.decode(resp.content, type=type)
        except msgspec.DecodeError as exc:
            raise ProtocolError(
                f"{method} {path}: unexpected answer: {exc}", resp.status_code
            ) from exc

    # --- anyone ----------------------------------------------------------------

    def health(self) -> Health:
        """``GET /healthz``."""
        return self._call("GET", "/healthz", Health)

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        return self.request("GET", "/metrics").text

    # --- tenant ----------------------------------------------------------------

    def topology(self) -> Topology:
        return self._call("GET", "/v1/topology", Topology)

    def pools(self) -> list[Pool]:
        pools = self._call("GET", "/v1/pools", list[Pool])
        with self._pool_lock:
            ids: dict[str, str] = {}
            for p in pools:
                ids[p.name] = p.id
            for p in pools:
                ids[p.id] = p.id  # an id wins over a pool *named* like another's id
            self._pool_ids = ids
        return pools

    def pool_id(self, pool: str) -> str:
        """Resolve a pool id or name to its id (``GET /v1/pools`` once, cached; refreshed on a miss)."""
        with self._pool_lock:
            cached = self._pool_ids.get(pool) if self._pool_ids is not None else None
        if cached is not None:
            return cached
        self.pools()
        with self._pool_lock:
            assert self._pool_ids is not None
            found = self._pool_ids.get(pool)
        if found is None:
            raise NotFound(404, "Not found", f"no pool with id or name {pool!r}", "about:blank")
        return found

    def reserve(
        self,
        size_bytes: int | None = None,
        *,
        size_gb: float | None = None,
        pool: str | None = None,
        persistence: str | None = None,
        latency_us: int | None = None,
        ttl_s: int = 600,
        label: str | None = None,
        key: str | None = None,
        evictable: bool = False,
        numa_node: int | None = None,
    ) -> Buffer:
        """Reserve a buffer: in ``pool`` (id or name) if given, else wherever the QoS fits.

        Give exactly one of ``size_bytes`` and ``size_gb`` (the daemon checks).
        ``numa_node`` only applies without ``pool``.

        >>> buf = c.reserve(size_bytes=64 << 20, latency_us=5, key="m:prefix")  # doctest: +SKIP
        """
        body: dict[str, Any] = {"ttl_s": ttl_s, "evictable": evictable}
        for name, value in (
            ("size_bytes", size_bytes),
            ("size_gb", size_gb),
            ("persistence", persistence),
            ("latency_us", latency_us),
            ("label", label),
            ("key", key),
        ):
            if value is not None:
                body[name] = value
        if pool is None:
            if numa_node is not None:
                body["numa_node"] = numa_node
            return self._call("POST", "/v1/reserve", Buffer, json=body)
        if numa_node is not None:
            raise ValueError("numa_node applies only without pool (the pool fixes the node)")
        pool_id = self.pool_id(pool)
        try:
            return self._call("POST", f"/v1/pools/{_seg(pool_id)}/reserve", Buffer, json=body)
        except NotFound:
            # The cached name may point at a pool deleted (and re-created) since.
            with self._pool_lock:
                self._pool_ids = None
            fresh = self.pool_id(pool)
            if fresh == pool_id:
                raise
            return self._call("POST", f"/v1/pools/{_seg(fresh)}/reserve", Buffer, json=body)

    def buffer(self, buffer_id: str) -> Buffer:
        return self._call("GET", f"/v1/buffers/{_seg(buffer_id)}", Buffer)

    def buffers(self, tenant_id: str | None = None) -> list[Buffer]:
        """The caller's buffers (admin: all, or ``tenant_id``'s)."""
        params = {"tenant_id": tenant_id} if tenant_id is not None else None
        return self._call("GET", "/v1/buffers", list[Buffer], params=params)

    def pin(self, buffer_id: str, numa_node: int) -> Buffer:
        """Bind and migrate the buffer's pages to ``numa_node``; the answer has ``placement``."""
        return self._call(
            "PATCH", f"/v1/buffers/{_seg(buffer_id)}/pin", Buffer, json={"numa_node": numa_node}
        )

    def renew(self, buffer_id: str, ttl_s: int = 600) -> Buffer:
        return self._call(
            "POST", f"/v1/buffers/{_seg(buffer_id)}/renew", Buffer, json={"ttl_s": ttl_s}
        )

    def checkpoint(self, buffer_id: str) -> Checkpoint:
        """Persistent buffers only (409 ``StateConflict`` for volatile ones)."""
        return self._call("POST", f"/v1/buffers/{_seg(buffer_id)}/checkpoint", Checkpoint)

    def release(self, buffer_id: str) -> None:
        """Scrub then free; returns once the bytes read zero."""
        self.request("DELETE", f"/v1/buffers/{_seg(buffer_id)}")

    def usage(self) -> Usage:
        return self._call("GET", "/v1/usage", Usage)

    def lookup_hit(self, keys: Iterable[str]) -> LookupHit | None:
        """Like :meth:`lookup` but also says which key matched."""
        try:
            return self._call("POST", "/v1/buffers/lookup", LookupHit, json={"keys": list(keys)})
        except NotFound:
            return None

    def lookup(self, keys: Iterable[str]) -> Buffer | None:
        """The live buffer of the longest of ``keys`` (ordered short → long), or ``None``."""
        hit = self.lookup_hit(keys)
        return hit.buffer if hit is not None else None

    # --- admin -----------------------------------------------------------------

    def create_tenant(self, name: str, quota_bytes: int) -> NewTenant:
        return self._call(
            "POST", "/v1/tenants", NewTenant, json={"name": name, "quota_bytes": quota_bytes}
        )

    def tenants(self) -> list[Tenant]:
        return self._call("GET", "/v1/tenants", list[Tenant])

    def tenant(self, tenant_id: str) -> Tenant:
        return self._call("GET", f"/v1/tenants/{_seg(tenant_id)}", Tenant)

    def set_quota(self, tenant_id: str, quota_bytes: int) -> Tenant:
        return self._call(
            "PATCH", f"/v1/tenants/{_seg(tenant_id)}", Tenant, json={"quota_bytes": quota_bytes}
        )

    def delete_tenant(self, tenant_id: str) -> None:
        self.request("DELETE", f"/v1/tenants/{_seg(tenant_id)}")

    def issue_key(self, tenant_id: str) -> KeyInfo:
        return self._call("POST", f"/v1/tenants/{_seg(tenant_id)}/keys", KeyInfo)

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        self.request("DELETE", f"/v1/tenants/{_seg(tenant_id)}/keys/{_seg(key_id)}")

    def create_pool(self, **fields: Any) -> Pool:
        """``POST /v1/pools`` with the pool fields of SPEC §1 (``name``, ``numa_node``, …)."""
        pool = self._call("POST", "/v1/pools", Pool, json=fields)
        with self._pool_lock:
            self._pool_ids = None
        return pool

    def delete_pool(self, pool_id: str, drain: bool = False) -> None:
        params = {"drain": "true"} if drain else None
        self.request("DELETE", f"/v1/pools/{_seg(self.pool_id(pool_id))}", params=params)
        with self._pool_lock:
            self._pool_ids = None
