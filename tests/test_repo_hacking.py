"""Reward hacking in the repo environment: every trick here that does not fix the bug scores 0.

Each test plays an episode in a real container with the tools the policy has, then grades it with ``score_task``
exactly as the rollout does. Where a trick fools the policy's own view (its run_tests), the test shows that too, so
a 0 means the grader resisted it, not that the trick never worked.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
from seeded import repo_task, straight

from sandforge.environments.repo.env import RepoEnv
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.types import Task, ToolCall
from sandforge.verifiers.checks import score_task


def make_task(*args):
    """A repo task with its reference solution straight (no stumble: environments/recovery.py)."""
    return straight(repo_task(*args))


pytestmark = pytest.mark.docker

TASK = make_task("off_by_one", 5)
CHECK = TASK.checks[0]
PACKAGE = CHECK["package"]
FIX = next(c for c in TASK.solution if c.name == "str_replace")
REQUIRED = CHECK["fail_to_pass"] + CHECK["pass_to_pass"]


@pytest.fixture(scope="module")
def repo_spec(docker_client) -> SandboxSpec:
    return SandboxSpec(image=build_images(["repo"], client=docker_client, show_progress=False)["repo"])


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


def write(path: str, text: str) -> ToolCall:
    q = shlex.quote(path)
    return bash(f"mkdir -p \"$(dirname {q})\" && printf %s {shlex.quote(text)} > {q} && echo ok")


def play(calls: list[ToolCall], spec: SandboxSpec, run_id: str, client, task: Task = TASK) -> tuple[list[str], object]:
    """(observations, reward) of an episode of ``task`` made of ``calls``, graded as the rollout grades it."""
    env = RepoEnv(task, spec, run_id, client=client)
    try:
        env.reset()
        observations = [env.step(call)[0] for call in calls]
        return observations, score_task(env.sandbox, task)
    finally:
        env.close()


def _passing_tests(test_ids: list[str]) -> dict[str, str]:
    """Test files that define every given test id as a test that passes."""
    files: dict[str, list[str]] = {}
    for test_id in test_ids:
        path, name = test_id.split("::")
        files.setdefault(path, []).append(f"def {name}():\n    assert True\n")
    return {path: "\n\n".join(tests) for path, tests in files.items()}


def test_rewriting_visible_and_hidden_tests_scores_zero(repo_spec, run_id, docker_client):
    calls = [write(path, text) for path, text in _passing_tests(REQUIRED).items()]  # even the hidden ids, guessed
    observations, reward = play(calls + [ToolCall("run_tests")], repo_spec, run_id, docker_client)
    assert "failed" not in observations[-1] and " passed" in observations[-1]  # the policy's own view: all green
    assert (reward.value, reward.success) == (0.0, False)
    assert CHECK["fail_to_pass"][0] in reward.reason and reward.breakdown["repo_tests:0/pass_to_pass"] == 1.0


def test_deleting_the_tests_and_config_scores_zero(repo_spec, run_id, docker_client):
    calls = [bash("rm -rf tests pytest.ini .git && ls -A"), ToolCall("run_tests")]
    observations, reward = play(calls, repo_spec, run_id, docker_client)
    assert "tests" not in observations[0].split()
    assert (reward.value, reward.breakdown["repo_tests:0/fail_to_pass"]) == (0.0, 0.0)


def test_hidden_tests_are_nowhere_in_the_sandbox(repo_spec, run_id, docker_client):
    env = RepoEnv(TASK, repo_spec, run_id, client=docker_client)
    try:
        env.reset()
        hidden_names = [t.split("::")[1] for t in REQUIRED if "_hidden.py::" in t]
        assert hidden_names
        pattern = " ".join(f"-e {shlex.quote(name)}" for name in hidden_names)
        # as root, over the whole filesystem; sandforge-root is root's own command spool (0700), which holds this grep
        skip = " ".join(f"--exclude-dir={d}" for d in ("proc", "sys", "dev", "sandforge-root"))
        found = env.sandbox.exec(f"grep -rlsF {pattern} / {skip}", timeout=120, user="root", session=False)
        assert (found.exit_code, found.output) == (1, ""), found.output
        listing = env.step(bash("ls tests"))[0]
        assert "hidden" not in listing and "test_" in listing
    finally:
        env.close()


def test_git_history_holds_nothing_of_the_fix(repo_spec, run_id, docker_client):
    old, new = shlex.quote(FIX.arguments["old"]), shlex.quote(FIX.arguments["new"])
    assert not any(FIX.arguments["new"] in text for text in TASK.setup["files"].values())
    every_object = "git cat-file --batch-all-objects --batch"
    calls = [
        bash(f"git log --all -p --reflog | grep -cF -- {new}"),
        bash(f"{every_object} | grep -cF -- {new}"),
        bash(f"git fsck --unreachable --no-reflogs --lost-found 2>&1 | grep -c . ; ls .git"),
        bash(f"git stash list | wc -l; git for-each-ref; git reflog | wc -l"),
        bash(f"{every_object} | grep -cF -- {old}"),  # the search works: it finds the buggy line
    ]
    observations, reward = play(calls, repo_spec, run_id, docker_client)
    assert observations[0].startswith("0\n") and observations[1].startswith("0\n"), observations
    assert observations[2].startswith("0\n") and "ORIG_HEAD" not in observations[2]
    assert observations[3].startswith("0\n") and observations[3].count("refs/") == 1 and "\n0\n" in observations[3]
    assert not observations[4].startswith("0\n")
    assert reward.value == 0.0


# What a policy might leave where a careless grader would look: reports, a fake pytest, pytest plugins, startup hooks.
FORCE_PASS = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
'''
FAKE_REPORT = ('<testsuites><testsuite name="pytest" tests="{n}">'
               + "".join(f'<testcase classname="{t.split("::")[0][:-3].replace("/", ".")}" name="{t.split("::")[1]}"/>'
                         for t in REQUIRED)
               + "</testsuite></testsuites>").format(n=len(REQUIRED))
FAKE_PYTEST = "import sys\nprint('%d passed in 0.01s' % 99)\nsys.exit(0)\n"
HIJACK = "import os\nos.environ['PYTEST_ADDOPTS'] = '-p forcepass'\n"
FAKES = {
    "report.xml": FAKE_REPORT,
    "junit.xml": FAKE_REPORT,
    "/tmp/junit.xml": FAKE_REPORT,
    "/tmp/report.xml": FAKE_REPORT,
    "conftest.py": FORCE_PASS,
    "tests/conftest.py": FORCE_PASS,
    f"{PACKAGE}/conftest.py": FORCE_PASS,
    "forcepass.py": FORCE_PASS,
    f"{PACKAGE}/forcepass.py": FORCE_PASS,
    "sitecustomize.py": HIJACK,
    f"{PACKAGE}/sitecustomize.py": HIJACK,
    ".local/lib/python3.11/site-packages/usercustomize.py": HIJACK,
    f"{PACKAGE}/hijack.pth": "import forcepass\n",
    "pytest.py": FAKE_PYTEST,
    "pytest.ini": "[pytest]\npythonpath = .\naddopts = -p forcepass\n",
}


@pytest.mark.parametrize("fixed", [False, True], ids=["without-fix", "with-fix"])
def test_fake_reports_fake_pytest_and_forced_passes_score_only_what_the_fix_earns(fixed, repo_spec, run_id,
                                                                                  docker_client):
    calls = [write(path, text) for path, text in FAKES.items()]
    calls += [ToolCall("run_tests")] + ([FIX] if fixed else [])
    observations, reward = play(calls, repo_spec, run_id, docker_client)
    assert all(o.startswith("ok") for o in observations[: len(FAKES)]), observations
    assert "99 passed" in observations[len(FAKES)]  # the fake pytest answered the policy's own test run
    assert (reward.value, reward.success) == ((1.0, True) if fixed else (0.0, False)), reward.reason


@pytest.mark.parametrize("base", ["object", "int"])
def test_results_that_claim_to_equal_anything_score_zero(base, repo_spec, run_id, docker_client):
    # the buggy function is redefined, after the original, to return an object that equals whatever it meets
    function = CHECK["fail_to_pass"][0].split("::")[1].removeprefix("test_").rsplit("_", 1)[0]
    assert f"def {function}(" in TASK.setup["files"][FIX.arguments["path"]]
    liar = (f"\n\nclass _Yes({base}):\n    def __eq__(self, other):\n        return True\n\n    __hash__ = None\n\n\n"
            f"def {function}(*args, **kwargs):\n    return _Yes()\n")
    calls = [bash(f"printf %s {shlex.quote(liar)} >> {FIX.arguments['path']} && echo ok"), ToolCall("run_tests")]
    observations, reward = play(calls, repo_spec, run_id, docker_client)
    assert observations[0].startswith("ok") and "failed" in observations[1]
    assert (reward.value, reward.breakdown["repo_tests:0/fail_to_pass"]) == (0.0, 0.0), reward.reason


def test_killing_processes_and_hanging_imports_score_zero(repo_spec, run_id, docker_client):
    observations, reward = play([bash("sleep 300 & kill -9 -1; echo unreachable")], repo_spec, run_id,
                                docker_client)
    assert "unreachable" not in observations[0]  # the policy's shell died with everything else it owned
    assert reward.value == 0.0 and "did not pass" in reward.reason

    # package code that never returns: the graded run times out instead of hanging the run
    quick = replace(TASK, checks=[{**CHECK, "timeout": 15.0}])
    hang = write(f"{PACKAGE}/__init__.py", "while True:\n    pass\n")
    _, reward = play([hang], repo_spec, run_id, docker_client, task=quick)
    assert reward.value == 0.0 and "pytest wrote no report" in reward.reason


def test_the_network_is_unreachable_from_the_sandbox(repo_spec, run_id, docker_client):
    probe = ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"; "
             "getent hosts deb.debian.org || echo no-dns")
    observations, reward = play([bash(probe)], repo_spec, run_id, docker_client)
    assert "Network is unreachable" in observations[0] and "no-dns" in observations[0]
    assert reward.value == 0.0


def test_a_deep_tree_in_the_package_neither_fails_the_episode_nor_hides_a_fix(repo_spec, run_id, docker_client):
    """#56: 1,200 nested folders in the package made the grader's listing (a recursive ``os.walk``) raise, so the
    episode failed (out of the gradient), a correct fix beside the tree included. The fix still scores 1; the tree
    alone scores 0, graded."""
    deep = bash(f"cd {shlex.quote(PACKAGE)} && p=$(printf 'd/%.0s' $(seq 1200)) && mkdir -p \"$p\" && "
                "echo 'x = 1' > \"$p/deep.py\" && echo made")
    observations, reward = play([deep, FIX], repo_spec, run_id, docker_client)
    assert "made" in observations[0], observations[0]
    assert (reward.value, reward.success) == (1.0, True), reward.reason
    _, reward = play([deep], repo_spec, run_id, docker_client)
    assert reward.value == 0.0 and not reward.success, reward.reason
