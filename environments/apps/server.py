"""The HTTP + SQLite server every mock app runs inside its sandbox. Python stdlib only: it runs on the image's python3.

An app is a module with ``SCHEMA`` (SQL), ``seed(con, data)`` and ``METHODS`` (name -> ``fn(con, args) -> result``);
it sits beside this module in the sandbox's bundle (environments/apps/env.py) and reads its arguments with
``text_arg`` (``from server import text_arg``).
Requests are RPC-style, like Slack's Web API: ``POST /api/<method>`` with a JSON object; the answer is
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``. Method names never come from the policy (the
env's tools choose them), and every value reaches SQLite as a bound parameter, so no argument can become SQL or a path.

A method raises LookupError for something that does not exist (404) and ValueError for a bad argument (400); the
message goes back to the policy, so it should say what to do. One lock serialises all requests: the apps are tiny and
a single writer keeps every episode's database deterministic.

Run as root at reset: ``python3 app.pyz serve DB SEED PORT READY``. The database file is made 0600 in a root-owned
folder, so only the server (and the verifier, reading it as root) can touch it; the policy changes it only through
the API.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20


def text_arg(args: dict, key: str, required: bool = True, strip: bool = False) -> str:
    """An app method's string argument ``args[key]`` ('' when absent); ValueError, which the policy sees, unless it
    is a string, or when ``required`` and it is blank. ``strip``: returned without surrounding whitespace (ids,
    titles), else as given (a message keeps the text it was sent with)."""
    value = args.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string")
    if required and not value.strip():
        raise ValueError(f"'{key}' must not be empty")
    return value.strip() if strip else value


def open_db(app, db_path: str, seed_path: str) -> sqlite3.Connection:
    """A fresh database at ``db_path``: the app's schema, filled from the seed JSON."""
    for stale in (db_path, db_path + "-journal"):
        if os.path.exists(stale):
            os.remove(stale)
    fd = os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600)  # 0600 from the start: never readable by the policy
    os.close(fd)
    con = sqlite3.connect(db_path, check_same_thread=False)
    con.executescript(app.SCHEMA)
    with open(seed_path) as f:
        app.seed(con, json.load(f))
    con.commit()
    return con


def handler_for(app, con: sqlite3.Connection) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            name = self.path.removeprefix("/api/")
            method = app.METHODS.get(name) if self.path.startswith("/api/") else None
            if method is None:
                return self._answer(404, {"ok": False, "error": f"no such API method {self.path!r}"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise ValueError(f"request too large ({length} bytes; at most {MAX_BODY})")
                args = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(args, dict):
                    raise ValueError("the request body must be a JSON object")
            except ValueError as e:
                return self._answer(400, {"ok": False, "error": str(e)})
            with lock:
                try:
                    result = method(con, args)
                    con.commit()
                except LookupError as e:
                    con.rollback()
                    return self._answer(404, {"ok": False, "error": e.args[0] if e.args else str(e)})
                except (ValueError, TypeError) as e:
                    con.rollback()
                    return self._answer(400, {"ok": False, "error": str(e)})
                except Exception as e:  # a bug in the app: say so, keep serving
                    con.rollback()
                    return self._answer(500, {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"})
            self._answer(200, {"ok": True, "result": result})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args) -> None:  # quiet: the log would only grow
            pass

    return Handler


def serve(app, db_path: str, seed_path: str, port: int, ready_path: str) -> None:
    """Create and seed the database, listen on 127.0.0.1:``port``, then create ``ready_path`` (the env waits for it)."""
    con = open_db(app, db_path, seed_path)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(app, con))
    server.daemon_threads = True
    with open(ready_path, "w") as f:
        f.write(str(os.getpid()))
    server.serve_forever()
