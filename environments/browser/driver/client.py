"""Send one action to the browser daemon and print its answer: ``python3 client.py REQUEST_JSON [WAIT_S [PORT]]``.

Plain python3 with the standard library only, so each tool call costs an interpreter start, not a Playwright import.
WAIT_S: how long to wait for the daemon's socket to appear (reset waits for Chromium's start); PORT: also wait until
the sites' server accepts connections on 127.0.0.1:PORT. Exit 0 with the daemon's answer, 3 if it never answered.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

SOCKET_PATH = "/tmp/browser/daemon.sock"
FAILED_PATH = "/tmp/browser/failed"  # the daemon writes why Chromium could not start


def wait_for(connect, deadline: float) -> socket.socket | None:
    while True:
        try:
            return connect()
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def connect_unix() -> socket.socket:
    if os.path.exists(FAILED_PATH):
        with open(FAILED_PATH) as f:
            fail(f"the browser could not start: {f.read()}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(SOCKET_PATH)
    except OSError:
        s.close()
        raise
    return s


def fail(message: str) -> None:
    print(json.dumps({"ok": False, "error": message, "daemon": False}))
    sys.exit(3)


def main() -> None:
    request = sys.argv[1]
    deadline = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 2.0)
    if len(sys.argv) > 3:
        port = int(sys.argv[3])
        site = wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1), deadline)
        if site is None:
            fail(f"the sites' server is not answering on 127.0.0.1:{port}")
        site.close()
    conn = wait_for(connect_unix, deadline)
    if conn is None:
        fail("the browser daemon is not running")
    with conn:
        conn.sendall(request.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    sys.stdout.write(b"".join(chunks).decode(errors="replace"))


if __name__ == "__main__":
    main()
