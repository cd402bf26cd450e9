"""The in-sandbox client the env's tools run (as the unprivileged sandbox user): one API call, one JSON line out.

``python3 app.pyz call METHOD JSON`` posts JSON to the app server on loopback and prints ``{"status": .., "body":
..}``. Python stdlib only. The policy never runs it directly; its tools do, with arguments the env has quoted.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def call(port: int, method: str, body: str) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/{method}", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return {"status": response.status, "body": json.loads(response.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": json.loads(e.read() or b"{}")}
    except (urllib.error.URLError, OSError) as e:
        return {"status": 0, "body": {"ok": False, "error": f"the app is not answering: {e}"}}


def main(port: int, argv: list[str]) -> None:
    method, body = argv[0], argv[1] if len(argv) > 1 else "{}"
    print(json.dumps(call(port, method, body)))
    sys.stdout.flush()
