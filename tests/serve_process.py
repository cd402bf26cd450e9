"""`sandforge serve CHECKPOINT --port 0` in a subprocess, for the tests that talk to a real server over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def serve_process(checkpoint: Path, log: Path, start_timeout: float = 90.0,
                  weights_dir: Path | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """Yields (process, base URL) once the server prints its URL (into ``log``); stopped afterwards, killed if it
    will not stop. A server that exits first, or prints no URL within ``start_timeout``, fails with its output.
    ``weights_dir``: its ``--weights-dir`` (weight updates on, from there)."""
    extra = ["--weights-dir", str(weights_dir)] if weights_dir is not None else []
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sandforge.job.cli", "serve", str(checkpoint), "--port", "0",
                                 *extra],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline, url = time.monotonic() + start_timeout, None
        while url is None:
            assert proc.poll() is None, f"sandforge serve exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"sandforge serve printed no URL within {start_timeout:g} s:\n" \
                                                f"{log.read_text()}"
            found = re.search(r"http://\S+?/v1", log.read_text())
            url = found.group(0)[: -len("/v1")] if found else None
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
