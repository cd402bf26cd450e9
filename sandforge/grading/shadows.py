"""Modules the policy planted to shadow what a grader's Python imports, set aside before a check runs in its workspace.

Python puts the working directory first on ``sys.path`` for ``python3 -m`` and ``-c``, so a check that runs
``python3 -m pytest`` in the workspace (every terminal-bench ``test.sh`` does, from the image's WORKDIR, as Harbor's
contract says) imports a ``pytest.py`` the policy left there, which can write any reward. Isolating that python
(``-I``, ``PYTHONSAFEPATH``) is not ours to do: it reaches the programs a test runs, and the policy's own script
importing its sibling module is no attack. The check's Pythons import root's modules first (sandforge/grading/startup.py,
which holds in any folder); the planted modules at the workdir's top level also go, a second line.

At reset, before the policy acts, ``mark_start`` records the names in the workdir (root-only, on the verifiers'
tmpfs). Before a check runs commands there, ``set_aside`` moves every *new* top-level entry that would be imported
under the name of a module the grader's Python can import (the standard library, the installed packages, pytest and
its plugins, ``sitecustomize``) into a fresh root-only folder in the workdir itself, ``.sandforge-aside.XXXXXX``
(Python cannot import it; pytest does not collect dot-folders): ``X.py``, ``X.pyc``, ``X*.so`` and packages ``X/``.
The move is a rename on the same filesystem, whatever the entries' sizes, in batches (one ``mv`` for many names), so
its cost is bounded by the number of names, not their bytes: neither a huge planted file nor 30,000 planted names can
make it fail or overrun. A file the task shipped (there at the start) is never touched, nor a Python file the task's
instruction names in the workdir (a task asking for ``statistics.py``: that file is the code under test, and the
tests import it as the task says; ``answer_paths``). Without a start record (a sandbox graded outside an env) nothing
is moved.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

from sandforge.types import Sandbox

START = "/run/sandforge-root/workdir-at-start"  # NUL-separated names
# a Python file named in prose: `statistics.py`, /app/json.py, ./solver.py (not part of a longer word or path)
_NAMED_FILE = re.compile(r"(?<![\w.\-/])((?:\.{0,2}/)?(?:[\w.\-]+/)*[A-Za-z_]\w*\.py)(?![\w/])")
SHOWN = 20  # names of the entries set aside that come back (the count is always exact)
ALWAYS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "sitecustomize", "usercustomize")

_MARK = r"""shopt -s nullglob dotglob
for e in "$1"/*; do printf '%s\0' "${e##*/}"; done > "$2"
"""

_SET_ASIDE = r"""wd=$1 start=$2 keep=$3; shift 3
[[ -r $start && -d $wd ]] || { echo "count 0"; exit 0; }
declare -A old known
while IFS= read -r -d '' n; do old[$n]=1; done < "$start"
for ((i = 0; i < keep; i++)); do old[$1]=1; shift; done
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
  [[ -n $m && -n ${known[$m]} ]] && found+=("$b")
done
(( ${#found[@]} )) || { echo "count 0"; exit 0; }
aside=$(mktemp -d "$wd/.sandforge-aside.XXXXXX") && chmod 0700 "$aside" && cd "$wd" || exit 1
for ((i = 0; i < ${#found[@]}; i += 500)); do mv -f -- "${found[@]:i:500}" "$aside/" || exit 1; done
printf '%s\n' "${found[@]:0:SHOWN}"
echo "count ${#found[@]}"
""".replace("SHOWN", str(SHOWN))


def mark_start(sandbox: Sandbox, workdir: str | None = None) -> None:
    """Record the names in ``workdir`` (default the sandbox's) as the episode starts, before the policy acts."""
    command = f"bash -c {shlex.quote(_MARK)} mark {shlex.quote(workdir or sandbox.workdir)} {START}"
    result = sandbox.exec(command, timeout=30, user="root", session=False, workdir="/")
    if result.exit_code != 0:
        raise OSError(f"cannot record the workdir's names: {result.output.strip()[-200:]}")


@dataclass(frozen=True)
class SetAside:
    """What ``set_aside`` moved: how many entries, and the names of the first ``SHOWN``."""

    count: int = 0
    names: tuple[str, ...] = ()


def answer_paths(instruction: str) -> tuple[str, ...]:
    """The Python files a task's instruction names (``statistics.py``, ``/app/json.py``), in order, once each."""
    return tuple(dict.fromkeys(m.group(1) for m in _NAMED_FILE.finditer(instruction)))


def answer_names(paths: list[str] | tuple[str, ...], workdir: str) -> tuple[str, ...]:
    """Of ``paths`` (``answer_paths``), the entry names at the top of ``workdir``: bare, ``./``, or under ``workdir``."""
    top = posixpath.normpath(workdir)
    names = []
    for path in paths:
        folder, name = posixpath.split(str(path))
        if name and (folder in ("", ".") or posixpath.normpath(posixpath.join(top, folder)) == top):
            names.append(name)
    return tuple(dict.fromkeys(names))


def set_aside(sandbox: Sandbox, workdir: str | None, timeout: float, keep: tuple[str, ...] = ()) -> SetAside:
    """Move the policy's new shadow modules out of ``workdir``'s top level (default the sandbox's), except the entry
    names in ``keep`` (the code under test the task names: ``answer_names``). OSError when that cannot be done (the
    check cannot run soundly: its caller scores the episode 0, the policy's doing)."""
    words = " ".join(shlex.quote(w) for w in (workdir or sandbox.workdir, START, str(len(keep)), *keep, *ALWAYS))
    result = sandbox.exec(f"bash -c {shlex.quote(_SET_ASIDE)} set-aside {words}", timeout=timeout, user="root",
                          session=False, workdir="/")
    if result.exit_code != 0 or result.timed_out:
        raise OSError(f"cannot set the workdir's shadow modules aside: {result.output.strip()[-200:]}")
    lines = [line for line in result.output.splitlines() if line]
    counted = lines[-1].split() if lines and lines[-1].startswith("count ") else ["count", "0"]
    return SetAside(int(counted[1]), tuple(line for line in lines if not line.startswith("count "))[:SHOWN])


def note(moved: SetAside) -> str:
    """What a check's reason says about modules set aside ("" when none were)."""
    if not moved.count:
        return ""
    shown = ", ".join(moved.names[:5]) + (f" and {moved.count - 5} more" if moved.count > 5 else "")
    return f" (set aside before the check: {shown}, which shadowed modules the grader imports)"
