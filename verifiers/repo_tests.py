"""Grading by tests: the policy's change to a repository, applied in a fresh container, against hidden tests.

``repo_tests`` never runs anything in the episode's sandbox: the policy could have rewritten its tests, its .git, a
conftest.py, a fake pytest or a report file there, or killed what it could. It only reads, as root, the package's
Python files from the final working tree. A FRESH container from the same image then gets the base repository from
the task (tests, pytest.ini and every other file exactly as the task shipped them), the policy's package files on top
(minus anything pytest or Python would load on its own: conftest.py, sitecustomize.py, usercustomize.py), and the
hidden tests. pytest runs there as root with a timeout, writing JUnit XML to a path of this run only; the score is
1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passed.

Known limit, as in SWE-bench: the package's own code runs inside that pytest process, so code written to attack
pytest itself (patching its reporter from an imported module) is not stopped here.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import uuid
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass

from sandforge.types import Sandbox
from sandforge.verifiers.checks import VerifierError, ZeroScore, time_left

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
MAX_CARRIED_FILES = 200
MAX_CARRIED_BYTES = 1 << 20  # per file; a larger "source file" is not a fix
# Python or pytest load these by name alone, so a policy-written one could decide the result: never carried over.
NEVER_CARRIED = {"conftest.py", "sitecustomize.py", "usercustomize.py"}
_PYTEST = "python3 -I -m pytest -q -p no:cacheprovider -o addopts= --junitxml={xml} tests"
# Lists the package's regular .py files (no symlinks) as JSON, run with -I so nothing in the workspace is imported.
# Breadth first, without recursion, to MAX_DEPTH folders down, past entries it cannot read: whatever tree the policy
# left (1,200 nested folders made a recursive os.walk raise), the listing ends, shallow files first.
MAX_DEPTH = 32
_LIST_FILES = r"""
import collections, json, os, sys
out, queue = [], collections.deque([(sys.argv[1], 0)])
while queue:
    folder, depth = queue.popleft()
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (OSError, ValueError):
        continue
    for e in entries:
        try:
            if e.is_symlink():
                continue
            if e.is_dir():
                if depth < %d:
                    queue.append((e.path, depth + 1))
            elif e.name.endswith(".py") and e.is_file():
                out.append(os.path.relpath(e.path))
        except (OSError, ValueError):
            continue
print(json.dumps(out))
""" % MAX_DEPTH


@dataclass
class CaseResult:
    """One test case from a JUnit report: ``test_id`` is pytest's node id ("tests/test_x.py::test_y")."""

    test_id: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""


def parse_junit(xml_text: str, test_files: list[str] | None = None) -> dict[str, CaseResult]:
    """Outcome of every test case in a JUnit XML report (pytest's xunit1 or xunit2, one or more testsuites).

    JUnit names a case by ``classname`` ("tests.test_x" or "tests.test_x.TestClass") and ``name``; with the test file
    paths known, ids come back as pytest node ids ("tests/test_x.py::TestClass::test_y"). A case reported twice (a
    failing test whose teardown also errors) keeps its worst outcome. Raises ValueError for text that is not JUnit.
    """
    try:
        root = ElementTree.fromstring(xml_text)
    except ElementTree.ParseError as e:
        raise ValueError(f"not a JUnit XML report: {e}") from e
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"not a JUnit XML report: root element <{root.tag}>")
    modules = {posixpath.splitext(p)[0].replace("/", "."): p for p in test_files or []}
    rank = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
    results: dict[str, CaseResult] = {}
    for case in root.iter("testcase"):
        test_id = _node_id(case.get("classname", ""), case.get("name", ""), modules)
        outcome, message = PASSED, ""
        for child in case:
            if child.tag in ("failure", ERROR, "skipped"):
                outcome = {"failure": FAILED, ERROR: ERROR, "skipped": SKIPPED}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0] if message else ""
                break
        old = results.get(test_id)
        if old is None or rank[outcome] > rank[old.outcome]:
            results[test_id] = CaseResult(test_id, outcome, message)
    return results


def _node_id(classname: str, name: str, modules: dict[str, str]) -> str:
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):  # the longest dotted prefix that is a known test file
        module = ".".join(parts[:cut])
        if module in modules:
            return "::".join([modules[module], *parts[cut:], name])
    return f"{classname}::{name}" if classname else name


def grade_results(results: dict[str, CaseResult], fail_to_pass: list[str], pass_to_pass: list[str]
                  ) -> tuple[float, dict[str, float], str]:
    """(1.0 iff every listed test passed, fraction passed per group, a reason naming what did not pass)."""
    breakdown, problems = {}, []
    for group, ids in (("fail_to_pass", fail_to_pass), ("pass_to_pass", pass_to_pass)):
        bad = [(i, results[i].outcome if i in results else "not run") for i in ids
               if i not in results or results[i].outcome != PASSED]
        breakdown[group] = (len(ids) - len(bad)) / len(ids) if ids else 1.0
        problems += [f"{i} {outcome}" for i, outcome in bad]
    if not problems:
        return 1.0, breakdown, f"all {len(fail_to_pass)} FAIL_TO_PASS and {len(pass_to_pass)} PASS_TO_PASS passed"
    shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
    return 0.0, breakdown, f"{len(problems)} required test(s) did not pass: {shown}"


def policy_package_files(sandbox: Sandbox, package: str) -> dict[str, str]:
    """The package's .py files (path relative to the workdir -> text) as the policy left them, read as root."""
    command = f"python3 -I -c {shlex.quote(_LIST_FILES)} {shlex.quote(package)}"
    result = sandbox.exec(command, timeout=min(30.0, time_left()), user="root", session=False)
    if result.timed_out:  # the tree the policy left: its 0, never a failed episode
        raise ZeroScore("timeout", "listing the policy's package files ran out of time")
    if result.exit_code != 0:
        raise ZeroScore("state", f"the policy's package files could not be listed: {result.output[-300:]}")
    try:
        paths = json.loads(result.output)
    except json.JSONDecodeError:
        return {}  # more names than an exec prints: no plausible fix looks like that
    files = {}
    for path in paths[:MAX_CARRIED_FILES]:
        if posixpath.basename(path) in NEVER_CARRIED:
            continue
        try:
            data = sandbox.get_file(path, user="root", max_bytes=MAX_CARRIED_BYTES)
        except OSError:
            continue  # too large, or gone: the base version (if any) stays out too
        if data is not None:
            files[path] = data.decode(errors="replace")
    return files


def graded_tree(package: str, base: dict[str, str], hidden: dict[str, str], policy: dict[str, str]) -> dict[str, str]:
    """What pytest runs on: the base repository with the package replaced by the policy's version (deleted modules
    stay deleted), then the hidden tests. Tests and config outside the package always come from the base."""
    prefix = package.rstrip("/") + "/"
    tree = {p: text for p, text in base.items() if not p.startswith(prefix)}
    tree.update({p: text for p, text in policy.items() if p.startswith(prefix)})
    tree.update(hidden)
    return tree


def run_tests_fresh(sandbox: Sandbox, tree: dict[str, str], timeout: float | None = None) -> tuple[str | None, str]:
    """Write ``tree`` into ``sandbox.fresh()``, run pytest there as root; (JUnit XML or None, output).

    pytest gets ``timeout`` seconds, by default what the check has left (``time_left()``: the check's ``timeout``
    less the container's start). The fresh sandbox has the episode's image, limits and owner, and none of what the
    policy left in ``sandbox``; it is closed here.
    """
    grader = sandbox.fresh()
    try:
        for path, text in tree.items():
            grader.write_file(posixpath.join(grader.workdir, path), text, user="root")
        xml = f"/tmp/sandforge-grade-{uuid.uuid4().hex}.xml"
        timeout = time_left() if timeout is None else timeout
        result = grader.exec(_PYTEST.format(xml=xml), timeout=timeout, user="root", session=False)
        report = grader.read_file(xml, user="root")
        output = result.output + (f"\n[timed out after {timeout:g}s]" if result.timed_out else "")
        return report, output
    finally:
        grader.close()


def repo_tests_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str, dict[str, float]]:
    needed = {"package", "files", "hidden_tests", "fail_to_pass", "pass_to_pass"}
    unknown, missing = set(args) - needed - {"timeout"}, needed - set(args)
    if unknown or missing:
        raise VerifierError(f"repo_tests takes {', '.join(sorted(needed))}[, timeout]; got {sorted(args)}")
    package = args["package"]
    tree = graded_tree(package, args["files"], args["hidden_tests"], policy_package_files(sandbox, package))
    report, output = run_tests_fresh(sandbox, tree)  # bounded by the check's timeout (verifiers/checks.py)
    if report is None:
        tail = output.strip().splitlines()[-3:]
        return 0.0, f"pytest wrote no report: {' | '.join(tail)}", {"fail_to_pass": 0.0, "pass_to_pass": 0.0}
    test_files = [p for p in tree if p.startswith("tests/") and p.endswith(".py")]
    try:
        results = parse_junit(report, test_files)
    except ValueError as e:
        return 0.0, f"unreadable pytest report: {e}", {"fail_to_pass": 0.0, "pass_to_pass": 0.0}
    score, breakdown, reason = grade_results(results, args["fail_to_pass"], args["pass_to_pass"])
    return score, reason, breakdown
