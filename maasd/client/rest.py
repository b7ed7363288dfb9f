"""``Client``: the REST control plane (docs/api.md) over a synchronous ``httpx.Client``.

Example::

    from maasd.client import Client, QuotaExceeded

    with Client("http://127.0.0.1:7878", api_key) as c:
        buf = c.reserve(size_bytes=64 << 20, pool="node0", ttl_s=600, key="model:abc")
        c.renew(buf.id, ttl_s=1200)
        hit = c.lookup(["model:a", "model:abc"])     # Buffer | None
        c.release(buf.id)

Every method returns frozen msgspec Structs from :mod:`maasd.client.types`
and raises the typed exceptions of :mod:`maasd.client.errors`. Ids and names
go into the URL as exactly one path segment each, or are refused
(:class:`~maasd.client.errors.InvalidReference`) before anything is sent.
"""

from __future__ import annotations

import contextlib
import json as jsonlib
import math
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, Literal, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from maasd.bounds import DEFAULT_TTL_S, Persistence
from maasd.client.errors import (
    ConnectionFailed,
    InvalidReference,
    MaasdClientError,
    NotFound,
    ProtocolError,
    error_from_problem,
)
from maasd.client.types import (
    Buffer,
    Checkpoint,
    Event,
    Health,
    Host,
    KeyInfo,
    LookupHit,
    NewTenant,
    Pool,
    Tenant,
    Topology,
    Usage,
)

__all__ = ["VOLATILE_UNLESS_POOL", "Client", "raw_json"]


class _VolatileUnlessPool(str):
    """``Client.reserve``'s default ``persistence``: ``"volatile"`` where the daemon picks
    the pool (SPEC §6), the named pool's own where one is named."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'volatile' (a named pool: its own)"


#: ``Client.reserve``'s default persistence (see :class:`_VolatileUnlessPool`).
VOLATILE_UNLESS_POOL: Any = _VolatileUnlessPool("volatile")

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()

#: How many pool names a "no pool" error lists before it says "… and N more".
_POOL_NAMES_SHOWN = 20


def _seg(value: str) -> str:
    """One URL path segment for an id or name: it can never reach another route.

    ``quote`` leaves dots alone, and httpx normalises ``.``/``..`` segments away
    (``/v1/buffers/..`` becomes ``/v1``); the daemon's server decodes ``%2F`` back
    into ``/`` before routing (``tenants/<id>%2Fkeys%2F<key>`` *is* the revoke route).
    So those are refused here, and everything else is percent-encoded.
    """
    if not isinstance(value, str):
        raise TypeError(f"an id or name must be a str, got {type(value).__name__}")
    if value in ("", ".", "..") or "/" in value:
        raise InvalidReference(
            f"{value!r} is not a valid id or name (empty, '.', '..' or containing '/')"
        )
    return quote(value, safe="")


def raw_json(response: httpx.Response) -> Any:
    """The JSON body of ``response`` exactly as the daemon sent it; ``None`` for an empty one."""
    if response.status_code == 204 or not response.content:
        return None
    try:
        return jsonlib.loads(response.content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not JSON: {response.text[:120]!r}", response.status_code) from exc


def _problem_of(resp: httpx.Response) -> dict[str, Any]:
    """The problem details of an error answer; a proxy's HTML page or an empty body
    still gives a title (the reason phrase) and a detail (the start of the text)."""
    try:
        problem = msgspec.json.decode(resp.content) if resp.content else {}
    except msgspec.DecodeError:
        problem = None
    if not isinstance(problem, dict):
        problem = {"detail": resp.text[:500]} if resp.content else {}
    if not isinstance(problem.get("title"), str):
        problem["title"] = resp.reason_phrase or f"HTTP {resp.status_code}"
    return problem


class _Http:
    """The transport under :class:`Client`: one request, typed errors, capture of answers."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "maasd-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        try:
            self._http = httpx.Client(
                base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
            )
        except (httpx.InvalidURL, TypeError) as exc:
            raise ValueError(f"invalid base_url {base_url!r}: {exc}") from None
        self._local = threading.local()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def responses(self) -> Iterator[list[httpx.Response]]:
        """Collect the responses this thread receives inside the block, in order.

        For tools that show the daemon's answer as it was sent (``maasctl --json``)
        while still calling the typed methods::

            with client.responses() as seen:
                tenant = client.tenant("acme")
            print(raw_json(seen[-1]))
        """
        sinks: list[list[httpx.Response]] = self._local.__dict__.setdefault("sinks", [])
        seen: list[httpx.Response] = []
        sinks.append(seen)
        try:
            yield seen
        finally:
            sinks.pop()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        answers: Collection[int] = (),
    ) -> httpx.Response:
        """Send one request; return the response if its status is < 400 or in ``answers``
        (a status that is an answer, not a problem), else raise.

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
            raise ConnectionFailed(
                f"{method} {path} timed out after {self.timeout:g}s ({type(exc).__name__})",
                timed_out=True,
            ) from exc
        except httpx.InvalidURL as exc:
            raise ValueError(f"{method} {path}: invalid URL: {exc}") from exc
        except (httpx.TransportError, OSError) as exc:
            raise ConnectionFailed(f"{method} {path}: {exc}") from exc
        for sink in self._local.__dict__.get("sinks", ()):
            sink.append(resp)
        if resp.status_code >= 400 and resp.status_code not in answers:
            raise error_from_problem(resp.status_code, _problem_of(resp))
        return resp

    def _call(self, method: str, path: str, type: type[T], **kw: Any) -> T:
        resp = self.request(method, path, **kw)
        try:
            return msgspec.json.decode(resp.content, type=type)
        except msgspec.DecodeError as exc:
            raise ProtocolError(
                f"{method} {path}: unexpected answer: {exc}", resp.status_code
            ) from exc


@contextlib.contextmanager
def _pool_not_found(pools: Callable[[], list[Pool]], pool: str) -> Iterator[None]:
    """Turn a 404 for ``pool`` into one that lists the known pools (``no pool 'x';
    pools: node0, fast``), so a typo is fixed without another command."""
    try:
        yield
    except NotFound as exc:
        try:
            known_pools = pools()
        except MaasdClientError:  # the listing is a courtesy; the 404 is the answer
            raise exc from None
        if any(pool in (p.id, p.name) for p in known_pools):
            raise  # it exists (again): this 404 was about something else, or a race
        names = sorted({p.name for p in known_pools})  # the admin sees each host's node0
        known = ", ".join(names[:_POOL_NAMES_SHOWN]) if names else "(none)"
        if len(names) > _POOL_NAMES_SHOWN:
            known += f" … and {len(names) - _POOL_NAMES_SHOWN} more"
        detail = f"no pool {pool!r}; pools: {known}"
        problem = {**exc.problem, "detail": detail}
        raise NotFound(exc.status, exc.title, detail, exc.type, problem) from None


class Client(_Http):
    """Synchronous REST client; one instance per key, usable from several threads.

    ``base_url`` is the daemon's REST address, ``api_key`` a tenant key or the
    admin key (``None``: no key, for ``/healthz`` and a public ``/metrics``).
    Transport failures raise :class:`~maasd.client.errors.ConnectionFailed`;
    error answers raise the typed exception of their status and problem ``type``.
    Wherever a pool or a tenant is asked for, its id or its name works: the
    daemon resolves it (an id wins over a name that looks like one).
    """

    # --- anyone ----------------------------------------------------------------

    def health(self) -> Health:
        """``GET /healthz``: the daemon's health, healthy (200) or not (503) alike.

        >>> h = c.health()                                        # doctest: +SKIP
        >>> h.ok, {n: x.detail for n, x in h.components.items() if not x.ok}  # doctest: +SKIP
        (False, {'broker': 'the accept thread died'})
        """
        return self._call("GET", "/healthz", Health, answers=(503,))

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        return self.request("GET", "/metrics").text

    # --- any key ---------------------------------------------------------------

    def topology(self) -> Topology:
        return self._call("GET", "/v1/topology", Topology)

    def pools(self) -> list[Pool]:
        """The daemon's pools; with the admin key, every host's (each names its ``host``)."""
        return self._call("GET", "/v1/pools", list[Pool])

    def pool(self, pool: str) -> Pool:
        """One pool by id or name; :class:`NotFound` names the pools there are."""
        with _pool_not_found(self.pools, pool):
            return self._call("GET", f"/v1/pools/{_seg(pool)}", Pool)

    def pool_id(self, pool: str) -> str:
        """The id of the pool with this id or name (one ``GET /v1/pools/{pool}``)."""
        return self.pool(pool).id

    # --- tenant ----------------------------------------------------------------

    def reserve(
        self,
        size_bytes: int | None = None,
        *,
        size_gb: float | None = None,
        pool: str | None = None,
        persistence: Persistence | None = VOLATILE_UNLESS_POOL,
        latency_us: float | None = None,
        latency_source: Literal["declared", "measured"] | None = None,
        ttl_s: int = DEFAULT_TTL_S,
        label: str | None = None,
        key: str | None = None,
        evictable: bool = False,
        numa_node: int | None = None,
    ) -> Buffer:
        """Reserve a buffer: in ``pool`` (id or name) if given, else wherever the QoS fits.

        ``persistence``: ``"volatile"`` unless given — where the daemon picks the pool; a
        named ``pool`` is taken with its own unless ``persistence`` is given (then it must
        match). ``None``: any pool, volatile or persistent.
        Give exactly one of ``size_bytes`` and ``size_gb`` (the daemon checks).
        ``numa_node`` only applies without ``pool``. ``latency_source="measured"`` holds
        ``latency_us`` to the pools' measured class instead of the declared one.

        >>> buf = c.reserve(size_bytes=64 << 20, latency_us=5, key="m:prefix")  # doctest: +SKIP
        """
        if persistence is VOLATILE_UNLESS_POOL:
            persistence = "volatile" if pool is None else None
        for name, number in (("size_gb", size_gb), ("latency_us", latency_us)):
            # JSON has no NaN or infinity: encoded as null, latency_us=nan meant no ceiling
            if number is not None and not math.isfinite(number):
                raise ValueError(f"{name} must be a finite number, got {number!r}")
        body: dict[str, Any] = {"ttl_s": ttl_s, "evictable": evictable}
        for name, value in (
            ("size_bytes", size_bytes),
            ("size_gb", size_gb),
            ("persistence", persistence),
            ("latency_us", latency_us),
            ("latency_source", latency_source),
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
        with _pool_not_found(self.pools, pool):
            return self._call("POST", f"/v1/pools/{_seg(pool)}/reserve", Buffer, json=body)

    def buffer(self, buffer_id: str) -> Buffer:
        return self._call("GET", f"/v1/buffers/{_seg(buffer_id)}", Buffer)

    def buffers(self, tenant_id: str | None = None, *, held: bool = False) -> list[Buffer]:
        """The caller's buffers (admin: all, or the tenant's with ``tenant_id``, id or name);
        ``held`` (admin): released entries some process still holds, with ``holder_pids``."""
        params: dict[str, str] = {} if tenant_id is None else {"tenant_id": tenant_id}
        if held:
            params["held"] = "true"
        return self._call("GET", "/v1/buffers", list[Buffer], params=params or None)

    def pin(self, buffer_id: str, numa_node: int) -> Buffer:
        """Bind and migrate the buffer's pages to ``numa_node``; the answer has ``placement``."""
        return self._call(
            "PATCH", f"/v1/buffers/{_seg(buffer_id)}/pin", Buffer, json={"numa_node": numa_node}
        )

    def renew(self, buffer_id: str, ttl_s: int = DEFAULT_TTL_S) -> Buffer:
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

    def create_tenant(
        self, name: str, quota_bytes: int, disk_quota_bytes: int | None = None
    ) -> NewTenant:
        """A new tenant and its first key: ``.id`` is the tenant's, ``.key_id`` the key's.
        ``disk_quota_bytes`` ``None``: the daemon's default (``disk_quota_factor`` × quota)."""
        body: dict[str, object] = {"name": name, "quota_bytes": quota_bytes}
        if disk_quota_bytes is not None:
            body["disk_quota_bytes"] = disk_quota_bytes
        return self._call("POST", "/v1/tenants", NewTenant, json=body)

    def tenants(self) -> list[Tenant]:
        return self._call("GET", "/v1/tenants", list[Tenant])

    def tenant(self, tenant: str) -> Tenant:
        """One tenant by id or name."""
        return self._call("GET", f"/v1/tenants/{_seg(tenant)}", Tenant)

    def set_quota(self, tenant: str, quota_bytes: int) -> Tenant:
        return self.update_tenant(tenant, quota_bytes=quota_bytes)

    def set_max_buffers(self, tenant: str, max_buffers: int) -> Tenant:
        """Cap the tenant's buffers (entries included); at the cap a reserve first evicts
        its evictable ones, then answers 409 ``BufferCountExceeded``."""
        return self.update_tenant(tenant, max_buffers=max_buffers)

    def set_disk_quota(self, tenant: str, disk_quota_bytes: int) -> Tenant:
        """Bound the tenant's bytes on the disk tiers (from its next demotion on)."""
        return self.update_tenant(tenant, disk_quota_bytes=disk_quota_bytes)

    def update_tenant(
        self,
        tenant: str,
        *,
        quota_bytes: int | None = None,
        max_buffers: int | None = None,
        disk_quota_bytes: int | None = None,
    ) -> Tenant:
        """``PATCH /v1/tenants/{tenant}``: the quota, the buffer cap, the disk quota (any
        of them at once)."""
        body = {
            k: v
            for k, v in (
                ("quota_bytes", quota_bytes),
                ("max_buffers", max_buffers),
                ("disk_quota_bytes", disk_quota_bytes),
            )
            if v is not None
        }
        if not body:
            raise ValueError("give quota_bytes, max_buffers or disk_quota_bytes")
        return self._call("PATCH", f"/v1/tenants/{_seg(tenant)}", Tenant, json=body)

    def delete_tenant(self, tenant: str) -> None:
        """Revoke its keys, release (scrub) all its buffers, forget it."""
        self.request("DELETE", f"/v1/tenants/{_seg(tenant)}")

    def issue_key(self, tenant: str) -> KeyInfo:
        """A further API key for the tenant: ``.id`` is the key's id, ``.api_key`` the key."""
        return self._call("POST", f"/v1/tenants/{_seg(tenant)}/keys", KeyInfo)

    def revoke_key(self, tenant: str, key_id: str) -> None:
        self.request("DELETE", f"/v1/tenants/{_seg(tenant)}/keys/{_seg(key_id)}")

    def events(
        self, limit: int = 100, tenant_id: str | None = None, before: int | None = None
    ) -> list[Event]:
        """The audit trail, newest first: at most ``limit`` (1…1000) events, only the
        tenant's (id or name) when given, only those older than event id ``before``."""
        params: dict[str, Any] = {"limit": limit}
        if tenant_id is not None:
            params["tenant_id"] = tenant_id
        if before is not None:
            params["before"] = before
        return self._call("GET", "/v1/events", list[Event], params=params)

    def hosts(self) -> list[Host]:
        """The daemon hosts sharing the ledger, with their heartbeat and use (docs/scale-out.md)."""
        return self._call("GET", "/v1/hosts", list[Host])

    def forget_host(self, host: str) -> None:
        """Forget a host that is not serving: its buffers stop counting, its pools go.

        :class:`~maasd.client.errors.Conflict` while the host still beats (or is
        the daemon asked); see docs/scale-out.md.
        """
        self.request("DELETE", f"/v1/hosts/{_seg(host)}")

    def create_pool(self, **fields: Any) -> Pool:
        """``POST /v1/pools`` with the pool fields of docs/api.md (``name``, ``numa_node``, …)."""
        return self._call("POST", "/v1/pools", Pool, json=fields)

    def delete_pool(self, pool: str, drain: bool = False) -> None:
        """Delete an empty pool (id or name); ``drain`` releases (scrubs) its buffers first."""
        params = {"drain": "true"} if drain else None
        with _pool_not_found(self.pools, pool):
            self.request("DELETE", f"/v1/pools/{_seg(pool)}", params=params)
