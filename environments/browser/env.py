"""A web browser in a fresh sandbox per episode: Chromium on mock sites (shop, booking, wiki) served in the same box.

The policy has no shell: its tools are browser actions (goto, click, type, select, scroll, back) and submit. Each
returns the page as accessibility-tree-like text in which every interactive element has an id in brackets, e.g.
``[3] spinbutton "Quantity" value="1"``; actions name elements by that id.

``reset`` starts two services in the sandbox (see ``driver/`` and ``sites/``): the sites' server, run as the ``site``
user with its SQLite database in a folder only that user may enter, and the browser daemon (Playwright driving one
Chromium page), run as the policy's ``sandbox`` user. Every tool call is one exec of a small stdlib client that talks
to the daemon over a unix socket. Verifiers read the database as root after the episode (``sql`` checks).
Screenshots: one per action inside the sandbox (/tmp/shots/NNN.png); ``screenshots`` lists them, ``screenshot()``
fetches one as PNG bytes, ``screenshots_png()`` the episode's last ones, which the agent loop hands to the run directory.
"""

from __future__ import annotations

import base64
import json
import shlex
import time

from sandforge.environments.sandbox_env import SandboxEnv
from sandforge.environments.tools import ToolError, tool
from sandforge.types import SandboxError

SITE_PORT = 8000
SITE_URL = f"http://127.0.0.1:{SITE_PORT}"
SITE_DIR = "/tmp/site"  # mode 0700, owned by `site`: the database verifiers read
SITE_DB = f"{SITE_DIR}/site.db"
SITE_USER = "site"
CLIENT = "python3 /opt/browser/driver/client.py"  # stdlib only: starts fast
DAEMON = "/opt/browser/venv/bin/python /opt/browser/driver/daemon.py"  # Playwright lives in this venv
START_TIMEOUT = 60.0  # Chromium's first start on a busy 1-cpu sandbox
MAX_SHOTS = 8  # screenshots of an episode kept for the run directory (its last ones)
MAX_SHOT_BYTES = 2 * 1024**2


class BrowserEnv(SandboxEnv):
    """Browse the task's mock sites through element ids; submit ends the episode. Lifecycle: ``SandboxEnv``'s."""

    # Chromium needs far more than a shell: ~300 MB resident, a renderer, a utility process and ~150 threads (pids
    # counts threads), and /tmp for its shared memory (--disable-dev-shm-usage) and profile.
    sandbox_defaults = {"memory": "1g", "cpus": 1.0, "pids_limit": 512, "tmp_size": "256m"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.screenshots: list[str] = []  # in-sandbox paths of this episode's screenshots, in order
        self.startup_seconds = 0.0  # how long the last reset took to bring up the sites and the browser

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        instruction, info = super().reset(seed=seed, options=options)
        self.screenshots = []
        t0 = time.monotonic()
        try:
            self._start_services()
        except SandboxError:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - t0
        return instruction, {**info, "startup_seconds": self.startup_seconds}

    def _start_services(self) -> None:
        seed = base64.b64encode(json.dumps(self.task.setup.get("site", {})).encode()).decode()
        # As `site`, in a one-off shell: the policy's session never holds this user's state.
        server = (
            f"mkdir -m 700 {SITE_DIR} && echo {seed} | base64 -d > {SITE_DIR}/seed.json && "
            f"setsid -f python3 /opt/browser/sites/server.py {SITE_DIR} {SITE_PORT} "
            f"> {SITE_DIR}/server.log 2>&1 < /dev/null"
        )
        result = self.sandbox.exec(server, timeout=self.exec_timeout, user=SITE_USER, session=False)
        if result.exit_code != 0:
            raise SandboxError(f"task {self.task.id}: the sites' server did not start: {result.output[-300:]}")
        # The daemon starts in the background and the same exec waits for it (and the server): one round trip.
        daemon = f"setsid -f {DAEMON} > /tmp/daemon.log 2>&1 < /dev/null"
        self._call("observe", {}, wait=START_TIMEOUT, port=SITE_PORT, before=daemon)

    def _call(self, action: str, args: dict, wait: float = 2.0, port: int | None = None, before: str = "") -> str:
        """Run one daemon action (after the command ``before``); returns the page text. ToolError for an action the
        page refused; SandboxError when the daemon does not answer."""
        request = json.dumps({"action": action, "args": args})
        command = f"{CLIENT} {shlex.quote(request)} {wait:g}" + (f" {port}" if port else "")
        command = f"{before} && {command}" if before else command
        try:
            result = self.run_command(command, timeout=wait + self.exec_timeout + 10)
        except ValueError as e:  # a NUL byte in typed text
            raise ToolError(f"{action}: {e}") from e
        header, _, text = result.output.partition("\n")
        try:
            meta = json.loads(header)
        except ValueError:
            meta = None
        if result.timed_out or not isinstance(meta, dict) or meta.get("daemon") is False:
            if self.stats is not None and not result.timed_out:  # run_command counted the timeout
                self.stats.failure("exec")
            log = self.sandbox.exec("tail -c 600 /tmp/daemon.log", timeout=5, session=False).output
            raise SandboxError(f"the browser stopped answering ({action}): {result.output[-300:]}\n{log}")
        if meta.get("screenshot"):
            self.screenshots.append(meta["screenshot"])
        if not meta.get("ok"):
            raise ToolError(f"{action}: {meta.get('error')}\n{self._truncate(text)}")
        note = f"[{meta['note']}]\n" if meta.get("note") else ""
        return note + self._truncate(text)

    def screenshots_png(self) -> list[bytes]:
        """The episode's last ``MAX_SHOTS`` screenshots, for the run directory. Only real PNGs under ``MAX_SHOT_BYTES``
        are kept: the bytes come out of the sandbox."""
        shots = []
        for i in range(max(0, len(self.screenshots) - MAX_SHOTS), len(self.screenshots)):
            data = self.sandbox.get_file(self.screenshots[i], user="root", max_bytes=MAX_SHOT_BYTES + 1)
            if data and data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) <= MAX_SHOT_BYTES:
                shots.append(data)
        return shots

    def screenshot(self, index: int = -1) -> bytes | None:
        """PNG bytes of one of this episode's screenshots (default: the latest), for logs; None if there is none."""
        if not self.screenshots:
            return None
        return self.sandbox.get_file(self.screenshots[index], user="root")

    @tool
    def goto(self, url: str) -> str:
        """Open a URL (only http://127.0.0.1 sites load); returns the page with element ids."""
        return self._call("goto", {"url": url}, wait=2.0)

    @tool
    def click(self, id: int) -> str:
        """Click the element with this id (a link, button, checkbox ...)."""
        return self._call("click", {"element_id": id})

    @tool
    def type(self, id: int, text: str) -> str:
        """Replace the text of the input with this id."""
        return self._call("type", {"element_id": id, "text": text})

    @tool
    def select(self, id: int, option: str) -> str:
        """Choose an option (its text) in the dropdown with this id."""
        return self._call("select", {"element_id": id, "option": option})

    @tool
    def scroll(self, direction: str) -> str:
        """Scroll the page 'up' or 'down'."""
        return self._call("scroll", {"direction": direction})

    @tool
    def back(self) -> str:
        """Go back to the previous page."""
        return self._call("back", {})

    @tool
    def submit(self) -> str:
        """Finish the task."""
        self.end_episode()
        return "submitted"
