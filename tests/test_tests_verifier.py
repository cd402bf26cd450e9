"""The tests verifier: JUnit parsing, FAIL_TO_PASS/PASS_TO_PASS grading, and the generated tests' two properties
checked by really running them: FAIL_TO_PASS fails on the buggy base and passes once fixed, PASS_TO_PASS passes on
both."""

from __future__ import annotations

import dataclasses
import io
import posixpath
import re
import tarfile

import pytest
from seeded import repo_task, straight

from sandforge.environments.repo.tasks import FAMILIES
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.sandbox.labels import DRIVER_LABELS, LABEL_RUN
from containers import list_run_containers
from sandforge.types import Sandbox as SandboxProtocol
from sandforge.types import Task
from sandforge.verifiers.checks import VerifierError, score_task
from sandforge.verifiers.repo_tests import (
    ERROR,
    FAILED,
    PASSED,
    SKIPPED,
    grade_results,
    graded_tree,
    parse_junit,
    run_tests_fresh,
)


def make_task(*args):
    """A repo task with its reference solution straight (no stumble: environments/recovery.py)."""
    return straight(repo_task(*args))


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

    from sandforge.sandbox.lifecycle import remove_run_containers

    image = build_images(["repo"], client=docker_client, show_progress=False)["repo"]
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    with DockerSandbox.create(SandboxSpec(image=image), run_id, client=docker_client) as box:
        yield box
    remove_run_containers(run_id, docker_client)


def _outcomes(box: DockerSandbox, task: Task, fixed: bool) -> dict[str, str]:
    check = task.checks[0]
    package = dict(check["files"])
    if fixed:
        fix = next(c for c in task.solution if c.name == "str_replace").arguments
        package[fix["path"]] = package[fix["path"]].replace(fix["old"], fix["new"])
    tree = graded_tree(check["package"], check["files"], check["hidden_tests"],
                       {p: t for p, t in package.items() if p.startswith(check["package"] + "/")})
    report, output = run_tests_fresh(box, tree, timeout=60)
    assert report is not None, output
    results = parse_junit(report, [p for p in tree if p.startswith("tests/")])
    return {test_id: r.outcome for test_id, r in results.items()}


@pytest.mark.docker
@pytest.mark.parametrize(("family", "split"),
                         [("off_by_one", "train"), ("wrong_operator", "heldout"), ("wrong_condition", "train")])
def test_fail_to_pass_fails_before_the_fix_and_pass_to_pass_passes_on_both(family, split, repo_box, docker_client):
    """Through the grading path itself (a fresh container per run, removed afterwards)."""
    task = make_task(family, 3, split)
    check = task.checks[0]
    required = set(check["fail_to_pass"]) | set(check["pass_to_pass"])
    buggy, fixed = _outcomes(repo_box, task, fixed=False), _outcomes(repo_box, task, fixed=True)
    assert set(buggy) == set(fixed) == required  # every test that ran is graded, and every graded test ran
    assert all(buggy[t] in (FAILED, ERROR) for t in check["fail_to_pass"]), buggy
    assert all(buggy[t] == PASSED for t in check["pass_to_pass"]), buggy
    assert all(outcome == PASSED for outcome in fixed.values()), fixed
    assert list_run_containers(repo_box.run_id, docker_client) == [repo_box.id]  # graders removed


class FreshRecorder:
    """An episode's sandbox that notes the labels of every sandbox its ``fresh()`` hands out."""

    def __init__(self, sandbox: DockerSandbox, client):
        self.sandbox, self.client, self.handed_out = sandbox, client, []

    def __getattr__(self, name: str):
        return getattr(self.sandbox, name)

    def fresh(self) -> DockerSandbox:
        grader = self.sandbox.fresh()
        self.handed_out.append((grader.id, self.client.api.inspect_container(grader.id)["Config"]["Labels"]))
        return grader


@pytest.mark.docker
def test_grading_runs_in_a_fresh_sandbox_without_what_the_policy_planted(repo_box, run_id, docker_client):
    """repo_tests grades in ``sandbox.fresh()`` (the Sandbox protocol), not in the episode's sandbox: files the policy
    left outside its package are not there, the grader has the episode's owner, and it is removed afterwards."""
    task = make_task("off_by_one", 3)
    check, fix = task.checks[0], next(c for c in task.solution if c.name == "str_replace").arguments
    probe = ("import os\n\n\ndef test_nothing_planted():\n"
             "    assert not os.path.exists('/workspace/planted.txt')\n"
             "    assert not os.path.exists('/tmp/planted.txt')\n")
    check = {**check, "hidden_tests": {**check["hidden_tests"], "tests/test_planted.py": probe},
             "fail_to_pass": [*check["fail_to_pass"], "tests/test_planted.py::test_nothing_planted"]}
    with DockerSandbox.create(repo_box.spec, run_id, client=docker_client) as episode:
        assert isinstance(episode, SandboxProtocol)
        for path, text in check["files"].items():  # the policy's fixed package, and two files it planted
            if path.startswith(check["package"] + "/"):
                episode.write_file(path, text.replace(fix["old"], fix["new"]) if path == fix["path"] else text)
        episode.write_file("planted.txt", "the policy was here")
        episode.write_file("/tmp/planted.txt", "the policy was here")
        recorder = FreshRecorder(episode, docker_client)
        reward = score_task(recorder, dataclasses.replace(task, checks=[check]))
        assert (reward.value, reward.success) == (1.0, True), reward.reason
        assert episode.read_file("planted.txt") == "the policy was here"  # it was there to be found
        [(grader, labels)] = recorder.handed_out
        mine = docker_client.api.inspect_container(episode.id)["Config"]["Labels"]
        assert grader != episode.id and labels[LABEL_RUN] == run_id
        assert {k: labels[k] for k in DRIVER_LABELS} == {k: mine[k] for k in DRIVER_LABELS}
        assert list_run_containers(run_id, docker_client) == [episode.id]  # the grader is gone


def _tar(files: dict[str, str]) -> bytes:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for path, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(path)
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))
    return archive.getvalue()


@pytest.mark.docker
def test_every_template_bug_has_tests_that_fail_before_and_pass_after_the_fix(repo_box):
    """One task per (bug kind, function) pair the generator can draw, both splits, buggy and fixed: 2 x 24 pytest
    runs batched in one container (one archive in, one archive of reports out) to stay quick."""
    tasks: dict[tuple[str, str], Task] = {}
    for family in sorted(FAMILIES):
        for seed in range(150):
            task = make_task(family, seed, ("train", "heldout")[seed % 2])
            fix = next(c for c in task.solution if c.name == "str_replace").arguments["new"]
            # generated names aside, the fix line says which template's bug it is
            tasks.setdefault((family, re.sub(r"\b(?:[bdfgklmnprstvz][aeiou])+\b", "X", fix)), task)
    assert len(tasks) == 24
    trees = {}
    for i, task in enumerate(tasks.values()):
        check, fix = task.checks[0], next(c for c in task.solution if c.name == "str_replace").arguments
        fixed = {**check["files"], fix["path"]: check["files"][fix["path"]].replace(fix["old"], fix["new"])}
        for state, files in (("buggy", check["files"]), ("fixed", fixed)):
            trees.update({f"{i}-{state}/{p}": text for p, text in {**files, **check["hidden_tests"]}.items()})
    repo_box.put_file("/tmp/trees.tar", _tar(trees), user="root")
    script = ("mkdir -p /tmp/junit && cd /workspace && tar -xf /tmp/trees.tar && for d in *-*; do "
              "(cd $d && python3 -I -m pytest -q -p no:cacheprovider -o addopts= --junitxml=/tmp/junit/$d.xml tests "
              ">/dev/null 2>&1); done; tar -cf /tmp/junit.tar -C /tmp/junit .")
    ran = repo_box.exec(script, timeout=600, user="root", session=False)
    assert ran.exit_code == 0, ran.output
    with tarfile.open(fileobj=io.BytesIO(repo_box.get_file("/tmp/junit.tar", user="root"))) as tar:
        reports = {posixpath.basename(m.name)[:-4]: tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    for i, task in enumerate(tasks.values()):
        check = task.checks[0]
        test_files = [p for p in {**check["files"], **check["hidden_tests"]} if p.startswith("tests/")]
        buggy = {k: r.outcome for k, r in parse_junit(reports[f"{i}-buggy"], test_files).items()}
        fixed = {k: r.outcome for k, r in parse_junit(reports[f"{i}-fixed"], test_files).items()}
        assert set(buggy) == set(fixed) == set(check["fail_to_pass"]) | set(check["pass_to_pass"]), task.id
        assert all(buggy[t] in (FAILED, ERROR) for t in check["fail_to_pass"]), (task.id, buggy)
        assert all(buggy[t] == PASSED for t in check["pass_to_pass"]), (task.id, buggy)
        assert set(fixed.values()) == {PASSED}, (task.id, fixed)
