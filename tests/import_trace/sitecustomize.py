"""Test-only (tests/test_quickstart.py): a Python process started with this folder on ``PYTHONPATH`` and
``SANDFORGE_TEST_IMPORT_TRACE`` set writes the names of the sandforge modules it has imported to
``$SANDFORGE_TEST_IMPORT_TRACE/<pid>.txt``, every second and at exit. Ray starts its workers with the driver's
environment, so the trace covers the driver, the trainer ranks, the engine and the rollout workers. It prints
nothing, and a process that imported no sandforge module writes no file."""

import atexit
import os
import sys
import threading
import time

_FOLDER = os.environ.get("SANDFORGE_TEST_IMPORT_TRACE")


def _dump() -> None:
    names = sorted(n for n in list(sys.modules) if n == "sandforge" or n.startswith("sandforge."))
    if names:
        part = os.path.join(_FOLDER, f"{os.getpid()}.part")
        with open(part, "w") as f:
            f.write("\n".join(names) + "\n")
        os.replace(part, os.path.join(_FOLDER, f"{os.getpid()}.txt"))


def _every_second() -> None:
    while True:
        time.sleep(1.0)
        try:
            _dump()
        except Exception:  # noqa: BLE001 - a trace is best effort; the process it watches must not notice it
            pass


if _FOLDER:
    threading.Thread(target=_every_second, name="sandforge-import-trace", daemon=True).start()
    atexit.register(_dump)
