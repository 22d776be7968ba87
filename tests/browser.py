"""Headless Chromium for tests of facepipe's HTML pages (the data-quality report, the search page).

The browser runs with its proxy pointed at a closed port and every host name unresolvable, so
nothing could leave the machine; on top of that the DevTools protocol records every request a page
makes, so a test can hold each one to ``data:`` or the page's own ``file:`` URL.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium not installed: `make test` and .ci/run install Debian's chromium (apt-get, as root); here it could not be",
)


class Chromium:
    """Headless Chromium driven over the DevTools protocol; no route off the machine."""

    def __init__(self, profile: Path) -> None:
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [
                CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
                "--window-size=1200,900", "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and len(port_file.read_text().split()) == 2):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port, path = port_file.read_text().split()
        self.socket = connect(f"ws://127.0.0.1:{port}{path}", max_size=256 << 20, proxy=None)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None) -> dict[str, Any]:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        while True:
            reply = json.loads(self.socket.recv(timeout=60))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic()))))

    def open(self, url: str, screenshot: Path | None = None) -> dict[str, Any]:
        """Load ``url`` in a new tab; returns its requests, every image's natural size, and the page height."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Network.enable", "Page.enable"):
            self.send(domain, session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_for("Page.loadEventFired", session)
        script = (
            "Promise.all(Array.from(document.images).map(i => i.decode().then(() => 0, () => 0)"
            ".then(() => [i.naturalWidth, i.naturalHeight, i.alt])))"
        )
        images = self.send("Runtime.evaluate", {"expression": script, "awaitPromise": True, "returnByValue": True}, session=session)
        height = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]["height"]
        if screenshot is not None:
            clip = {"x": 0, "y": 0, "width": 1200, "height": min(height, 5000), "scale": 1}
            shot = self.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True}, session=session)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        requests = [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session
        ]
        self.send("Target.closeTarget", {"targetId": target})
        return {"requests": requests, "images": images["result"]["value"], "height": height}

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One browser per test module."""
    browser = Chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()
