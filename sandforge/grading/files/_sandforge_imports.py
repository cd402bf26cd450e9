"""sandforge's grader start-up, run by every Python a root grader's command starts inside a sandbox (startup.py).

It runs first: from a ``.pth`` file in the user site that ``PYTHONUSERBASE`` points at (root's spool), before ``site``
imports ``sitecustomize`` and whatever the command did to ``PYTHONPATH``; else from sandforge's ``sitecustomize`` on
``PYTHONPATH`` (a venv without the user site). What it changes, by construction rather than by name:

- every search of Python's path finder (every import, pytest's assertion-rewriting hook, ``importlib.util.find_spec``,
  a namespace package's portions) looks in the trusted folders of its search path first, and takes a module found
  there; the rest of the path is searched only after a miss;
- after such a miss, a library's own ``import`` statement (the standard library's, an installed package's: its
  optional dependencies, ``copy``'s ``org.python.core``, ``site``'s ``sitecustomize``) stops there and fails as
  it would where the module is not installed. The tests' imports, ``-c`` code, ``python3 -m`` and imports by
  name (``importlib.import_module``: pytest's of test files) still reach the rest, in Python's order: the code under
  test lives there. So do the modules the task's instruction names (``SANDFORGE_ANSWERS``: ``statistics``);
- packages' metadata (``importlib.metadata`` and its backport: pytest's and every tool's plugin entry points) is
  read from trusted folders only, whatever finders ``sys.meta_path`` holds.

Trusted: a folder (or zip) the policy cannot write: not owned by its uid, not writable by others, nor by a group of
its (``SANDFORGE_POLICY_IDS``: its uid, then its groups; where a command emptied the environment, the ``context``
file beside this one says the same). A policy running as root (Harbor's root mode) can write
anything, and the start-up does nothing.
"""

import os
import sys

METADATA = ("importlib.metadata", "importlib_metadata")


def _context():
    """The policy's ids and the answer modules: from the environment the grader's exports set, else (a command that
    emptied it, ``env -i``) from the ``context`` file the grader wrote beside this one on root's own spool."""
    if "SANDFORGE_POLICY_IDS" in os.environ:
        return os.environ["SANDFORGE_POLICY_IDS"], os.environ.get("SANDFORGE_ANSWERS", "")
    try:
        with open(os.path.join(os.path.dirname(_context.__code__.co_filename), "context")) as file:
            lines = file.read().split("\n")
    except OSError:
        return "", ""
    return lines[0], lines[1] if len(lines) > 1 else ""


def _start():
    if getattr(sys, "_sandforge_imports", False):
        return
    sys._sandforge_imports = True
    named, answered = _context()
    ids = [int(i) for i in named.split() if i.isdigit()]
    if not ids or ids[0] == 0:
        return  # no policy named, or a root one: nothing is the grader's alone
    uid, gids = ids[0], frozenset(ids[1:])
    answers = frozenset(answered.split())
    finder = next(f for f in sys.meta_path if getattr(f, "__name__", "") == "PathFinder")
    verdicts = {}

    def trusted(entry):
        """Whether the policy could not have written the search-path entry ('' is the working directory)."""
        if not isinstance(entry, str):
            return False
        path = os.path.abspath(entry or os.curdir)
        verdict = verdicts.get(path)
        if verdict is None:
            try:
                st = os.stat(path)
            except OSError:
                verdict = False
            else:
                verdict = not (st.st_uid == uid or st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid in gids))
            verdicts[path] = verdict
        return verdict

    library = tuple(p.rstrip("/") + "/" for p in {getattr(sys, "_stdlib_dir", None) or os.path.dirname(os.__file__),
                                                   *(e for e in sys.path if e.endswith(".zip"))} if p)

    def is_library(filename):
        return (filename.startswith("<frozen ") or filename.startswith(library) or "/site-packages/" in filename
                or "/dist-packages/" in filename)

    import_name = []  # the IMPORT_NAME opcode, read once the search is ours (opcode is a standard module)

    def library_statement():
        """Whether the import being searched is an ``import`` statement of a library's code."""
        if not import_name:
            return False
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib._bootstrap")
                                     or frame.f_code.co_name == "find_spec"):  # the import system and finders
            frame = frame.f_back
        if frame is None or not is_library(frame.f_code.co_filename):
            return False
        code, at = frame.f_code.co_code, frame.f_lasti
        return 0 <= at < len(code) and code[at] == import_name[0]

    original = finder.find_spec

    def find_spec(cls, name, path=None, target=None):
        entries = sys.path if path is None else path
        try:
            entries = list(entries)
        except TypeError:
            return original(name, path, target)
        safe = [e for e in entries if trusted(e)]
        if len(safe) == len(entries) or name.partition(".")[0] in answers:
            return original(name, path, target)
        spec = original(name, safe, target)
        if spec is not None and spec.loader is not None:
            return spec
        if library_statement():
            return spec  # nothing (or only a namespace of trusted portions): as where it is not installed
        return original(name, path, target)

    finder.find_spec = classmethod(find_spec)
    sys._sandforge_imports = trusted  # for sitecustomize.py's chain

    def guard(module):
        """Make a metadata library's distributions those on trusted entries only (whatever finders sys.meta_path has:
        the importlib_metadata backport adds an unfiltered one of its own)."""

        def find_distributions(context=None):
            context = context or module.DistributionFinder.Context()
            safe = [e for e in context.path if trusted(e)]
            return module.MetadataPathFinder.find_distributions(
                module.DistributionFinder.Context(name=context.name, path=safe))

        module.Distribution._discover_resolvers = staticmethod(lambda: [find_distributions])

    class MetadataGuard:
        """First on sys.meta_path: a metadata library (the standard one, or the backport) is guarded as it loads."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in METADATA:
                return None
            spec = finder.find_spec(name, path, target)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                guard(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, MetadataGuard)
    for name in METADATA:
        if name in sys.modules:
            guard(sys.modules[name])
    import opcode

    import_name.append(opcode.opmap["IMPORT_NAME"])


_start()
