"""The browser daemon: one headless Chromium page, driven by Playwright, serving actions on a unix socket.

Runs inside the sandbox as the policy's ``sandbox`` user (``/opt/browser/venv/bin/python daemon.py``) and lives for
the episode, so the page keeps its history, form contents and scroll position between tool calls. ``client.py`` sends
one JSON request per connection ({"action": "click", "id": 3}, ...); the answer is one JSON line (ok, error, url,
screenshot) followed by the page as text (see page_tree.js). Every action saves a screenshot to /tmp/shots/NNN.png for
logs; the policy only ever sees text.

Only pages of this machine load: ``goto`` refuses any URL that is not http://127.0.0.1 or http://localhost (file:,
chrome:, data: ... included), and every request the page makes (links, redirects, subresources) goes through a route
that aborts the rest. The sandbox has no network anyway; this makes the refusal immediate and says why.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

RUN_DIR = Path("/tmp/browser")
SOCKET_PATH = RUN_DIR / "daemon.sock"
FAILED_PATH = RUN_DIR / "failed"  # why the browser could not start
SHOTS_DIR = Path("/tmp/shots")
CHROMIUM = "/usr/bin/chromium"
# --no-sandbox: Chromium's own sandbox needs user namespaces or setuid, which the container (no capabilities,
# no-new-privileges) denies; the container is the sandbox. /dev/shm is small in a container: use /tmp instead.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run", "--disable-extensions",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--renderer-process-limit=1",
]
ALLOWED_HOSTS = ("127.0.0.1", "localhost")
ACTION_TIMEOUT_MS = 5000
VIEWPORT = {"width": 800, "height": 500}
MAX_CHARS = 4000  # of page text per observation; scroll to see the rest
TREE_JS = (Path(__file__).parent / "page_tree.js").read_text()


class ActionError(Exception):
    """An action the page cannot carry out; the message tells the policy what to do instead."""


def allowed(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "http" and parts.hostname in ALLOWED_HOSTS


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class Browser:
    def __init__(self, playwright) -> None:
        self.browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        self.context = self.browser.new_context(viewport=VIEWPORT, service_workers="block")
        self.context.route("**/*", self._guard)
        self.page = self.context.new_page()
        self.page.set_default_timeout(ACTION_TIMEOUT_MS)
        self.shots = 0

    def _guard(self, route) -> None:
        if allowed(route.request.url):
            route.continue_()
        else:
            route.abort("blockedbyclient")

    def _element(self, element_id: int):
        locator = self.page.locator(f'[data-sf-id="{int(element_id)}"]')
        if locator.count() == 0:
            raise ActionError(f"no element [{element_id}] on this page: use an id in brackets from the latest page")
        return locator.first

    def _settle(self) -> None:
        try:
            self.page.wait_for_load_state("load", timeout=ACTION_TIMEOUT_MS)
        except PlaywrightError:
            pass  # a slow page is still shown as far as it got

    # --- actions: each returns a note for the policy, or raises ActionError -------------------------------------

    def goto(self, url: str) -> str:
        url = url.strip()
        if not allowed(url):
            raise ActionError(
                f"cannot open {url!r}: only sites on this machine load (http://127.0.0.1:PORT/... or "
                "http://localhost:PORT/...); there is no internet, and file:, chrome: and other schemes are refused"
            )
        try:
            response = self.page.goto(url, wait_until="load")
        except PlaywrightError as e:
            raise ActionError(f"cannot open {url}: {first_line(e)}") from e
        return f"HTTP {response.status}" if response is not None and response.status >= 400 else ""

    def click(self, element_id: int) -> str:
        self._element(element_id).click()
        self._settle()
        return ""

    def type(self, element_id: int, text: str) -> str:
        self._element(element_id).fill(text)
        return ""

    def select(self, element_id: int, option: str) -> str:
        element = self._element(element_id)
        options = element.evaluate("el => el.tagName === 'SELECT' ? Array.from(el.options, o => [o.text, o.value])"
                                   " : null")
        if options is None:
            raise ActionError(f"[{element_id}] is not a dropdown: use type for text fields, click for buttons")
        labels = [" ".join(text.split()) for text, _ in options]
        match = next((i for i, (text, value) in enumerate(options) if option.strip() in (labels[i], value)), None)
        if match is None:
            raise ActionError(f"no option {option!r} in [{element_id}]; options: {' | '.join(labels)}")
        element.select_option(index=match)
        return ""

    def scroll(self, direction: str) -> str:
        delta = {"down": 1, "up": -1}.get(direction.strip().lower())
        if delta is None:
            raise ActionError(f"scroll direction must be 'up' or 'down', got {direction!r}")
        self.page.evaluate("d => window.scrollBy(0, d * window.innerHeight * 0.8)", delta)
        return ""

    def back(self) -> str:
        self.page.go_back(wait_until="load")
        if self.page.url == "about:blank":  # the blank page the browser started on is not a page to go back to
            self.page.go_forward(wait_until="load")
            raise ActionError("there is no previous page")
        return ""

    def observe(self) -> str:
        return ""

    # --- the page as text -------------------------------------------------------------------------------------

    def screenshot(self) -> str:
        self.shots += 1
        path = SHOTS_DIR / f"{self.shots:03d}.png"
        try:
            self.page.screenshot(path=str(path), timeout=ACTION_TIMEOUT_MS)
        except PlaywrightError:
            return ""
        return str(path)

    def render(self) -> str:
        if self.page.url == "about:blank":
            return "URL: about:blank\n(empty page: use goto to open a site)"
        tree = self.page.evaluate(TREE_JS)
        items = tree["items"]
        start = 0
        if tree["scrollY"] > 0:
            start = next((i for i, item in enumerate(items) if item["y"] >= tree["scrollY"]), len(items))
        lines, used = [], 0
        for item in items[start:]:
            if used + len(item["line"]) > MAX_CHARS and lines:
                break
            lines.append(item["line"])
            used += len(item["line"]) + 1
        header = [f"URL: {self.page.url}", f"Title: {self.page.title()}"]
        if start:
            header.append(f"({start} lines above: scroll up to see them)")
        below = len(items) - start - len(lines)
        footer = [f"({below} more lines below: scroll down to see them)"] if below else []
        return "\n".join(header + lines + footer)

    def handle(self, request: dict) -> tuple[dict, str]:
        action = request.get("action")
        args = request.get("args", {})
        meta = {"ok": True, "error": "", "note": ""}
        method = getattr(self, action, None) if action in ACTIONS else None
        try:
            if method is None:
                raise ActionError(f"unknown action {action!r}")
            meta["note"] = method(**args)
        except ActionError as e:
            meta.update(ok=False, error=str(e))
        except PlaywrightError as e:  # a click on a hidden element, text into a select ...
            meta.update(ok=False, error=first_line(e))
        except TypeError as e:
            meta.update(ok=False, error=f"bad arguments for {action}: {e}")
        if action != "observe":
            meta["screenshot"] = self.screenshot()
        meta["url"] = self.page.url
        try:
            text = self.render()
        except PlaywrightError:  # the page navigated while it was read: read the new one once it has loaded
            self._settle()
            try:
                text = self.render()
            except PlaywrightError as e:
                text = f"URL: {self.page.url}\n(the page could not be read: {first_line(e)})"
        return meta, text


ACTIONS = ("goto", "click", "type", "select", "scroll", "back", "observe")


def serve() -> None:
    t0 = time.monotonic()
    RUN_DIR.mkdir(mode=0o700, exist_ok=True)
    SHOTS_DIR.mkdir(mode=0o755, exist_ok=True)
    try:
        browser = Browser(sync_playwright().start())  # stopped with the process: the sandbox ends with the episode
    except Exception as e:  # tell the waiting client now rather than after its timeout
        FAILED_PATH.write_text(f"{type(e).__name__}: {e}"[-2000:])
        raise
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = RUN_DIR / "daemon.sock.tmp"
    tmp.unlink(missing_ok=True)
    server.bind(str(tmp))
    os.chmod(tmp, 0o600)
    server.listen(4)
    tmp.rename(SOCKET_PATH)  # appears only once it accepts: the client waits for it
    print(f"browser daemon ready in {time.monotonic() - t0:.2f}s", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            try:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                meta, text = browser.handle(json.loads(data))
                conn.sendall(json.dumps(meta).encode() + b"\n" + text.encode())
            except (OSError, ValueError) as e:
                print(f"bad request: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    serve()
