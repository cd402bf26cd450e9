"""The engine's C kernels (engine/kernels/*.c): built once per machine with the system's C compiler into one shared
library, loaded with ctypes, and called on tensors' memory.

The kernels are plain C (pthreads, no torch headers), so the library builds in a couple of seconds. It is compiled for
this CPU (``-march=native``) into ``~/.cache/sandforge/kernels`` (``SANDFORGE_KERNELS`` moves it) under a name that
hashes the sources, the compiler's version, the flags and the CPU's model and feature flags, so a home directory shared
by two kinds of machine never loads code built for the other. One library, so that every kernel runs on one thread pool
(kernels/pool.c).

Where there is no compiler, or the build fails, or ``SANDFORGE_KERNELS=off``, ``load`` returns None once with a
warning and callers take their torch references instead (slower, the same results within rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

SOURCES = Path(__file__).parent / "kernels"
# compiled with -ffast-math, linked without it: gcc links crtfastmath.o into anything linked with -ffast-math, shared
# libraries too (before gcc 13), and its constructor sets the CPU to flush subnormal floats to zero in the whole
# process, the trainer's arithmetic and every other library's included (tests/test_engine_llama.py checks it does not)
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-pthread", "-fPIC"]
LINK = ["-shared", "-pthread"]

_loaded: list = []  # [the library or None], once tried


def cache_dir() -> Path:
    return Path(os.environ.get("SANDFORGE_KERNELS") or Path.home() / ".cache" / "sandforge" / "kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def load() -> ctypes.CDLL | None:
    """The kernels' library, built if need be (None where it cannot be: see the module docstring)."""
    if not _loaded:
        _loaded.append(_build_and_load())
    return _loaded[0]


@functools.cache
def function(name: str, argtypes: tuple = (), restype=None):
    """The library's function ``name`` with its C signature set, or None where the library is not built."""
    lib = load()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _build_and_load() -> ctypes.CDLL | None:
    if os.environ.get("SANDFORGE_KERNELS", "").lower() == "off":
        return None
    sources = sorted(SOURCES.glob("*.c"))
    compiler = _compiler()
    if compiler is None:
        warnings.warn("no C compiler (cc, gcc or clang): the engine's kernels run in torch ops, slower", stacklevel=3)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        text = [p.read_text() for p in sorted(SOURCES.glob("*.[ch]"))]
        digest = hashlib.sha256("\0".join([*text, version, " ".join(FLAGS + LINK), _cpu()]).encode())
        target = cache_dir() / f"kernels-{digest.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
                commands = [[compiler, *FLAGS, "-c", str(source), "-o", str(obj)]
                            for source, obj in zip(sources, objects)]
                commands.append([compiler, *LINK, "-o", str(built), *map(str, objects), "-lm"])
                for command in commands:
                    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                    if result.returncode != 0:
                        raise RuntimeError(result.stderr.strip()[-2000:])
                os.replace(built, target)  # atomic: two processes building at once both end with a whole file
        return ctypes.CDLL(str(target))
    except Exception as e:  # noqa: BLE001 - any failure leaves the torch reference in place
        warnings.warn(f"the engine's kernels did not build ({type(e).__name__}: {e}); they run in torch ops, slower",
                      stacklevel=3)
        return None
