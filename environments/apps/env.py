"""An environment whose episode drives a mock app (HTTP API + SQLite) running inside its own sandbox.

At reset the env puts the app into the fresh sandbox as root (one zip: the server, the client and the app module,
all stdlib Python) with the task's seed data (``task.setup["app"]``), and starts the server in the background on
127.0.0.1 in a new session, so it outlives the exec that started it. The app's folder and database belong to root:
the policy has no shell, only the app's tools, and each tool runs the in-sandbox client as the unprivileged sandbox
user, so the database changes only through the API. Verifiers read it afterwards with the ``sql`` check.

Subclasses set ``app`` (the name, also the database's) and ``app_module`` (the file defining SCHEMA, seed and
METHODS), and add tools that call ``self.call(method, **args)`` and format the result for the policy.
"""

from __future__ import annotations

import functools
import io
import json
import shlex
import zipfile
from pathlib import Path
from typing import Any, ClassVar

from sandforge.environments.sandbox_env import SandboxEnv
from sandforge.environments.tools import ToolError, tool
from sandforge.types import SandboxError

APP_DIR = "/tmp/app"  # /tmp is the sandbox's writable tmpfs; the folder is made root's at reset
PORT = 8765  # on the sandbox's own loopback: every sandbox has its own network namespace (and no other network)
START_TIMEOUT = 20.0
MAX_REQUEST = 64 * 1024  # bytes of JSON per call: it travels as one argv string, which Linux caps at 128 KiB
_HERE = Path(__file__).resolve().parent

_MAIN = """import sys
PORT = {port}
if sys.argv[1] == "serve":
    import app, server
    server.serve(app, sys.argv[2], sys.argv[3], PORT, sys.argv[4])
elif sys.argv[1] == "call":
    import client
    client.main(PORT, sys.argv[2:])
else:
    sys.exit("usage: app.pyz serve DB SEED READY | call METHOD JSON")
"""

# Runs as root in a fresh exec. setsid: the server leaves the exec's process group, which a timeout would kill.
_START = """set -e
chown root:root {dir} && chmod 0755 {dir} && cd {dir}
rm -f ready
setsid python3 app.pyz serve {db} seed.json ready > server.log 2>&1 < /dev/null &
for i in $(seq 300); do
  [ -s ready ] && exit 0
  kill -0 $! 2>/dev/null || break
  sleep 0.05
done
echo "the app server did not start:"; tail -c 2000 server.log; exit 1
"""


@functools.cache
def app_bundle(app_module: Path) -> bytes:
    """A zipapp of the server, the client and ``app_module`` (as ``app``); fixed timestamps, so same sources, same
    bytes."""
    sources = {"server.py": _HERE / "server.py", "client.py": _HERE / "client.py", "app.py": app_module}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("__main__.py", (2020, 1, 1, 0, 0, 0)), _MAIN.format(port=PORT))
        for name, path in sources.items():
            z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), path.read_bytes())
    return buf.getvalue()


class AppEnv(SandboxEnv):
    """A mock app's tools over its HTTP API; ``submit`` ends the episode. The sandbox lifecycle is ``SandboxEnv``'s."""

    app: ClassVar[str] = ""
    app_module: ClassVar[Path]
    # API answers travel as one JSON line through exec output: give them room (the default caps it at 16 KiB).
    sandbox_defaults: ClassVar[dict[str, Any]] = {"max_output_bytes": 1 << 20}

    @classmethod
    def db_path(cls) -> str:
        """Where the app's SQLite database lives inside the sandbox (what ``sql`` checks name as ``db``)."""
        return f"{APP_DIR}/{cls.app}.db"

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        instruction, info = super().reset(seed=seed, options=options)
        try:
            self._start_app()
        except (OSError, ValueError, SandboxError) as e:
            self.close()
            raise SandboxError(f"task {self.task.id}: the {self.app} app could not start: {e}") from e
        return instruction, info

    def _start_app(self) -> None:
        sandbox = self.sandbox
        seed = json.dumps(self.task.setup.get("app", {})).encode()
        sandbox.put_file(f"{APP_DIR}/app.pyz", app_bundle(self.app_module), user="root", mode=0o644)
        sandbox.put_file(f"{APP_DIR}/seed.json", seed, user="root", mode=0o600)
        script = _START.format(dir=APP_DIR, db=shlex.quote(self.db_path()))
        result = sandbox.exec(script, timeout=START_TIMEOUT, user="root", session=False)
        if result.exit_code != 0:
            raise SandboxError(result.output.strip()[-2000:] or f"exit code {result.exit_code}")

    def call(self, method: str, **args: Any) -> Any:
        """One API call, run by the in-sandbox client as the sandbox user; the app's ``result``.

        Raises ToolError with the app's message for a call it refused (the policy reads it), SandboxError when the
        app or the sandbox is broken (the episode fails).
        """
        request = json.dumps(args)
        if len(request) > MAX_REQUEST:
            raise ToolError(f"{method}: the arguments are {len(request)} bytes as JSON; at most {MAX_REQUEST}")
        command = f"python3 {APP_DIR}/app.pyz call {shlex.quote(method)} {shlex.quote(request)}"
        result = self.run_command(command)
        if result.timed_out:
            raise ToolError(f"the {self.app} app did not answer within {self.exec_timeout:g}s; try again")
        lines = result.output.strip().splitlines()
        try:
            answer = json.loads(lines[-1])
            status, body = answer["status"], answer["body"]
        except (IndexError, ValueError, KeyError, TypeError):
            if len(result.output) >= self.sandbox_spec.max_output_bytes:
                raise ToolError(f"{method}: the answer is too large to show; ask for less") from None
            raise SandboxError(f"the {self.app} client failed (exit {result.exit_code}): {result.output[-500:]}") \
                from None
        if status == 0 or status >= 500:
            raise SandboxError(f"the {self.app} app failed on {method}: {body.get('error')}")
        if not body.get("ok"):
            raise ToolError(str(body.get("error", "the app refused the call")))
        return body["result"]

    @tool
    def submit(self) -> str:
        """Finish the task."""
        self.end_episode()
        return "submitted"

