"""sandforge's grader start-up by way of ``PYTHONPATH`` (startup.py): for a Python whose user site is off (a venv
without the system's packages), ``_sandforge_imports.py`` runs here, from this folder; where the user site already
ran it, that is a no-op. Then the next ``sitecustomize`` on the path's trusted folders (the image's own) runs, as
``site`` would have run it without this one."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_start = os.path.join(_here, "_sandforge_imports.py")
with open(_start, "rb") as _file:
    exec(compile(_file.read(), _start, "exec"), {"__name__": "_sandforge_imports"})


def _chain():
    finder = next(f for f in sys.meta_path if getattr(f, "__name__", "") == "PathFinder")
    trusted = getattr(sys, "_sandforge_imports", None)
    entries = [e for e in sys.path if os.path.abspath(e or os.curdir) != _here and (not callable(trusted)
                                                                                    or trusted(e))]
    spec = finder.find_spec("sitecustomize", entries)
    if spec is None or spec.loader is None:
        return
    try:
        from importlib.util import module_from_spec

        spec.loader.exec_module(module_from_spec(spec))
    except Exception as e:  # as site reports a failing sitecustomize: the program still runs
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
              file=sys.stderr)


_chain()
