"""The tests verifier: JUnit parsing, FAIL_TO_PASS/PASS_TO_PASS grading, and the generated tests' two properties
checked by really running them: FAIL_TO_PASS fails on the buggy base and passes once fixed, PASS_TO_PASS passes on
both."""

from __future__ import annotations

import pytest

from sandforge.environments.repo.tasks import FAMILIES, make_task
from sandforge.environments.sandbox.docker_sandbox import Sandbox, SandboxSpec, list_run_containers
from sandforge.environments.sandbox.images import build_images
from sandforge.types import Task
from sandforge.verifiers.base import VerifierError, score_task
from sandforge.verifiers.tests import (
    ERROR,
    FAILED,
    PASSED,
    SKIPPED,
    grade_results,
    graded_tree,
    parse_junit,
    run_tests_fresh,
)

# What pytest 7 writes (xunit2): one testsuite under testsuites, classname = dotted module path (+ class).
XUNIT2 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="0.05">
<testcase classname="tests.test_math" name="test_ok" time="0.001" />
<testcase classname="tests.test_math" name="test_bad" time="0.001">
  <failure message="assert 1 == 2&#10;  where 1 = f()">def test_bad():
&gt;       assert f() == 2
E       assert 1 == 2</failure></testcase>
<testcase classname="tests.test_math.TestGroup" name="test_in_class" time="0.001" />
<testcase classname="tests.test_math" name="test_skip" time="0.0"><skipped type="pytest.skip" message="not today" />
</testcase>
<testcase classname="tests.test_text_hidden" name="test_boom" time="0.0">
  <error message="collection failure">ImportError: cannot import name 'shout'</error></testcase>
</testsuite></testsuites>
"""

# xunit1 with a bare testsuite root, and a test that failed and then errored in teardown (reported twice).
XUNIT1 = """<testsuite name="pytest" tests="2">
<testcase classname="tests.test_a" file="tests/test_a.py" name="test_twice"><failure message="boom"/></testcase>
<testcase classname="tests.test_a" file="tests/test_a.py" name="test_twice"><error message="teardown"/></testcase>
<testcase classname="tests.test_a" name="test_fine"><system-out>hello</system-out></testcase>
</testsuite>"""

FILES = ["tests/test_math.py", "tests/test_text_hidden.py", "tests/test_a.py"]


def test_junit_outcomes_map_to_pytest_node_ids():
    results = parse_junit(XUNIT2, FILES)
    assert {k: r.outcome for k, r in results.items()} == {
        "tests/test_math.py::test_ok": PASSED,
        "tests/test_math.py::test_bad": FAILED,
        "tests/test_math.py::TestGroup::test_in_class": PASSED,
        "tests/test_math.py::test_skip": SKIPPED,
        "tests/test_text_hidden.py::test_boom": ERROR,
    }
    assert results["tests/test_math.py::test_bad"].message == "assert 1 == 2"
    assert results["tests/test_math.py::test_skip"].message == "not today"
    # without the file list the ids stay JUnit's own
    assert "tests.test_math::test_ok" in parse_junit(XUNIT2)


def test_junit_keeps_the_worst_report_of_a_test_and_reads_xunit1():
    results = parse_junit(XUNIT1, FILES)
    assert results["tests/test_a.py::test_twice"].outcome == ERROR
    assert results["tests/test_a.py::test_fine"].outcome == PASSED and len(results) == 2


@pytest.mark.parametrize("text", ["", "not xml at all", "<html><body>PASSED</body></html>"])
def test_text_that_is_not_junit_is_refused(text):
    with pytest.raises(ValueError, match="not a JUnit XML report"):
        parse_junit(text)


def test_grade_needs_every_required_test_to_pass():
    results = parse_junit(XUNIT2, FILES)
    score, parts, reason = grade_results(results, ["tests/test_math.py::test_ok"],
                                         ["tests/test_math.py::test_in_class"])  # the id lacks its class
    assert score == 0.0 and "did not pass: tests/test_math.py::test_in_class not run" in reason
    score, parts, reason = grade_results(
        results, ["tests/test_math.py::test_ok"], ["tests/test_math.py::TestGroup::test_in_class"])
    assert (score, parts) == (1.0, {"fail_to_pass": 1.0, "pass_to_pass": 1.0}) and "all 1 FAIL_TO_PASS" in reason
    score, parts, reason = grade_results(
        results, ["tests/test_math.py::test_bad", "tests/test_math.py::test_ok"],
        ["tests/test_math.py::test_skip", "tests/test_text_hidden.py::test_boom"])
    assert (score, parts) == (0.0, {"fail_to_pass": 0.5, "pass_to_pass": 0.0})
    assert reason == ("3 required test(s) did not pass: tests/test_math.py::test_bad failed, "
                      "tests/test_math.py::test_skip skipped, tests/test_text_hidden.py::test_boom error")


def test_graded_tree_takes_only_the_package_from_the_policy():
    base = {"pkg/a.py": "A", "pkg/b.py": "B", "tests/test_a.py": "T", "pytest.ini": "[pytest]\n"}
    policy = {"pkg/a.py": "A fixed", "pkg/new.py": "N", "tests/test_a.py": "assert True", "conftest.py": "hack",
              "pkgx/evil.py": "E"}
    tree = graded_tree("pkg", base, {"tests/test_a_hidden.py": "H"}, policy)
    assert tree == {"pkg/a.py": "A fixed", "pkg/new.py": "N", "tests/test_a.py": "T", "pytest.ini": "[pytest]\n",
                    "tests/test_a_hidden.py": "H"}  # pkg/b.py deleted by the policy stays deleted


def test_bad_arguments_fail_the_episode_with_a_usage_message():
    task = Task(id="t/1", env="repo", family="f", seed=1, instruction="x",
                checks=[{"verifier": "repo_tests", "package": "p", "files": {}}])
    with pytest.raises(VerifierError, match="repo_tests takes fail_to_pass, files, hidden_tests"):
        score_task(object(), task)


# --- the generated tests, run for real ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_box(docker_client, tmp_path_factory):
    """A sandbox of the repo image: run_tests_fresh copies its spec and labels for the grading containers."""
    import uuid

    from sandforge.environments.sandbox.docker_sandbox import remove_run_containers

    image = build_images(["repo"], client=docker_client, show_progress=False)["repo"]
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    with Sandbox.create(SandboxSpec(image=image), run_id, client=docker_client) as box:
        yield box
    remove_run_containers(run_id, docker_client)


def _outcomes(box: Sandbox, task: Task, fixed: bool) -> dict[str, str]:
    check = task.checks[0]
    package = dict(check["files"])
    if fixed:
        fix = task.solution[0].arguments
        package[fix["path"]] = package[fix["path"]].replace(fix["old"], fix["new"])
    tree = graded_tree(check["package"], check["files"], check["hidden_tests"],
                       {p: t for p, t in package.items() if p.startswith(check["package"] + "/")})
    report, output = run_tests_fresh(box, tree, timeout=60)
    assert report is not None, output
    results = parse_junit(report, [p for p in tree if p.startswith("tests/")])
    return {test_id: r.outcome for test_id, r in results.items()}


@pytest.mark.docker
@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fail_to_pass_fails_before_the_fix_and_pass_to_pass_passes_on_both(family, split, repo_box, docker_client):
    task = make_task(family, 3, split)
    check = task.checks[0]
    required = set(check["fail_to_pass"]) | set(check["pass_to_pass"])
    buggy, fixed = _outcomes(repo_box, task, fixed=False), _outcomes(repo_box, task, fixed=True)
    assert set(buggy) == set(fixed) == required  # every test that ran is graded, and every graded test ran
    assert all(buggy[t] in (FAILED, ERROR) for t in check["fail_to_pass"]), buggy
    assert all(buggy[t] == PASSED for t in check["pass_to_pass"]), buggy
    assert all(outcome == PASSED for outcome in fixed.values()), fixed
    assert list_run_containers(repo_box.run_id, docker_client) == [repo_box.id]  # graders removed
