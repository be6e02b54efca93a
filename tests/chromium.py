"""Load a page in headless Chromium over the DevTools protocol: what a person's browser would show.

`load_page(path)` starts Debian's `chromium` with a fresh profile, opens the file, waits for its
load event and returns the console errors, uncaught exceptions, failed requests and every image's
natural size. Every wait is bounded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
_IMAGES = (
    "JSON.stringify(Array.from(document.images).map("
    "i => ({w: i.naturalWidth, h: i.naturalHeight, complete: i.complete, alt: i.alt})))"
)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _port(profile: Path, proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Chromium writes its DevTools port into the profile once it listens."""
    deadline = time.monotonic() + timeout
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before listening")
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.05)
    raise TimeoutError(f"chromium did not open its DevTools port within {timeout} s")


def load_page(
    path: Path | str,
    timeout: float = 60.0,
    *,
    evaluate: Mapping[str, str] | None = None,
    screenshot: Path | None = None,
) -> dict[str, Any]:
    """Open `path` (a file, or an http URL) and report what the page did (see the module docs);
    `evaluate`: JavaScript expressions whose values come back under their names;
    `screenshot`: where to write a PNG of the page as it rendered (1280x900)."""
    exe = chromium_path()
    assert exe is not None, "chromium is not installed"
    # Chromium's helper processes can still be writing to the profile as the main one exits:
    # the whole process group is stopped, and what is left of the profile may stay in /tmp.
    with tempfile.TemporaryDirectory(prefix="edgefl-chromium-", ignore_cleanup_errors=True) as tmp:
        profile = Path(tmp)
        scratch = profile / "tmp"  # chromium's own temporary directories, removed with it
        scratch.mkdir()
        proc = subprocess.Popen(
            [
                exe,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(scratch)},
            start_new_session=True,  # its own process group, helpers included
        )
        try:
            port = _port(profile, proc, timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            with connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as ws:
                url = path if isinstance(path, str) else path.resolve().as_uri()
                return _drive(ws, url, timeout, evaluate or {}, screenshot)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop chromium and every helper process it started (its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + 5  # the helpers, after the main process
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _drive(
    ws: Any, url: str, timeout: float, evaluate: Mapping[str, str], screenshot: Path | None
) -> dict[str, Any]:
    found: dict[str, Any] = {"console_errors": [], "exceptions": [], "failed_requests": []}
    deadline = time.monotonic() + timeout
    next_id = 0
    urls: dict[str, str] = {}

    def send(method: str, **params: Any) -> int:
        nonlocal next_id
        next_id += 1
        ws.send(json.dumps({"id": next_id, "method": method, "params": params}))
        return next_id

    def until(done: Any) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the page did not finish loading in time")
            msg = json.loads(ws.recv(timeout=left))
            method, params = msg.get("method"), msg.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                found["console_errors"].append(params["args"])
            elif method == "Runtime.exceptionThrown":
                found["exceptions"].append(params["exceptionDetails"])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found["console_errors"].append(params["entry"])
            elif method == "Network.requestWillBeSent":
                urls[params["requestId"]] = params["request"]["url"]
            elif method == "Network.loadingFailed":
                found["failed_requests"].append(
                    urls.get(params["requestId"], "?") + ": " + params["errorText"]
                )
            if done(msg):
                return msg

    for method in ("Runtime.enable", "Log.enable", "Network.enable", "Page.enable"):
        wanted = send(method)
        until(lambda m, i=wanted: m.get("id") == i)
    wanted = send(
        "Emulation.setDeviceMetricsOverride",
        width=1280,
        height=900,
        deviceScaleFactor=1,
        mobile=False,
    )
    until(lambda m: m.get("id") == wanted)
    send("Page.navigate", url=url)
    until(lambda m: m.get("method") == "Page.loadEventFired")
    wanted = send("Runtime.evaluate", expression=_IMAGES, returnByValue=True)
    reply = until(lambda m: m.get("id") == wanted)
    found["images"] = json.loads(reply["result"]["result"]["value"])
    wanted = send("Runtime.evaluate", expression="document.title", returnByValue=True)
    found["title"] = until(lambda m: m.get("id") == wanted)["result"]["result"]["value"]
    for name, expression in evaluate.items():
        wanted = send("Runtime.evaluate", expression=expression, returnByValue=True)
        found[name] = until(lambda m, i=wanted: m.get("id") == i)["result"]["result"].get("value")
    if screenshot is not None:
        wanted = send("Page.captureScreenshot", format="png")
        data = until(lambda m: m.get("id") == wanted)["result"]["data"]
        screenshot.write_bytes(base64.b64decode(data))
    return found
