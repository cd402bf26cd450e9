"""Harbor task directories: loaded as Tasks, run in their own image, graded by their tests/test.sh as root.

The tasks under tests/data/harbor/ are written for these tests: hello-file (reward.txt) and count-lines
(reward.json, a helper script beside test.sh). Their image deliberately lets the policy write /logs/verifier.
tests/data/harbor/harbor-0.25/ holds two in Harbor 0.25's format: named-rewards (reward.json of two named rewards)
and env-vars (schema_version 1.1, an [environment.env] the agent, the oracle and test.sh all need).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.environments.harbor.env import HarborEnv
from sandforge.environments.harbor.tasks import HarborTaskError, load_task, load_tasks
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import ImageError, build_images
from containers import list_run_containers
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import TaskSandbox, ToolCall, ZeroScore
from sandforge.verifiers.checks import score_task

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "harbor"
CHAT = ChatFormat(ByteTokenizer())


# --- loading, no Docker ---------------------------------------------------------------------------------------------


def test_a_task_directory_becomes_a_task_with_its_solution_and_tests():
    task = load_task(TASKS / "hello-file")
    assert task.id == "harbor/hello-file" and task.env == "harbor" and task.family == "files"
    assert task.instruction == (TASKS / "hello-file" / "instruction.md").read_text().strip()
    assert task.setup == {"harbor_dir": str(TASKS / "hello-file")}
    assert task.image == "harbor/hello-file" and task.sandbox == TaskSandbox(user="root") and task.agent_timeout == 120.0
    assert task.solution == [ToolCall("bash", {"command": (TASKS / "hello-file/solution/solve.sh").read_text()}),
                             ToolCall("submit")]
    (check,) = task.checks
    assert check["verifier"] == "harbor_tests" and check["timeout"] == 30.0 and check["user"] == "root"
    assert check["files"] == {"test.sh": (TASKS / "hello-file/tests/test.sh").read_text()}


def test_a_folder_of_tasks_loads_each_with_its_image_context():
    tasks, images = load_tasks(TASKS)
    assert [t.id for t in tasks] == ["harbor/count-lines", "harbor/hello-file"]
    assert {name: ctx.folder for name, ctx in images.items()} == {
        "harbor/count-lines": TASKS / "count-lines" / "environment",
        "harbor/hello-file": TASKS / "hello-file" / "environment"}
    assert {ctx.user for ctx in images.values()} == {None}  # root mode: the agent is root, no user required
    assert set(tasks[0].checks[0]["files"]) == {"test.sh", "check_count.sh"}


def test_malformed_task_directories_name_the_file(tmp_path):
    task = tmp_path / "broken"
    shutil.copytree(TASKS / "hello-file", task)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(HarborTaskError, match=r"broken: not a Harbor task, missing tests/test.sh"):
        load_task(task)
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "task.toml").write_text("[verifier\ntimeout_sec = 1")
    with pytest.raises(HarborTaskError, match=r"broken/task.toml: not valid TOML"):
        load_task(task)
    (task / "task.toml").write_text('[metadata]\nsplit = "test"\n')
    with pytest.raises(HarborTaskError, match=r"split = 'test'; use one of train, heldout"):
        load_task(task)
    with pytest.raises(HarborTaskError, match="no Harbor tasks here"):
        load_tasks(tmp_path / "broken" / "tests")


# --- in containers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harbor_images(docker_client) -> dict[str, str]:
    _, contexts = load_tasks(TASKS)
    return build_images([], client=docker_client, show_progress=False, contexts=contexts)


def _env(task, images, run_id, client) -> HarborEnv:
    spec = SandboxSpec(image=images[task.image], **HarborEnv.sandbox_defaults)
    return HarborEnv(task, spec, run_id, exec_timeout=20, client=client)


def _episode(task, env, calls):
    """The real agent loop with a scripted policy replaying ``calls``; grades with the task's own checks."""
    scripted = type(task)(**{**task.__dict__, "solution": calls})
    limits = EpisodeLimits(max_turns=4, max_context=16384, max_new_tokens=4096, stop_ids=CHAT.stop_ids)
    return asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits, group="g"))


@pytest.mark.docker
@pytest.mark.parametrize("name", ["hello-file", "count-lines"])
def test_reference_solution_scores_one_and_doing_nothing_scores_zero(name, harbor_images, run_id, docker_client):
    task = load_task(TASKS / name)
    env = _env(task, harbor_images, run_id, docker_client)
    solved = _episode(task, env, task.solution)
    assert not solved.failed, solved.failure
    assert solved.turns[0].tool_calls[0].name == "bash"  # solve.sh went through the policy's own tool
    assert (solved.reward.value, solved.reward.success) == (1.0, True), solved.reward.reason
    idle = _episode(task, env, [ToolCall("submit")])
    assert not idle.failed, idle.failure
    assert (idle.reward.value, idle.reward.success) == (0.0, False), idle.reward.reason
    assert solved.metadata["sandbox"] != idle.metadata["sandbox"]
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_the_policy_cannot_plant_the_reward_or_the_tests(harbor_images, run_id, docker_client):
    """The image lets the policy write /logs/verifier; it writes a perfect reward in both formats, a fake test.sh
    where the tests will go, and leaves a process that keeps rewriting the reward. Grading still says 0."""
    task = load_task(TASKS / "hello-file")
    plant = ("echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json; "
             "mkdir -p /tmp/tests; echo 'echo 1 > /logs/verifier/reward.txt' > /tmp/tests/test.sh; "
             "(while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; done) "
             "> /dev/null 2>&1 & cat /logs/verifier/reward.txt")
    env = _env(task, harbor_images, run_id, docker_client)
    try:
        env.reset()
        observation, *_ = env.step(ToolCall("bash", {"command": plant}))
        assert observation.startswith("1\n"), observation  # the plant took: the image really lets it write there
        reward = score_task(env.sandbox, task)
        assert (reward.value, reward.success) == (0.0, False), reward.reason
        # the grader's folders are root's now: the policy's shell cannot write either
        observation, *_ = env.step(ToolCall("bash", {"command": "echo 1 > /logs/verifier/reward.txt; ls /tests"}))
        assert "Permission denied" in observation and "[exit code 2]" in observation, observation
    finally:
        env.close()


@pytest.mark.docker
def test_bad_rewards_and_a_missing_one_score_zero(harbor_images, run_id, docker_client):
    """test.sh writes from the policy's answer: a reward file that is not a reward scores 0 (cause malformed), never a
    failed episode; no reward file scores 0 too."""
    task = load_task(TASKS / "hello-file")
    env = _env(task, harbor_images, run_id, docker_client)
    try:
        env.reset()
        for script, expect in [("echo 7 > /logs/verifier/reward.txt", "reward 7.0 .* sandforge rewards are in"),
                               ("echo yes > /logs/verifier/reward.txt", "without a number")]:
            task.checks[0]["files"] = {"test.sh": script}
            reward = score_task(env.sandbox, task)
            assert reward.value == 0.0 and reward.zero_causes == ["malformed"], reward
            assert re.search(expect, reward.reason), reward.reason
        task.checks[0]["files"] = {"test.sh": "echo oops; exit 3"}
        reward = score_task(env.sandbox, task)
        assert reward.value == 0.0 and "wrote no reward" in reward.reason and "exit 3" in reward.reason
        task.checks[0]["files"], task.checks[0]["timeout"] = {"test.sh": "sleep 30"}, 1.0
        reward = score_task(env.sandbox, task)
        assert reward.value == 0.0 and "timed out after 1s" in reward.reason
    finally:
        env.close()


@pytest.mark.docker
def test_an_image_without_the_sandbox_user_is_refused_at_build_time(tmp_path, docker_client):
    (tmp_path / "Dockerfile").write_text("ARG BASE=sandforge/base:bookworm\nFROM ${BASE}\nRUN mkdir /workspace\n")
    with pytest.raises(ImageError, match=r"Dockerfile: the image has no 'sandbox' user.*RUN useradd"):
        build_images([], client=docker_client, show_progress=False, contexts={"harbor/no-user": tmp_path})


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_harbor_task_trains_for_one_step(tmp_path, harbor_images):
    """`sandforge train configs/harbor.yaml` (the Harbor folder of these tests): images built per task, episodes run
    and graded, one RL step taken."""
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "warmup.steps=0", "rollout.workers=1", "rollout.concurrency=2",
                 "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=32",
                 "trainer.grad_accum_steps=1", "logging.wandb.mode=disabled", f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/harbor.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    import json

    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len({r["task"]["id"] for r in rows}) == 1  # one task, two episodes
    assert rows[0]["task"]["id"] in {"harbor/hello-file", "harbor/count-lines"}
    assert all(not r["failed"] and r["reward"]["reason"].startswith("test.sh") for r in rows), rows[0]["failure"]
    files = rows[0]["task"]["checks"][0]["files"]  # the tests by hash, not their text in every row
    assert all(set(f) == {"sha256", "bytes"} for f in files.values()), files
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("phase") == "rl"] == [0]


# --- Harbor 0.25: named rewards, schema 1.1 keys, the task's environment (no Docker) ------------------------------------

HARBOR_025 = TASKS / "harbor-0.25"


class RewardSandbox:
    """Enough of a sandbox for ``harbor_tests``: every exec succeeds, and /logs/verifier holds ``files``. ``commands``
    keeps what ran (test.sh's line last)."""

    workdir = "/workspace"
    policy_user = "sandbox"

    def __init__(self, files: dict[str, str]):
        self.files, self.commands = files, []

    def exec(self, command, timeout=10.0, user=None, workdir=None, session=True):
        from sandforge.types import ExecResult

        self.commands.append(command)
        return ExecResult(0, "1000\n1000\n" if command.startswith("id -u") else "", False, 0.0)  # harness.policy_ids

    def put_file(self, path, data, user=None, mode=0o644):
        pass

    def read_file(self, path, user=None):
        return self.files.get(path.rsplit("/", 1)[-1])


def _grade(files: dict[str, str], **args):
    from sandforge.environments.harbor.grading import harbor_tests_verifier

    return harbor_tests_verifier(RewardSandbox(files), {"files": {"test.sh": "true"}, **args})


def test_named_rewards_are_combined_by_the_rule_and_each_kept_in_the_breakdown():
    both = {"reward.json": '{"correctness": 1, "performance": 0}'}
    score, reason, parts = _grade(both)  # no "reward" key: the mean
    assert (score, parts) == (0.5, {"correctness": 1.0, "performance": 0.0}) and "mean of" in reason, reason
    assert _grade(both, reward="min")[0] == 0.0 and _grade(both, reward="mean")[0] == 0.5
    assert _grade(both, reward="correctness")[0] == 1.0 and _grade(both, reward="performance")[0] == 0.0
    # a "reward" key is the reward (Harbor's primary); the other keys are logged, and need not be in [0, 1]
    score, _, parts = _grade({"reward.json": '{"reward": 0.25, "seconds": 12.5}'})
    assert (score, parts) == (0.25, {"reward": 0.25, "seconds": 12.5})
    assert _grade({"reward.json": '{"reward": 1}'})[:1] == (1.0,) and len(_grade({"reward.json": '{"reward": 1}'})) == 2
    assert _grade({"reward.txt": "1\n"}) == (1.0, "test.sh: reward 1 (exit 0)")  # a lone number: no parts
    # test.sh writes from the policy's answer: what is not a reward is the policy's 0, with the cause "malformed"
    with pytest.raises(ZeroScore, match=r"reward rule 'speed' \(the job's reward_rule, or the check's reward\): "
                                        r"reward.json has no key 'speed' \(it has correctness, performance\)"):
        _grade(both, reward="speed")
    with pytest.raises(ZeroScore, match=r"reward 3.0 as .performance.; sandforge rewards are in \[0, 1\]"):
        _grade({"reward.json": '{"correctness": 1, "performance": 3}'})  # the mean would use it
    with pytest.raises(ValueError, match="harbor_tests takes"):
        _grade(both, reward=3)


class FailingTestsSandbox(RewardSandbox):
    """test.sh exits 1 after printing pytest's failures, having written its reward."""

    def exec(self, command, timeout=10.0, user=None, workdir=None, session=True):
        from sandforge.types import ExecResult

        done = super().exec(command, timeout, user, workdir, session)
        return ExecResult(1, "collected 2 items\nFAILED test_outputs.py::test_x - assert 1 == 2\n", False, 0.0) \
            if "test.sh" in command else done


def test_a_reward_short_of_one_quotes_what_test_sh_printed():
    """#58: a row said only "reward 0 (exit 127)" once a reward file existed, never why (there: uvx's lost options)."""
    from sandforge.environments.harbor.grading import harbor_tests_verifier

    score, reason = harbor_tests_verifier(FailingTestsSandbox({"reward.txt": "0"}), {"files": {"test.sh": "true"}})
    assert score == 0.0 and reason.startswith("test.sh: reward 0 (exit 1): collected 2 items"), reason
    assert "FAILED test_outputs.py::test_x - assert 1 == 2" in reason


def test_reward_json_is_read_before_reward_txt():
    assert _grade({"reward.json": '{"reward": 1}', "reward.txt": "0"})[0] == 1.0
    assert _grade({"reward.txt": "0"})[0] == 0.0


@pytest.mark.parametrize("text, message", [
    ("0.5", "not a JSON object"), ("[1, 0]", "not a JSON object"), ("{}", "no numeric reward"),
    ('{"correctness": "yes"}', r"correctness = 'yes' is not a number"), ('{"a": NaN}', "a = nan is not finite"),
    ("{oops", "not JSON"), ("", "not JSON")])
def test_a_malformed_reward_json_scores_zero_with_the_reason(text, message):
    with pytest.raises(ZeroScore, match=message) as e:
        _grade({"reward.json": text})
    assert e.value.cause == "malformed"


@pytest.mark.parametrize("metric", ["-0.37", "nan", "1e308", "-inf", "7"])
def test_a_metric_the_policys_answer_drives_out_of_range_scores_zero_not_failed(metric):
    """#56: a test.sh writing an R² (or any metric the answer drives) made read_rewards/combine raise, and the episode
    was dropped as failed: an answer made to break the metric turned its loss into a failure. Through the whole
    grading path: graded, 0, cause malformed; an honest 1 still scores 1."""
    from sandforge.types import Task

    task = Task(id="t", env="harbor", family="f", seed=0, instruction="",
                checks=[{"verifier": "harbor_tests", "files": {"test.sh": "true"}, "timeout": 5}])
    for name, text in (("reward.txt", metric), ("reward.json", f'{{"r2": {metric}}}')):
        reward = score_task(RewardSandbox({name: text}), task)
        assert reward.value == 0.0 and reward.zero_causes == ["malformed"], (name, reward)
    assert score_task(RewardSandbox({"reward.txt": "1"}), task).value == 1.0


def test_named_rewards_reach_the_reward_breakdown():
    from sandforge.types import Task

    task = Task(id="t", env="harbor", family="f", seed=0, instruction="",
                checks=[{"verifier": "harbor_tests", "files": {"test.sh": "true"}, "timeout": 5}])
    reward = score_task(RewardSandbox({"reward.json": '{"correctness": 1, "performance": 0}'}), task)
    assert reward.value == 0.5 and not reward.success
    assert reward.breakdown == {"harbor_tests:0": 0.5, "harbor_tests:0/correctness": 1.0,
                                "harbor_tests:0/performance": 0.0}


def test_schema_1_1_keys_are_honoured_and_the_task_env_goes_to_every_exec():
    from sandforge.environments.harbor.settings import read_settings

    named = load_task(HARBOR_025 / "named-rewards")  # schema_version, [task], os, mcp_servers = []: nothing flagged
    assert "not_honoured" not in named.setup, named.setup["not_honoured"]
    assert named.sandbox.overrides() == {"user": "root", "cpus": 1.0, "memory": "512m", "workspace_size": "256m"}
    task = load_task(HARBOR_025 / "env-vars")
    assert "not_honoured" not in task.setup, task.setup["not_honoured"]
    # test.sh and solve.sh see [environment] env under their own tables (which win), as in Harbor
    assert task.checks[0]["env"] == {"SECRET_WORD": "marmalade", "ANSWER_FILE": "/workspace/answer.txt"}
    assert task.setup["solution_env"] == {"SECRET_WORD": "marmalade", "ANSWER_FILE": "/workspace/wrong-place.txt"}
    s = read_settings({"schema_version": "1.4", "environment": {"env": {}}, "artifacts": []}, "t.toml")
    assert s.not_honoured == [] and s.env == {}  # an empty [environment.env] and no artifacts
    s = read_settings({"version": "1.0", "environment": {"env": {"A": "${HOST_A:-fallback}", "B": "${HOST_B}"}}},
                      "t.toml")
    assert s.env == {"A": "fallback"}  # a host variable's default; the host's own environment never goes in
    assert s.not_honoured == ["[environment] env B = ${HOST_B} (the host's variables do not reach sandboxes)"]


@pytest.mark.parametrize("meta, error", [
    ({"agent": {"timeout_sec": 0}}, "t.toml: [agent] timeout_sec must be a positive number, got 0"),
    ({"verifier": {"timeout_sec": "30"}}, "t.toml: [verifier] timeout_sec must be a positive number, got '30'"),
    ({"environment": {"cpus": True}}, "t.toml: [environment] cpus must be a positive number, got True"),
    ({"agent": 5}, "t.toml: [agent] must be a table, got 5"),
    ({"solution": {"env": ["A=1"]}}, "t.toml: [solution] env must be a table of NAME = value"),
])
def test_task_toml_is_read_by_phase_and_a_wrong_value_names_its_file_and_key(meta, error):
    from sandforge.environments.harbor.settings import HarborSettingsError, TaskToml, read_settings

    with pytest.raises(HarborSettingsError) as e:
        read_settings(meta, "t.toml")
    assert str(e.value) == error
    toml = TaskToml.model_validate({"agent": {"timeout_sec": 90, "user": "agent"}, "verifier": {"timeout_sec": 30},
                                    "environment": {"cpus": 2, "workdir": "/app"}, "metadata": {"category": "x"}})
    assert (toml.agent.timeout_sec, toml.agent.user, toml.verifier.timeout_sec, toml.verifier.user) == (90, "agent", 30,
                                                                                                       "root")
    assert (toml.environment.cpus, toml.environment.workdir, toml.solution.env) == (2.0, "/app", None)


def test_what_schema_1_1_asks_for_that_sandforge_cannot_do_is_named_exactly():
    from sandforge.environments.harbor.settings import read_settings

    meta = {"schema_version": "1.1", "task": {"name": "org/t"}, "source": "bench", "artifacts": ["/app/out.log"],
            "environment": {"os": "windows", "mcp_servers": [{"name": "docs", "url": "http://x"}],
                            "network_mode": "public", "gpu_types": ["H100"], "skills_dir": "/skills",
                            "healthcheck": {"command": "true"}, "memory": "2G", "storage": "1G"},
            "agent": {"network_mode": "no-network"},
            "verifier": {"environment_mode": "separate", "collect": [{"command": "true"}]}}
    s = read_settings(meta, "t.toml")
    assert (s.memory_mb, s.storage_mb) == (2048, 1024)  # the deprecated sizes, as Harbor reads them
    assert s.not_honoured == [
        "[environment] os = 'windows' (sandboxes are Linux containers)",
        "[environment] mcp_servers (no MCP servers are started for the agent)",
        "[environment] network_mode = 'public' (sandboxes have no network)",
        "[environment] gpu_types (sandboxes get no GPU)",
        "[environment] skills_dir (no skills are copied for the agent)"]  # the healthcheck is run (healthcheck.py)
    # the separate verifier, its artifacts and its collect hook are honoured (tests/test_harbor_separate.py)
    assert [a.source for a in s.separate.artifacts] == ["/app/out.log"] and len(s.separate.collect) == 1


def test_a_sidecar_compose_file_and_a_non_docker_environment_are_named(tmp_path):
    """Seen in outside task sets: the cookbook's multi-container task (environment/docker-compose.yaml beside the
    Dockerfile) loaded without a word about its api-server, and a task whose environment is `type = "cloudlab"` (no
    Dockerfile) was called "not a Harbor task"."""
    task = tmp_path / "multi-container"
    shutil.copytree(TASKS / "hello-file", task)
    (task / "environment" / "docker-compose.yaml").write_text("services:\n  api-server:\n    build: ./api\n")
    assert load_task(task).setup["not_honoured"][0] == (
        "environment/docker-compose.yaml (its other services are not started: api-server; the task runs in "
        "environment/Dockerfile's container alone)")
    # #58: a compose file that only restates `main` (the agent's container) leaves nothing out
    (task / "environment" / "docker-compose.yaml").write_text("services:\n  main:\n    build: .\n")
    assert "not_honoured" not in load_task(task).setup
    remote = tmp_path / "remote-cluster"
    shutil.copytree(TASKS / "hello-file", remote)
    (remote / "environment" / "Dockerfile").unlink()
    (remote / "task.toml").write_text('[environment]\ntype = "cloudlab"\n')
    with pytest.raises(HarborTaskError, match=r"remote-cluster: its environment is \[environment\] type = "
                                              r"'cloudlab', which sandforge cannot start"):
        load_task(remote)


def test_the_agents_commands_get_the_task_env():
    from sandforge.types import Task

    task = Task(id="t", env="harbor", family="f", seed=0, instruction="",
                setup={"env": {"SECRET_WORD": "marmalade", "QUOTED": "a b'c"}})
    env = HarborEnv(task, SandboxSpec(image="x"), "run")
    env._sandbox = sandbox = RewardSandbox({})
    env.run_command("echo $SECRET_WORD")
    assert sandbox.commands == ["export SECRET_WORD=marmalade QUOTED='a b'\"'\"'c'\necho $SECRET_WORD"]
    plain = HarborEnv(Task(id="t", env="harbor", family="f", seed=0, instruction=""), SandboxSpec(image="x"), "run")
    plain._sandbox = sandbox = RewardSandbox({})
    plain.run_command("ls")
    assert sandbox.commands == ["ls"]


def test_a_loaded_task_carries_its_env_to_the_agent():
    assert load_task(HARBOR_025 / "env-vars").setup.get("env") == {"SECRET_WORD": "marmalade",
                                                                   "ANSWER_FILE": "/workspace/wrong-place.txt"}


# --- task shapes Harbor runs: a compile-and-run grader, a multi-step task (tests/data/harbor/shapes) -----------------

SHAPES = TASKS / "shapes"  # outside the set configs/harbor.yaml trains on


def test_a_multi_step_task_loads_as_its_steps():
    """Harbor's `[[steps]]` layout (steps/<name>/instruction.md, tests/, solution/; nothing at the root) was refused
    in one line. It loads as a Task with steps: each its instruction, its tests layered over the task's, its reward
    gate; the warm start's reference is every step's solve.sh, each ending in submit."""
    from sandforge.types import TaskStep

    for mode in ("root", "hardened"):
        task = load_task(SHAPES / "two-step", mode)
        assert [(s.name, s.min_reward, bool(s.place), bool(s.setup)) for s in task.steps] == [
            ("write-notes", None, False, False), ("sort-notes", 1.0, True, True)]
        assert "echo banana >> /app/notes.txt" in task.steps[1].setup  # its workdir/setup.sh
        assert "ABOUT.txt" in task.steps[1].place and "setup.sh" not in task.steps[1].place
        assert task.step_reward == "final" and task.instruction == task.steps[0].instruction
        assert task.steps[1].instruction == "Sort /app/notes.txt alphabetically, in place."
        assert [c.name for c in task.solution] == ["bash", "submit", "bash", "submit"]
        assert "sort -o /app/notes.txt" in task.solution[2].arguments["command"]
        assert all(s.checks[0]["verifier"] == "harbor_tests" and "sort" not in s.checks[0]["files"]["test.sh"]
                   or s.name == "sort-notes" for s in task.steps)
        assert task.checks == task.steps[-1].checks and isinstance(task.steps[0], TaskStep)
    compile_and_run = load_task(SHAPES / "compile-and-run")  # its neighbour, single-step, loads as before
    assert not compile_and_run.steps
    assert compile_and_run.sandbox.overrides() == {"user": "root", "workdir": "/app", "cpus": 1.0, "memory": "512m",
                                                   "workspace_size": "64m"}


def test_a_steps_table_that_is_wrong_names_the_file_and_the_key(tmp_path):
    import shutil

    task = tmp_path / "t"
    shutil.copytree(SHAPES / "two-step", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace('name = "sort-notes"', 'name = "../up"'))
    with pytest.raises(HarborTaskError, match=r"task.toml: \[steps\] 1 name must be a folder name"):
        load_task(task)
    (task / "task.toml").write_text(toml.replace('name = "sort-notes"', 'name = "write-notes"'))
    with pytest.raises(HarborTaskError, match=r"a second step named 'write-notes'"):
        load_task(task)
    (task / "task.toml").write_text(toml.replace('"final"', '"median"'))
    with pytest.raises(HarborTaskError, match=r"\[multi_step_reward_strategy\] must be one of 'mean' or 'final'"):
        load_task(task)
    (task / "task.toml").write_text(toml)
    (task / "steps" / "sort-notes" / "instruction.md").unlink()
    with pytest.raises(HarborTaskError, match=r"missing steps/sort-notes/instruction.md"):
        load_task(task)


def test_a_steps_workdir_and_setup_script_become_what_runs_before_it(tmp_path):
    """A step's `workdir/` is merged into the working directory (as the agent's user: `place`) and its `setup.sh` runs
    there as root (`setup`) before the step's agent, as Harbor's docs describe."""
    import shutil
    import subprocess

    task = tmp_path / "t"
    shutil.copytree(SHAPES / "two-step", task)
    extra = task / "steps" / "sort-notes" / "workdir"
    (extra / "data").mkdir(parents=True)
    (extra / "data" / "more.txt").write_text("kiwi\n")
    (extra / "setup.sh").write_text("echo set-up ran > ran.txt\n")
    loaded = load_task(task, "hardened")
    step = loaded.steps[1]
    assert (loaded.steps[0].place, loaded.steps[0].setup) == ("", "") and "chown" not in step.place
    work = tmp_path / "work"
    work.mkdir()
    for command in (step.place, step.setup):
        done = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert (work / "data" / "more.txt").read_text() == "kiwi\n" and (work / "ran.txt").read_text() == "set-up ran\n"
    assert (work / "ABOUT.txt").is_file() and not (work / "setup.sh").exists()


def test_two_task_folders_of_one_name_are_told_apart(tmp_path):
    """#58: two task sets each with a folder `hello` gave `harbor check` two identical rows, and a job that trained on
    both gave them one task id and one image name: one task silently ran in the other's image. The check's rows say
    which is which; a job refuses the pair in one line naming both."""
    import shutil

    from sandforge.config import EnvironmentConfig
    from sandforge.job.harbor_check import labels, task_dirs
    from sandforge.job.task_sampler import TaskSampler

    for name in ("set1", "set2"):
        shutil.copytree(SHAPES / "compile-and-run", tmp_path / name / "hello")
    (tmp_path / "set2" / "hello" / "instruction.md").write_text("Something else entirely.\n")
    dirs = task_dirs([tmp_path / "set1", tmp_path / "set2", tmp_path / "set1" / "hello"])  # named twice: once
    assert labels(dirs) == ["set1/hello", "set2/hello"]
    envs = [EnvironmentConfig(name="harbor", tasks=str(tmp_path / s)) for s in ("set1", "set2")]
    with pytest.raises(ValueError, match=r"environments\[1\]\.tasks: task id 'harbor/hello' is also a different task "
                                         r"of environments\[0\]"):
        TaskSampler(envs, seed=0)
    same = [EnvironmentConfig(name="harbor", tasks=str(tmp_path / "set1")) for _ in range(2)]
    assert len(TaskSampler(same, seed=0).sample(2)) == 2  # the same folder twice is the same tasks


def test_a_download_piped_into_a_shell_at_build_time_is_said():
    """#58: `RUN curl -LsSf https://astral.sh/uv/install.sh | sh` "succeeds" offline (the pipeline's status is the
    shell's, which read nothing), and the image built without uv, unsaid. The build's notes say it."""
    from sandforge.environments.harbor.dockerfile import piped_fetches

    text = ("FROM ubuntu:24.04\nRUN apt-get update && \\\n    curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n"
            "RUN curl -fsSL https://deb.example/setup | sudo -E bash -\nRUN wget -qO- https://y | /bin/sh -s -- -y\n"
            "RUN set -o pipefail && curl -fsSL https://x | bash\nRUN curl -o f https://z && sh f\n")
    notes = piped_fetches(text, "harbor/t")
    assert len(notes) == 3 and all(n.startswith("harbor/t: RUN pipes a download into a shell") for n in notes), notes
    assert "astral.sh" in notes[0] and "no network" in notes[0]


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_a_grader_that_builds_a_program_in_tmp_and_runs_it_scores_the_oracle(mode, run_id, docker_client):
    """compile-and-run's test.sh builds the program into `mktemp -d` under /tmp and executes it there, as Go's and C's
    tests do (solve.sh tries it the same way, as the agent). Under Docker's default noexec tmpfs the oracle scored 0
    where Harbor's plain Docker passes. The oracle scores 1 and a no-op 0, as `harbor check` runs them and as the warm
    start replays solve.sh through the policy's bash tool."""
    from sandforge.config import SandboxConfig
    from sandforge.sandbox.job_spec import sandbox_spec
    from sandforge.job.harbor_check import check

    [row] = check([SHAPES / "compile-and-run"], mode=mode)
    assert (row.oracle, row.noop) == (1.0, 0.0), row
    [task], images = load_tasks(SHAPES / "compile-and-run", mode)
    tags = build_images([], client=docker_client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)
    solved = _episode(task, HarborEnv(task, spec, run_id, exec_timeout=20, client=docker_client), task.solution)
    assert not solved.failed, solved.failure
    assert (solved.reward.value, solved.reward.success) == (1.0, True), solved.reward.reason


# --- Harbor 0.25 in containers ----------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_harbor_check_scores_named_rewards_and_the_task_env_oracle_1_noop_0(mode):
    """`sandforge harbor check`'s rows for the two Harbor 0.25 tasks: the oracle's reward.json of two named rewards
    is 1 and doing nothing 0; the env-vars oracle and test.sh both need [environment.env] (and test.sh its
    [verifier.env] over it), and nothing in either task.toml is flagged."""
    from sandforge.job.harbor_check import check

    rows = check([HARBOR_025 / "named-rewards", HARBOR_025 / "env-vars"], mode=mode)
    assert [(r.task, r.oracle, r.noop) for r in rows] == [("harbor/named-rewards", 1.0, 0.0),
                                                         ("harbor/env-vars", 1.0, 0.0)], rows
    assert not any("not honoured" in note for r in rows for note in r.notes), rows


@pytest.fixture(scope="module")
def harbor_025_images(docker_client) -> dict[str, str]:
    _, contexts = load_tasks(HARBOR_025)
    return build_images([], client=docker_client, show_progress=False, contexts=contexts)


@pytest.mark.docker
def test_an_episode_is_graded_on_its_named_rewards(harbor_025_images, run_id, docker_client):
    """The oracle through the bash tool scores 1 with both rewards in the breakdown; a correct script that is slow
    on large N gets correctness 1, performance 0: the mean, 0.5; doing nothing 0."""
    task = load_task(HARBOR_025 / "named-rewards")
    env = _env(task, harbor_025_images, run_id, docker_client)
    solved = _episode(task, env, task.solution)
    assert not solved.failed, solved.failure
    assert solved.reward.value == 1.0 and solved.reward.breakdown == {
        "harbor_tests:0": 1.0, "harbor_tests:0/correctness": 1.0, "harbor_tests:0/performance": 1.0}
    slow = ("cat > /workspace/fib.sh <<'FIB'\nif [ \"$1\" -gt 50 ]; then sleep 5; fi\na=0; b=1\n"
            "for ((i = 0; i < $1; i++)); do t=$((a + b)); a=$b; b=$t; done\necho \"$a\"\nFIB")
    half = _episode(task, env, [ToolCall("bash", {"command": slow}), ToolCall("submit")])
    assert not half.failed, half.failure
    assert (half.reward.value, half.reward.success) == (0.5, False), half.reward.reason
    assert half.reward.breakdown["harbor_tests:0/performance"] == 0.0
    assert "mean of correctness 1, performance 0" in half.reward.reason, half.reward.reason
    idle = _episode(task, env, [ToolCall("submit")])
    assert not idle.failed and idle.reward.value == 0.0, idle.reward.reason


@pytest.mark.docker
def test_the_agents_commands_see_the_task_env_in_a_container(harbor_025_images, run_id, docker_client):
    """HarborEnv exports ``task.setup["env"]`` before each of the policy's commands, in its session,
    as the folder's loader puts it there from task.toml's [environment] env. The oracle's text through the bash tool
    then scores 1; without the env it fails loudly (solve.sh's ${SECRET_WORD:?})."""
    task = load_task(HARBOR_025 / "env-vars")
    assert task.setup["env"]
    env = _env(task, harbor_025_images, run_id, docker_client)
    try:
        env.reset()
        observation, *_ = env.step(ToolCall("bash", {"command": "unset SECRET_WORD; echo \"[$SECRET_WORD]\""}))
        assert observation.startswith("[]\n"), observation  # the policy may unset it within a command...
        observation, *_ = env.step(ToolCall("bash", {"command": "echo \"[$SECRET_WORD] $ANSWER_FILE\""}))
        assert observation.startswith("[marmalade] /workspace/wrong-place.txt\n"), observation  # ...set again next
    finally:
        env.close()
    solved = _episode(task, env, task.solution)
    said = [t.observations for t in solved.turns]
    assert not solved.failed and solved.reward.value == 1.0, (solved.reward.reason, said)
    bare = type(task)(**{**task.__dict__, "setup": {k: v for k, v in task.setup.items() if k != "env"}})
    unsolved = _episode(bare, _env(bare, harbor_025_images, run_id, docker_client), bare.solution)
    assert unsolved.reward.value == 0.0, unsolved.reward.reason
