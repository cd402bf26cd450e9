"""What a grader's own command starts with in a sandbox: Python that trusts root's files first, offline uv, safe git.

A check (a ``command`` check, a Harbor ``test.sh``, a judge's command) runs as root in the policy's workdir, after
every process of the policy is gone, but among the files the policy left. The start-up it runs must load nothing
from them except the code under test. Python and pytest would: ``python3 -m pytest`` puts the working directory
first on ``sys.path`` (a ``pytest.py`` there, or in a subfolder the check ``cd``s into, or a module named like one
only the tests' own ``PYTHONPATH`` has, would be imported), libraries try optional imports that the policy can
answer (``copy``'s ``org.python.core``), and pytest autoloads the plugins every ``*.dist-info`` on ``sys.path``
announces. terminal-bench's test.sh sources ``.tbench-testing/bin/activate`` from the workdir after a ``uv venv``
that, offline, never ran; root's git refuses the policy's repository, and trusting it runs what its config names.

So ``prepare`` writes sandforge's own start-up into the root-only spool (``files/``, in one exec) and returns
the shell lines a root check runs first:

- every Python the check starts runs ``files/_sandforge_imports.py`` first: from a ``.pth`` in the user site
  ``PYTHONUSERBASE`` names (before ``site`` imports ``sitecustomize``, whatever ``PYTHONPATH`` says), from a
  root-owned ``.pth`` in every site-packages folder of the image the policy cannot write (``SITE_PTH``: the image's
  venvs, and a check that turns the user site off or sets ``PYTHONPATH`` itself), else from the ``sitecustomize`` on
  ``PYTHONPATH``. Imports search the folders the policy cannot
  write first, a library's own import statement never reaches the others, and packages' metadata (plugin entry
  points) comes from those folders only; the Python files the task's instruction names (``statistics.py``: the code
  under test) keep Python's own order (``SANDFORGE_ANSWERS``). What the policy can write is judged by its ids
  (``SANDFORGE_POLICY_IDS``, asked in the sandbox);
- ``PATH`` keeps only folders the policy cannot write (``files/path.sh``);
- ``uv`` and ``uvx`` are bash functions running ``files/uv.sh``: ``uv venv`` removes what stands at the path
  and makes a venv that sees the image's packages, ``uv pip install`` succeeds only for what the image has, ``uv
  run`` runs the command, and an option it does not know is refused;
- ``git`` is a bash function running ``files/git.sh``: a repository root does not own is read through a
  root-owned view of it (its objects, refs and index; a config of the settings that run nothing);
- ``apt-get``/``apt`` and ``curl``/``wget`` are bash functions running ``files/apt.sh`` and ``curl.sh``, so
  Harbor's own test.sh template runs offline: ``apt-get update`` keeps the image's lists, ``apt-get install``
  succeeds for what the image has and names what it lacks, and uv's installer is not fetched (uv is the stand-in
  above); any other URL goes to the image's own curl.

Isolating the check's Python outright (``-I``, ``PYTHONSAFEPATH``) would also drop the working directory that the
tests import the answer from. The shadow set-aside (sandforge/grading/shadows.py) still runs first, as a second line.
A command that empties the environment (``env -i``) keeps the start-up: the ``.pth`` in the image's site-packages
reads the policy's ids from a ``context`` file on the spool when the environment has none.
Not covered: a check running as another user than root (the spool is root's); a Python that skips ``site``
(``python3 -S``); a venv the
policy made itself (its site-packages are the policy's); ``uv`` or ``git`` started by another program than bash (the functions are bash's: a
Python test's ``subprocess.run(["git", ...])`` gets the image's git, which refuses the policy's repository).
"""

from __future__ import annotations

import base64
import posixpath
import shlex
from pathlib import Path

from sandforge.types import Sandbox

DIR = "/run/sandforge-root/startup"  # on the verifiers' root-only (0700) spool: the policy cannot read or write it
FILES = Path(__file__).with_name("files")
PYTHON = ("_sandforge_imports.py", "sitecustomize.py")  # into DIR/py: PYTHONPATH's folder
SCRIPTS = ("uv.sh", "git.sh", "path.sh", "apt.sh", "curl.sh")  # into DIR, run by bash (the spool is noexec)
VERSIONS = tuple(f"3.{minor}" for minor in range(6, 16))  # the Pythons whose user site gets the .pth
SITE_PTH = "00-sandforge-startup.pth"  # in the image's own site-packages folders: first of their .pth files


def answer_modules(answers: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The top-level module names of the Python files a task's instruction names (``shadows.answer_paths``): a
    module's stem, or a package's name for its ``__init__.py``."""
    names = []
    for path in answers:
        folder, name = posixpath.split(posixpath.normpath(str(path)))
        stem = posixpath.basename(folder) if name == "__init__.py" else name[:-3] if name.endswith(".py") else ""
        if stem.isidentifier():
            names.append(stem)
    return tuple(dict.fromkeys(names))


def pth_line(start: str) -> str:
    """The user site's .pth line: it runs ``start`` by its absolute path (no module found by name, which a policy
    folder first on PYTHONPATH could answer), before ``site`` imports ``sitecustomize``."""
    source = f"compile(open({start!r}, 'rb').read(), {start!r}, 'exec')"
    return f"import sys; exec({source}, {{'__name__': '_sandforge_imports'}})\n"


def site_pth_line(start: str) -> str:
    """The line of the ``.pth`` put in the image's own site-packages folders: ``pth_line``, for a process that can
    read the root-only spool (a root check's); any other Python starts as it would without it."""
    source = f"compile(open({start!r}, 'rb').read(), {start!r}, 'exec')"
    return (f"import os, sys; os.access({start!r}, os.R_OK) and "
            f"exec({source}, {{'__name__': '_sandforge_imports'}})\n")


def site_folders_script(pth: str, policy_ids: tuple[int, ...]) -> str:
    """The bash that puts ``pth`` (``SITE_PTH``) in every site-packages (or Debian dist-packages) folder of the
    sandbox that the policy cannot write: every Python of the image, its venvs' too, runs the start-up, whatever a
    check does to its environment (``-E``, ``-I``, ``PYTHONNOUSERSITE``, a ``PYTHONPATH`` of its own, a venv without
    the user site). A folder the policy can write (not owned by its uid, nor writable by others or a group of its) is
    left alone: it is the policy's, and root writes nothing there."""
    uid, gids = policy_ids[0], policy_ids[1:]
    groups = "".join(f" ! \\( -perm -0020 -group {g} \\)" for g in gids)
    return (f"find / \\( -path /proc -o -path /sys -o -path /dev -o -path {DIR.rsplit('/', 1)[0]} \\) -prune -o "
            f"-type d \\( -name site-packages -o -name dist-packages \\) ! -user {uid} ! -perm -0002{groups} "
            f"-print -prune 2>/dev/null | while IFS= read -r d; do printf '%s' {shlex.quote(pth)} > \"$d/{SITE_PTH}\" "
            "|| true; done")


def install_script(folder: str = DIR, policy_ids: tuple[int, ...] = (), answers: tuple[str, ...] = ()) -> str:
    """The bash that writes the start-up's files under ``folder``, a user site per Python version, the ``context``
    (``policy_ids`` and the ``answers``' modules, what ``exports`` sets, for a Python started with an emptied
    environment) and (for a non-root policy) the ``.pth`` in the image's own site-packages folders."""
    context = f"{' '.join(map(str, policy_ids))}\n{' '.join(answer_modules(answers))}\n"
    lines = ["set -e", f"mkdir -p {folder}/py", f"printf '%s' {shlex.quote(context)} > {folder}/py/context"]
    files = [(f"py/{name}", FILES / name) for name in PYTHON] + [(name, FILES / name) for name in SCRIPTS]
    for rel, source in files:
        lines.append(f"base64 -d > {folder}/{rel} <<'SANDFORGE_EOF'\n"
                     f"{base64.b64encode(source.read_bytes()).decode()}\nSANDFORGE_EOF")
    pth = shlex.quote(pth_line(f"{folder}/py/{PYTHON[0]}"))
    lines.append(f"for v in {' '.join(VERSIONS)}; do d={folder}/base/lib/python$v/site-packages; mkdir -p \"$d\"; "
                 f"printf '%s' {pth} > \"$d/sandforge.pth\"; done")
    if policy_ids and policy_ids[0] != 0:  # a root policy can write anything: the start-up does nothing for it
        lines.append(site_folders_script(site_pth_line(f"{folder}/py/{PYTHON[0]}"), policy_ids))
    return "\n".join(lines) + "\n"


def exports(answers: list[str] | tuple[str, ...] = (), policy_ids: tuple[int, ...] = ()) -> str:
    """The shell lines that put the start-up in front of a root check's command (``prepare`` writes its files)."""
    uv, git, path, apt, curl = (shlex.quote(f"{DIR}/{name}") for name in SCRIPTS)
    return (f"export PYTHONPATH={DIR}/py${{PYTHONPATH:+:$PYTHONPATH}} PYTHONUSERBASE={DIR}/base "
            f"SANDFORGE_ANSWERS={shlex.quote(' '.join(answer_modules(answers)))} "
            f"SANDFORGE_POLICY_IDS={shlex.quote(' '.join(map(str, policy_ids)))}\n"
            f"unset PYTHONNOUSERSITE; PATH=$(bash {path})\n"
            f"uv() {{ bash {uv} uv \"$@\"; }}; uvx() {{ bash {uv} uvx \"$@\"; }}; git() {{ bash {git} \"$@\"; }}\n"
            f"apt-get() {{ bash {apt} apt-get \"$@\"; }}; apt() {{ bash {apt} apt \"$@\"; }}\n"
            f"curl() {{ bash {curl} curl \"$@\"; }}; wget() {{ bash {curl} wget \"$@\"; }}\n"
            "export -f uv uvx git apt-get apt curl wget\n")


def policy_ids(sandbox: Sandbox) -> tuple[int, ...]:
    """The uid and group ids of the sandbox's own (the policy's) user: the user the sandbox was made for
    (``policy_user``, a name or "uid[:gid]"), looked up by root, through root's own spool. Asked as that user, the
    command went through the policy's spool, which the policy can fill: a grading fault it could cause (#56)."""
    user = str(getattr(sandbox, "policy_user", "") or "")
    if not user:
        raise OSError("the sandbox does not say which user the policy runs as (policy_user)")
    uid, _, gid = user.partition(":")
    q = shlex.quote(uid)
    result = sandbox.exec(f"id -u -- {q} && id -G -- {q}", timeout=30, user="root", session=False, workdir="/")
    numbers = result.output.split()
    if result.exit_code == 0 and numbers and all(n.isdigit() for n in numbers):
        return tuple(int(n) for n in numbers)
    if uid.isdigit():  # a numeric user the image's /etc/passwd does not name
        return (int(uid),) + ((int(gid),) if gid.isdigit() else ())
    raise OSError(f"cannot read the ids of the sandbox's user {user!r}: {result.output.strip()[-200:]}")


def prepare(sandbox: Sandbox, user: str, answers: list[str] | tuple[str, ...] = ()) -> str:
    """Write the start-up into ``sandbox`` and return what a check run as ``user`` puts before its command ("" for a
    user other than root: the spool is root's alone). OSError if it cannot be written (the spool is root's, so that
    is the sandbox's fault, never the policy's)."""
    if user not in ("root", "0", "0:0"):
        return ""
    ids = policy_ids(sandbox)
    made = sandbox.exec(install_script(policy_ids=ids, answers=tuple(answers)), timeout=30, user="root",
                        session=False, workdir="/")
    if made.exit_code != 0:
        raise OSError(f"cannot write the grader start-up into the sandbox: {made.output.strip()[-200:]}")
    return exports(answers, ids)
