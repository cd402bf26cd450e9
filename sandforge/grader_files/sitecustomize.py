"""sandforge's grader start-up, run by every Python a grader's command starts inside a sandbox (sandforge/harness.py).

It reaches that Python through ``PYTHONPATH`` (a root-only folder first), and makes the imports it does trust first:

- a top-level import is looked up in the trusted entries of ``sys.path`` before the rest, so a module the policy
  planted (``pytest.py`` in the working directory, which ``python3 -m`` and ``-c`` put first; the same in a subfolder a
  check ``cd``s into; a module named like one only the tests' ``PYTHONPATH`` has) never wins over the one the grader
  meant. Names of the code under test (``SANDFORGE_ANSWERS``, the Python files the task's instruction names, such as
  ``statistics``) keep Python's own order: the task asks for them, so the working directory's is the answer.
- packages' metadata (``importlib.metadata``: pytest's and every tool's plugin entry points) is read only from trusted
  entries, so a ``*.dist-info`` the policy left in the working directory announces no plugin.

Trusted: a folder (or zip) root owns that no one else may write, which the policy (never root) cannot have made or
changed. Then the next ``sitecustomize`` on the trusted path runs, as it would have without this one.
"""

import os
import sys
from importlib.machinery import PathFinder

_HERE = os.path.dirname(os.path.abspath(__file__))
_ANSWERS = frozenset(os.environ.get("SANDFORGE_ANSWERS", "").split())
_verdicts = {}


def trusted(entry):
    """Whether the ``sys.path`` entry is root's alone ('' is the working directory, as Python reads it)."""
    path = os.path.abspath(entry or os.curdir) if isinstance(entry, str) else None
    if path is None:
        return False
    if path not in _verdicts:
        try:
            st = os.stat(path)
        except OSError:
            _verdicts[path] = False
        else:
            _verdicts[path] = st.st_uid == 0 and not st.st_mode & 0o002 and not (st.st_mode & 0o020 and st.st_gid)
    return _verdicts[path]


class TrustedFirst:
    """A meta-path finder just ahead of Python's own path finder: a top-level module found on a trusted entry wins."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None or name in _ANSWERS:
            return None  # a submodule is found in its package's folder; an answer keeps Python's order
        entries = sys.path
        safe = [entry for entry in entries if trusted(entry)]
        if len(safe) == len(entries):
            return None  # nothing untrusted on the path: Python's own order is the same
        spec = PathFinder.find_spec(name, safe, target)
        if spec is None or spec.loader is None:
            return None  # not there, or only a namespace portion, which a regular module elsewhere outranks
        return spec


def _trusted_distributions(*args, **kwargs):
    from importlib.metadata import DistributionFinder

    context = args[0] if args else kwargs.get("context") or DistributionFinder.Context()
    safe = [entry for entry in context.path if trusted(entry)]
    return _find_distributions(DistributionFinder.Context(name=context.name, path=safe))


def _install():
    at = next((i for i, finder in enumerate(sys.meta_path) if finder is PathFinder), len(sys.meta_path))
    sys.meta_path.insert(at, TrustedFirst)
    PathFinder.find_distributions = staticmethod(_trusted_distributions)


def _chain():
    """Run the next ``sitecustomize`` on the trusted path (the image's own), as ``site`` would have."""
    spec = PathFinder.find_spec("sitecustomize", [e for e in sys.path if os.path.abspath(e or os.curdir) != _HERE
                                                  and trusted(e)])
    if spec is None or spec.loader is None:
        return
    try:
        from importlib.util import module_from_spec

        spec.loader.exec_module(module_from_spec(spec))
    except Exception as e:  # as site reports a failing sitecustomize: the program still runs
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}",
              file=sys.stderr)


_find_distributions = PathFinder.find_distributions
_install()
_chain()
