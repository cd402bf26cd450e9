"""Terminal tasks, the terminal environment and the file verifier: reference solutions score 1, doing nothing 0."""

from __future__ import annotations

import shlex

import pytest
from seeded import terminal_task as make_task

from containers import list_run_containers
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.environments.terminal.tasks import FAMILIES
from sandforge.types import ExecResult, SandboxError, Task, ToolCall
from sandforge.verifiers.checks import VerifierError, score_task


def run_episode(env: TerminalEnv, calls: list[ToolCall]) -> list[tuple]:
    steps = []
    for call in calls:
        steps.append(env.step(call))
        if steps[-1][2]:
            break
    return steps


# --- tasks and scoring, no Docker ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tasks_are_deterministic_and_split_apart(family):
    assert make_task(family, 17) == make_task(family, 17)
    assert len({repr((t.setup, t.checks)) for t in (make_task(family, s) for s in range(20))}) > 15
    train, held = make_task(family, 5), make_task(family, 5, "heldout")
    assert train.id == f"terminal/{family}/5" and held.id == f"terminal/{family}/heldout/5"
    assert held.split == "heldout" and held.instruction != train.instruction
    task = make_task(family, 3)
    assert task.env == "terminal" and task.family == family and task.seed == 3
    assert task.solution[-1] == ToolCall("submit") and task.checks[0]["verifier"] == "file_equals"
    assert task.instruction.count(".") <= 3 and len(task.instruction) < 120  # one short sentence


def test_unknown_family_and_split_are_explained():
    with pytest.raises(ValueError, match="count_words, write_file|write_file, count_words"):
        make_task("sort_lines", 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_task("write_file", 1, "test")


def test_count_words_setup_holds_the_counted_words():
    for seed in range(10):
        task = make_task("count_words", seed)
        (content,) = task.setup["files"].values()
        assert str(len(content.split())) == task.checks[0]["content"]


class FakeSandbox:
    """Regular files only: the file checks' look before reading (verifiers/file.py) finds each or finds nothing."""

    workdir = "/"

    def __init__(self, files: dict[str, str]):
        self.files = files

    def exec(self, command, timeout=10.0, user=None, workdir=None, session=True) -> ExecResult:
        path = shlex.split(command)[4]
        return ExecResult(0, f"ok {path}\n" if path in self.files else "missing missing\n", False, 0.0)

    def get_file(self, path, user=None, max_bytes=None):
        return self.files[path].encode() if path in self.files else None


def _task(checks) -> Task:
    return Task(id="t/1", env="terminal", family="f", seed=1, instruction="x", checks=checks)


def test_score_task_averages_checks():
    checks = [
        {"verifier": "file_equals", "path": "/a", "content": "one"},
        {"verifier": "file_equals", "path": "/b", "content": "two", "strip": False},
        {"verifier": "file_equals", "path": "/c", "content": "three"},
    ]
    reward = score_task(FakeSandbox({"/a": "one\n", "/b": "two\n"}), _task(checks))
    assert reward.value == pytest.approx(1 / 3) and not reward.success
    assert reward.breakdown == {"file_equals:/a": 1.0, "file_equals:/b": 0.0, "file_equals:/c": 0.0}
    assert "/c: missing" in reward.reason and "/b: expected 'two'" in reward.reason
    assert score_task(FakeSandbox({"/a": " one "}), _task(checks[:1])).success


def test_partial_file_equals_scores_a_near_miss_below_one_and_success_stays_exact():
    check = {"verifier": "file_equals", "path": "/a", "content": "kolu dasi", "partial": True}
    scores = {text: score_task(FakeSandbox({"/a": text}), _task([check])) for text in ("kolu dasi\n", "kolu dasu", "zz")}
    assert scores["kolu dasi\n"].value == 1.0 and scores["kolu dasi\n"].success
    assert 0.5 > scores["kolu dasu"].value > scores["zz"].value >= 0.0
    assert not scores["kolu dasu"].success and not scores["zz"].success
    assert score_task(FakeSandbox({}), _task([check])).value == 0.0  # no file, no credit


def test_score_task_raises_verifier_error_when_a_check_cannot_run():
    with pytest.raises(VerifierError, match="unknown verifier 'tests_pass'.*file_equals"):
        score_task(FakeSandbox({}), _task([{"verifier": "tests_pass"}]))
    with pytest.raises(VerifierError, match="file_equals takes path, content"):
        score_task(FakeSandbox({}), _task([{"verifier": "file_equals", "path": "/a"}]))

    class Broken(FakeSandbox):
        def exec(self, *args, **kwargs):
            raise SandboxError("container gone")

    with pytest.raises(VerifierError, match="container gone"):
        score_task(Broken({}), _task([{"verifier": "file_equals", "path": "/a", "content": "x"}]))
    with pytest.raises(VerifierError, match="no checks"):
        score_task(FakeSandbox({}), _task([]))


# --- episodes in real containers ----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_solution_scores_one_and_submit_alone_scores_zero(family, terminal_spec, run_id, docker_client):
    task = make_task(family, 11)
    env = TerminalEnv(task, terminal_spec, run_id, client=docker_client)
    try:
        obs, info = env.reset(seed=11)
        assert obs == task.instruction and info["task_id"] == task.id
        first_box = env.sandbox.id
        steps = run_episode(env, task.solution)
        assert [s[2] for s in steps] == [False] * (len(task.solution) - 1) + [True]
        assert all(s[4]["executed"] and s[1] == 0.0 for s in steps)
        reward = score_task(env.sandbox, task)
        assert (reward.value, reward.success) == (1.0, True), reward.reason

        env.reset()  # a fresh sandbox: nothing from the solved episode survives
        assert env.sandbox.id != first_box and list_run_containers(run_id, docker_client) == [env.sandbox.id]
        steps = run_episode(env, [ToolCall("submit")])
        assert steps[0][2] is True
        reward = score_task(env.sandbox, task)
        assert (reward.value, reward.success) == (0.0, False)
    finally:
        env.close()
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_terminal_tools_and_bad_calls(terminal_spec, run_id, docker_client):
    task = make_task("count_words", 4)
    env = TerminalEnv(task, terminal_spec, run_id, exec_timeout=1, client=docker_client)
    try:
        env.reset()
        assert [t["name"] for t in env.tools] == ["bash", "read_file", "write_file", "submit"]
        (path,) = task.setup["files"]
        assert env.sandbox.exec(f"stat -c %U {path}").output.strip() == "sandbox"

        obs, _, _, _, info = env.step(ToolCall("bash", {"command": f"wc -w < {path}; false"}))
        assert obs == f"{task.checks[0]['content']}\n[exit code 1]" and info == {"executed": True}
        obs, *_ = env.step(ToolCall("bash", {"command": "sleep 30"}))
        assert obs == "[timed out after 1s; killed]"
        obs, *_ = env.step(ToolCall("read_file", {"path": path}))
        assert obs == task.setup["files"][path]
        obs, *_ = env.step(ToolCall("read_file", {"path": "nope.txt"}))
        assert obs == "Error: no such file: nope.txt"
        obs, *_ = env.step(ToolCall("write_file", {"path": "sub/a.txt", "content": "it's \"ok\"\n"}))
        assert obs == "wrote 10 bytes to sub/a.txt"
        assert env.sandbox.read_file("/workspace/sub/a.txt") == "it's \"ok\"\n"
        obs, _, _, _, info = env.step(ToolCall("write_file", {"path": "/etc/motd", "content": "x"}))
        assert obs.startswith("Error: cannot write /etc/motd") and "Read-only file system" in obs and info["executed"]

        for bad, fragment in [
            (ToolCall("python", {"code": "1"}), "unknown tool 'python'"),
            (ToolCall("bash", {}), "missing argument 'command'"),
            (ToolCall("bash", {"command": 7}), "'command' must be string, got integer"),
            (ToolCall("write_file", {"path": "a", "content": "b", "mode": "w"}), "unknown argument 'mode'"),
            (ToolCall("bash", {"command": "echo \0"}), "NUL"),
        ]:
            obs, reward, terminated, truncated, info = env.step(bad)
            assert obs.startswith("Error: ") and fragment in obs, obs
            assert (reward, terminated, truncated, info["executed"]) == (0.0, False, False, False)
            assert fragment in info["error"]

        env.sandbox.exec(f"umask 077; wc -w < {path} > /tmp/a && mv /tmp/a /workspace/answer.txt")
        assert score_task(env.sandbox, task).success  # graded as root, whatever the file's mode
    finally:
        env.close()


@pytest.mark.docker
def test_a_killed_sandbox_fails_the_step(terminal_spec, run_id, docker_client):
    env = TerminalEnv(make_task("write_file", 2), terminal_spec, run_id, client=docker_client)
    try:
        env.reset()
        docker_client.api.kill(env.sandbox.id)
        for call in (ToolCall("bash", {"command": "ls"}), ToolCall("read_file", {"path": "x"})):
            with pytest.raises(SandboxError):
                env.step(call)
        with pytest.raises(VerifierError, match="not running"):
            score_task(env.sandbox, env.task)
    finally:
        env.close()
    assert list_run_containers(run_id, docker_client) == []
