"""Modules the policy planted to shadow what a grader's Python imports, set aside before a check runs in its workspace.

Python puts the working directory first on ``sys.path`` for ``python3 -m`` and ``-c``, so a check that runs
``python3 -m pytest`` in the workspace (every terminal-bench ``test.sh`` does, from the image's WORKDIR, as Harbor's
contract says) imports a ``pytest.py`` the policy left there, which can write any reward. Isolating that python
(``-I``, ``PYTHONSAFEPATH``) is not ours to do: it reaches the programs a test runs, and the policy's own script
importing its sibling module is no attack. So the planted modules go instead.

At reset, before the policy acts, ``mark_start`` records the names in the workdir (root-only, on the verifiers'
tmpfs). Before a check runs commands there, ``set_aside`` moves every *new* top-level entry that would be imported
under the name of a module the grader's Python can import (the standard library, the installed packages, pytest and
its plugins, ``sitecustomize``) into a root-only folder: ``X.py``, ``X.pyc``, ``X*.so`` and packages ``X/``. A file the
task shipped (there at the start) is never touched, and a solution's own module names are not the standard library's.
Without a start record (a sandbox graded outside an env) nothing is moved.
"""

from __future__ import annotations

import shlex

from sandforge.types import Sandbox

START = "/run/sandforge-root/workdir-at-start"  # NUL-separated names
ASIDE = "/run/sandforge-root/set-aside"
ALWAYS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "sitecustomize", "usercustomize")

_MARK = r"""shopt -s nullglob dotglob
for e in "$1"/*; do printf '%s\0' "${e##*/}"; done > "$2"
"""

_SET_ASIDE = r"""wd=$1 start=$2 aside=$3; shift 3
[[ -r $start && -d $wd ]] || exit 0
declare -A old known
while IFS= read -r -d '' n; do old[$n]=1; done < "$start"
for n in "$@"; do known[$n]=1; done
while IFS= read -r n; do [[ -n $n ]] && known[$n]=1; done < <(python3 -I -c 'import pkgutil, sys
print("\n".join(sorted(set(sys.stdlib_module_names) | {m.name for m in pkgutil.iter_modules()})))' 2>/dev/null)
shopt -s nullglob dotglob
for e in "$wd"/*; do
  b=${e##*/}
  [[ -n ${old[$b]} ]] && continue
  m=
  if [[ -d $e ]]; then
    [[ -e $e/__init__.py || -e $e/__init__.pyc ]] && m=$b
  else
    case $b in *.py|*.pyc) m=${b%.*} ;; *.so) m=${b%%.*} ;; esac
  fi
  [[ -n $m && -n ${known[$m]} ]] || continue
  mkdir -p -m 0700 "$aside" && mv -f -- "$e" "$aside/" && printf '%s\n' "$b"
done
"""


def mark_start(sandbox: Sandbox, workdir: str | None = None) -> None:
    """Record the names in ``workdir`` (default the sandbox's) as the episode starts, before the policy acts."""
    command = f"bash -c {shlex.quote(_MARK)} mark {shlex.quote(workdir or sandbox.workdir)} {START}"
    result = sandbox.exec(command, timeout=30, user="root", session=False, workdir="/")
    if result.exit_code != 0:
        raise OSError(f"cannot record the workdir's names: {result.output.strip()[-200:]}")


def set_aside(sandbox: Sandbox, workdir: str | None, timeout: float) -> list[str]:
    """Move the policy's new shadow modules out of ``workdir`` (default the sandbox's); the names moved."""
    words = " ".join(shlex.quote(w) for w in (workdir or sandbox.workdir, START, ASIDE, *ALWAYS))
    result = sandbox.exec(f"bash -c {shlex.quote(_SET_ASIDE)} set-aside {words}", timeout=timeout, user="root",
                          session=False, workdir="/")
    if result.exit_code != 0 or result.timed_out:
        raise OSError(f"cannot set the workdir's shadow modules aside: {result.output.strip()[-200:]}")
    return [line for line in result.output.splitlines() if line]


def note(moved: list[str]) -> str:
    """What a check's reason says about modules set aside ("" when none were)."""
    if not moved:
        return ""
    shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
    return f" (set aside before the check: {shown}, which shadowed modules the grader imports)"
