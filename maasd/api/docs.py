"""The API page: Swagger UI at ``/docs`` over ``/schema/openapi.json``, with no network.

litestar's UI plugins load their JavaScript and fonts from public CDNs, which a node
agent behind a firewall cannot reach; so the page here loads only what the daemon
serves itself: Swagger UI's bundle and stylesheet (shipped in ``maasd/api/swagger_ui/``,
updated with ``scripts/vendor-swagger-ui``), a small init script, and the schema. Its
``Content-Security-Policy`` allows nothing from anywhere else, so a reference to a CDN
would fail loudly rather than leak a request.

Routes (none in the schema, none needs a key; "Authorize" takes a bearer key for
"Try it out")::

    GET /                      → 302 /docs
    GET /docs                  the page (links /schema/openapi.json)
    GET /docs/assets/{file}    Swagger UI's files and the init script
    GET /schema/openapi.json   the schema (litestar's own route; the only render plugin)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Response, get
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

from maasd import __version__

__all__ = ["ASSETS", "ROUTES", "SCHEMA_PLUGINS"]

#: Swagger UI's files, as ``scripts/vendor-swagger-ui`` left them.
ASSETS = Path(__file__).resolve().parent / "swagger_ui"

#: What ``/schema`` serves: the JSON document only (no CDN-backed UI).
SCHEMA_PLUGINS = [JsonRenderPlugin()]

#: Only this origin; inline styles are Swagger UI's own, ``data:`` images its icons.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)

_PAGE = f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>maasd {__version__} API</title>
  <meta name="viewport" content="width=device-width, initial-scale=1">
  <link rel="icon" type="image/png" href="/docs/assets/favicon-32x32.png">
  <link rel="stylesheet" href="/docs/assets/swagger-ui.css">
  <style>
    body {{ margin: 0; }}
    header {{ font-family: sans-serif; padding: 10px 20px; background: #1b1f24; color: #eee; }}
    header a {{ color: #9cdcfe; margin-left: 1.5em; }}
  </style>
</head>
<body>
  <header>
    <strong>maasd {__version__}</strong> — memory as a service
    <a href="/schema/openapi.json">/schema/openapi.json</a>
    <a href="/healthz">/healthz</a>
  </header>
  <div id="swagger-ui"></div>
  <script src="/docs/assets/swagger-ui-bundle.js"></script>
  <script src="/docs/assets/init.js"></script>
</body>
</html>
"""

_INIT = """window.ui = SwaggerUIBundle({
  url: "/schema/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  persistAuthorization: false,
  displayRequestDuration: true,
  docExpansion: "list",
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout"
});
"""


@get("/", include_in_schema=False, sync_to_thread=False)
def root() -> Redirect:
    return Redirect("/docs", status_code=302)


@get("/docs", include_in_schema=False, sync_to_thread=False)
def page() -> Response[str]:
    return Response(
        _PAGE,
        media_type="text/html",
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )


@get("/docs/assets/init.js", include_in_schema=False, sync_to_thread=False)
def init_js() -> Response[str]:
    return Response(_INIT, media_type="text/javascript")


_assets = create_static_files_router(
    path="/docs/assets",
    directories=[ASSETS],
    include_in_schema=False,
    send_as_attachment=False,
    name="docs-assets",
)

#: The handlers to mount on the app: ``route_handlers=[..., *docs.ROUTES]``.
ROUTES: list[Any] = [root, page, init_js, _assets]
