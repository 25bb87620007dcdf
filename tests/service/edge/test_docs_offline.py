"""/docs and /redoc render in a real headless Chromium with every request on loopback (no CDN, no fonts, no
validator badge), as on a server without internet access.

Chromium comes from Debian's packages (`.ci/run` installs it); the browser's NetLog records every URL it
requests, and non-loopback host names resolve to nothing, so a page that needed the internet stays blank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from PIL import Image

from benchmarks.server import start, stop

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs it (.ci/run), so there a missing browser fails instead of skipping.
pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                reason="chromium not installed (apt-get install chromium)")
LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}
ENDPOINTS = ["/v1/models", "/v1/completions", "/v1/models/{name}/classify", "/v2/health/ready", "/metrics"]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start()
    try:
        yield url
    finally:
        stop(proc)


def chromium(url: str, tmp: Path, *extra: str) -> tuple[str, NetLog]:
    """Run headless Chromium on `url`; returns its stdout and its network log."""
    netlog = tmp / "netlog.json"
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
        "--disable-features=AutofillServerCommunication",  # the browser's own form lookups, not the page's
        f"--user-data-dir={profile}", f"--log-net-log={netlog}", "--net-log-capture-mode=Default",
        # An offline machine: any host but loopback fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
        "--virtual-time-budget=15000", "--window-size=1280,1600", *extra, url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, NetLog(netlog)


class NetLog:
    """A Chromium NetLog (JSON, possibly unterminated when the browser exits): what the page asked for and every
    address the browser opened a connection to."""

    def __init__(self, path: Path) -> None:
        text = path.read_text().rstrip()
        if not text.endswith("}"):
            text = text.rstrip(",") + "]}"
        log = json.loads(text)
        names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
        self.page_urls: set[str] = set()  # requests made for a page on loopback (its own and any CDN's)
        self.connects: set[str] = set()  # "host:port" of every TCP connection attempt, the browser's own too
        for event in log["events"]:
            params, name = event.get("params"), names.get(event["type"], "")
            if not isinstance(params, dict):
                continue
            if name == "URL_REQUEST_START_JOB" and "127.0.0.1" in params.get("network_isolation_key", ""):
                self.page_urls.add(params["url"])
            # TCP only: Chromium's one UDP "connect", to a public DNS address, is its IPv6 reachability probe, which
            # picks a route and sends nothing (and QUIC, over UDP, would need a resolved name first).
            if name == "TCP_CONNECT_ATTEMPT" and "address" in params:
                self.connects.add(params["address"])

    def assert_offline(self) -> None:
        assert self.page_urls, "the NetLog recorded no page requests"
        outside = sorted(u for u in self.page_urls if urlsplit(u).hostname not in LOOPBACK)
        assert not outside, f"the page requested: {outside}"
        remote = sorted(a for a in self.connects if a.rsplit(":", 1)[0] not in LOOPBACK)
        assert not remote, f"connections leaving the machine: {remote}"
        assert self.connects, "no connection recorded at all"


def test_swagger_ui_lists_the_endpoints_offline(server: str, tmp_path: Path) -> None:
    dom, log = chromium(f"{server}/docs", tmp_path, "--dump-dom")
    log.assert_offline()
    assert any(u.endswith("/docs-assets/swagger-ui-bundle.js") for u in log.page_urls)
    assert any(u.endswith("/openapi.json") for u in log.page_urls)
    assert 'class="swagger-ui' in dom and "opblock" in dom  # Swagger UI ran and rendered operations
    for path in ENDPOINTS:
        assert f'data-path="{path}"' in dom, path


def test_swagger_ui_screenshot_shows_the_endpoints(server: str, tmp_path: Path) -> None:
    shot = tmp_path / "docs.png"
    _, log = chromium(f"{server}/docs", tmp_path, f"--screenshot={shot}")
    log.assert_offline()
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 1600)
    # A blank page (the CDN case) is one colour; a rendered one has text and coloured method badges.
    assert len(set(image.getdata())) > 50
    if out := os.environ.get("DOCS_SCREENSHOT"):  # to look at it
        shutil.copy(shot, out)


def test_redoc_renders_offline(server: str, tmp_path: Path) -> None:
    dom, log = chromium(f"{server}/redoc", tmp_path, "--dump-dom")
    log.assert_offline()
    assert any(u.endswith("/docs-assets/redoc.standalone.js") for u in log.page_urls)
    assert "/v1/completions" in dom and "multimax-serve" in dom
