"""Procedural SWE-style tasks: a small Python package with one injected bug, visible tests and hidden tests.

Each family is a bug kind (``off_by_one``, ``wrong_operator``, ``wrong_condition``). A seed picks two or three
modules of functions drawn from ``functions.FUNCTIONS``, the function that gets the bug and the test inputs, and
names everything afresh: the package, its modules, the functions and their variables are syllable words of the
task's split (environments/words.py). So a held-out repository is a training one with names no training task uses,
fixed by the same steps, and no name or line of a fix can be learnt in place of reading it.
Expected values come from running the correct code here; whether a test exposes the bug from running the buggy code,
so FAIL_TO_PASS (fails before the fix, passes after) and PASS_TO_PASS (passes on both) are measured, never guessed.

What the policy gets: the buggy repository in /workspace as a git repository whose only commit is the buggy base (no
other refs, no reflog, garbage collected: nothing in .git holds the fix), the visible tests in tests/, and an
issue-style instruction naming the module, the call and what it should return. The reference solution reads the
module, then replaces the buggy line it has just seen (naming the module spares it a search: a grep opener taught a
warm-started policy to open terminal tasks with grep too). The hidden tests exist only in the task's check, driver side;
the ``repo_tests`` verifier adds them in a fresh container after the episode. Same (family, seed, split) -> same task.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import keyword
import random
import re
import sys
from typing import Any, Callable

from sandforge.environments.recovery import stumble
from sandforge.environments.seeding import SPLITS, task_start  # noqa: F401 - SPLITS: the task module's
from sandforge.environments.repo.functions import (
    FUNCTIONS,
    MODULES,
    OFF_BY_ONE,
    WRONG_CONDITION,
    WRONG_OPERATOR,
    Function,
)
from sandforge.environments.words import distinct
from sandforge.types import Task, ToolCall

# names a package, module, function or parameter must not take: a package named `site` or `time` in /workspace
# would shadow the standard library's for pytest itself
_RESERVED = set(sys.stdlib_module_names) | set(keyword.kwlist) | set(dir(builtins)) | {"same", "tests"}
SHORT = (2, 2)  # syllables of the names a fix's str_replace call spells out: it must fit in a turn's tokens
GRADE_TIMEOUT = 60.0  # seconds for the whole graded pytest run
_CANDIDATE_INPUTS = 24  # random argument tuples tried per function, beyond its edge cases
_SETUP = (
    "git init -q -b main . && git add -A"
    " && git -c user.name=sandforge -c user.email=sandforge@localhost commit -q -m 'Initial import'"
    " && git reflog expire --expire=now --all && git gc -q --prune=now"
)
_PYTEST_INI = "[pytest]\npythonpath = .\ntestpaths = tests\naddopts = -p no:cacheprovider\n"
# Every test file compares with this helper, and so does the generator when it decides which tests expose the bug.
# Equal is not enough: a function returning an object whose __eq__ always says True would pass any `==` test.
# `type` is bound before the package under test is imported, so the package cannot swap it out.
_SAME = '''_type = type


def same(got, want):
    """got equals want and has the same builtin types all the way down."""
    if _type(got) is not _type(want):
        return False
    if _type(want) in (list, tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return got == want
'''


def _variables(fn: Function) -> list[str]:
    """The names ``fn`` binds, parameters first, in order: what a task renames, so no line of a fix recurs."""
    tree = ast.parse(fn.source.format(name="f"))
    found = [a.arg for a in tree.body[0].args.args]
    found += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return list(dict.fromkeys(found))


def _renamed(fn: Function, names: list[str]) -> Function:
    """``fn`` with its variables (``_variables``) called ``names``: in the code, its bug lines, and where the docstring
    quotes them (`items`); the docstring's plain words stay English."""
    swap = dict(zip(_variables(fn), names))

    def rename(text: str) -> str:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if line.lstrip().startswith('"""'):
                lines[i] = re.sub(r"`(\w+)`", lambda m: f"`{swap.get(m.group(1), m.group(1))}`", line)
            else:  # whole names outside strings; no template has a variable's name inside a string
                lines[i] = re.sub(r"(?<![\w.\"'])(\w+)\b(?![\"'])", lambda m: swap.get(m.group(1), m.group(1)), line)
        return "\n".join(lines)

    return dataclasses.replace(fn, source=rename(fn.source),
                               bugs={kind: (rename(good), rename(bad)) for kind, (good, bad) in fn.bugs.items()})


def _compile(code: str, name: str) -> Callable:
    namespace: dict[str, Any] = {}
    exec(compile(code, f"<{name}>", "exec"), namespace)  # our own template source, never the policy's
    return namespace[name]


same: Callable[[Any, Any], bool] = _compile(_SAME, "same")


def _passes(got: tuple[bool, Any], want: Any) -> bool:
    """Whether a test expecting ``want`` passes on the ``_outcome`` ``got``."""
    return got[0] and same(got[1], want)


def _outcome(fn: Callable, args: tuple) -> tuple[bool, Any]:
    """(returned, value or exception type name) of fn(*args), on copies so a mutating bug cannot leak."""
    try:
        return True, fn(*[list(a) if isinstance(a, list) else a for a in args])
    except Exception as e:  # noqa: BLE001 - a buggy function raising is one of the symptoms we look for
        return False, type(e).__name__


def _cases(fn: Function, name: str, bug: str | None, rng: random.Random) -> tuple[list, list]:
    """(passing, revealing) argument tuples with the correct result: revealing ones give another result (or raise)
    on the buggy code. Without a bug every case is passing."""
    good, bad = _compile(fn.code(name), name), _compile(fn.code(name, bug), name) if bug else None
    tried, passing, revealing = set(), [], []
    for args in list(fn.edges) + [fn.inputs(rng) for _ in range(_CANDIDATE_INPUTS)]:
        key = repr(args)
        if key in tried:
            continue
        tried.add(key)
        ok, want = _outcome(good, args)
        if not ok:
            continue
        got = _outcome(bad, args) if bad else (True, want)
        (passing if _passes(got, want) else revealing).append((args, want, got))
    return passing, revealing


def _test_file(package: str, module: str, cases: list[tuple[str, str, tuple, Any]]) -> str:
    """A pytest file: one ``test_<id>`` per (test name, function, args, expected)."""
    imports = sorted({fn for _, fn, _, _ in cases})
    lines = [_SAME, "", f"from {package}.{module} import {', '.join(imports)}  # noqa: E402", ""]
    for test, fn, args, want in cases:
        call = f"{fn}({', '.join(repr(a) for a in args)})"
        lines += ["", f"def {test}():", f"    assert same({call}, {want!r})", ""]
    return "\n".join(lines)


def _symptom(name: str, args: tuple, want: Any, got: tuple[bool, Any]) -> str:
    call = f"{name}({', '.join(repr(a) for a in args)})"
    actual = f"returns {got[1]!r}" if got[0] else f"raises {got[1]}"
    return f"`{call}` {actual}, but it should return {want!r}"


def repo_task(family: str, seed: int, split: str = "train") -> Task:
    rng, task_id = task_start("repo", family, seed, split, key=f"repo/{family}/{split}/{seed}")  # as first written
    taken = set(_RESERVED)  # every name in the package differs from every other and from Python's own
    (package,) = distinct(rng, split, 1, taken, SHORT)
    target = rng.choice([f for f in FUNCTIONS if family in f.bugs])
    kinds = [target.module] + rng.sample([m for m in MODULES if m != target.module], rng.randint(1, 2))

    files: dict[str, str] = {}
    hidden: dict[str, str] = {}
    fail_to_pass: list[str] = []
    pass_to_pass: list[str] = []
    fix: tuple[str, str, str] | None = None  # (path, buggy line, correct line)
    symptom = ""
    for kind in kinds:
        (stem,) = distinct(rng, split, 1, taken, SHORT)
        pool = [f for f in FUNCTIONS if f.module == kind and f is not target]
        chosen = rng.sample(pool, rng.randint(1, 2)) + ([target] if kind == target.module else [])
        rng.shuffle(chosen)
        path = f"{package}/{stem}.py"
        sources, visible, secret = [], [], []
        for template in chosen:
            (name,) = distinct(rng, split, 1, taken)
            fn = _renamed(template, distinct(rng, split, len(_variables(template)), taken, SHORT))
            bug = family if template is target else None
            sources.append(fn.code(name, bug))
            passing, revealing = _cases(fn, name, bug, rng)
            if template is target:
                if not revealing:
                    raise AssertionError(f"{name}: no input exposes the {family} bug; add an edge case")
                # the hidden tests repeat the shown symptom when it is the only one (an empty list, say)
                shown, kept = revealing[:1] + passing[:1], (revealing[1:3] or revealing[:1]) + passing[1:2]
                symptom = _symptom(name, *revealing[0])
                fix = (path, *reversed(fn.bugs[family]))
            else:
                shown, kept = passing[:1], passing[1:3]
            for group, cases, label in ((visible, shown, ""), (secret, kept, "hidden_")):
                for i, (args, want, got) in enumerate(cases, 1):
                    group.append((f"test_{name}_{label}{i}", name, args, want))
                    test_file = f"tests/test_{stem}{'_hidden' if label else ''}.py"
                    (pass_to_pass if _passes(got, want) else fail_to_pass).append(
                        f"{test_file}::test_{name}_{label}{i}")
        docstring = f'"""{kind.capitalize()} helpers of {package}."""\n\n\n'
        files[path] = docstring + "\n\n".join(sources)
        files[f"tests/test_{stem}.py"] = _test_file(package, stem, visible)
        hidden[f"tests/test_{stem}_hidden.py"] = _test_file(package, stem, secret)
    assert fix is not None and files[fix[0]].count(fix[1]) == 1, "the buggy line must be unique in its module"
    files[f"{package}/__init__.py"] = f'"""{package}: small helpers."""\n'
    files["pytest.ini"] = _PYTEST_INI
    files[".gitignore"] = "__pycache__/\n.pytest_cache/\n"
    files["README.md"] = f"# {package}\n\nSmall helpers. Run the tests with `python3 -m pytest`.\n"

    path, buggy, correct = fix
    return Task(
        id=task_id,
        env="repo",
        family=family,
        seed=seed,
        split=split,
        # the report names the module, as a traceback would: the reference reads it and edits the line it saw
        instruction=f"Bug report for the `{package}` package in /workspace: in {path}, {symptom}. Fix the bug, "
                    "then submit.",
        setup={"files": files, "commands": [_SETUP]},
        checks=[{
            "verifier": "repo_tests",
            "package": package,
            "files": files,
            "hidden_tests": hidden,
            "fail_to_pass": fail_to_pass,
            "pass_to_pass": pass_to_pass,
            "timeout": GRADE_TIMEOUT,
        }],
        solution=_solution(task_id, path, buggy, correct),
    )


def _solution(task_id: str, path: str, buggy: str, correct: str) -> list[ToolCall]:
    """Read the module, replace the buggy line, submit; about half stumble first (environments/recovery.py): a read
    of the module's name outside its package, or the replacement without its ``new``, each rejected, then made right."""
    how = stumble(task_id, ("wrong_path", "missing_new"))
    read = ToolCall("read_file", {"path": path})
    fix = ToolCall("str_replace", {"path": path, "old": buggy, "new": correct})
    if how == "wrong_path":
        return [ToolCall("read_file", {"path": path.rsplit("/", 1)[-1]}), read, fix, ToolCall("submit")]
    if how == "missing_new":
        return [read, ToolCall("str_replace", {"path": path, "old": buggy}), fix, ToolCall("submit")]
    return [read, fix, ToolCall("submit")]


FAMILIES: dict[str, Callable[[int, str], Task]] = {
    kind: (lambda seed, split="train", kind=kind: repo_task(kind, seed, split))
    for kind in (OFF_BY_ONE, WRONG_OPERATOR, WRONG_CONDITION)
}
