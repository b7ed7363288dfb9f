"""The API page (/docs) works with no network: Swagger UI from the daemon's own files.

Over HTTP: the page, its assets and its Content-Security-Policy. In a real headless
Chromium (Debian's ``chromium``) that can reach nothing but 127.0.0.1: the page renders
the routes (the reserve route among them) and loads nothing from anywhere else — read
from Chromium's own network log — and a screenshot is kept for a person to look at.

The network log also holds what the browser asks for itself (its component updater asks
``update.googleapis.com`` whatever the flags, depending on the build), so a request
counts as the page's by its initiator — the origin whose document asked for it — not by
its URL; a page that loads from a CDN is caught (the last test shows it). The page's
CSP refuses such a load first, before any request; this is the check for a page whose
CSP would let one through.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Daemon
from maasd.api.docs import ASSETS

chromium = shutil.which("chromium") or shutil.which("chromium-browser")


def test_root_redirects_to_the_page_which_links_the_schema(daemon: Daemon) -> None:
    r = httpx.get(f"{daemon.url}/", follow_redirects=False)
    assert r.status_code == 302
    assert r.headers["location"] == "/docs"
    page = httpx.get(f"{daemon.url}/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'href="/schema/openapi.json"' in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'self'" in csp
    # every script, stylesheet and image is the daemon's own
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs
    assert all(ref.startswith("/") for ref in refs), refs


def test_the_assets_are_served_and_are_the_vendored_files(daemon: Daemon) -> None:
    sums: dict[str, str] = {}
    for line in (ASSETS / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    assert {"swagger-ui-bundle.js", "swagger-ui.css", "LICENSE"} <= set(sums)
    for name, digest in sums.items():
        assert hashlib.sha256((ASSETS / name).read_bytes()).hexdigest() == digest, name
    for name, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "text/css")):
        r = httpx.get(f"{daemon.url}/docs/assets/{name}")
        assert r.status_code == 200
        assert kind in r.headers["content-type"]
        assert hashlib.sha256(r.content).hexdigest() == sums[name]
    assert httpx.get(f"{daemon.url}/docs/assets/init.js").status_code == 200
    assert httpx.get(f"{daemon.url}/docs/assets/../admin.key").status_code == 404
    assert httpx.get(f"{daemon.url}/schema/openapi.json").json()["openapi"].startswith("3.1")


def _asked_by(netlog: Path, origin: str) -> set[str]:
    """The URLs of every request that a document of ``origin`` started, from Chromium's
    network log: each ``URL_REQUEST_START_JOB`` names its ``initiator`` (the requesting
    document's origin; ``not an origin`` for the browser's own requests, the top-level
    navigation among them)."""
    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return {
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start_job and e.get("params", {}).get("initiator") == origin
    }


def _chromium(url: str, tmp_path: Path, *action: str) -> subprocess.CompletedProcess[str]:
    assert chromium is not None
    return subprocess.run(
        [
            chromium,
            *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"),
            *("--no-first-run", "--disable-background-networking", "--disable-component-update"),
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            # nothing but 127.0.0.1: names resolve nowhere, anything else goes to a dead proxy
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--proxy-server=http://127.0.0.1:9",
            "--proxy-bypass-list=127.0.0.1",
            f"--log-net-log={tmp_path / 'netlog.json'}",
            "--window-size=1280,2600",
            "--virtual-time-budget=15000",
            *action,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(chromium is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_page_renders_offline_in_a_real_browser(daemon: Daemon, tmp_path: Path) -> None:
    dom = _chromium(f"{daemon.url}/docs", tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    # Swagger UI built the operations from the schema: the reserve route is on the page
    paths = set(re.findall(r'data-path="([^"]+)"', dom.stdout))
    assert "/v1/reserve" in paths, sorted(paths)
    assert "/v1/pools/{pool_id}/reserve" in paths
    assert 'class="opblock' in dom.stdout

    # What the page's documents asked for: its assets and the schema, all of them the
    # daemon's (the attribution is proven on this build by finding them), nothing else.
    asked = _asked_by(tmp_path / "netlog.json", daemon.url)
    ours = {u[len(daemon.url) :] for u in asked if u.startswith(daemon.url + "/")}
    assert {
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
        "/docs/assets/init.js",
        "/schema/openapi.json",
    } <= ours, sorted(asked)
    elsewhere = sorted(u for u in asked if not u.startswith(daemon.url + "/"))
    assert not elsewhere, elsewhere

    shot = tmp_path / "api-page.png"
    r = _chromium(f"{daemon.url}/docs", tmp_path, f"--screenshot={shot}")
    assert r.returncode == 0, r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 50_000  # a rendered page, not a blank one (which is a few KiB)


@pytest.fixture
def static_site(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A plain HTTP server on 127.0.0.1 serving a directory: (its origin, the directory)."""
    root = tmp_path / "site"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.skipif(chromium is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_check_catches_a_page_that_loads_from_a_cdn(
    static_site: tuple[str, Path], tmp_path: Path
) -> None:
    """The check above can fail: a page that takes its script, style and font from CDNs
    has each of those requests attributed to it (they fail here: nothing but 127.0.0.1
    is reachable), beside its own script's fetch."""
    origin, root = static_site
    script = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
    style = "https://unpkg.com/swagger-ui-dist@5/swagger-ui.css"
    font = "https://fonts.googleapis.com/css2?family=Inter"
    (root / "index.html").write_text(
        "<!doctype html><html><head>"
        f'<script src="{script}"></script>'
        f'<link rel="stylesheet" href="{style}"><link rel="stylesheet" href="{font}">'
        '<script src="/own.js"></script></head><body>page</body></html>'
    )
    (root / "own.js").write_text('fetch("/data.json");')
    (root / "data.json").write_text("{}")
    r = _chromium(f"{origin}/index.html", tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    asked = _asked_by(tmp_path / "netlog.json", origin)
    assert {f"{origin}/own.js", f"{origin}/data.json"} <= asked, sorted(asked)
    assert {script, style, font} <= {u for u in asked if not u.startswith(origin + "/")}, sorted(
        asked
    )
