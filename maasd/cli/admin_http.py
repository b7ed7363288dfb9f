"""The thin REST layer of ``maasctl``: httpx, problem details, one-line errors.

``maasctl`` owns no state and touches no database or memory: every command is
one or a few calls to the routes of SPEC §4 through :class:`AdminApi`. Every
failure — a problem+json answer, a refused connection, a timeout, a reply that
is not JSON — becomes a :class:`CliError`, a ``click.ClickException`` whose
``show()`` prints a single line to stderr, so no traceback ever reaches the
user.

(``maasd.client.Client`` serves workers; this module stays separate so the
admin CLI depends on nothing but the wire format.)
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any
from urllib.parse import quote

import click
import httpx

__all__ = ["AdminApi", "ApiError", "CliError", "ConnectionFailed", "NotFoundLocally"]

DEFAULT_URL = "http://127.0.0.1:7878"

#: Exit codes: 1 the daemon refused the request, 2 bad usage (click's own),
#: 3 the daemon could not be reached at all.
EXIT_API = 1
EXIT_USAGE = 2
EXIT_CONNECTION = 3


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class CliError(click.ClickException):
    """A failure to show as one line on stderr, then exit non-zero."""

    exit_code = EXIT_API

    def __init__(self, title: str, detail: str = "", *, hint: str = "") -> None:
        self.title = _one_line(title)
        self.detail = _one_line(detail)
        self.hint = _one_line(hint)
        super().__init__(self.line())

    def line(self) -> str:
        out = self.title
        if self.detail and self.detail != self.title:
            out += f": {self.detail}"
        if self.hint:
            out += f" ({self.hint})"
        return out

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"maasctl: error: {self.line()}", file=file if file is not None else sys.stderr)


class ApiError(CliError):
    """The daemon answered with an error status (problem details when it sent them)."""

    def __init__(
        self, status: int, title: str, detail: str = "", *, type_: str = "", hint: str = ""
    ) -> None:
        self.status = status
        self.type = type_
        super().__init__(f"{title} [{status}]", detail, hint=hint)


class NotFoundLocally(CliError):
    """A NAME|ID that matches nothing the daemon listed."""


class ConnectionFailed(CliError):
    """The daemon could not be reached (refused, DNS, timeout, bad URL)."""

    exit_code = EXIT_CONNECTION


_HINTS = {
    401: "check --key or MAASD_ADMIN_KEY; tenant commands use MAASD_KEY",
}


def _problem(response: httpx.Response) -> ApiError:
    status = response.status_code
    title = response.reason_phrase or f"HTTP {status}"
    detail = ""
    type_ = ""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        body = None
    if isinstance(body, dict):
        title = str(body.get("title") or title)
        raw_detail = body.get("detail")
        if raw_detail is None and "extra" in body:  # litestar's default shape, just in case
            raw_detail = body.get("extra")
        detail = (
            raw_detail
            if isinstance(raw_detail, str)
            else (json.dumps(raw_detail) if raw_detail is not None else "")
        )
        type_ = str(body.get("type") or "")
    elif response.content:
        detail = response.text[:300]
    return ApiError(status, title, detail, type_=type_, hint=_HINTS.get(status, ""))


def _connect_reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    low = text.lower()
    if "connection refused" in low or "errno 111" in low:
        return "connection refused"
    if "name or service not known" in low or "nodename nor servname" in low:
        return "unknown host"
    return _one_line(text)


class AdminApi:
    """Synchronous calls to the maasd REST API with one key.

    Every method returns the decoded JSON body exactly as the daemon sent it
    (``None`` for 204) and raises :class:`CliError` on any failure.

    >>> api = AdminApi("http://127.0.0.1:7878", "admin-key")   # doctest: +SKIP
    >>> [p["name"] for p in api.pools()]                        # doctest: +SKIP
    ['node0']
    """

    def __init__(self, url: str, key: str | None, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout = timeout
        headers = {"Accept": "application/json", "User-Agent": "maasctl"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError, TypeError) as exc:
            raise ConnectionFailed(f"invalid URL {url!r}", _one_line(str(exc))) from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------

    def send(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """One request; error statuses raise :class:`ApiError`."""
        try:
            response = self._http.request(
                method,
                path,
                json=json_body,
                params=params,
                timeout=timeout if timeout is not None else self.timeout,
            )
        except httpx.TimeoutException:
            raise ConnectionFailed(
                f"no answer from {self.url}",
                f"{method} {path} timed out after {timeout or self.timeout:g}s",
                hint="is maasd overloaded? raise --timeout",
            ) from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise ConnectionFailed(f"invalid URL {self.url!r}", str(exc)) from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.NetworkError) as exc:
            raise ConnectionFailed(
                f"cannot reach maasd at {self.url}",
                _connect_reason(exc),
                hint="is the daemon running? set --url or MAASD_URL",
            ) from None
        except httpx.HTTPError as exc:
            raise ConnectionFailed(f"request to {self.url} failed", str(exc)) from None
        if response.status_code >= 400:
            raise _problem(response)
        return response

    def call(self, method: str, path: str, **kw: Any) -> Any:
        """One request, decoded: the JSON body, or ``None`` for an empty answer."""
        response = self.send(method, path, **kw)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise CliError(
                "unexpected answer from maasd",
                f"{method} {path} returned {response.status_code} but not JSON: "
                f"{response.text[:120]!r}",
            ) from None

    # -- routes (SPEC §4) ---------------------------------------------------

    def healthz(self) -> Any:
        return self.call("GET", "/healthz")

    def metrics_text(self) -> str:
        return self.send("GET", "/metrics").text

    def topology(self) -> Any:
        return self.call("GET", "/v1/topology")

    def pools(self) -> Any:
        return self.call("GET", "/v1/pools")

    def pool(self, pool_id: str) -> Any:
        return self.call("GET", f"/v1/pools/{_seg(pool_id)}")

    def create_pool(self, body: dict[str, Any]) -> Any:
        return self.call("POST", "/v1/pools", json_body=body)

    def delete_pool(self, pool_id: str, *, drain: bool = False) -> Any:
        params = {"drain": "true"} if drain else None
        return self.call("DELETE", f"/v1/pools/{_seg(pool_id)}", params=params)

    def tenants(self) -> Any:
        return self.call("GET", "/v1/tenants")

    def tenant(self, tenant_id: str) -> Any:
        return self.call("GET", f"/v1/tenants/{_seg(tenant_id)}")

    def create_tenant(self, name: str, quota_bytes: int) -> Any:
        return self.call(
            "POST", "/v1/tenants", json_body={"name": name, "quota_bytes": quota_bytes}
        )

    def set_quota(self, tenant_id: str, quota_bytes: int) -> Any:
        return self.call(
            "PATCH", f"/v1/tenants/{_seg(tenant_id)}", json_body={"quota_bytes": quota_bytes}
        )

    def delete_tenant(self, tenant_id: str) -> Any:
        return self.call("DELETE", f"/v1/tenants/{_seg(tenant_id)}")

    def issue_key(self, tenant_id: str) -> Any:
        return self.call("POST", f"/v1/tenants/{_seg(tenant_id)}/keys")

    def revoke_key(self, tenant_id: str, key_id: str) -> Any:
        return self.call("DELETE", f"/v1/tenants/{_seg(tenant_id)}/keys/{_seg(key_id)}")

    def usage(self) -> Any:
        return self.call("GET", "/v1/usage")

    def events(self, limit: int, tenant_id: str | None = None, before: int | None = None) -> Any:
        params: dict[str, Any] = {"limit": limit}
        if tenant_id:
            params["tenant_id"] = tenant_id
        if before is not None:
            params["before"] = before
        return self.call("GET", "/v1/events", params=params)

    def buffers(self, tenant_id: str | None = None) -> Any:
        params = {"tenant_id": tenant_id} if tenant_id else None
        return self.call("GET", "/v1/buffers", params=params)

    def buffer(self, buffer_id: str) -> Any:
        return self.call("GET", f"/v1/buffers/{_seg(buffer_id)}")

    def release_buffer(self, buffer_id: str) -> Any:
        return self.call("DELETE", f"/v1/buffers/{_seg(buffer_id)}")


def _seg(value: str) -> str:
    """Quote one path segment, so an argument like ``a/b`` stays one segment."""
    if value.strip() in ("", ".", ".."):
        raise CliError("invalid id", f"{value!r} is not an id")
    return quote(value, safe="")
