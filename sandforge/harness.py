"""What a grader's own command starts with in a sandbox: Python that trusts root's files first, and an offline uv.

A check (a ``command`` check, a Harbor ``test.sh``) runs as root in the policy's workdir, after every process of the
policy is gone, but among the files the policy left. The harness it starts must load nothing from them except the
code under test. Python and pytest would: ``python3 -m pytest`` puts the working directory first on ``sys.path`` (a
``pytest.py`` there, or in a subfolder the check ``cd``s into, or a module named like one only the tests' own
``PYTHONPATH`` has, would be imported), and pytest autoloads the plugins every ``*.dist-info`` on ``sys.path``
announces, the working directory's too. And terminal-bench's test.sh sources ``.tbench-testing/bin/activate`` from
the workdir after a ``uv venv`` that, offline, never ran.

So ``prepare`` writes sandforge's own start-up into the root-only spool (``grader_files/``) and returns the shell lines
a root check runs first:

- ``PYTHONPATH`` puts that folder first, so every Python the check starts runs ``grader_files/sitecustomize.py``: a
  top-level import is found on root's own ``sys.path`` entries before the policy's, and packages' metadata (plugin
  entry points) is read only from root's. The Python files the task's instruction names (``statistics.py``: the code
  under test) keep Python's own order (``SANDFORGE_ANSWERS``).
- ``uv`` and ``uvx`` are bash functions running ``grader_files/uv.sh``: ``uv venv`` removes what stands at the path
  and makes a venv that sees the image's packages, ``uv pip install`` succeeds only for what the image has, and
  ``uv run`` runs the command.

Isolating the check's Python outright (``-I``, ``PYTHONSAFEPATH``) would also drop the working directory that the
tests import the answer from. The shadow set-aside (sandforge/shadows.py) still runs first, as a second line.
Not covered: a check running as another user than root (the spool is root's), a command that drops the environment
(``python3 -E``, ``env -i``) or replaces ``PYTHONPATH`` instead of extending it, and a Python older than 3.4.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path

from sandforge.types import Sandbox

DIR = "/run/sandforge-root/harness"  # on the verifiers' root-only (0700) spool: the policy can neither read nor write it
FILES = Path(__file__).with_name("grader_files")
SITE = "sitecustomize.py"
UV = "uv.sh"


def answer_modules(answers: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The top-level module names of the Python files a task's instruction names (``shadows.answer_paths``)."""
    names = (posixpath.basename(str(path)) for path in answers)
    return tuple(dict.fromkeys(name[:-3] for name in names if name.endswith(".py") and name[:-3].isidentifier()))


def exports(answers: list[str] | tuple[str, ...] = ()) -> str:
    """The shell lines that put the harness in front of a root check's command (``prepare`` writes its files)."""
    uv = shlex.quote(f"{DIR}/{UV}")
    return (f"export PYTHONPATH={DIR}/py${{PYTHONPATH:+:$PYTHONPATH}} "
            f"SANDFORGE_ANSWERS={shlex.quote(' '.join(answer_modules(answers)))}\n"
            f"uv() {{ bash {uv} uv \"$@\"; }}; uvx() {{ bash {uv} uvx \"$@\"; }}; export -f uv uvx\n")


def prepare(sandbox: Sandbox, user: str, answers: list[str] | tuple[str, ...] = ()) -> str:
    """Write the harness into ``sandbox`` and return what a check run as ``user`` puts before its command ("" for a
    user other than root: the spool is root's alone). OSError if it cannot be written (the spool is root's, so that
    is the sandbox's fault, never the policy's)."""
    if user not in ("root", "0", "0:0"):
        return ""
    sandbox.put_file(f"{DIR}/py/{SITE}", (FILES / SITE).read_bytes(), user="root", mode=0o644)
    sandbox.put_file(f"{DIR}/{UV}", (FILES / UV).read_bytes(), user="root", mode=0o644)
    return exports(answers)
