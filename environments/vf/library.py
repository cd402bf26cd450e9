"""The installed ``verifiers`` library, imported as itself.

sandforge's repository has a top-level ``verifiers/`` folder (``sandforge.verifiers``, the graders). Wherever the
repository root is on ``sys.path`` (``python -m pytest`` or ``python -c`` run from it, Ray workers started there),
``import verifiers`` would find that folder instead of the library. ``vf()`` loads the library from its installed
distribution's own folder, whatever ``sys.path`` holds, and registers it as ``verifiers`` so its own imports work.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from importlib import metadata
from types import ModuleType

PINNED = "0.4.0"  # the version sandforge is tested against (pyproject's verifiers extra)


class VerifiersMissing(RuntimeError):
    """The library is not installed: the message says how to install it."""


def vf() -> ModuleType:
    """``verifiers.v1``, the library's API (``import verifiers.v1 as vf`` in its own examples)."""
    loaded = sys.modules.get("verifiers")
    if loaded is None or not _is_library(loaded):
        try:
            dist = metadata.distribution("verifiers")
        except metadata.PackageNotFoundError:
            raise VerifiersMissing("the verifiers environment needs the `verifiers` library: pip install "
                                   f"'sandforge[verifiers]' (verifiers=={PINNED}), then the environment's own "
                                   "package") from None
        folder = str(dist.locate_file(""))
        spec = importlib.machinery.PathFinder.find_spec("verifiers", [folder])
        if spec is None or spec.loader is None:
            raise VerifiersMissing(f"verifiers {dist.version} is installed but its package is not in {folder}")
        for name in [n for n in sys.modules if n == "verifiers" or n.startswith("verifiers.")]:
            del sys.modules[name]  # sandforge's graders, loaded under the library's name
        module = importlib.util.module_from_spec(spec)
        sys.modules["verifiers"] = module
        spec.loader.exec_module(module)
    return importlib.import_module("verifiers.v1")


def uv_on_path() -> None:
    """Put the ``uv`` installed beside this Python (sandforge's verifiers extra pins it) first on ``PATH``: verifiers'
    runtimes prepare their chat program with whatever ``uv`` they find, and install one with ``pip --user`` when
    they find none."""
    folder = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(folder, "uv")):
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[:1] != [folder]:
            os.environ["PATH"] = os.pathsep.join([folder, path]) if path else folder


def _is_library(module: ModuleType) -> bool:
    """Whether ``module`` (loaded as ``verifiers``) is the library, not sandforge's graders folder."""
    ours = importlib.util.find_spec("sandforge.verifiers")
    folders = {os.path.realpath(p) for p in (ours.submodule_search_locations or [])} if ours else set()
    return not folders & {os.path.realpath(p) for p in getattr(module, "__path__", [])}
